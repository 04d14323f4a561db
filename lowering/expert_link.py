"""How the devices of an expert group meet inside a per-device program (parallel.mode=shard_map): the collectives
its MoE layers use (xlatrain/models/moe.py's ExpertGroup), XLA's or xlatrain's custom calls. Under
collectives.impl=custom every one of them is xlatrain's: an XLA:CPU collective beside xlatrain's in one program
can wait for it in another order."""

from __future__ import annotations

import jax

from xlatrain.mesh import EXPERT
from xlatrain.models.experts import xla_expert_group
from xlatrain.models.moe import ExpertGroup


def expert_group(size: int, impl: str, timeout_s: float) -> ExpertGroup:
    if impl != "custom":
        return xla_expert_group(size)
    from xlatrain import custom_calls as ops

    return ExpertGroup(size, lambda blocks: ops.all_to_all(blocks, EXPERT, 0, 0, tiled=True, timeout_s=timeout_s),
                       lambda value: ops.all_gather(value[None], EXPERT, tiled=True, timeout_s=timeout_s),
                       lambda: jax.lax.axis_index(EXPERT))

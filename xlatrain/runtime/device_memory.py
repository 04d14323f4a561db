"""What one device may hold, and the refusals of a train state or a compiled step that cannot fit it.

Measured before the steps compile and agreed by every process (the least any has), so that each decides alike.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from xlatrain.compat.backends import is_compile_only
from xlatrain.errors import UserError
from xlatrain.runtime.distributed import everyones, host_name
from xlatrain.runtime.gpu_targets import resolved_memory
from xlatrain.runtime.host_memory import host_memory
from xlatrain.sizes import readable_bytes

DeviceMemory = tuple[int | None, str]
"""What one device may hold (None when the runtime does not say), and where that figure comes from."""


def device_memory(mesh: Mesh) -> DeviceMemory:
    """One device's memory; over several processes, the least any has: every process must decide alike
    (remat: auto choosing apart would give them different programs, and a refusal by one alone reaches the
    others only as its failure). They exchange it, so call it before the steps compile: a process that loads
    its steps from its compile cache would otherwise wait out the others' compilations."""
    figures = everyones("device_memory", [*_this_process_device_memory(mesh), host_name()])
    known = [(limit, rank, where, host) for rank, (limit, where, host) in enumerate(figures) if limit]
    if not known:
        return None, figures[jax.process_index()][1]
    least, rank, where, host = min(known)
    if all(limit == least for limit, *_ in known):
        return least, where
    return least, f"{where} on rank {rank} (host {host}), the least of the {len(figures)} processes"


def _this_process_device_memory(mesh: Mesh) -> DeviceMemory:
    """device_memory as this process sees it. CPU devices of one process share the host's RAM."""
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if devices[0].platform == "cpu":
        ram, what = host_memory()
        return ram // len(devices), f"a CPU device's share of {what} ({len(devices)} devices in this process)"
    if is_compile_only(devices[0]):
        limit = resolved_memory(devices[0].device_kind)
        return limit, f"the {readable_bytes(limit)} of one {devices[0].device_kind} (its target config)"
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        return None, f"the memory of one {devices[0].device_kind}"
    return limit, f"the {readable_bytes(limit)} of one {devices[0].device_kind}"


def check_state_fits(abstract_sharded: Any, memory: DeviceMemory) -> None:
    """Refuse, before allocating anything, a train state that alone exceeds the memory of the devices holding
    it (a mistyped size would otherwise end in an out-of-memory kill without a word)."""
    per_device = sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                     for a in jax.tree.leaves(abstract_sharded))
    _refuse_beyond_a_device(per_device, memory, "the train state (params and optimizer state)", "",
                            "make the model smaller (model.* sizes), or shard it (parallel.strategy=zero1/fsdp, "
                            "mesh.stage)")


def check_step_fits(step: str, needed: int, memory: DeviceMemory) -> None:
    """Refuse, before it first runs, a compiled step that needs more memory per device than a device has (an
    oversized batch would otherwise end in an out-of-memory kill, or in XLA's allocation error inside the step).
    `needed`: XLA's memory analysis of the step, the state and the batch included."""
    _refuse_beyond_a_device(needed, memory, f"the {step}", " by XLA's memory analysis (the train state, the batch "
                            "and the step's temporaries)", "lower batch.global_size or the length of an example "
                            "(data.seq_len), raise batch.microbatches (gradient accumulation), make the model "
                            "smaller, or shard it (parallel.strategy=zero1/fsdp, mesh.stage)")


def _refuse_beyond_a_device(needed: int, memory: DeviceMemory, what: str, counted: str, fixes: str) -> None:
    """One config error when `what` needs more bytes per device than a device has (`counted`: how the need was
    measured, `fixes`: the settings that shrink it); nothing where the device's memory is unknown."""
    available, where = memory
    if available and needed > available:
        raise UserError(f"config: {what} needs {readable_bytes(needed)} per device{counted}, more than {where}; "
                        f"{fixes}")

"""The torch bridge: a PyTorch GPT trained by xlatrain (through torchax) vs the same module in eager
PyTorch, and vs xlatrain's own flax GPT of the same shape. One device, the same batch, AdamW with the same
clipping, one host read of the step's metrics per step on every side.

    PYTHONPATH=examples/torch_model python3 -m bench.torch_bridge    # writes bench/results/torch_bridge.json

The GPT: 4 blocks, width 128, 4 heads, MLP ratio 4, 256 tokens, sequences of 64, batch 16 (the default run's
shape; examples/torch_model/tiny_gpt.py and xlatrain/models/gpt.py are the same architecture). The process keeps
freed memory as the `xlatrain` command does (xlatrain/runtime/malloc.py), for every side.
"""

from __future__ import annotations

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX or torch start a thread

import copy  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import interleaved_medians, train_runner, write_results  # noqa: E402
from xlatrain.commands.torch_parity import optimizer_spec  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.program import build_program  # noqa: E402
from xlatrain.torch_bridge.eager import build_optimizer, loss_sum  # noqa: E402

COMMON = ["mesh.data=1", "optimizer.weight_decay=0.01", "data.seq_len=64", "batch.global_size=16"]
TORCH = ["examples/configs/torch_gpt.yaml"]
FLAX = ["model.name=gpt", "model.layers=4", "model.width=128", "model.heads=4"]


def eager_runner(program) -> callable:
    """The same module, weights, batch and optimizer in eager PyTorch (the threads torch picks: 2 here)."""
    module = copy.deepcopy(program.model.torch.module).train()
    spec = optimizer_spec(program.config, 1)
    optimizer = build_optimizer(module, spec)
    rows = [program.dataset.train[i] for i in range(program.derived.global_batch)]
    batch = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in ("inputs", "targets")}

    def run():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_sum(module(batch["inputs"]), batch, "cross_entropy") / batch["targets"].numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), spec.clip_norm)
        optimizer.step()
        return loss.item()

    return run


def program_for(overrides: list[str]):
    path, rest = (overrides[0], overrides[1:]) if overrides[0].endswith(".yaml") else (None, overrides)
    return build_program(load_config(path, [*rest, *COMMON]), jax.devices()[:1])


def main() -> None:
    torch_program = program_for(TORCH)
    flax_unrolled = program_for([*FLAX, "model.scan_layers=false"])
    flax_scanned = program_for([*FLAX, "model.scan_layers=true"])
    assert torch_program.param_count == flax_unrolled.param_count, (torch_program.param_count,
                                                                     flax_unrolled.param_count)
    medians = interleaved_medians({"torch_via_xlatrain": train_runner(torch_program),
                                   "pytorch_eager": eager_runner(torch_program),
                                   "flax_via_xlatrain_unrolled": train_runner(flax_unrolled),
                                   "flax_via_xlatrain_scanned": train_runner(flax_scanned)},
                                  rounds=10, steps_per_round=10, warmup=5)
    ratios = {"torch_via_xlatrain_over_flax_unrolled": medians["torch_via_xlatrain"]
              / medians["flax_via_xlatrain_unrolled"],
              "torch_via_xlatrain_over_flax_scanned": medians["torch_via_xlatrain"]
              / medians["flax_via_xlatrain_scanned"],
              "torch_via_xlatrain_over_pytorch_eager": medians["torch_via_xlatrain"] / medians["pytorch_eager"]}
    for name, seconds in medians.items():
        print(f"{name:28s} {seconds * 1e3:8.2f} ms/step")
    for name, ratio in ratios.items():
        print(f"{name:40s} {ratio:.3f}")
    path = write_results("torch_bridge", "PYTHONPATH=examples/torch_model python3 -m bench.torch_bridge",
                         {"target": "torch_via_xlatrain / flax_via_xlatrain <= 1.05",
                          "torch_threads": torch.get_num_threads(), "malloc": MALLOC,
                          "params": torch_program.param_count,
                          "median_step_seconds": medians, "ratios": ratios, "steps_per_candidate": 100})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

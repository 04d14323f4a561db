"""The GPT on CPU: xlatrain's train step against the same model in eager PyTorch (the threads torch picks: 2
here), one device, the same batch, AdamW with clipping, one host read of the metrics per step on every side;
and the effect of each XLA:CPU compiler option tried (lowering/xla_options.py), one at a time, on the step.

    PYTHONPATH=examples/torch_model python3 -m bench.cpu_speed    # writes bench/results/cpu_speed.json

Shapes: the built-in default GPT (4 blocks, width 128, 4 heads, sequences of 64, batch 16) and a 4-block
width-256 GPT on sequences of 128 (batch 16). The PyTorch side is examples/torch_model/tiny_gpt.py, the same
architecture with the same parameter count. Target: xlatrain / PyTorch eager <= 1.0 on both.

xlatrain runs as `xlatrain train` does by default (one XLA:CPU device; model.scan_layers=auto: unrolled on CPU;
causal attention in query blocks, xlatrain/models/attention.py), with the dense causal attention it ran before, scanned,
and with mesh.cpu_devices=per_core (data-parallel over one XLA:CPU device per core, as far as the batch
and memory allow: xlatrain/runtime/cpu_devices.py): one device's XLA:CPU program leaves the cores partly idle (some
kernels keep to one thread), PyTorch's kernels keep every core busy.

The process tunes malloc to keep freed memory as the `xlatrain` command does (xlatrain/runtime/malloc.py), for both
sides; `XLATRAIN_MALLOC=release` in front of the command measures with the system allocator's defaults instead.
"""

from __future__ import annotations

from unittest import mock

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX or torch start a thread

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from xlatrain.lowering.xla_options import CPU_OPTIONS_TRIED, compiler_options  # noqa: E402

from bench.common import blas_programs, interleaved_medians, train_runner, write_results  # noqa: E402
from bench.torch_bridge import eager_runner  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.program import apply_cpu_devices, build_program  # noqa: E402

SHAPES = {
    "default GPT (4 x 128, seq 64)": {"width": 128, "seq_len": 64},
    "GPT 4 x 256, seq 128": {"width": 256, "seq_len": 128},
}
COMMON = ["optimizer.name=adamw", "optimizer.weight_decay=0.01", "batch.global_size=16", "runtime.cpu_matmul=xla"]
ONE_DEVICE, PER_CORE = "mesh.data=1", "mesh.cpu_devices=per_core"


def gpt_overrides(width: int, seq_len: int) -> list[str]:
    return [*COMMON, "model.layers=4", "model.heads=4", f"model.width={width}", f"data.seq_len={seq_len}"]


# The CPU devices `xlatrain train mesh.cpu_devices=per_core` makes for these configs here, before JAX starts.
PER_CORE_DEVICES = apply_cpu_devices(*(load_config(None, [*gpt_overrides(**shape), PER_CORE])
                                       for shape in SHAPES.values()))


def programs(width: int, seq_len: int) -> dict:
    torch_gpt = [*COMMON, ONE_DEVICE, f"data.seq_len={seq_len}",
                 f"model.kwargs={{vocab: 256, width: {width}, layers: 4, heads: 4, max_len: {seq_len}}}"]
    gpt = gpt_overrides(width, seq_len)
    first = jax.devices()[:1]
    built = {
        "torch": build_program(load_config("examples/configs/torch_gpt.yaml", torch_gpt), first),
        "unrolled": build_program(load_config(None, [*gpt, ONE_DEVICE]), first),
        "per_core": build_program(load_config(None, [*gpt, PER_CORE])),
        "scanned": build_program(load_config(None, [*gpt, ONE_DEVICE, "model.scan_layers=true"]), first),
    }
    built.update(blas_programs(None, [*gpt, ONE_DEVICE], first))
    with mock.patch("xlatrain.models.attention.query_blocks", return_value=1):  # traced when the step compiles, inside
        built["dense_attention"] = build_program(load_config(None, [*gpt, ONE_DEVICE]), first)
        built["dense_attention"].train_step.first
    assert len({p.param_count for p in built.values()}) == 1, {k: p.param_count for k, p in built.items()}
    return built


def against_pytorch(width: int, seq_len: int) -> dict:
    built = programs(width, seq_len)
    runners = {"pytorch_eager": eager_runner(built.pop("torch")),
               **{f"xlatrain_{name}": train_runner(program) for name, program in built.items()}}
    medians = interleaved_medians(runners, rounds=10, steps_per_round=10, warmup=5)
    eager = medians["pytorch_eager"]
    return {"median_step_seconds": medians, "over_pytorch_eager": {k: v / eager for k, v in medians.items()},
            "params": built["scanned"].param_count, "per_core_devices": built["per_core"].derived.devices}


def option_effects(width: int, seq_len: int) -> tuple[dict, dict]:
    """Each option of CPU_OPTIONS_TRIED alone on top of xlatrain's defaults: step time over the defaults', and
    whether its results differ from theirs (an option that changes them never becomes a default). The reference is
    compiled like the options, from the same lowering; the program's own executable (what the trainer runs: the
    same compilation, maybe loaded from the persistent cache) is measured beside it, since in two runs of this
    bench it ran 1.2-1.3x slower than every recompilation throughout the process."""
    program = build_program(load_config(None, [*gpt_overrides(width, seq_len), ONE_DEVICE]), jax.devices()[:1])
    lowered, defaults = program.train_step.first.lowered, compiler_options("cpu")
    executables = {"defaults": lowered.compile(compiler_options=defaults),
                   "defaults, the program's own executable": None}
    for name, value in CPU_OPTIONS_TRIED.items():
        executables[f"{name}={value}"] = lowered.compile(compiler_options={**defaults, name: value})
    runners = {name: train_runner(program, executable) for name, executable in executables.items()}
    results = {name: metrics_after(run, RESULT_STEPS) for name, run in runners.items()}  # then timed from there
    changes = {name: not jax.tree.all(jax.tree.map(np.array_equal, metrics, results["defaults"]))
               for name, metrics in results.items()}
    medians = interleaved_medians(runners, rounds=6, steps_per_round=10, warmup=3)
    return {name: medians[name] / medians["defaults"] for name in medians}, changes


RESULT_STEPS = 3
"""Steps from the initial state after which an option's metrics (loss, gradient and parameter norms) are compared
with the defaults' bit for bit."""


def metrics_after(run, steps: int) -> dict:
    for _ in range(steps - 1):
        run()
    return run()


def main() -> None:
    print(f"malloc: {MALLOC}; CPU devices with {PER_CORE}: {PER_CORE_DEVICES.describe()}")
    results = {}
    for label, shape in SHAPES.items():
        results[label] = against_pytorch(**shape)
        for name, ratio in results[label]["over_pytorch_eager"].items():
            ms = results[label]["median_step_seconds"][name] * 1e3
            print(f"{label:32s} {name:20s} {ms:8.2f} ms  {ratio:.2f}x PyTorch eager")
    effects, changes = option_effects(**SHAPES["default GPT (4 x 128, seq 64)"])
    for name, ratio in effects.items():
        print(f"option {name:60s} {ratio:.3f}x the defaults' step time{', changes results' * changes[name]}")
    path = write_results("cpu_speed", "PYTHONPATH=examples/torch_model python3 -m bench.cpu_speed",
                         {"target": "xlatrain / PyTorch eager <= 1.0", "torch_threads": torch.get_num_threads(),
                          "malloc": MALLOC, "per_core_cpu_devices": PER_CORE_DEVICES.describe(),
                          "shapes": results, "xla_cpu_options_alone_over_defaults": effects,
                          f"xla_cpu_options_change_results_in_{RESULT_STEPS}_steps": changes})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What GPT-2 small's train step launches on an H100 beside its matmuls and attention, compiled on a host without
one (`xlatrain lower --target h100`): kernels per step by class, the bytes they move, the matmuls' FLOPs, XLA's
cost analysis of the optimised module and its memory, for each formulation xlatrain chooses between on GPUs:
a layer scan or unrolled layers (at 12 and at 48 blocks), and, tried, GELU recomputed by the backward instead of
its tanh saved by the forward. A change of formulation is kept where it moves fewer bytes on the GPU, its losses
over 20 steps on this host's CPU stay within rtol 1e-5 of the formulation before it, and the CPU's step is no more
than 3% slower by the median of interleaved runs (or the change is made on GPUs alone).

    pip install jax-cuda13-plugin==$JAX jax-cuda13-pjrt==$JAX nvidia-cudnn-cu13   (in an environment of its own)
    python3 -m bench.gpu_kernels

XLA gives no estimate of a kernel's time for a compile-only GPU (its optimised HLO carries none), so the figures
are counts and bytes: at the H200's 4.8 TB/s, 10 GB moved is about 2 ms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only writes the results; the plugin is for the CLI's
from bench.common import write_results  # noqa: E402
from bench.gpu import GPT2_SMALL  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = "h100"
SHAPE = [o for o in GPT2_SMALL if not o.startswith("trainer.")]
VARIANTS = {"scanned": ["model.scan_layers=true"], "unrolled": ["model.scan_layers=false"]}
LOSS_STEPS, LOSS_RTOL = 20, 1e-5


RECOMPUTED_GELU = ("from unittest import mock; import sys, jax; from xlatrain.cli import main; "
                   "mock.patch.object(jax.nn, 'gelu', jax.checkpoint(jax.nn.gelu)).start(); "
                   "sys.exit(main(sys.argv[1:]))")
"""The CLI with the GPT's GELU recomputed by the backward (jax.checkpoint) instead of its tanh saved."""


def lower(overrides: list[str], recomputed_gelu: bool = False) -> dict:
    began = time.perf_counter()
    command = ["-c", RECOMPUTED_GELU] if recomputed_gelu else ["-m", "xlatrain.cli"]
    result = subprocess.run([sys.executable, *command, "lower", *SHAPE, "mesh.data=1", *overrides, "--json",
                             "--target", TARGET], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": ""})
    if result.returncode != 0:
        raise SystemExit(f"xlatrain lower {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout)
    return {"kernels": report["kernels"], "xla_flops": report["flops"], "xla_bytes_accessed": report["bytes_accessed"],
            "model_flops": report["model_flops"], "peak_memory_bytes": report["peak_memory_bytes"],
            "cudnn_missing": report["target"]["cudnn_missing"],
            "lower_seconds": round(time.perf_counter() - began, 1)}


def losses(overrides: list[str], run_dir: Path) -> list[float]:
    """The default GPT's losses over LOSS_STEPS steps on this host's CPU."""
    result = subprocess.run([sys.executable, "-m", "xlatrain.cli", "train", *overrides, f"trainer.steps={LOSS_STEPS}",
                             "trainer.log_every=1", "trainer.progress=false", f"trainer.run_dir={run_dir}",
                             "trainer.eval_every=100000", "trainer.checkpoint_every=100000"], cwd=REPO,
                            capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if result.returncode != 0:
        raise SystemExit(f"xlatrain train {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def gelu_on_cpu() -> dict:
    """The default GPT on one CPU device with GELU recomputed by the backward against saved: the median step of
    interleaved runs (two compilations of each), and the losses of LOSS_STEPS steps on one batch."""
    from unittest import mock

    import jax

    from bench.common import interleaved_medians, train_runner
    from xlatrain.config import load_config
    from xlatrain.program import build_program

    def build(variant: int, recomputed: bool):
        # a distinct weight decay per build keeps jax from handing two builds one cached executable
        config = load_config(None, [f"optimizer.weight_decay=0.01{variant}", "mesh.data=1",
                                    "trainer.compile_cache=off"])
        gelu = jax.checkpoint(jax.nn.gelu) if recomputed else jax.nn.gelu
        with mock.patch.object(jax.nn, "gelu", gelu):
            program = build_program(config, jax.devices()[:1])
            program.train_step.first.compiled
        return program

    built = {f"{name}_{copy}": build(2 * copy + (name == "saved"), name == "recomputed")
             for copy in (1, 2) for name in ("recomputed", "saved")}
    medians = interleaved_medians({name: train_runner(program) for name, program in built.items()},
                                  rounds=8, steps_per_round=20, warmup=5)
    runs = {name: train_runner(built[f"{name}_1"]) for name in ("recomputed", "saved")}
    walked = {name: [float(run()["loss"]) for _ in range(LOSS_STEPS)] for name, run in runs.items()}
    return {"median_step_seconds": medians,
            "step_recomputed_over_saved": round((medians["recomputed_1"] + medians["recomputed_2"])
                                                / (medians["saved_1"] + medians["saved_2"]), 4),
            "largest_relative_loss_difference": max(abs(a - b) / abs(b) for a, b in
                                                    zip(walked["recomputed"], walked["saved"], strict=True))}


def ratios(of: dict, to: dict) -> dict:
    return {"kernels": round(of["kernels"]["kernels"] / to["kernels"]["kernels"], 3),
            "bytes": round(of["kernels"]["bytes"] / to["kernels"]["bytes"], 3),
            "peak_memory": round(of["peak_memory_bytes"] / to["peak_memory_bytes"], 3)}


def main() -> None:
    rows = {}
    for layers in (12, 48):
        variants = {"scanned": ([f"model.layers={layers}", "model.scan_layers=true"], False),
                    "unrolled": ([f"model.layers={layers}", "model.scan_layers=false"], False)}
        if layers == 12:
            variants["unrolled, GELU recomputed"] = ([f"model.layers={layers}", "model.scan_layers=false"], True)
        for name, (overrides, recomputed_gelu) in variants.items():
            row = rows.setdefault(f"{layers} layers", {})[name] = lower(overrides, recomputed_gelu)
            k = row["kernels"]
            print(f"{layers} layers, {name}: {k['kernels']} kernels, {k['bytes'] / 1e9:.2f} GB moved, peak "
                  f"{row['peak_memory_bytes'] / 2**30:.2f} GiB, lowered in {row['lower_seconds']} s; "
                  + ", ".join(f"{c} {v['kernels']} ({v['bytes'] / 1e9:.2f} GB)" for c, v in k["by_class"].items()),
                  flush=True)
        shape = rows[f"{layers} layers"]
        shape["unrolled_over_scanned"] = ratios(shape["unrolled"], shape["scanned"])
        print(f"  unrolled / scanned: {shape['unrolled_over_scanned']}")
    twelve = rows["12 layers"]
    twelve["gelu_recomputed_over_saved"] = ratios(twelve["unrolled, GELU recomputed"], twelve["unrolled"])
    print(f"  GELU recomputed / its tanh saved: {twelve['gelu_recomputed_over_saved']}")
    with tempfile.TemporaryDirectory() as work:
        scanned, unrolled = (losses(overrides, Path(work) / name) for name, overrides in VARIANTS.items())
    worst = max(abs(a - b) / abs(b) for a, b in zip(unrolled, scanned, strict=True))
    print(f"{LOSS_STEPS} steps of the default GPT on CPU, unrolled against scanned: largest relative loss "
          f"difference {worst:.2e} (kept if <= {LOSS_RTOL:g})")
    gelu = gelu_on_cpu()
    print(f"GELU recomputed on CPU: step {gelu['step_recomputed_over_saved']:.3f}x saved's, largest relative loss "
          f"difference over {LOSS_STEPS} steps {gelu['largest_relative_loss_difference']:.2e} (kept if <= "
          f"{LOSS_RTOL:g})")
    path = write_results("gpu_kernels", "python3 -m bench.gpu_kernels", {
        "target": TARGET, "model": SHAPE,
        "note": "compiled only (jax's CUDA plugin with cuDNN, compile-only devices): counts and bytes of the "
                "optimised HLO (lowering/kernels.py), XLA's cost analysis of it (a loop's body counted once), "
                "nothing run; XLA gives no time estimate of a compile-only GPU's kernels",
        "rows": rows,
        "cpu_losses_unrolled_vs_scanned": {"steps": LOSS_STEPS, "largest_relative_difference": worst,
                                           "rtol": LOSS_RTOL, "kept": worst <= LOSS_RTOL},
        "cpu_gelu_recomputed_vs_saved": gelu})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

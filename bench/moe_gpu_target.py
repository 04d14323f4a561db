"""Does XLA:GPU expand the MoE experts' grouped matmul into dense products? The train step of bench.gpu's Mixture of
Experts (8 experts, top-2, bf16; 4 of its 16 layers, to compile quickly) compiled for an H100 on a host without
one (`xlatrain lower --target h100`; jax's CUDA plugin in an environment of its own, docs/performance.md), once per
model.moe.formulation: the matmul FLOPs of the compiled module (its dots, a loop's body once per trip) against the
model's FLOPs (counted on the jaxpr: the chosen experts' products alone), the bytes its kernels move, and its peak
memory; beside it the dense Llama with the same active parameters.

    /path/to/cuda-venv/bin/python -m bench.moe_gpu_target    # writes bench/results/moe_gpu_target.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only writes the results; the plugin is for the CLI's
from bench.common import write_results  # noqa: E402
from bench.gpu import MOE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = "h100"
LAYERS = 4
SHAPE = [o for o in MOE if not o.startswith(("trainer.", "model.layers="))] + [f"model.layers={LAYERS}"]
DENSE = [o for o in SHAPE if not o.startswith("model.moe.")] + ["model.mlp_hidden=5632"]
"""The dense Llama whose MLP is as wide as the two chosen experts together."""
FORMULATIONS = ("sorted", "blocked", "padded", "dense")


def lower(overrides: list[str]) -> tuple[dict, float]:
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "xlatrain.cli", "lower", *overrides, "--json", "--target", TARGET,
                             "--devices", "1"], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"xlatrain lower {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout), time.perf_counter() - began


def row(name: str, overrides: list[str]) -> dict:
    report, seconds = lower(overrides)
    kernels = report["kernels"]
    found = {"step": name, "matmul_flops": kernels["matmul_flops"], "model_flops": report["model_flops"],
             "matmul_over_model_flops": kernels["matmul_flops"] / report["model_flops"],
             "kernel_bytes": kernels["bytes"], "kernels": kernels["kernels"],
             "by_class": kernels["by_class"], "peak_memory_bytes": report["peak_memory_bytes"],
             "lower_seconds": round(seconds, 1)}
    print(f"{name:14s} matmul FLOPs {found['matmul_flops']:.3e} = {found['matmul_over_model_flops']:.2f}x the "
          f"model's {found['model_flops']:.3e}; kernels {found['kernels']:g} moving {found['kernel_bytes'] / 1e9:.2f} "
          f"GB; peak {found['peak_memory_bytes'] / 2**30:.2f} GiB; lowered in {seconds:.0f} s", flush=True)
    return found


def main() -> None:
    rows = [row(f"moe {f}", [*SHAPE, f"model.moe.formulation={f}"]) for f in FORMULATIONS]
    rows.append(row("dense", DENSE))
    path = write_results("moe_gpu_target", "python3 -m bench.moe_gpu_target", {
        "target": TARGET, "model": SHAPE, "dense_model": DENSE, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

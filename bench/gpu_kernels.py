"""What GPT-2 small's train step launches on an H100 beside its matmuls and attention, compiled on a host without
one (`xlatrain lower --target h100`): kernels per step by class, the bytes they move, the matmuls' FLOPs, XLA's
cost analysis of the optimised module and its memory, for each formulation xlatrain chooses between on GPUs
(a layer scan or unrolled layers, at 12 and at 48 blocks). Then, on this host's CPU, 20 steps of the default GPT
scanned and unrolled: a formulation is kept only if the losses agree (rtol 1e-5).

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


def lower(overrides: list[str]) -> dict:
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "xlatrain.cli", "lower", *SHAPE, "mesh.data=1", *overrides,
                             "--json", "--target", TARGET], cwd=REPO, capture_output=True, text=True,
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


def ratios(of: dict, to: dict) -> dict:
    return {"kernels": round(of["kernels"]["kernels"] / to["kernels"]["kernels"], 3),
            "bytes": round(of["kernels"]["bytes"] / to["kernels"]["bytes"], 3),
            "peak_memory": round(of["peak_memory_bytes"] / to["peak_memory_bytes"], 3)}


def main() -> None:
    rows = {}
    for layers in (12, 48):
        for name, overrides in VARIANTS.items():
            row = rows.setdefault(f"{layers} layers", {})[name] = lower([f"model.layers={layers}", *overrides])
            k = row["kernels"]
            print(f"{layers} layers {name:>8}: {k['kernels']:5} kernels, {k['bytes'] / 1e9:6.1f} GB moved, "
                  f"peak {row['peak_memory_bytes'] / 2**30:.2f} GiB, lowered in {row['lower_seconds']} s; "
                  + ", ".join(f"{c} {v['kernels']} ({v['bytes'] / 1e9:.1f} GB)" for c, v in k["by_class"].items()),
                  flush=True)
        rows[f"{layers} layers"]["unrolled_over_scanned"] = ratios(rows[f"{layers} layers"]["unrolled"],
                                                                   rows[f"{layers} layers"]["scanned"])
        print(f"  unrolled / scanned: {rows[f'{layers} layers']['unrolled_over_scanned']}")
    with tempfile.TemporaryDirectory() as work:
        scanned, unrolled = (losses(overrides, Path(work) / name) for name, overrides in VARIANTS.items())
    worst = max(abs(a - b) / abs(b) for a, b in zip(unrolled, scanned, strict=True))
    print(f"{LOSS_STEPS} steps of the default GPT on CPU, unrolled against scanned: largest relative loss "
          f"difference {worst:.2e} (kept if <= {LOSS_RTOL:g})")
    path = write_results("gpu_kernels", "python3 -m bench.gpu_kernels", {
        "target": TARGET, "model": SHAPE,
        "note": "compiled only (jax's CUDA plugin with cuDNN, compile-only devices): counts and bytes of the "
                "optimised HLO (lowering/kernels.py), XLA's cost analysis of it (a loop's body counted once), "
                "nothing run; XLA gives no time estimate of a compile-only GPU's kernels",
        "rows": rows,
        "cpu_losses": {"steps": LOSS_STEPS, "largest_relative_difference": worst, "rtol": LOSS_RTOL,
                       "kept": worst <= LOSS_RTOL}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""XLA's memory per GPU of GPT-2 small's train step in 4 pipeline stages, for each schedule and remat, compiled for
H100s on a host without one (`xlatrain lower --target h100`; needs jax's CUDA plugin, docs/performance.md,
"Compile for a GPU you do not have"); the unpipelined step on one H100 beside it. One stage per device: SPMD runs the
same program, so the same buffers, on every stage, and XLA's memory analysis of that program is each stage's memory.

    pip install jax-cuda13-plugin==$JAX jax-cuda13-pjrt==$JAX   (in an environment of its own)
    python3 -m bench.gpu_target
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
from bench.gpu import GPT2_SMALL  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET = "h100"
STAGES, MICROBATCHES = 4, 8
SHAPE = [o for o in GPT2_SMALL if not o.startswith("trainer.")]
SCHEDULES = {"gpipe": [], "1f1b": [], "interleaved": ["parallel.pipeline.virtual_stages=2"], "zb1p": [], "zbv": []}
SPLITS_BACKWARD = ("zb1p", "zbv")
"""Their B and W run from the forward's residuals: remat none only."""


def lower(overrides: list[str], devices: int) -> tuple[dict, float]:
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "xlatrain.cli", "lower", *SHAPE, *overrides, "--json",
                             "--target", TARGET, "--devices", str(devices)], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"xlatrain lower {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout), time.perf_counter() - began


def pipeline_row(schedule: str, remat: str) -> dict:
    overrides = ["mesh.data=1", f"mesh.stage={STAGES}", f"parallel.pipeline.schedule={schedule}",
                 f"parallel.pipeline.microbatches={MICROBATCHES}", f"parallel.pipeline.remat={remat}",
                 *SCHEDULES[schedule]]
    report, seconds = lower(overrides, STAGES)
    p = report["pipeline"]
    return {"schedule": schedule, "remat": remat, "peak_memory_bytes": report["peak_memory_bytes"],
            "temp_bytes": p["temp_bytes"], "partition": p["partition"], "virtual_stages": p["virtual_stages"],
            "activation_buffers": p["activation_buffers"], "residual_buffers": p["residual_buffers"],
            "stash_buffers": p["stash_buffers"],
            "activation_bytes_per_microbatch": p["activation_bytes_per_microbatch"],
            "residual_bytes_per_microbatch": p["residual_bytes_per_microbatch"],
            "stash_bytes_per_microbatch": p["stash_bytes_per_microbatch"], "lower_seconds": round(seconds, 1)}


def main() -> None:
    unpipelined, seconds = lower(["mesh.data=1"], 1)
    rows = []
    for schedule in SCHEDULES:
        for remat in ("none",) if schedule in SPLITS_BACKWARD else ("none", "full"):
            rows.append(pipeline_row(schedule, remat))
            r = rows[-1]
            print(f"{schedule:>12} remat {remat:<4}: {r['peak_memory_bytes'] / 2**30:6.2f} GiB per GPU "
                  f"(temporaries {r['temp_bytes'] / 2**30:.2f} GiB), partition {r['partition']}, "
                  f"{r['activation_buffers']} activation / {r['residual_buffers']} residual / {r['stash_buffers']} "
                  f"stash buffers, lowered in {r['lower_seconds']} s", flush=True)
    print(f"unpipelined, one {unpipelined['target']['device_kind']}: "
          f"{unpipelined['peak_memory_bytes'] / 2**30:.2f} GiB")
    path = write_results("gpu_target", "python3 -m bench.gpu_target", {
        "target": unpipelined["target"], "model": SHAPE, "stages": STAGES, "microbatches": MICROBATCHES,
        "note": "compiled only (jax's CUDA plugin, compile-only devices): XLA's memory analysis, nothing run",
        "unpipelined": {"peak_memory_bytes": unpipelined["peak_memory_bytes"], "lower_seconds": round(seconds, 1)},
        "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The default GPT trained by `xlatrain train` on one XLA:CPU device (mesh.cpu_devices=1: what auto makes here) and
on one device per core (mesh.cpu_devices=per_core), in fresh processes, alternating, each side ROUNDS times:
the whole training loop (data, dispatch, metrics, logging), not the step alone as bench.cpu_speed times it.

    python3 -m bench.cpu_devices    # writes bench/results/cpu_devices.json

Per run: milliseconds per step over the logged intervals between the first (compilation and warm-up) and the
last (the final checkpoint), from metrics.jsonl's interval_seconds; and the time breakdown's device and host
shares over the same intervals. The environment's own device count (XLA_FLAGS) is removed for these processes.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import write_results
from xlatrain.run.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 3
STEPS, LOG_EVERY = 300, 50
SIDES = {"one_device": "mesh.cpu_devices=1", "per_core": "mesh.cpu_devices=per_core"}


def train(setting: str, run_dir: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = ["train", setting, f"trainer.steps={STEPS}", f"trainer.log_every={LOG_EVERY}", "trainer.progress=false",
            "trainer.eval_every=100000", "trainer.checkpoint_every=100000", f"trainer.run_dir={run_dir}",
            f"trainer.compile_cache={cache}"]
    done = subprocess.run([sys.executable, "-m", "xlatrain.cli", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    devices = next(line for line in done.stdout.splitlines() if line.strip().startswith("devices "))
    intervals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "interval_seconds" in r][1:-1]
    seconds = sum(r["interval_seconds"] for r in intervals)
    return {"ms_per_step": 1e3 * seconds / (LOG_EVERY * len(intervals)), "devices": devices.strip(),
            **{f"time_{part}": sum(r[f"time_{part}"] * r["interval_seconds"] for r in intervals) / seconds
               for part in ("device", "host")}}


def main() -> None:
    runs = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for round_ in range(ROUNDS):
            for side, setting in SIDES.items():
                runs[side].append(train(setting, work / f"{side}-{round_}", work / "cache"))
                print(f"round {round_ + 1} {side:10s} {runs[side][-1]}")
    medians = {side: round(statistics.median(r["ms_per_step"] for r in rs), 2) for side, rs in runs.items()}
    ratio = medians["per_core"] / medians["one_device"]
    print(f"median ms per step: {medians}; per_core / one device: {ratio:.3f}")
    path = write_results("cpu_devices", "python3 -m bench.cpu_devices",
                         {"steps": STEPS, "log_every": LOG_EVERY, "rounds": ROUNDS, "runs": runs,
                          "median_ms_per_step": medians, "per_core_over_one_device": round(ratio, 3)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Time to first step of the default GPT (`xlatrain train`, the built-in config), and of it in two pipeline
stages, started twice with the same persistent compilation cache (trainer.compile_cache): the first start
compiles and fills an empty cache, the second loads its executables. xlatrain keeps every compilation; the same
pair of starts under JAX's default threshold (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1: only compilations of
a second or more are kept) is measured beside it. Rounds alternate nothing (the order is the point), each from
empty caches.

    python3 -m bench.compile_cache
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.common import time_to_first_step, write_results
from xlatrain.runtime.compile_cache import MIN_COMPILE_TIME_ENV

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 3
CONFIGS = {"default GPT": [], "default GPT, 2 pipeline stages": ["mesh.cpu_devices=2", "mesh.stage=2"]}
THRESHOLDS = {"every compilation (xlatrain)": {}, "JAX's 1 s threshold": {MIN_COMPILE_TIME_ENV: "1"}}
CASES = {f"{config}, {threshold}": (overrides, env) for config, overrides in CONFIGS.items()
         for threshold, env in THRESHOLDS.items()}


def start(run_dir: Path, cache: Path, overrides: list[str], env: dict) -> dict:
    """One 1-step run in a fresh process: seconds from the process's start to its first logged step, and the
    compilations it reports."""
    first_step, summary = time_to_first_step(["train", "trainer.steps=1", "trainer.log_every=1",
                                              "trainer.progress=false", f"trainer.run_dir={run_dir}",
                                              f"trainer.compile_cache={cache}", *overrides], run_dir, REPO, env)
    return {"time_to_first_step_s": first_step, "compilations": summary["compilations"],
            "compile_seconds": summary["compile_seconds"], "loaded_from_cache": summary["compile_cache_hits"]}


def starts(overrides: list[str], env: dict) -> dict:
    """The first and the second start from an empty cache."""
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        return {which: start(work / which, work / "cache", overrides, env) for which in ("first", "second")}


def main() -> None:
    rounds = [{label: starts(*case) for label, case in CASES.items()} for _ in range(ROUNDS)]
    results = {}
    for label in CASES:
        medians = {which: {key: round(statistics.median(r[label][which][key] for r in rounds), 2)
                           for key in rounds[0][label][which]} for which in ("first", "second")}
        ratio = medians["second"]["time_to_first_step_s"] / medians["first"]["time_to_first_step_s"]
        results[label] = {"median": medians, "second_over_first": round(ratio, 3)}
        for which, m in medians.items():
            print(f"{label}, {which} start: first step after {m['time_to_first_step_s']:.2f}s, "
                  f"{m['compilations']:.0f} compilations ({m['compile_seconds']:.2f}s), "
                  f"{m['loaded_from_cache']:.0f} loaded from the cache")
        print(f"{label}: second / first start {ratio:.2f}x the time to first step")
    path = write_results("compile_cache", "python3 -m bench.compile_cache", {"rounds": ROUNDS, **results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

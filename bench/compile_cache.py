"""Time to first step of the default GPT (`xlatrain train`, the built-in config) started twice with the same
persistent compilation cache (trainer.compile_cache): the first start compiles and fills an empty cache, the
second loads its executables. Rounds alternate nothing (the order is the point), each from an empty cache.

    python3 -m bench.compile_cache
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.common import time_to_first_step, write_results

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 3


def start(run_dir: Path, cache: Path) -> dict:
    """One 1-step run in a fresh process: seconds from the process's start to its first logged step, and the
    compilations it reports."""
    first_step, summary = time_to_first_step(["train", "trainer.steps=1", "trainer.log_every=1",
                                              "trainer.progress=false", f"trainer.run_dir={run_dir}",
                                              f"trainer.compile_cache={cache}"], run_dir, REPO)
    return {"time_to_first_step_s": first_step, "compile_seconds": summary["compile_seconds"],
            "loaded_from_cache": summary["compile_cache_hits"]}


def main() -> None:
    rounds = []
    for _ in range(ROUNDS):
        with tempfile.TemporaryDirectory() as work:
            work = Path(work)
            rounds.append({"first": start(work / "first", work / "cache"),
                           "second": start(work / "second", work / "cache")})
    medians = {which: {key: round(statistics.median(r[which][key] for r in rounds), 2)
                       for key in rounds[0][which]} for which in ("first", "second")}
    ratio = medians["second"]["time_to_first_step_s"] / medians["first"]["time_to_first_step_s"]
    for which, m in medians.items():
        print(f"{which} start: first step after {m['time_to_first_step_s']:.2f}s, compilations "
              f"{m['compile_seconds']:.2f}s, {m['loaded_from_cache']:.0f} loaded from the cache")
    print(f"second / first start: {ratio:.2f}x the time to first step")
    path = write_results("compile_cache", "python3 -m bench.compile_cache",
                         {"rounds": ROUNDS, "median": medians, "second_over_first": round(ratio, 3)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

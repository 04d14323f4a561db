"""Shared measurement rules for benchmarks: interleaved A/B rounds, medians, and a results file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import jax

RESULTS = Path(__file__).parent / "results"


def interleaved_medians(candidates: dict[str, Callable[[], object]], rounds: int, steps_per_round: int,
                        warmup: int) -> dict[str, float]:
    """Median seconds per call of each candidate; rounds alternate their order to cancel drift."""
    for run in candidates.values():
        for _ in range(warmup):
            jax.block_until_ready(run())
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            for _ in range(steps_per_round):
                start = time.perf_counter()
                jax.block_until_ready(candidates[name]())
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def environment(command: str) -> dict[str, str]:
    return {"python": sys.version.split()[0], "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "devices": str(jax.device_count()),
            "machine": platform.machine(), "cpus": str(os.cpu_count()), "command": command}


def write_results(name: str, command: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(command), **payload}, indent=2) + "\n")
    return path

"""bench/gpu.py: refuses a machine without a GPU, and its --smoke shape runs the whole measurement anywhere."""

import json
import subprocess
import sys

import jax
import pytest
from conftest import REPO


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="this machine has a GPU: the benchmark would run")
def test_the_gpu_benchmark_refuses_a_machine_without_one():
    result = _bench()
    assert result.returncode == 2 and "no GPU here (jax's backend is cpu)" in result.stderr, result.stderr
    assert "--smoke" in result.stderr


@pytest.mark.slow
def test_the_gpu_benchmark_measures_its_smoke_shape_with_the_cache_and_a_trace():
    committed = REPO / "bench" / "results" / "gpu.json"
    before = committed.stat().st_mtime_ns if committed.exists() else None
    result = _bench("--smoke")
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["tokens_per_sec"] > 0 and measured["tokens_per_step"] == 8 * 64
    assert measured["step_ms"] == pytest.approx(1e3 * 512 / measured["tokens_per_sec"], rel=1e-2)
    assert measured["profile_trace"].startswith("profile/") and measured["profile_trace_bytes"] > 0
    assert measured["loaded_from_cache_at_second_start"] >= 1
    assert set(measured["time_breakdown"]) == {"data", "compile", "device", "eval", "checkpoint", "host"}
    assert (committed.stat().st_mtime_ns if committed.exists() else None) == before  # a smoke run writes nothing

"""bench/gpu.py refuses a machine without a GPU; bench/gpu_check.sh --smoke runs the device check's every step but
the build anywhere, bench.gpu's whole measurement of its smoke shape included."""

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
def test_the_gpu_check_runs_each_step_in_smoke_form_and_bench_gpu_measures_its_shape(tmp_path):
    """bench/gpu_check.sh --smoke: every step but the build runs (the GPU tests as skips), with bench.gpu's tiny GPT
    measured whole (the cache, a second start, a trace); its results go to the folder alone, and a folder that
    holds an earlier check's is refused."""
    committed = REPO / "bench" / "results" / "gpu.json"
    before = committed.stat().st_mtime_ns if committed.exists() else None
    out = tmp_path / "check"
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text().splitlines()
    assert result.returncode == 0, summary + [(out / "bench.log").read_text()[-3000:]]
    assert [line.split(":")[0] for line in summary] == ["wheels", "environment", "build", "imports", "gpu tests",
                                                        "bench gpt2-small", "bench llama-1b", "bench moe"]
    assert all(": ok in " in line for line in summary[:-2]) and all("skipped" in line for line in summary[-2:])
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "build.log", "environment.txt", "gpu.json",
                                                     "summary.txt", "tests.log", "trace.xplane.pb"]
    assert "MISSING" not in (out / "environment.txt").read_text()
    assert "skipped" in (out / "tests.log").read_text()
    measured = json.loads((out / "gpu.json").read_text())
    assert measured["smoke"] and measured["tokens_per_sec"] > 0 and measured["tokens_per_step"] == 8 * 64
    assert measured["step_ms"] == pytest.approx(1e3 * 512 / measured["tokens_per_sec"], rel=1e-2)
    assert measured["profile_trace"].startswith("profile/") and measured["profile_trace_bytes"] > 0
    assert measured["loaded_from_cache_at_second_start"] >= 1
    assert set(measured["time_breakdown"]) == {"data", "compile", "device", "eval", "checkpoint", "host"}
    gpu = jax.default_backend() == "gpu"
    assert (measured["kernels_from_trace"]["ms_per_step"] > 0) == gpu  # a CPU's trace has no device plane
    assert (committed.stat().st_mtime_ns if committed.exists() else None) == before  # a smoke run writes nothing

    again = subprocess.run(["bash", "bench/gpu_check.sh", "--smoke", "--out", str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "is not empty" in again.stderr

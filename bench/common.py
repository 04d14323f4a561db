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
import numpy as np

RESULTS = Path(__file__).parent / "results"


def eager_runner(model, program, objective: Callable) -> Callable[[], object]:
    """A torch model trained in eager PyTorch on `program`'s first batch with its optimizer (xlatrain's AdamW and
    clipping, as torch_parity builds them): each call one step of `objective(model, inputs, targets)` -> (the loss
    to differentiate, what the call returns)."""
    import torch

    from xlatrain.commands.torch_parity import optimizer_spec
    from xlatrain.torch_bridge.eager import build_optimizer

    model.train()
    spec = optimizer_spec(program.config, 1)
    optimizer = build_optimizer(model, spec)
    rows = [program.dataset.train[i] for i in range(program.derived.global_batch)]
    inputs, targets = (torch.from_numpy(np.stack([r[k] for r in rows])).long() for k in ("inputs", "targets"))

    def run():
        optimizer.zero_grad(set_to_none=True)
        loss, returned = objective(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip_norm)
        optimizer.step()
        return returned

    return run


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


def cpu_model() -> str:
    """The host CPU as Linux reports it: model name, family and model numbers (a hypervisor may show only the
    vendor's name; the numbers tell the generation). Results from different hosts differ a lot."""
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor() or "unknown"
    fields = dict(tuple(part.strip() for part in line.split(":", 1)) for line in first_cpu if ":" in line)
    name = fields.get("model name", platform.processor() or "unknown")
    return f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def environment(command: str) -> dict[str, str]:
    return {"python": sys.version.split()[0], "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind), "devices": str(jax.device_count()),
            "machine": platform.machine(), "cpu_model": cpu_model(), "cpus": str(os.cpu_count()),
            "command": command}


def host_probe_ms(size: int = 1024, calls: int = 15) -> float:
    """Median milliseconds of one float32 [size, size] @ [size, size] matmul on jax's first device, measured as a
    results file is written. The same probe in every file tells runs on one host apart when the host's speed
    drifts: three runs on one Intel host within a day saw PyTorch's default GPT step take 44.6, 103.7 and 50.9 ms."""
    x = jax.device_put(np.ones((size, size), np.float32), jax.devices()[0])
    matmul = jax.jit(lambda a: a @ a)
    seconds = interleaved_medians({"matmul": lambda: matmul(x)}, rounds=1, steps_per_round=calls, warmup=1)["matmul"]
    return round(1e3 * seconds, 3)


def write_results(name: str, command: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {"environment": environment(command), "host_matmul_1024_ms": host_probe_ms(), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def metrics_steps(run_dir: Path) -> list[int]:
    """The steps of the training records that RUN_DIR/metrics.jsonl holds so far."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def time_to_first_step(argv: list[str], run_dir: Path, cwd: Path, env: dict | None = None) -> tuple[float, dict]:
    """Start `xlatrain ARGV` (which trains into run_dir; `env` added to this process's environment), and return
    the seconds until its first step was logged, and, after it exits, its last session summary."""
    import subprocess

    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "xlatrain.cli", *argv], cwd=cwd, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    while not metrics_steps(run_dir):
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.02)
    first_step = time.perf_counter() - began
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    return first_step, json.loads((run_dir / "summary.jsonl").read_text().splitlines()[-1])


def blas_programs(config_path: str | None, overrides: list[str], devices: list) -> dict:
    """The program with its dense layers on each CPU BLAS installed (runtime.cpu_matmul), by the BLAS's name."""
    from xlatrain.custom_calls.blas import LIBRARIES, find

    from xlatrain.config import load_config
    from xlatrain.program import build_program

    return {library: build_program(
        load_config(config_path, [*overrides, f"runtime.cpu_matmul={library}"]), devices)
        for library in LIBRARIES if find(library) is not None}


def train_runner(program, executable=None) -> Callable[[], dict]:
    """Calls of the program's compiled train step (or `executable`, another compilation of it) on its first
    training batch (stacked for fused steps), each fetching that boundary's metrics to the host as the trainer
    does."""
    from xlatrain.data.loader import make_global
    from xlatrain.mesh import train_batch_sharding

    k = program.steps_per_sync
    rows = [program.dataset.train[i] for i in range(program.derived.global_batch)]
    batch = {key: np.stack([r[key] for r in rows])[None] for key in ("inputs", "targets")}
    if k > 1:
        batch = {key: np.stack([v] * k) for key, v in batch.items()}
    device_batch = make_global(batch, train_batch_sharding(program.mesh, k), 2 if k > 1 else 1, 1)
    box = {"state": program.create_state()}

    def run():
        box["state"], metrics = (executable or program.train_step)(box["state"], device_batch)
        return jax.device_get(metrics)

    return run

"""Two real processes on 127.0.0.1 (jax.distributed, gloo) train exactly like one process with 8 devices."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from xlatrain.config import load_config
from xlatrain.metrics import read_metrics
from xlatrain.trainer import train

COMMON = ["trainer.steps=12", "trainer.log_every=1", "trainer.eval_every=6", "trainer.checkpoint_every=6",
          "trainer.progress=false", "model.hidden=[32]", "optimizer.schedule=constant", "optimizer.warmup_steps=0"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(run_dir, port, steps, extra=()):
    """Both processes' (returncode, stdout, stderr)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    args = [sys.executable, "-m", "xlatrain.cli", "train", "examples/configs/digits_mlp.yaml", *COMMON,
            f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", f"distributed.coordinator=127.0.0.1:{port}",
            "distributed.num_processes=2", *extra]
    processes = [subprocess.Popen([*args, f"distributed.process_id={i}"], cwd=REPO, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    outputs = [p.communicate(timeout=300) for p in processes]
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]


def launch(run_dir, port, steps):
    outputs = start(run_dir, port, steps)
    for returncode, _, err in outputs:
        assert returncode == 0, err[-3000:]
    return [(out, err) for _, out, err in outputs]


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume(tmp_path, devices):
    run_dir = tmp_path / "two"
    outputs = launch(run_dir, free_port(), steps=6)
    assert "data-parallel 8" in outputs[0][0] and "xlatrain:" not in outputs[1][0]
    launch(run_dir, free_port(), steps=12)
    logged = read_metrics(run_dir / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in logged if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in logged if "eval_loss" in r}

    reference = train(load_config(REPO / "examples/configs/digits_mlp.yaml",
                                  [*COMMON, f"trainer.run_dir={tmp_path / 'one'}"]), echo=lambda _: None)
    assert sorted(losses) == list(range(1, 13)) and sorted(evals) == [6, 12]
    np.testing.assert_allclose([losses[s] for s in range(1, 13)], [reference.losses[s] for s in range(1, 13)],
                               rtol=1e-5)
    np.testing.assert_allclose([evals[6], evals[12]], [reference.eval_losses[6], reference.eval_losses[12]],
                               rtol=1e-5)


@pytest.mark.slow
def test_custom_cpu_collectives_refuse_a_multi_process_run(tmp_path):
    outputs = start(tmp_path / "custom", free_port(), steps=2,
                    extra=["parallel.mode=shard_map", "collectives.impl=custom"])
    for returncode, _, err in outputs:
        assert returncode == 2 and "collectives.impl=custom on CPU runs across the devices of one process" in err

"""Real processes on 127.0.0.1 (jax.distributed, gloo): started by hand, by `xlatrain launch`, with SLURM's
variables and by Open MPI's mpirun; the watchdog; signals; resuming on other process and device counts."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from conftest import REPO, TINY_GPT, xla_flags

from xlatrain.commands.launch import free_port
from xlatrain.config import load_config
from xlatrain.run.metrics import read_metrics
from xlatrain.runtime.distributed import slurm_step_port
from xlatrain.runtime.watchdog import WATCHDOG_EXIT
from xlatrain.trainer import train

CONFIG = "examples/configs/digits_mlp.yaml"
COMMON = ["trainer.steps=12", "trainer.log_every=1", "trainer.eval_every=6", "trainer.checkpoint_every=6",
          "trainer.progress=false", "model.hidden=[32]", "optimizer.schedule=constant", "optimizer.warmup_steps=0"]
LONG = ["trainer.steps=100000", "trainer.checkpoint_every=10", "trainer.eval_every=100000", "trainer.log_every=1",
        "trainer.progress=false", "model.hidden=[32]"]
TIMEOUT_S = 240


def devices_env(count: int) -> dict:
    return {**os.environ, "XLA_FLAGS": xla_flags(count)}


def start(run_dir, port, extra=(), *, processes=2, devices=4, program=("-m", "xlatrain.cli", "train"),
          per_rank=lambda i: [], base=(CONFIG, *COMMON), cwd=lambda i: REPO):
    """The processes of one run, started by hand with distributed.* keys; `cwd(rank)`: where each runs."""
    args = [sys.executable, *program, *base, f"trainer.run_dir={run_dir}",
            f"distributed.coordinator=127.0.0.1:{port}", f"distributed.num_processes={processes}", *extra]
    return [subprocess.Popen([*args, f"distributed.process_id={i}", *per_rank(i)], cwd=cwd(i), env=devices_env(devices),
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(processes)]


def finish(processes, timeout=TIMEOUT_S):
    """Every process's (returncode, stdout, stderr); kills them all if one outlives the timeout."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in processes:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            outputs.append((p.returncode, out, err))
    finally:
        for p in processes:
            p.kill()
    return outputs


def succeed(processes):
    outputs = finish(processes)
    for returncode, _, err in outputs:
        assert returncode == 0, err[-3000:]
    return outputs


def launch(processes, devices, *overrides):
    """`xlatrain launch` of the test config, with `overrides` after COMMON."""
    command = [sys.executable, "-m", "xlatrain.cli", "launch", "--nproc", str(processes), "--devices-per-proc",
               str(devices), CONFIG, *COMMON, *overrides]
    return subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def losses_of(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def assert_same_losses(losses, reference, steps, rtol=1e-5):
    np.testing.assert_allclose([losses[s] for s in steps], [reference[s] for s in steps], rtol=rtol)


def wait_for_step(run_dir, step, processes, timeout=TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(losses_of(run_dir), default=0) >= step:
            return
        assert all(p.poll() is None for p in processes), "a process ended before reaching the step"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def reference_losses(tmp_path, extra=()) -> dict[int, float]:
    config = load_config(REPO / CONFIG, [*COMMON, f"trainer.run_dir={tmp_path / 'one'}", *extra])
    return train(config, echo=lambda _: None).losses


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume(tmp_path, devices):
    run_dir = tmp_path / "two"
    outputs = succeed(start(run_dir, free_port(), ["trainer.steps=6"]))
    # every process says whom it joins; only process 0 reports the run
    reported_by_second = [line for line in outputs[1][1].splitlines()
                          if line.startswith("xlatrain:") and "joining the other processes" not in line]
    assert "data-parallel 8" in outputs[0][1] and reported_by_second == []
    succeed(start(run_dir, free_port()))
    logged = read_metrics(run_dir / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in logged if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in logged if "eval_loss" in r}

    reference = train(load_config(REPO / CONFIG, [*COMMON, f"trainer.run_dir={tmp_path / 'one'}"]),
                      echo=lambda _: None)
    assert sorted(losses) == list(range(1, 13)) and sorted(evals) == [6, 12]
    np.testing.assert_allclose([losses[s] for s in range(1, 13)], [reference.losses[s] for s in range(1, 13)],
                               rtol=1e-5)
    np.testing.assert_allclose([evals[6], evals[12]], [reference.eval_losses[6], reference.eval_losses[12]],
                               rtol=1e-5)


def test_processes_that_disagree_name_the_rank_and_the_keys(tmp_path):
    outputs = finish(start(tmp_path / "run", free_port(), per_rank=lambda i: ["seed=7"] if i else []))
    for returncode, _, err in outputs:
        assert returncode == 2, err[-2000:]
        assert "the processes disagree before compiling: rank 1 (host " in err and "seed=7 vs 0" in err


def test_xlatrain_profile_over_two_processes_traces_both_into_the_one_directory_process_0_claimed(tmp_path):
    """Each process claiming its own RUN_DIR-profile-<time> (the second one's -2) made them disagree on
    trainer.run_dir, a key the user never set."""
    succeed(start(tmp_path / "run", free_port(), devices=2, program=("-m", "xlatrain.cli", "profile"),
                  per_rank=lambda i: ["--steps", "2:3"]))
    claimed = list(tmp_path.glob("run-profile-*"))
    assert len(claimed) == 1, claimed
    for traces in (claimed[0] / "profile", claimed[0] / "profile" / "process-1"):
        assert len(list(traces.glob("plugins/profile/*/*.xplane.pb"))) == 1, traces


def test_custom_cpu_collectives_across_processes_need_mpirun(tmp_path):
    outputs = finish(start(tmp_path / "custom", free_port(), ["parallel.mode=shard_map", "collectives.impl=custom"]))
    for returncode, _, err in outputs:
        assert returncode == 2, err[-2000:]
        assert "collectives.impl=custom across processes on CPU exchanges between processes with MPI: start the 2 " \
               "processes with mpirun" in err


@pytest.mark.slow
def test_launch_shows_rank_0_stops_every_rank_on_sigterm_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    launcher = launch(2, 4, *LONG, f"trainer.run_dir={run_dir}")
    wait_for_step(run_dir, 15, [launcher])
    for returncode, _, err in finish(start(run_dir, free_port(), LONG)):  # the same run, started a second time
        assert returncode == 2 and f"trainer.run_dir='{run_dir}' is in use by another run (xlatrain process " in err, \
            err[-2000:]
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err[-3000:]
    assert "xlatrain launch: 2 processes x 4 devices" in out and "data-parallel 8" in out
    assert "[Gloo]" not in out + err and "stopped by signal at step" in out
    stopped = int(out.split("stopped by signal at step ")[1].split(";")[0])
    assert "xlatrain: digits-mlp" in (run_dir / "logs" / "rank-0.log").read_text()
    assert "[Gloo] Rank 4" in (run_dir / "logs" / "rank-1.log").read_text()  # its devices are the run's 4..7
    assert (run_dir / "checkpoints" / str(stopped)).is_dir()

    resumed = launch(2, 4, *LONG, f"trainer.run_dir={run_dir}",
                     f"trainer.steps={stopped + 3}")
    out, err = resumed.communicate(timeout=TIMEOUT_S)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming from checkpoint at step {stopped}" in out and f"finished at step {stopped + 3}" in out


def test_launch_shows_every_ranks_error_prefixed_and_exits_with_the_first(tmp_path):
    launcher = launch(2, 2, f"trainer.run_dir={tmp_path / 'run'}", "mesh.data=3")
    out, err = launcher.communicate(timeout=TIMEOUT_S)
    assert launcher.returncode == 2
    assert "[rank 1] xlatrain: error: " in err and "mesh.data=3 needs 3 devices" in err
    assert err.strip().splitlines()[-1].startswith("xlatrain launch: error: rank 0 exited with code 2: xlatrain: "
                                                   "error: ")


@pytest.mark.slow
def test_launch_stops_the_others_when_a_rank_dies(tmp_path):
    run_dir = tmp_path / "run"
    launcher = launch(2, 2, *LONG, f"trainer.run_dir={run_dir}")
    wait_for_step(run_dir, 5, [launcher])
    rank_1 = subprocess.run(["pgrep", "-f", f"trainer.run_dir={run_dir} .*process_id=1"], capture_output=True,
                            text=True).stdout.split()
    os.kill(int(rank_1[0]), signal.SIGKILL)
    began = time.monotonic()
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - began < 30
    assert launcher.returncode != 0
    assert err.strip().splitlines()[-1].startswith("xlatrain launch: error: rank 1 was killed by SIGKILL")


@pytest.mark.parametrize("codes, named", [([-signal.SIGABRT, -signal.SIGKILL], 1), ([2, -signal.SIGABRT], 1),
                                          ([-signal.SIGSEGV, -signal.SIGKILL], 0), ([3, 2], 0), ([0, None], None)])
def test_the_launcher_names_the_rank_whose_failure_came_first_not_its_peers_reaction(codes, named):
    """A rank killed from outside over one that aborted (jax's coordination client aborts a process whose peer
    vanished, often before the launcher's next poll), over one that exited with an error code."""
    from types import SimpleNamespace

    from xlatrain.commands.launch import _first_failure

    ranks = [SimpleNamespace(index=i, process=SimpleNamespace(returncode=code)) for i, code in enumerate(codes)]
    failed = _first_failure(ranks)
    assert (failed.index if failed else None) == named


@pytest.mark.slow
def test_the_watchdog_names_a_killed_rank_and_the_last_checkpoint_resumes(tmp_path):
    run_dir = tmp_path / "run"
    processes = start(run_dir, free_port(), LONG, devices=2)
    wait_for_step(run_dir, 25, processes)
    processes[1].kill()
    began = time.monotonic()
    (returncode, _, err), _ = finish(processes, timeout=60)
    assert time.monotonic() - began < 30
    assert returncode == WATCHDOG_EXIT
    last = err.strip().splitlines()[-1]
    assert last.startswith("xlatrain: error: rank 1 (host ") and " stopped responding at step " in last
    assert "no heartbeat for" in last and "last checkpoint: step " in last and "Check failure" not in err
    checkpoint = int(last.split("last checkpoint: step ")[1])

    resumed = launch(2, 2, *LONG, f"trainer.run_dir={run_dir}",
                     f"trainer.steps={checkpoint + 2}")
    out, err = resumed.communicate(timeout=TIMEOUT_S)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming from checkpoint at step {checkpoint} (verified)" in out


@pytest.mark.slow
def test_a_killed_rank_0_ends_the_others_with_xlatrain_s_line_not_the_runtime_s_abort(tmp_path):
    """jax's runtime aborts the others within milliseconds of losing process 0 (which hosts its service): the
    stderr guard prints xlatrain's line instead of its fatal dump, as under srun or mpirun."""
    processes = start(tmp_path / "run", free_port(), LONG, devices=2)
    wait_for_step(tmp_path / "run", 25, processes)
    processes[0].kill()
    began = time.monotonic()
    _, (returncode, _, err) = finish(processes, timeout=60)
    assert time.monotonic() - began < 30
    assert returncode == WATCHDOG_EXIT, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"xlatrain: error: rank 0 (the coordinator, host "
                                                   f"{socket.gethostname()}) stopped responding at step ")
    assert "last checkpoint: step " in err and "Check failure" not in err and "Terminating process" not in err


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "words", "phase"), [("stuck-hook", "in a hook", "hook"),
                                                       ("stuck-loader", "loading data", "loading_data")])
def test_the_watchdog_names_a_stuck_rank_within_its_stall_timeout(tmp_path, fault, words, phase):
    processes = start(tmp_path / "run", free_port(), [*LONG, f"distributed.stall_timeout.{phase}=3"], devices=2,
                      program=("tests/multiprocess_driver.py", fault))
    wait_for_step(tmp_path / "run", 20, processes)
    began = time.monotonic()
    outputs = finish(processes, timeout=60)
    assert time.monotonic() - began < 3 + 10
    for returncode, _, err in outputs:
        assert returncode == WATCHDOG_EXIT, err[-2000:]
        assert f"rank 1 (host {socket.gethostname()}) has been {words} at step 2" in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_no_false_alarm_while_a_rank_compiles_and_checkpoints_slowly(tmp_path):
    timeouts = ["distributed.stall_timeout.training=2", "distributed.stall_timeout.hook=2",
                "distributed.stall_timeout.loading_data=2"]
    succeed(start(tmp_path / "run", free_port(), [*timeouts, "trainer.steps=12"], devices=2,
                  program=("tests/multiprocess_driver.py", "slow-start")))


def test_every_process_measures_memory_by_the_smallest_host_and_refuses_alike(tmp_path):
    """Rank 1 has 16 KiB per device, rank 0 its share of this host: both refuse the state, naming rank 1 (alone,
    rank 1 refused and rank 0, with room, went on until the watchdog ended it with "rank 1 failed")."""
    outputs = finish(start(tmp_path / "run", free_port(), program=("tests/multiprocess_driver.py", "small-host")))
    for returncode, _, err in outputs:
        # rank 0 refuses right after rank 1; should its watchdog see rank 1's end first, it passes on the same words
        assert returncode in (2, WATCHDOG_EXIT), err[-2000:]
        assert re.search(r"config: the train state \(params and optimizer state\) needs \d+\.\d KiB per device, "
                         r"more than a CPU device's share of a host's 64 KiB of RAM \(4 devices in this process\) on "
                         rf"rank 1 \(host {re.escape(socket.gethostname())}\), the least of the 2 processes",
                         err.strip().splitlines()[-1]), err[-2000:]
    assert outputs[1][0] == 2
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("rows, words", [
    ((64, 64), "as many examples as rank 0 (host {host}), but sampled ones differ (digest "),
    ((64, 48), "has 44 training and 4 held-out examples, rank 0 (host {host}) 58 and 6")])
def test_processes_whose_copies_of_the_data_differ_refuse_alike(tmp_path, rows, words):
    """Each rank runs in a directory of its own holding its own data.npz (one config: data.path=data.npz): rank 1's
    copy has other values, or fewer rows. Every process names rank 1, before the run directory holds anything."""
    for rank, count in enumerate(rows):
        (tmp_path / f"host{rank}").mkdir()
        rng = np.random.default_rng(rank)
        np.savez(tmp_path / f"host{rank}" / "data.npz", inputs=rng.normal(size=(count, 4)).astype(np.float32),
                 targets=rng.integers(0, 3, count).astype(np.int32))
    base = ["model.name=mlp", "model.hidden=[8]", "data.source=arrays", "data.path=data.npz", "batch.global_size=8",
            "trainer.steps=2", "trainer.progress=false"]
    outputs = finish(start(tmp_path / "run", free_port(), base=base, cwd=lambda rank: tmp_path / f"host{rank}"))
    for returncode, _, err in outputs:
        assert returncode == 2, err[-2000:]
        assert err.strip().splitlines()[-1].startswith(
            "xlatrain: error: data.source=arrays, data.path='data.npz': the processes read different data: rank 1 "
            f"(host {socket.gethostname()}) "), err[-2000:]
        assert words.format(host=socket.gethostname()) in err and "give every host the same files" in err
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.slow
def test_processes_whose_devices_measure_a_pipeline_differently_take_one_partition_and_one_remat(tmp_path):
    """Rank 1 measures its first piece 1000x heavier and its step with residuals 64 MiB larger: alone it would cut
    the blocks [1, 3] and recompute, where rank 0 cuts them [3, 1] and keeps residuals (a different SPMD program
    in one collective step). Both take rank 0's partition and recompute, as the larger need requires."""
    run_dir, extra = tmp_path / "run", ["model.layers=4", "trainer.steps=4", "parallel.pipeline.remat=auto",
                                        f"parallel.pipeline.memory_budget_bytes={64 * 2**20}"]
    outputs = succeed(start(run_dir, free_port(), extra, base=PIPELINED_GPT,
                            program=("tests/multiprocess_driver.py", "other-device")))
    assert "blocks per chunk [3, 1]" in outputs[0][1]
    assert "pipeline remat full (auto: keeping residuals needs 65.8 MiB" in outputs[0][1]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["derived"]["pipeline_partition"] == [3, 1]
    alone = train(load_config(None, [*PIPELINED_GPT, *extra, f"trainer.run_dir={tmp_path / 'one'}"]),
                  echo=lambda _: None)
    assert_same_losses(losses_of(run_dir), alone.losses, steps=range(1, 5))


def slurm_env(rank: int, job: int, step: int | None = None) -> dict:
    """What srun gives each task of a job step (the coordinator port follows the job id and the step id)."""
    return {**devices_env(4), "SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_STEP_NUM_NODES": "1",
            **({} if step is None else {"SLURM_STEP_ID": str(step)})}


def is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_slurm_job(steps: int = 1) -> int:
    """A job id whose first `steps` steps' coordinator ports are free here."""
    for job in range(2**12):
        if all(is_free(slurm_step_port(str(job), str(step))) for step in range(steps)):
            return job
    raise AssertionError("no free ports for the SLURM test")


def test_each_slurm_job_step_meets_on_a_port_of_its_own_and_step_0_on_jaxs():
    first, count = 65535 - 2**12 + 1, 2**12
    assert slurm_step_port("123456", None) == slurm_step_port("123456", "0") == first + 123456 % count
    steps = [slurm_step_port("123456", str(step)) for step in range(count)]
    assert len(set(steps)) == count and all(first <= port <= 65535 for port in steps)
    assert slurm_step_port("7", "batch") == first + 7  # sbatch's own step, not a number


@pytest.mark.slow
def test_slurm_environment_alone_joins_the_processes_and_two_steps_of_one_job_run_at_once(tmp_path, devices):
    """A sweep: two `srun` steps of one job at the same time, each of two tasks, with no distributed.* keys."""
    job = free_slurm_job(steps=2)
    processes = [subprocess.Popen([sys.executable, "-m", "xlatrain.cli", "train", CONFIG, *COMMON,
                                   f"trainer.run_dir={tmp_path / f'step{step}'}"], cwd=REPO,
                                  env=slurm_env(rank, job, step), text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for step in range(2) for rank in range(2)]
    outputs = succeed(processes)
    assert "data-parallel 8" in outputs[0][1] and "data-parallel 8" in outputs[2][1]
    assert f"(job {job}, step 1: 127.0.0.1:{slurm_step_port(str(job), '1')})" in outputs[2][1]
    reference = reference_losses(tmp_path)
    for step in range(2):
        assert_same_losses(losses_of(tmp_path / f"step{step}"), reference, steps=range(1, 13))


NO_MPIRUN = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed "
                               "(apt install openmpi-bin libopenmpi-dev; .ci/run installs it)")


MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo", "--mca",
          "btl_tcp_if_include", "lo"]
"""Open MPI on 127.0.0.1 only."""


def mpirun(run_dir, *overrides, processes=2, devices=4, base=(CONFIG, *COMMON)):
    """`xlatrain train` under Open MPI's mpirun on 127.0.0.1, with no distributed.* keys."""
    command = [*MPIRUN, "-np", str(processes), "-x", "XLA_FLAGS", sys.executable, "-m", "xlatrain.cli", "train",
               *base, f"trainer.run_dir={run_dir}", *overrides]
    done = subprocess.run(command, cwd=REPO, env=devices_env(devices), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
@NO_MPIRUN
def test_mpirun_alone_joins_the_processes(tmp_path, devices):
    assert "data-parallel 8" in mpirun(tmp_path / "run").stdout
    assert_same_losses(losses_of(tmp_path / "run"), reference_losses(tmp_path), steps=range(1, 13))


@pytest.mark.slow
@NO_MPIRUN
def test_custom_collectives_across_processes_under_mpirun_match_xla_over_50_steps(tmp_path):
    """2 processes x 4 devices: the custom collectives meet in each process and exchange across them with MPI
    (zero1: all-reduce of the gradient buckets, all-gather of the updated blocks; the replicated strategy's
    all-reduce is among them)."""
    extra = ["trainer.steps=50", "trainer.checkpoint_every=50", "trainer.eval_every=50", "parallel.mode=shard_map",
             "parallel.strategy=zero1"]
    for impl in ("custom", "xla"):
        mpirun(tmp_path / impl, *extra, f"collectives.impl={impl}")
    assert_same_losses(losses_of(tmp_path / "custom"), losses_of(tmp_path / "xla"), steps=range(1, 51), rtol=1e-6)


@pytest.mark.slow
@NO_MPIRUN
def test_every_custom_collective_across_processes_under_mpirun_matches_xla():
    """all_reduce, reduce_scatter, all_gather, all_to_all, ppermute and broadcast over axes spanning 2 processes x 4
    devices, one group and two groups at once, in float32, bfloat16 and int32; a process that skips one is named by the
    other's error (tests/mpi_collectives_driver.py)."""
    command = [*MPIRUN, "-np", "2", "-x", "XLA_FLAGS", sys.executable, "tests/mpi_collectives_driver.py"]
    done = subprocess.run(command, cwd=REPO, env=devices_env(4), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0: 56 cases match" in done.stdout and "rank 1: 56 cases match" in done.stdout
    assert "rank 0: named the missing process" in done.stdout


def train_leg(run_dir, steps, processes, devices, extra, base=(CONFIG, *COMMON)):
    """One leg of a run: `processes` x `devices`, to trainer.steps=steps."""
    overrides = [*extra, f"trainer.steps={steps}"]
    if processes == 1:
        command = [sys.executable, "-m", "xlatrain.cli", "train", *base, f"trainer.run_dir={run_dir}", *overrides]
        done = subprocess.run(command, cwd=REPO, env=devices_env(devices), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        succeed(start(run_dir, free_port(), overrides, processes=processes, devices=devices, base=base))


@pytest.mark.slow
def test_a_run_resumes_on_other_process_and_device_counts_exactly(tmp_path, devices):
    """2 processes x 4 devices -> 1 x 8 -> 1 x 4 -> 2 x 2: the state is resharded on restore and the data position
    is kept in global samples, so the losses are the uninterrupted run's. (fsdp splits the params and optimizer
    state over `data`, zero1 the optimizer state alone: one restore path, taken here by fsdp; the replicated
    strategy's by the other resume tests.)"""
    extra = ["parallel.strategy=fsdp", "trainer.checkpoint_every=4", "trainer.eval_every=1000"]
    run_dir = tmp_path / "elastic"
    for steps, (processes, devices_each) in zip((4, 8, 12, 16), ((2, 4), (1, 8), (1, 4), (2, 2)), strict=True):
        train_leg(run_dir, steps, processes, devices_each, extra)
    reference = reference_losses(tmp_path, [*extra, "trainer.steps=16"])
    assert_same_losses(losses_of(run_dir), reference, steps=range(1, 17), rtol=1e-6)


PIPELINED_GPT = [*TINY_GPT, "model.width=16", "data.seq_len=16", "batch.global_size=32", "mesh.stage=2",
                 "parallel.pipeline.microbatches=2", "trainer.checkpoint_every=4", "optimizer.schedule=constant",
                 "optimizer.warmup_steps=0"]


@pytest.mark.slow
@NO_MPIRUN
def test_a_pipeline_with_custom_collectives_whose_stages_span_two_processes_equals_one_process(tmp_path, devices):
    """The stages pass activations between the processes with the custom ppermute over MPI (4 MPI lanes, one per
    data row)."""
    mpirun(tmp_path / "custom", "trainer.steps=4", "collectives.impl=custom", base=PIPELINED_GPT)
    reference = train(load_config(None, [*PIPELINED_GPT, "trainer.steps=4", f"trainer.run_dir={tmp_path / 'one'}"]),
                      echo=lambda _: None).losses
    assert_same_losses(losses_of(tmp_path / "custom"), reference, steps=range(1, 5))


@pytest.mark.slow
def test_a_pipeline_whose_stages_span_two_processes_equals_one_process_and_resumes_on_fewer_replicas(
        tmp_path, devices):
    """2 processes x 4 devices with one pipeline stage per process (data 4 x stage 2), then resumed on one process
    with 4 devices (data 2 x stage 2): the losses are those of one process with 8 devices, uninterrupted. With
    fsdp each stage's params and optimizer state are split over `data` and resharded from 4 to 2 on resume (zero1,
    splitting the optimizer state alone, is tested in one process: tests/test_pipeline.py)."""
    run_dir, extra = tmp_path / "pipelined", ["parallel.strategy=fsdp"]
    train_leg(run_dir, 4, 2, 4, extra, base=PIPELINED_GPT)
    train_leg(run_dir, 8, 1, 4, extra, base=PIPELINED_GPT)
    reference = train(load_config(None, [*PIPELINED_GPT, *extra, "trainer.steps=8",
                                         f"trainer.run_dir={tmp_path / 'one'}"]), echo=lambda _: None).losses
    assert_same_losses(losses_of(run_dir), reference, steps=range(1, 9))


TENSOR_GPT = [*TINY_GPT, "model.width=64", "model.heads=4", "batch.global_size=16", "trainer.checkpoint_every=4",
              "optimizer.schedule=constant", "optimizer.warmup_steps=0"]


@pytest.mark.slow
@pytest.mark.parametrize("split", [["mesh.tensor=4", "parallel.sequence_parallel=true"],
                                   ["mesh.stage=2", "mesh.tensor=2", "parallel.sequence_parallel=true"]],
                         ids=["jit-tensor4", "pipeline-stage2-tensor2"])
def test_a_tensor_group_inside_each_of_two_processes_equals_one_process(split, tmp_path, devices):
    """2 processes x 4 devices: the tensor axis inside each process, the others across them (in one global
    program, and in a pipeline's per-device program); the losses are one process's with no tensor split."""
    succeed(start(tmp_path / "two", free_port(), ["trainer.steps=4", *split], base=TENSOR_GPT))
    reference = train(load_config(None, [*TENSOR_GPT, "trainer.steps=4", f"trainer.run_dir={tmp_path / 'one'}"]),
                      echo=lambda _: None).losses
    assert_same_losses(losses_of(tmp_path / "two"), reference, steps=range(1, 5))

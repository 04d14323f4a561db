"""Multi-process runs on one CPU host: start-up and step overheads, the two-level custom all-reduce against
XLA's gloo all-reduce across processes, and how fast the watchdog stops a run with a dead or a stuck rank.

- Time to first step and steps/s of the digits MLP (8 CPU devices in all) with 1, 2 and 4 processes started by
  `xlatrain launch`. All processes share this machine's cores, so these are the overheads of more processes
  (joining, gloo, per-process host work), not a scaling curve.
- all_reduce bus bandwidth (nccl-tests' definition: algbw x 2(n-1)/n) at 2 processes x 4 devices under mpirun,
  xlatrain's two-level all-reduce vs XLA's psum over gloo, interleaved in the same run.
- Detection: seconds from kill -9 of rank 1 (or of rank 0, which hosts jax's coordination service) until every
  process has exited; seconds from rank 1 blocking in a hook until every process has exited, with
  distributed.stall_timeout.hook=5.

    python3 -m bench.multiprocess      # writes bench/results/multiprocess.json; needs Open MPI's mpirun
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench.common import metrics_steps, time_to_first_step, write_results
from xlatrain.commands.launch import free_port

REPO = Path(__file__).resolve().parents[1]
CONFIG = ["examples/configs/digits_mlp.yaml", "model.hidden=[32]", "trainer.progress=false", "trainer.log_every=1",
          "trainer.eval_every=100000", "trainer.checkpoint_every=100000"]
STEPS = 300
SIZES = [2**16, 2**20, 2**22, 2**24]  # bytes per device: 64 KiB .. 16 MiB
STUCK_HOOK_TIMEOUT_S = 5


def start_up_and_throughput(processes: int, work: Path) -> dict:
    run_dir = work / f"launch-{processes}"
    first_step, summary = time_to_first_step(["launch", "--nproc", str(processes), "--devices-per-proc",
                                              str(8 // processes), *CONFIG, f"trainer.steps={STEPS}",
                                              f"trainer.run_dir={run_dir}"], run_dir, REPO)
    return {"processes": processes, "devices_per_process": 8 // processes,
            "time_to_first_step_s": round(first_step, 2),
            "steps_per_s": round((summary["final_step"] - summary["start_step"]) / summary["wall_seconds"], 1)}


def all_reduce_worker() -> None:
    """Run by mpirun: one row per size, printed as JSON by process 0."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from xlatrain.custom_calls.backend import check_mpi_spans

    from bench.common import interleaved_medians
    from xlatrain import custom_calls as ours
    from xlatrain.compat.mapping import shard_map
    from xlatrain.config import DistributedConfig
    from xlatrain.runtime.distributed import initialize

    initialize(DistributedConfig())
    check_mpi_spans(jax.process_count(), jax.process_index())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    n = mesh.size
    for size in SIZES:
        per_device = size // 4
        sharding = NamedSharding(mesh, P("data"))
        x = jax.make_array_from_callback((n * per_device,), sharding,
                                         lambda index: np.ones((n * per_device,), np.float32)[index])
        compiled = {name: jax.jit(shard_map(fn, mesh, P("data"), P("data"))).lower(x).compile()
                    for name, fn in (("xlatrain", lambda v: ours.all_reduce(v, "data")),
                                     ("xla", lambda v: jax.lax.psum(v, "data")))}
        runners = {name: partial(executable, x) for name, executable in compiled.items()}
        rounds, steps = (8, 8) if size <= 2**20 else (6, 3)
        seconds = interleaved_medians(runners, rounds=rounds, steps_per_round=steps, warmup=2)
        row = {"bytes_per_device": size}
        for name, secs in seconds.items():
            row[name] = {"seconds": secs, "busbw_GBps": size / secs / 1e9 * 2 * (n - 1) / n}
        row["bandwidth_ratio"] = seconds["xla"] / seconds["xlatrain"]
        if jax.process_index() == 0:
            print("ROW " + json.dumps(row), flush=True)


def all_reduce_rows() -> list[dict]:
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo",
               "--mca", "btl_tcp_if_include", "lo", "-np", "2", "-x", "XLA_FLAGS", sys.executable, "-m",
               "bench.multiprocess", "--all-reduce-worker"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]


def two_processes(run_dir: Path, extra: list[str], program: list[str]) -> list[subprocess.Popen]:
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    return [subprocess.Popen([sys.executable, *program, *CONFIG, "trainer.steps=100000", f"trainer.run_dir={run_dir}",
                              "trainer.checkpoint_every=10", f"distributed.coordinator=127.0.0.1:{port}",
                              "distributed.num_processes=2", f"distributed.process_id={i}", *extra], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]


def seconds_until_all_exit(processes: list[subprocess.Popen], since: float) -> float:
    for p in processes:
        p.communicate(timeout=120)
    return round(time.perf_counter() - since, 2)


def wait_for_step(run_dir: Path, step: int) -> None:
    while max(metrics_steps(run_dir), default=0) < step:
        time.sleep(0.05)


def seconds_to_stop_after_killing(rank: int, run_dir: Path) -> float:
    processes = two_processes(run_dir, [], ["-m", "xlatrain.cli", "train"])
    wait_for_step(run_dir, 25)
    processes[rank].send_signal(signal.SIGKILL)
    return seconds_until_all_exit(processes, time.perf_counter())


def detection(work: Path) -> dict:
    killed_s = seconds_to_stop_after_killing(1, work / "killed")
    killed_coordinator_s = seconds_to_stop_after_killing(0, work / "killed-coordinator")
    stuck = two_processes(work / "stuck", [f"distributed.stall_timeout.hook={STUCK_HOOK_TIMEOUT_S}"],
                          ["tests/multiprocess_driver.py", "stuck-hook"])
    wait_for_step(work / "stuck", 20)  # rank 1 blocks in its hook at step 20
    stuck_s = seconds_until_all_exit(stuck, time.perf_counter())
    return {"killed_rank_all_exited_s": killed_s, "killed_rank_0_all_exited_s": killed_coordinator_s,
            "stuck_rank_all_exited_s": stuck_s,
            "stall_timeout_hook_s": STUCK_HOOK_TIMEOUT_S, "heartbeat_timeout_s": 10}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        launches = [start_up_and_throughput(p, work) for p in (1, 2, 4)]
        for row in launches:
            print(row, flush=True)
        rows = all_reduce_rows()
        for row in rows:
            print(f"all_reduce {row['bytes_per_device'] / 2**10:>6.0f} KiB/device  busbw xlatrain "
                  f"{row['xlatrain']['busbw_GBps']:.2f} GB/s, xla (gloo) {row['xla']['busbw_GBps']:.2f} GB/s, "
                  f"ratio {row['bandwidth_ratio']:.2f}", flush=True)
        detected = detection(work)
        print(detected, flush=True)
    write_results("multiprocess", "python3 -m bench.multiprocess", {
        "note": "every process shares this machine's 2 cores: start-up and step numbers are overheads of more "
                "processes, not scaling; bandwidths are memory-copy and loopback numbers, compare the ratios",
        "launches": launches, "all_reduce_2_processes_x_4_devices": rows, "detection": detected})


if __name__ == "__main__":
    if sys.argv[1:] == ["--all-reduce-worker"]:
        all_reduce_worker()
    else:
        main()

"""mesh.cpu_devices: how many XLA:CPU devices a run makes, decided before JAX starts."""

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import COMPILE_FASTER, DIGITS_MLP, REPO, TINY_GPT

from xlatrain.compat.backends import set_cpu_device_count
from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.run.metrics import read_metrics
from xlatrain.runtime.cpu_devices import count_set_by_environment, plan_cpu_devices
from xlatrain.runtime.host_memory import available_memory_bytes, host_memory

GIB = 2**30


def plan(overrides=(), cores=2, available=64 * GIB, state=GIB // 8, environment=None, multi_process=False):
    def replica_state_bytes():
        if state is None:
            raise AssertionError("auto sized the replicas where it had no split to consider")
        return state

    return plan_cpu_devices(load_config(None, list(overrides)), cores, available, replica_state_bytes, environment,
                            multi_process)


PER_CORE = "mesh.cpu_devices=per_core"


@pytest.mark.parametrize("overrides, cores, count", [
    ([], 16, None),  # auto without a mesh size: JAX's own one device
    (["mesh.data=4"], 2, 4),  # what the mesh asks for, on any number of cores
    (["mesh.data=2", "mesh.stage=2"], 64, 4),
    (["mesh.stage=4", "model.layers=4"], 2, 4),
    (["mesh.cpu_devices=3"], 64, 3),
    ([PER_CORE], 2, 2),
    ([PER_CORE], 16, 16),
    ([PER_CORE], 6, 4),  # the largest count <= cores that batch.global_size=16 divides over
    ([PER_CORE], 1, 1),
    ([PER_CORE, "batch.global_size=24", "batch.microbatches=4"], 8, 6),
    ([PER_CORE, "batch.global_size=16", "batch.microbatches=16"], 8, 1),
    ([PER_CORE, "batch.global_size=15"], 2, 1),
    ([PER_CORE, "batch.per_replica=8"], 8, 1),  # more replicas would change the global batch
    ([PER_CORE, "mesh.data=2"], 8, 2),
])
def test_the_count_follows_the_mesh_and_per_core_the_cores_and_the_batch(overrides, cores, count):
    assert plan(overrides, cores=cores).count == count


def test_per_core_makes_only_as_many_replicas_as_fit_half_the_available_memory():
    # two replicas of a 1 GiB state need 2 x 2 x 1 GiB (state, gradients and temporaries): 4 GiB
    assert plan([PER_CORE], cores=8, available=8 * GIB, state=GIB).count == 2
    assert plan([PER_CORE], cores=8, available=16 * GIB, state=GIB).count == 4
    tight = plan([PER_CORE], cores=8, available=6 * GIB, state=GIB)
    assert tight.count == 1 and "would not fit" in tight.why
    assert plan([PER_CORE], cores=8, available=None, state=GIB).count == 8  # memory unknown: cores and batch decide


def test_the_environment_and_multi_process_runs_keep_their_own_count():
    forced = count_set_by_environment({"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true "
                                                    "--xla_force_host_platform_device_count=8"})
    assert forced == "XLA_FLAGS' --xla_force_host_platform_device_count=8"
    assert count_set_by_environment({"JAX_NUM_CPU_DEVICES": "4"}) == "JAX_NUM_CPU_DEVICES=4"
    assert count_set_by_environment({"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true"}) is None
    assert plan(["mesh.cpu_devices=3"], environment=forced, state=None).count is None
    assert plan([PER_CORE], multi_process=True, state=None).count is None
    assert plan(["mesh.cpu_devices=2"], multi_process=True, state=None).count == 2  # per process, as asked


def test_a_bad_count_is_a_config_error(capsys):
    from xlatrain.cli import main

    assert main(["config", "mesh.cpu_devices=0"]) == 2
    assert "mesh.cpu_devices" in capsys.readouterr().err


def test_a_started_backend_keeps_its_count_or_refuses_another(devices):
    set_cpu_device_count(len(devices))
    with pytest.raises(UserError, match="started JAX with 8 CPU device"):
        set_cpu_device_count(3)


def _xlatrain(*args, cores, **extra_env):
    """`xlatrain ARGS` in a process without the suite's forced device count, on the first `cores` cores."""
    env = {**os.environ, "XLA_FLAGS": COMPILE_FASTER, **extra_env}
    pinned = (f"import os, runpy, sys; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:{cores}]); "
              "sys.argv[0] = 'xlatrain'; runpy.run_module('xlatrain.cli', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", pinned, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin the command to")
def test_the_command_makes_what_the_mesh_asks_or_one_device_per_core():
    auto = _xlatrain("config", cores=2)
    assert "  devices: 1\n" in auto.stdout, auto.stderr
    assert "# CPU devices: JAX's default (mesh.cpu_devices=per_core makes one per core)" in auto.stdout
    mesh = _xlatrain("config", "mesh.data=4", cores=1)
    assert "  devices: 4\n  data_parallel: 4\n" in mesh.stdout, mesh.stderr
    split = _xlatrain("config", PER_CORE, cores=2)
    assert "  devices: 2\n  data_parallel: 2\n" in split.stdout, split.stderr
    assert "# CPU devices: 2 (one per core, data-parallel over 2 of 2 cores)" in split.stdout
    one = _xlatrain("config", PER_CORE, cores=1)
    assert "  devices: 1\n" in one.stdout and "# CPU devices: 1 (one core)" in one.stdout
    asked = _xlatrain("config", "mesh.cpu_devices=3", "batch.global_size=12", cores=1)
    assert "  devices: 3\n  data_parallel: 3\n" in asked.stdout, asked.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin the command to")
@pytest.mark.skipif(importlib.util.find_spec("torchax") is None, reason="needs torchax (the [torch] extra)")
def test_a_torch_model_is_sized_without_starting_jax_so_it_splits_per_core_too():
    split = _xlatrain("config", "examples/configs/torch_gpt.yaml", PER_CORE, cores=2,
                      PYTHONPATH=str(REPO / "examples" / "torch_model"))
    assert "  devices: 2\n  data_parallel: 2\n" in split.stdout, split.stderr
    assert "# CPU devices: 2 (one per core, data-parallel over 2 of 2 cores)" in split.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin the command to")
def test_training_over_a_device_per_core_says_so_and_counts_the_dispatch_wait_as_device_time(tmp_path, devices):
    """XLA:CPU runs each device's part of a step on one worker thread per core (or per device, if more), so with a
    device per core dispatching a step returns only once the step before has finished: that wait is device time,
    and the run is not host-bound (counted as host work, it made this run 88% host, 2% device, host-bound)."""
    from xlatrain.runtime.cpu_devices import dispatch_waits_for_the_previous_step

    assert dispatch_waits_for_the_previous_step(devices) == (len(os.sched_getaffinity(0)) <= len(devices))
    assert not dispatch_waits_for_the_previous_step(devices[:2])  # 2 of this process's 8 workers
    run = tmp_path / "run"
    result = _xlatrain("train", *TINY_GPT, "model.width=128", "data.seq_len=64", PER_CORE, "trainer.steps=30",
                       "trainer.log_every=10", "trainer.checkpoint_every=1000", f"trainer.run_dir={run}", cores=2)
    assert result.returncode == 0, result.stderr
    assert "devices 2 (cpu), data-parallel 2" in result.stdout
    assert "  CPU devices: 2 (one per core, data-parallel over 2 of 2 cores)\n" in result.stdout
    timing = [r for r in read_metrics(run / "metrics.jsonl") if "interval_seconds" in r]
    past_the_warm_up = timing[1]  # steps 11..20: the last interval holds the final checkpoint
    assert past_the_warm_up["time_device"] > 0.5 > past_the_warm_up["time_host"], timing
    assert "bottleneck host-bound" not in result.stdout


RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("groups, files, expected", [
    ("0::/\n", {"memory.max": str(GIB)}, GIB),  # cgroup v2, as a container sees it
    ("0::/job/42\n", {"job/42/memory.max": str(2 * GIB), "memory.max": "max"}, 2 * GIB),  # v2, a batch job
    ("4:memory:/process_api/abc\n1:cpu:/\n", {"memory/process_api/abc/memory.limit_in_bytes": str(3 * GIB)},
     3 * GIB),  # v1
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, RAM),  # v1 without a limit
    ("0::/\n", {"memory.max": "max"}, RAM),
    (None, {}, RAM),  # no /proc/self/cgroup
])
def test_host_memory_is_what_the_control_group_allows_where_it_caps_the_ram(tmp_path, groups, files, expected):
    """A container's or a batch job's memory limit is what the out-of-memory killer enforces, not the RAM."""
    proc = tmp_path / "cgroup"
    if groups is not None:
        proc.write_text(groups)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    limit, said = host_memory(proc, tmp_path / "fs")
    assert limit == min(expected, RAM)
    assert said.endswith(f"the host's {RAM / GIB:.1f} GiB of RAM" + (")" if expected < RAM else ""))
    assert ("its control group allows" in said) == (expected < RAM)


@pytest.mark.parametrize("files, expected", [
    ({}, 20 * GIB),  # MemAvailable
    ({"memory.max": str(4 * GIB), "memory.current": str(GIB)}, 3 * GIB),  # v2: what is left of the limit
    ({"memory/memory.limit_in_bytes": str(4 * GIB), "memory/memory.usage_in_bytes": str(5 * GIB)}, 0),  # over it
    ({"memory.max": "max", "memory.current": str(GIB)}, 20 * GIB),
])
def test_available_memory_is_what_is_left_of_the_control_groups_limit_where_that_is_less(tmp_path, files, expected):
    (tmp_path / "meminfo").write_text(f"MemTotal: {64 * GIB // 1024} kB\nMemAvailable: {20 * GIB // 1024} kB\n")
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    assert available_memory_bytes(tmp_path / "meminfo", tmp_path / "missing", tmp_path / "fs") == expected
    assert available_memory_bytes(tmp_path / "missing", tmp_path / "missing", tmp_path / "nothing") is None


def test_a_run_counted_by_mesh_cpu_devices_resumes_on_another_count_as_one_counted_by_xla_flags(tmp_path):
    """mesh.cpu_devices is a device count like mesh.data: an elastic resume may change it."""
    common = [*DIGITS_MLP, "trainer.checkpoint_every=2", f"trainer.run_dir={tmp_path / 'run'}"]
    first = _xlatrain("train", *common, "trainer.steps=2", "mesh.cpu_devices=2", cores=2)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _xlatrain("train", *common, "trainer.steps=4", "mesh.cpu_devices=4", cores=2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from checkpoint at step 2" in resumed.stdout and "data-parallel 4" in resumed.stdout

"""Multi-process runs through JAX's own runtime (jax.distributed); process 0 owns the run directory.

Processes join either through `distributed.*` keys (set by `xlatrain launch`, or by hand) or through the
cluster that jax.distributed detects from the environment: SLURM's `srun`, Open MPI's `mpirun`, Kubernetes.
Before anything compiles, every process checks that all agree on the config, the versions and the devices.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
from importlib.metadata import version
from typing import Any

import jax

from xlatrain.compat.backends import jaxlib_version
from xlatrain.compat.multihost import (
    detected_cluster,
    keep_our_signal_handlers,
    key_value_dir_get,
    key_value_get,
    key_value_set,
    slurm_coordinator,
    use_gloo_for_cpu_collectives,
)
from xlatrain.config import Config, DistributedConfig, flatten
from xlatrain.errors import UserError, first_line
from xlatrain.runtime.signals import StopSignals
from xlatrain.runtime.watchdog import guard_against_runtime_abort

START_TIMEOUT_S = 300.0
"""How long a process waits for the others' start-up facts (they joined already, so this is generous)."""


SLURM_PORTS = (65535 - 2**12 + 1, 2**12)
"""The ephemeral ports jax.distributed takes SLURM's coordinator port from: (first, how many)."""
SLURM_STEP_STRIDE = 1021
"""Ports between consecutive job steps: prime, so one job's steps take every port of the range before one repeats."""


def slurm_step_port(job_id: str, step_id: str | None) -> int:
    """The coordinator port of one SLURM job step. jax.distributed derives it from the job id alone, so two steps
    of one job running at once (a sweep of `srun`s in one allocation) met on one port and one of them aborted; the
    step id moves each step to a port of its own (step 0, and a job without steps, keep jax's)."""
    first, count = SLURM_PORTS
    step = int(step_id) if step_id is not None and step_id.isdigit() else 0
    return first + (int(job_id) + SLURM_STEP_STRIDE * step) % count


def initialize(config: DistributedConfig) -> None:
    """Join the other processes before any device is touched; a no-op for single-process runs."""
    cluster = detected_cluster()
    if not joins_other_processes(config):
        if (config.num_processes or 1) > 1:
            raise UserError(f"distributed.num_processes={config.num_processes} needs distributed.coordinator="
                            "host:port (process 0's address), or a launcher that jax.distributed detects "
                            "(srun, mpirun, a Kubernetes Job), or `xlatrain launch --nproc N`")
        return
    use_gloo_for_cpu_collectives()
    keep_our_signal_handlers()
    coordinator = config.coordinator
    joined_through = f"distributed.coordinator={coordinator}" if coordinator else f"the {cluster} cluster's environment"
    if coordinator is None and cluster == "slurm":
        job, step = os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_STEP_ID")
        coordinator = slurm_coordinator(slurm_step_port(job, step))
        joined_through += f" (job {job}, step {step or 0}: {coordinator})"
    print(f"xlatrain: joining the other processes through {joined_through}", flush=True)
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=config.num_processes,
                                   process_id=config.process_id)
    except Exception as err:  # connection and timeout errors come from deep inside the runtime
        raise UserError(f"distributed: could not join the other processes through {joined_through} "
                        f"({type(err).__name__}: {first_line(err)}); start every process with the same "
                        "coordinator and num_processes, and a distinct process_id") from None
    guard_against_runtime_abort()


def joins_other_processes(config: DistributedConfig) -> bool:
    """Whether this process is one of several: a coordinator is set, or jax.distributed detects a cluster."""
    return config.coordinator is not None or detected_cluster() is not None


def is_primary() -> bool:
    return jax.process_index() == 0


def host_name() -> str:
    return socket.gethostname()


_calls = collections.Counter()
"""How often each exchange was begun in this process: every process begins them in the same order."""


def exchange_key(name: str) -> str:
    """A key-value-store prefix of its own for this call's exchange called `name`: the count of earlier ones tells
    it from them, so a process that trains twice in one jax.distributed session never reads what the first run
    published (its start facts, its stop request, its verdicts)."""
    _calls[name] += 1
    return f"xlatrain/{name}/{_calls[name]}/"


def as_primary_has_it(name: str, value: str) -> str:
    """`value` as process 0 has it, on every process: for what only process 0 can find out (whether it holds the
    run directory's lock), so that every process goes on or stops alike."""
    if jax.process_count() == 1:
        return value
    key = exchange_key(f"primary/{name}")
    if is_primary():
        key_value_set(key, value.encode())
        return value
    return key_value_get(key, START_TIMEOUT_S).decode()


def start_facts(config: Config) -> dict[str, Any]:
    """What every process must agree on before compiling, plus where it runs (for messages)."""
    flat = flatten(config.model_dump(mode="json"))
    flat.pop("distributed.process_id", None)
    return {"host": host_name(), "config": flat,
            "config_hash": hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest(),
            "xlatrain": version("xlatrain"), "jax": jax.__version__, "jaxlib": jaxlib_version(),
            "platform": jax.devices()[0].platform, "local_devices": jax.local_device_count(),
            "devices": jax.device_count()}


def disagreements(facts: list[dict[str, Any]]) -> list[str]:
    """How each process's start facts differ from process 0's, one phrase per differing process."""
    reference = facts[0]
    found = []
    for rank, mine in enumerate(facts[1:], start=1):
        differences = [f"{key} {mine[key]} vs {reference[key]}" for key in
                       ("xlatrain", "jax", "jaxlib", "platform", "local_devices", "devices")
                       if mine[key] != reference[key]]
        if mine["config_hash"] != reference["config_hash"]:
            keys = sorted(set(mine["config"]) | set(reference["config"]))
            differences += [f"{key}={mine['config'].get(key)!r} vs {reference['config'].get(key)!r}"
                            for key in keys if mine["config"].get(key) != reference["config"].get(key)]
        if differences:
            found.append(f"rank {rank} (host {mine['host']}) differs from rank 0 (host {reference['host']}): "
                         + ", ".join(differences))
    return found


def everyones(name: str, value: Any, timeout_s: float = START_TIMEOUT_S) -> list[Any]:
    """Every process's `value` (JSON), in rank order, on every process: each publishes its own and reads all."""
    if jax.process_count() == 1:
        return [value]
    prefix = exchange_key(name)
    key_value_set(f"{prefix}{jax.process_index()}", json.dumps(value).encode())
    return [json.loads(key_value_get(f"{prefix}{rank}", timeout_s)) for rank in range(jax.process_count())]


def check_processes_agree(config: Config) -> None:
    """Every process publishes its start facts and reads everyone's; a mismatch is one error on every process."""
    if jax.process_count() == 1:
        return
    problems = disagreements(everyones("start", start_facts(config)))
    if problems:
        raise UserError("distributed: the processes disagree before compiling: " + "; ".join(problems)
                        + "; start every process with the same config, xlatrain, jax and device count")


class StopAgreement:
    """When a multi-process run stops on a signal, every process must stop after the same step, or the ones
    still stepping wait forever in a collective for those saving a checkpoint.

    A process that received a signal publishes the boundary it was at (t) in the key-value store; every
    process stops at boundary t + LAG. Why every process learns of t in time: at each boundary a process
    reads the previous boundary's results, which needs every process to have dispatched that executable, so
    each has finished its host work of two boundaries before, the publishing included; a process at
    boundary t + LAG therefore already sees t. Single-process runs stop at the next boundary."""

    LAG = 2

    def __init__(self, stop: StopSignals):
        self.stop = stop
        self.processes = jax.process_count()
        self.published = False
        self.prefix = exchange_key("stop") if self.processes > 1 else ""

    def should_stop(self, boundary: int) -> bool:
        """Called once per boundary, after its results of the previous boundary were read."""
        if self.processes == 1:
            return self.stop.requested
        if self.stop.requested and not self.published:
            key_value_set(f"{self.prefix}{jax.process_index()}", str(boundary).encode())
            self.published = True
        requested_at = [int(value) for _, value in key_value_dir_get(self.prefix)]
        return any(at + self.LAG <= boundary for at in requested_at)

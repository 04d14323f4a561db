"""How many XLA:CPU devices a single-process run makes (mesh.cpu_devices), decided before JAX starts.

`auto` makes what the mesh asks for (mesh.data x mesh.stage x mesh.tensor), so `xlatrain train mesh.data=8` needs no
XLA_FLAGS.
`per_core` splits the host into one XLA:CPU device per core and trains data-parallel over them: one device's XLA:CPU
program leaves the cores partly idle (some kernels, such as attention's batched dots, keep to one thread; the 4 x
256 GPT's step uses 1.8 of 2 cores' time), so on a 2-core AMD EPYC host the GPT's step measured 0.85-1.02x PyTorch
eager's time split in two, against 0.93-1.11x on one device, and on a 2-core Intel Xeon 0.99-1.14x against
1.06-1.26x (bench.cpu_speed). The price is a replica of the train state per
device, so it splits only where every replica fits the host's memory with room to spare, and only where the split
keeps the run the same computation (batch.global_size fixed). It is not the default (bench/README.md, the GPT on
CPU): each replica holds the whole train state, and no host with more than two cores has measured it.

JAX fixes its CPU device count when its backend starts, so `xlatrain`'s commands call apply_cpu_devices()
after reading the config and before anything touches a device.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

from xlatrain.config import Config
from xlatrain.runtime.host_memory import available_memory_bytes
from xlatrain.sizes import readable_bytes

REPLICA_MEMORY_FACTOR = 2
"""A replica's memory in units of its train state: the state, plus its gradients and the update's temporaries."""

MEMORY_SHARE = 0.5
"""The share of the host's available memory that per_core lets the replicas' state take (activations need the
rest)."""

_FORCED_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


@dataclass(frozen=True)
class CpuDevicePlan:
    count: int | None
    """XLA:CPU devices to make; None leaves JAX's own count (one, or what the environment sets)."""
    why: str
    asked: bool = False
    """Whether the config named the count (mesh.cpu_devices=N), rather than auto or per_core choosing it."""

    def describe(self) -> str:
        return self.why if self.count is None else f"{self.count} ({self.why})"


def count_set_by_environment(environ: dict[str, str]) -> str | None:
    """The variable that already fixes the CPU device count, e.g. "XLA_FLAGS=...device_count=8", or None."""
    forced = _FORCED_COUNT.findall(environ.get("XLA_FLAGS", ""))
    if forced:
        return f"XLA_FLAGS' --xla_force_host_platform_device_count={forced[-1]}"
    if environ.get("JAX_NUM_CPU_DEVICES"):
        return f"JAX_NUM_CPU_DEVICES={environ['JAX_NUM_CPU_DEVICES']}"
    return None


def plan_cpu_devices(config: Config, cores: int, available_bytes: int | None, replica_state_bytes: Callable[[], int],
                     set_by_environment: str | None, multi_process: bool) -> CpuDevicePlan:
    """Pure: the count mesh.cpu_devices asks for on a host with `cores` usable cores. `replica_state_bytes`
    (params and optimizer state of one replica) is called only when per_core considers a split."""
    wanted, mesh = config.mesh.cpu_devices, config.mesh
    if set_by_environment is not None:
        return CpuDevicePlan(None, f"as set by {set_by_environment}")
    if isinstance(wanted, int):
        return CpuDevicePlan(wanted, "as asked", asked=True)
    if multi_process:
        return CpuDevicePlan(None, "JAX's default: a multi-process run (`xlatrain launch --devices-per-proc K` sets K)")
    axes = (("stage", mesh.stage), ("context", mesh.context), ("tensor", mesh.tensor))
    replica = " x ".join(f"mesh.{axis}={size}" for axis, size in axes if size > 1 or axis == "stage")
    if mesh.data != -1:
        return CpuDevicePlan(mesh.data * mesh.per_replica(), f"mesh.data={mesh.data} x {replica}")
    if mesh.per_replica() > 1:
        return CpuDevicePlan(mesh.per_replica(), f"one replica of {replica}")
    if wanted == "auto":
        return CpuDevicePlan(None, "JAX's default (mesh.cpu_devices=per_core makes one per core)")
    if config.batch.global_size is None:
        return CpuDevicePlan(1, "batch.per_replica is set: more replicas would train on a larger batch")
    size, micro = config.batch.global_size, config.batch.microbatches
    if cores == 1:
        return CpuDevicePlan(1, "one core")
    divides = [n for n in range(cores, 0, -1) if size % (n * micro) == 0]
    count = divides[0]
    if count == 1:
        return CpuDevicePlan(1, f"batch.global_size={size} does not split into batch.microbatches={micro} "
                                f"for 2..{cores} replicas")
    per_replica = REPLICA_MEMORY_FACTOR * replica_state_bytes()
    fits = next((n for n in divides if available_bytes is None or n * per_replica <= MEMORY_SHARE * available_bytes), 1)
    if fits < count:
        return CpuDevicePlan(fits, f"one per core would not fit: {fits} replica(s) of ~{readable_bytes(per_replica)} "
                                   f"within half of the host's {readable_bytes(available_bytes)} available")
    return CpuDevicePlan(count, f"one per core, data-parallel over {count} of {cores} cores")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which taskset and container cpusets narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def dispatch_waits_for_the_previous_step(devices: list) -> bool:
    """Whether dispatching a step over `devices` blocks until the step before has finished. XLA:CPU runs each
    device's part of a multi-device program on its client's worker threads, max(cores, CPU devices of the
    process) of them; where the program's devices take them all, they are busy with the previous step when the
    next is dispatched, so the wait is device time."""
    import jax

    local = [d for d in devices if d.process_index == jax.process_index()]
    workers = max(usable_cores(), jax.local_device_count())
    return devices[0].platform == "cpu" and len(local) > 1 and len(local) >= workers


applied: CpuDevicePlan | None = None
"""What apply_cpu_devices() chose in this process, if it ran."""


def apply_cpu_devices(*configs: Config, replica_state_bytes: Callable[[Config], int]) -> CpuDevicePlan:
    """Decide mesh.cpu_devices for this host and tell JAX, which must not have started its backends yet. Given
    two configs (`xlatrain parity`), the process gets the larger count; a side with mesh.data=-1 uses them all.
    `replica_state_bytes(config)`: the bytes of one replica's train state (params and optimizer state), asked
    only where per_core considers a split; xlatrain.program.apply_cpu_devices sizes it from the model."""
    global applied
    from xlatrain.compat.backends import backends_started, set_cpu_device_count
    from xlatrain.runtime.distributed import joins_other_processes

    plans = [plan_cpu_devices(config, usable_cores(), available_memory_bytes(),
                              lambda config=config: replica_state_bytes(config),
                              count_set_by_environment(dict(os.environ)), joins_other_processes(config.distributed))
             for config in configs]
    plan = max(plans, key=lambda p: p.count or 0)
    if plan.count is not None and not plan.asked and backends_started():
        plan = CpuDevicePlan(None, "JAX's default: JAX started before the count could be set (a script must call "
                                   "xlatrain.program.apply_cpu_devices before any JAX operation)")
    if plan.count is not None:
        set_cpu_device_count(plan.count)
    applied = plan
    return plan

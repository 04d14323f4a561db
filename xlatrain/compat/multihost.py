"""Several processes: jax.distributed's client and key-value store, the cluster it detects, barriers,
gathering a global array, and the settings that must precede its start."""

from __future__ import annotations

import jax
import numpy as np


def gather_to_host(array: jax.Array) -> np.ndarray:
    """The whole of a global array as numpy on every process (one on this process's devices alone is whole here)."""
    if jax.process_count() == 1 or array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def use_gloo_for_cpu_collectives() -> None:
    """CPU collectives across processes need gloo; must run before the CPU backend starts."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def keep_our_signal_handlers() -> None:
    """jax.distributed's preemption service installs its own SIGTERM handler in C++, which would replace
    xlatrain's (xlatrain/runtime/signals.py); xlatrain agrees on the stopping step itself
    (runtime/distributed.py's StopAgreement)."""
    jax.config.update("jax_enable_preemption_service", False)


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def distributed_client():
    """jax.distributed's client (its key-value store), or None before jax.distributed.initialize."""
    from jax._src import distributed

    return distributed.global_state.client


def key_value_set(name: str, value: bytes) -> None:
    """Publish bytes to every process (jax.distributed's key-value store; a no-op with one process); a later
    value replaces an earlier one."""
    if jax.process_count() > 1:
        distributed_client().key_value_set_bytes(name, value, allow_overwrite=True)


def key_value_get(name: str, timeout_s: float = 300) -> bytes:
    return distributed_client().blocking_key_value_get_bytes(name, int(timeout_s * 1000))


def key_value_dir_get(prefix: str) -> list[tuple[str, bytes]]:
    """Every (key, value) under `prefix`, without waiting."""
    return distributed_client().key_value_dir_get_bytes(prefix)


def detected_cluster() -> str | None:
    """The name of the cluster environment jax.distributed would auto-detect ("slurm", "ompi", "k8s", ...),
    or None; only the kinds jax detects without being asked."""
    from jax._src import clusters

    found = next((env for env in clusters.ClusterEnv._cluster_types
                  if not env.opt_in_only_method and env.is_env_present()), None)
    if found is None:
        return None
    return getattr(found, "name", "") or found.__name__.removesuffix("Cluster").lower()


def slurm_coordinator(port: int) -> str:
    """Process 0's address as jax.distributed finds it under SLURM (the step's first node), with `port`."""
    from jax._src.clusters.slurm_cluster import SlurmCluster

    return SlurmCluster.get_coordinator_address(None, str(port))

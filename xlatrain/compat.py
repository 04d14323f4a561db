"""Every JAX API that is private, experimental or changed between jax 0.10 and 0.12 is used from here."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""Recorded by jax (jax/_src/dispatch.py) once per XLA backend compilation, with a `fun_name`."""


def shard_map(fn: Callable, mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any,
              check: bool = False) -> Callable:
    """jax.shard_map; `check` is replication/varying-axis checking (check_vma, formerly check_rep)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)


def gather_to_host(array: jax.Array) -> np.ndarray:
    """The whole of a global array as numpy on every process."""
    if jax.process_count() == 1:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def use_gloo_for_cpu_collectives() -> None:
    """CPU collectives across processes need gloo; must run before the CPU backend starts."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def backend_compile_listener(callback: Callable[[str, float], None]) -> Iterator[None]:
    """Calls callback(function_name, seconds) for every XLA compilation while the context is open."""

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            callback(str(kwargs.get("fun_name", "?")), duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def cost_analysis(compiled: Any) -> dict[str, float]:
    """Compiled.cost_analysis() is a dict in new jax and a one-element list of dicts in older ones."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return dict(analysis or {})


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """jax.nn.dot_product_attention(is_causal=True). XLA:CPU has no float16 x float16 -> float32 dot (the
    precision jax asks for with f16 inputs), so there f16 attention runs in float32 and casts back."""
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        out = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


_HOST_READS = threading.local()


def _guard_array_reads() -> None:
    """Make implicit reads of jax.Array values (float(x), np.asarray(x), x.tolist()) check a per-thread
    flag. Needed on XLA:CPU, where arrays already live in host memory and jax's transfer guard does not
    count reading them as a device-to-host transfer. Idempotent."""
    from jax._src.array import ArrayImpl

    original = ArrayImpl.__dict__["_value"]
    if getattr(original.fget, "xlatrain_guarded", False):
        return

    def value(self):
        if getattr(_HOST_READS, "forbidden", False):
            raise RuntimeError(f"Disallowed device-to-host transfer: implicit read of a {self.aval.str_short()} "
                               "array between step boundaries")
        return original.fget(self)

    value.xlatrain_guarded = True
    ArrayImpl._value = property(value)


@contextlib.contextmanager
def _host_reads(forbidden: bool, guard: str) -> Iterator[None]:
    previous = getattr(_HOST_READS, "forbidden", False)
    _HOST_READS.forbidden = forbidden
    try:
        with jax.transfer_guard(guard):
            yield
    finally:
        _HOST_READS.forbidden = previous


def forbid_implicit_transfers() -> contextlib.AbstractContextManager[None]:
    """jax.transfer_guard("disallow") on this thread, plus implicit array reads on every backend."""
    _guard_array_reads()
    return _host_reads(True, "disallow")


def allow_transfers() -> contextlib.AbstractContextManager[None]:
    """Undo forbid_implicit_transfers inside it (step boundaries: closures, checkpoints)."""
    return _host_reads(False, "allow")

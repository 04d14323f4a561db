"""Every JAX API that is private, experimental or changed between jax 0.10 and 0.12 is used from here."""

from __future__ import annotations

import contextlib
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

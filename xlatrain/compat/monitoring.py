"""What jax reports of its compilations and programs: compile events, cost analysis, the profiler's state."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""Recorded by jax (jax/_src/dispatch.py) once per XLA backend compilation, with a `fun_name`."""
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""Recorded by jax once per executable loaded from the persistent compilation cache."""


def abandon_profile() -> None:
    """Forget a jax.profiler trace whose stop_trace raised while writing it: jax leaves it registered as
    running, and a later start_trace in this process would be refused."""
    from jax._src import profiler

    with profiler._profile_state.lock:
        profiler._profile_state.reset()


@contextlib.contextmanager
def backend_compile_listener(callback: Callable[[str, float], None], on_cache_hit: Callable[[], None]
                             ) -> Iterator[None]:
    """Calls callback(function_name, seconds) for every XLA compilation while the context is open, and
    on_cache_hit() for each executable loaded from the persistent cache instead (it is reported as a compilation
    too, lasting the load)."""

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            callback(str(kwargs.get("fun_name", "?")), duration)

    def hit(event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            on_cache_hit()

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(hit)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(hit)


def cost_analysis(compiled: Any) -> dict[str, float]:
    """Compiled.cost_analysis() is a dict in new jax and a one-element list of dicts in older ones. A GPU
    compiled for on a host without one has none: XLA's analysis of its optimised module is then run on the
    host's CPU client (jaxlib's hlo_module_cost_analysis, which takes any module)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return dict(analysis or {}) or _module_cost_analysis(compiled)


def _module_cost_analysis(compiled: Any) -> dict[str, float]:
    try:
        from jax._src.lib import _jax

        modules = compiled.runtime_executable().hlo_modules()
        analysis = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, modules[0])
    except Exception:  # an older or newer jaxlib without these, or a host without a CPU backend
        return {}
    return {key: float(value) for key, value in analysis.items() if "{" not in key}

"""The platform a step is traced and compiled for, where it may differ from the process's own backend.

`xlatrain lower --target h100` compiles on a CPU-only host for a GPU it does not have (xlatrain/runtime/gpu_targets.py).
The formulations that depend on the platform (attention, layer scan, compiler options) must then follow the
devices the step is compiled for, not `jax.default_backend()`. `build_program` and `compile_step` set it from
their devices; everything else traced in between reads it here. jax reuses a function's trace for the same
shapes whatever this says, so one process compiles for one platform (as `xlatrain lower --target` does).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import jax

_COMPILING_FOR: ContextVar[str | None] = ContextVar("xlatrain_compiling_for", default=None)


def lowering_platform() -> str:
    """"cpu", "gpu", "tpu": the platform of the devices being compiled for, else the process's default backend."""
    return _COMPILING_FOR.get() or jax.default_backend()


@contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    token = _COMPILING_FOR.set(platform)
    try:
        yield
    finally:
        _COMPILING_FOR.reset(token)

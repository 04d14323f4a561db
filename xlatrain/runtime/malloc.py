"""glibc's malloc tuned to keep freed memory for reuse, so an XLA:CPU step does not page-fault its buffers in
again every run.

XLA:CPU allocates an executable's temporary buffer when it runs and frees it after: 71 MB for the default GPT's
train step. glibc serves an allocation that large with a fresh `mmap` from a thread's own arena (an arena heap
holds at most 64 MiB) and `munmap`s it on free, so every step touches ~19,600 new pages, each a page fault and
a page zeroed by the kernel: a third of the step's CPU time (docs/performance.md). The settings below make
every thread allocate from glibc's main heap, never by `mmap`, and keep freed memory there, so the next step
reuses the same pages. The cost is that the process keeps its peak heap (up to TRIM_THRESHOLD of freed memory).

They must be applied before any second thread allocates (an arena, once made, stays), so `xlatrain`'s command
line applies them first thing; a script using the Python API calls `tune_malloc()` before importing JAX. An
allocator chosen by the environment (any MALLOC_* variable, or one preloaded such as jemalloc) is left alone, and
XLATRAIN_MALLOC=release turns this off (XLATRAIN_HOST_MEMORY, its earlier name, still does).
"""

from __future__ import annotations

import ctypes
import os
import platform

from xlatrain.errors import UserError

# mallopt's parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the most freed memory the heap's top keeps, ~2 GiB

SETTINGS = {
    M_ARENA_MAX: 1,  # every thread allocates from the main heap, which can grow past an arena heap's 64 MiB
    M_MMAP_MAX: 0,  # no allocation is served by its own mmap, which free() would unmap
    M_TRIM_THRESHOLD: TRIM_THRESHOLD,  # free() leaves up to this much at the heap's top instead of returning it
}

OPT_OUT = "XLATRAIN_MALLOC"
OPT_OUT_EARLIER_NAME = "XLATRAIN_HOST_MEMORY"

applied: str | None = None
"""What tune_malloc() did in this process, if it ran."""


def allocator_chosen_by_environment(environ: dict[str, str]) -> str | None:
    """The environment variable that already decides how memory is allocated, if any."""
    name = OPT_OUT if OPT_OUT in environ or OPT_OUT_EARLIER_NAME not in environ else OPT_OUT_EARLIER_NAME
    choice = environ.get(name, "keep")
    if choice not in ("keep", "release"):
        raise UserError(f"{name}={choice!r}: use keep (the default: freed memory is kept for reuse) or "
                        "release (the system allocator's defaults)")
    if choice == "release":
        return name
    for variable in sorted(environ):
        if variable.startswith("MALLOC_") or (variable == "LD_PRELOAD" and "alloc" in environ[variable]):
            return variable
    return None


def tune_malloc(environ: dict[str, str] | None = None) -> str:
    """Applies SETTINGS where glibc allocates and the environment has not chosen; says what it did."""
    global applied
    applied = _apply(os.environ if environ is None else environ)
    return applied


def _apply(environ: dict[str, str]) -> str:
    chosen = allocator_chosen_by_environment(environ)
    if chosen is not None:
        return f"left to the environment ({chosen})"
    if platform.libc_ver()[0] != "glibc":
        return "as the system allocates (not glibc)"
    mallopt = ctypes.CDLL(None).mallopt
    if not all(mallopt(param, value) == 1 for param, value in SETTINGS.items()):
        return "as the system allocates (glibc refused mallopt)"
    return "freed memory kept for reuse (glibc: one heap, no mmap)"

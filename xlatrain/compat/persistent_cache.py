"""JAX's persistent compilation cache: where it is, and hooks around jax's read and write of an entry."""

from __future__ import annotations

from functools import wraps
from pathlib import Path
from typing import Any, Callable

import jax

from xlatrain.errors import first_line


def set_persistent_compile_cache(path: Path | None) -> None:
    """JAX reads its cache directory once, at the first compilation after a reset; None turns the cache off."""
    from jax.experimental.compilation_cache import compilation_cache

    wanted = None if path is None else str(path)
    if jax.config.jax_compilation_cache_dir != wanted:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", wanted)


CACHE_ENTRY_SUFFIX = "-cache"
"""jax/_src/lru_cache.py stores a persistent-cache entry as KEY-cache in the cache directory."""


def _cache_entry(cache_key: str) -> Path:
    return Path(jax.config.jax_compilation_cache_dir) / f"{cache_key}{CACHE_ENTRY_SUFFIX}"


def drop_unreadable_cache_entries(report: Callable[[str], None]) -> None:
    """JAX writes a cache entry in place, so a kill or a full disk during the write leaves it cut short. JAX then
    warns and compiles at every later start, and never writes that entry again, since one exists. Around JAX's
    read, an entry that cannot be read is deleted and reported instead, so the compilation that follows writes
    a good one; so is an entry holding another program's executable (a file renamed or copied over another:
    its module's name is not the one in its key), which JAX would load and fail on with an AssertionError.
    Installed once per process; jax_raise_persistent_cache_errors still raises."""
    from jax._src import compilation_cache

    read = compilation_cache.get_executable_and_time
    if getattr(read, "drops_unreadable_entries", False):
        return

    def drop(cache_key: str, why: str) -> tuple[None, None]:
        entry = _cache_entry(cache_key)
        entry.unlink(missing_ok=True)
        report(f"compile cache entry {entry} {why}; removed it, so this compilation is written there again")
        return None, None

    @wraps(read)
    def read_or_drop(cache_key: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        try:
            executable, seconds = read(cache_key, *args, **kwargs)
        except Exception as err:
            if jax.config.jax_raise_persistent_cache_errors or not jax.config.jax_compilation_cache_dir:
                raise
            return drop(cache_key, f"could not be read ({type(err).__name__}: {first_line(err)})")
        held = None if executable is None else _module_name(executable)
        if held is not None and held != cache_key.rsplit("-", 1)[0]:
            return drop(cache_key, f"holds the executable of another program ({held})")
        return executable, seconds

    read_or_drop.drops_unreadable_entries = True  # type: ignore[attr-defined]
    compilation_cache.get_executable_and_time = read_or_drop


def _module_name(executable: Any) -> str | None:
    """The name of the HLO module a loaded executable was compiled from, where the runtime tells it."""
    try:
        return executable.hlo_modules()[0].name
    except Exception:
        return None


def report_unwritable_cache_entries(report: Callable[[str], None]) -> None:
    """Around JAX's write of a cache entry: a file system that refuses it (full, read-only) is reported once per
    process instead of in JAX's warning for every entry, and the entry it cut short is removed (a later start
    would read it); compilations go on as without the cache. Installed once per process; other errors keep JAX's
    warning, and jax_raise_persistent_cache_errors still raises."""
    from jax._src import compilation_cache

    write = compilation_cache.put_executable_and_time
    if getattr(write, "reports_unwritable_entries", False):
        return
    reported = False

    @wraps(write)
    def write_or_report(cache_key: str, *args: Any, **kwargs: Any) -> None:
        nonlocal reported
        try:
            write(cache_key, *args, **kwargs)
        except OSError as err:
            if jax.config.jax_raise_persistent_cache_errors or not jax.config.jax_compilation_cache_dir:
                raise
            entry = _cache_entry(cache_key)
            entry.unlink(missing_ok=True)
            if not reported:
                reported = True
                report(f"compile cache {entry.parent}: entries cannot be written ({err.strerror or first_line(err)}); "
                       "compilations are not cached until there is room (said once)")

    write_or_report.reports_unwritable_entries = True  # type: ignore[attr-defined]
    compilation_cache.put_executable_and_time = write_or_report

"""JAX's persistent compilation cache (trainer.compile_cache): a second start of a run, or another run with the
same programs, loads its executables from disk instead of compiling them.

`auto` is JAX's own JAX_COMPILATION_CACHE_DIR when set, else a per-user directory
($XDG_CACHE_HOME or ~/.cache, then xlatrain/jax). The cache is trusted code: whoever can write into the
directory can run code in the training process, so it must not be shared with other users.

Every compilation is kept, not only those over JAX's default threshold of a second: a start's many small
ones (the state's initialisation, the eval step, a pipeline's per-piece costs) add up to seconds.
JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when set, still decides.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from xlatrain.compat.persistent_cache import (
    drop_unreadable_cache_entries,
    report_unwritable_cache_entries,
    set_persistent_compile_cache,
)
from xlatrain.errors import make_writable_directory, warn

MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def cache_dir(setting: str) -> Path | None:
    """The directory trainer.compile_cache names: None for `off`."""
    if setting == "off":
        return None
    if setting == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "xlatrain" / "jax"
    return Path(setting).expanduser()


def use_compile_cache(setting: str) -> Path | None:
    """Point JAX's persistent cache at the directory (created if missing) before anything compiles."""
    path = cache_dir(setting)
    if path is not None:
        make_writable_directory(path, f"trainer.compile_cache={setting!r}", ", or set trainer.compile_cache=off")
    set_persistent_compile_cache(path)
    drop_unreadable_cache_entries(warn)
    report_unwritable_cache_entries(warn)
    if path is not None and MIN_COMPILE_TIME_ENV not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path

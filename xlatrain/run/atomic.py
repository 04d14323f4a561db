"""Files replaced whole or not at all: a kill or a full disk midway leaves the old file, never half a new one."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def replace_file(path: Path, write: Callable[[Path], object]) -> None:
    """`write(partial)` writes the new content beside `path`, which it then replaces by a rename."""
    partial = path.with_name(path.name + ".partial")
    try:
        write(partial)
        partial.replace(path)
    except BaseException as err:
        partial.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a write or flush that failed names no file
            err.filename = str(path)
        raise

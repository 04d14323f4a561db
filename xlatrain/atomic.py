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
    except BaseException:
        partial.unlink(missing_ok=True)
        raise

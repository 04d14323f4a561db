"""The one exception type users see: it carries a message that names the field or file and the fix; and the one
way a warning reaches them."""

import contextlib
import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator


class UserError(Exception):
    """A problem with the user's input (config, devices, files). The CLI prints it and exits 2."""

    exit_code = 2


class NonFiniteLoss(Exception):
    """The loss or gradient norm became inf/NaN with trainer.on_nonfinite=stop."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message ("" when it has none), for one-line errors."""
    lines = str(err).splitlines()
    return lines[0] if lines else ""


def warn(message: str) -> None:
    """One line on stderr for something the run survives but the user should know."""
    print(f"xlatrain: warning: {message}", file=sys.stderr, flush=True)


# The errors whose fix is the user's (make room, repair or remount the file system), not a bug to trace back.
FILE_SYSTEM_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


@contextlib.contextmanager
def file_system_refusals_named(where: object = None) -> Iterator[None]:
    """A file system that is full or read-only, met anywhere inside, is one UserError naming the file (or the
    directory `where` it was written in): making room is the user's fix, and a traceback would not say so."""
    try:
        yield
    except OSError as err:
        if err.errno not in FILE_SYSTEM_REFUSALS:
            raise
        place = err.filename or (f"a file in {where}" if where is not None else "a file")
        raise UserError(f"{place} could not be written ({err.strerror}): make room or repair the file system, then "
                        "run the same command again") from None


def make_writable_directory(path: Path, named: str, otherwise: str = "") -> None:
    """Creates the directory the user `named` (with its parents) and checks it can be written, before anything
    is computed for it: else one UserError, which ends with `otherwise` (another way out) when given."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{named}: cannot create {path} ({err.strerror}); name a directory you can write"
                        f"{otherwise}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{named}: {path} is not writable; name a directory you can write{otherwise}")


_dropping: set[str] = set()


def drop_follow_up_errors(name: str, is_follow_up: Callable[[Any], bool], *, threads: bool = False) -> None:
    """From now on, drop the unraisable exceptions (and with `threads`, the uncaught exceptions of threads) that
    `is_follow_up` picks out of their hook's arguments: what a library prints, often hundreds of lines, about a
    failure xlatrain has already reported in one line. Every other one is printed as before; installed once per
    name."""
    if name in _dropping:
        return
    _dropping.add(name)
    previous_unraisable, previous_thread = sys.unraisablehook, threading.excepthook

    def unraisable(args: Any) -> None:
        if not is_follow_up(args):
            previous_unraisable(args)

    def thread(args: Any) -> None:
        if not is_follow_up(args):
            previous_thread(args)

    sys.unraisablehook = unraisable
    if threads:
        threading.excepthook = thread

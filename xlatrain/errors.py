"""The one exception type users see: it carries a message that names the field or file and the fix; and the one
way a warning reaches them."""

import sys


class UserError(Exception):
    """A problem with the user's input (config, devices, files). The CLI prints it and exits 2."""

    exit_code = 2


def first_line(err: BaseException) -> str:
    """The first line of an exception's message ("" when it has none), for one-line errors."""
    lines = str(err).splitlines()
    return lines[0] if lines else ""


def warn(message: str) -> None:
    """One line on stderr for something the run survives but the user should know."""
    print(f"xlatrain: warning: {message}", file=sys.stderr, flush=True)

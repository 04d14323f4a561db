"""JSON-lines logs (metrics.jsonl, summary.jsonl) that survive a writer killed in the middle of a line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from xlatrain.errors import UserError
from xlatrain.run.atomic import replace_file


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of `path`, one per line. A torn last line (its writer was killed or the disk filled) is
    dropped; any other line that is not a JSON object (bytes that are not UTF-8 included) is an error naming the
    file and line. Read as bytes: a tear or a disk's garbage may split a UTF-8 character, and only its line is bad."""
    lines = path.read_bytes().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if number == len(lines):
                break
            record = None
        if not isinstance(record, dict):
            raise UserError(f"{path}:{number} is not a JSON record written by xlatrain; repair or remove that line")
        records.append(record)
    return records


def open_for_append(path: Path) -> IO[str]:
    """`path` opened to append lines, after cutting a torn last line (one without its newline), so that the next
    record starts a line of its own instead of being glued to the fragment."""
    if path.exists() and _ends_torn(path):
        with path.open("rb+") as handle:
            handle.truncate(handle.read().rfind(b"\n") + 1)
    return path.open("a")


def _ends_torn(path: Path) -> bool:
    """Whether the last byte is not a newline: a writer was killed in the middle of a line."""
    with path.open("rb") as handle:
        if handle.seek(0, os.SEEK_END) == 0:
            return False
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) != b"\n"


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace `path` with `records`, whole (a kill midway loses nothing)."""
    replace_file(path, lambda partial: partial.write_text("".join(json.dumps(r) + "\n" for r in records)))

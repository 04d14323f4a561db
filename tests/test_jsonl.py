"""JSON-lines logs after a writer was killed mid-line: the fragment is dropped, never glued to the next record;
and the files xlatrain rewrites are replaced whole (xlatrain/run/atomic.py)."""

import errno
import json

import pytest

from xlatrain.errors import UserError
from xlatrain.run.atomic import replace_file
from xlatrain.run.jsonl import open_for_append, read_records, write_records


def test_a_torn_last_line_is_dropped_and_cut_before_the_next_record(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert read_records(log) == [{"step": 1}, {"step": 2}]
    with open_for_append(log) as handle:
        handle.write(json.dumps({"step": 3}) + "\n")
    assert log.read_text() == '{"step": 1}\n\n{"step": 2}\n{"step": 3}\n'
    assert read_records(log) == [{"step": 1}, {"step": 2}, {"step": 3}]


def test_a_last_line_torn_inside_a_utf8_character_is_dropped_too(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_bytes('{"step": 1}\n{"name": "é'.encode()[:-1])
    assert read_records(log) == [{"step": 1}]


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b"7", b"\xff\xfe garbage", b'{"name": "\xe9"}'])
def test_a_bad_line_before_the_last_names_the_file_and_line(tmp_path, line):
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"step": 1}\n' + line + b'\n{"step": 2}\n')
    with pytest.raises(UserError, match=f"{log}:2 is not a JSON record written by xlatrain; repair or remove"):
        read_records(log)


def test_rewriting_replaces_the_log_whole(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n')
    write_records(log, [{"step": 1}])
    assert log.read_text() == '{"step": 1}\n' and [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]


def test_a_write_that_fails_midway_keeps_the_old_file_and_leaves_no_partial(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old")

    def half_then_disk_full(partial):
        partial.write_text("ne")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        replace_file(target, half_then_disk_full)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]

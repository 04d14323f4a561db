"""Run logs: metrics.jsonl (one JSON object per logged step) and TensorBoard event files."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
from pathlib import Path
from traceback import walk_tb
from typing import Any, Iterator

from xlatrain.errors import UserError, drop_follow_up_errors
from xlatrain.run.jsonl import open_for_append, read_records, write_records

METRICS_FILE = "metrics.jsonl"


class LogNotWritten(UserError):
    """The file system refused a log line (a full disk, a lost mount): the run stops; the checkpoints stay."""


class MetricsWriter:
    def __init__(self, run_dir: Path, start_step: int):
        """Logs from start_step + 1 on: what an earlier session logged past the state it left (a checkpoint, or
        none when it was killed before its first) is dropped, since those steps run again."""
        self.path = run_dir / METRICS_FILE
        self._failed = False
        with self._refused_as("when opening"):
            if self.path.exists():
                _drop_records_after(self.path, start_step)
            self._file = open_for_append(self.path)
            self._tensorboard = _summary_writer()(str(run_dir / "tensorboard"), purge_step=start_step + 1)
        _quiet_tensorboard_nan_warnings()

    def write(self, record: dict[str, Any]) -> None:
        with self._refused_as(f"at step {record['step']}"):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        """After a refused write the files are closed without a word: that line is lost and the error said so."""
        with contextlib.suppress(OSError) if self._failed else self._refused_as("when closing"):
            self._file.close()
            self._tensorboard.close()

    @contextlib.contextmanager
    def _refused_as(self, when: str) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            self._failed = True
            _quiet_tensorboard_at_exit()
            raise LogNotWritten(f"{self.path} or its TensorBoard events could not be written {when} "
                                f"({err.strerror or err}): make room or repair the directory, then run the same "
                                "command to resume from the newest checkpoint") from None


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch where nothing has imported it yet: tensorboardX imports
    torch, when installed, only to accept its tensors (1.5 s of every start here), and xlatrain logs numbers."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects where it is absent
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


@functools.cache
def _quiet_tensorboard_nan_warnings() -> None:
    """tensorboardX warns of every NaN or infinite scalar it is given: a skipped step's loss, which the run reports
    itself (trainer.on_nonfinite=skip) and metrics.jsonl and TensorBoard record as it was."""
    logging.getLogger("tensorboardX.x2num").addFilter(lambda record: "NaN or Inf found" not in record.getMessage())


def _quiet_tensorboard_at_exit() -> None:
    """After the file system refused a write, tensorboardX's exit handler retries its flush and its writer thread
    finds its queue closed: each would print a traceback for what the error already said."""
    drop_follow_up_errors("tensorboardx-at-exit", _from_tensorboard, threads=True)


def _from_tensorboard(hook_args: Any) -> bool:
    return any("tensorboardX" in Path(frame.f_code.co_filename).parts for frame, _ in walk_tb(hook_args.exc_traceback))


class DiscardedMetrics:
    """The writer of processes other than 0 in a multi-process run: only process 0 owns the logs."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return read_records(path) if path.exists() else []


def last_logged(path: Path, through_step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last training record (without its step) and the last evaluation (with it) logged up to `through_step`:
    what a resumed run had reached. Empty where there are none (or the file cannot be read)."""
    try:
        records = [r for r in read_metrics(path) if r.get("step", 0) <= through_step]
    except (UserError, OSError):
        return {}, {}
    trained = next((r for r in reversed(records) if "loss" in r), {})
    evaluated = next((r for r in reversed(records) if "eval_loss" in r), {})
    return {k: v for k, v in trained.items() if k != "step"}, dict(evaluated)


def _drop_records_after(path: Path, step: int) -> None:
    write_records(path, [r for r in read_metrics(path) if r.get("step", 0) <= step])

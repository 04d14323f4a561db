"""Run logs: metrics.jsonl (one JSON object per logged step, flat keys), TensorBoard event files, and the trackers
a run also logs to (xlatrain/observe/trackers.py), which, with TensorBoard, get the scalars under train/, eval/ and
perf/ (`tracker_scalars`)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
from pathlib import Path
from traceback import walk_tb
from typing import Any, Iterator, Protocol, Sequence

from xlatrain.errors import UserError, drop_follow_up_errors
from xlatrain.run.jsonl import open_for_append, read_records, write_records

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PERF_METRICS = ("samples_per_sec", "tokens_per_sec", "tflops_per_sec_per_device", "mfu", "interval_seconds")
"""The throughput and timing metrics, logged under perf/ (with the time_* fractions)."""


class LogNotWritten(UserError):
    """The file system refused a log line (a full disk, a lost mount): the run stops; the checkpoints stay."""


class Tracker(Protocol):
    """A service that records a run's scalars (xlatrain/observe/trackers.py)."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def tracker_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's numbers as trackers name them: eval_loss -> eval/loss (a task's eval/<task>/<metric>
    as it is), samples_per_sec and the
    time_* fractions -> perf/..., the rest (loss, accuracy, grad_norm, lr, ...) -> train/...; `skipped` as 0 or 1."""
    scalars = {}
    for key, value in record.items():
        if key == "step" or not isinstance(value, (int, float)):
            continue
        if key.startswith("eval/"):  # a downstream task's score: eval/<task>/<metric>
            name = key
        elif key.startswith("eval_"):
            name = f"eval/{key.removeprefix('eval_')}"
        elif key in PERF_METRICS or key.startswith("time_"):
            name = f"perf/{key}"
        else:
            name = f"train/{key}"
        scalars[name] = float(value)
    return scalars


class MetricsWriter:
    def __init__(self, run_dir: Path, start_step: int, loggers: Sequence[str] = ("jsonl", "tensorboard"),
                 hyperparameters: dict[str, Any] | None = None, trackers: Sequence[Tracker] = ()):
        """Logs from start_step + 1 on: what an earlier session logged past the state it left (a checkpoint, or
        none when it was killed before its first) is dropped from metrics.jsonl and TensorBoard, since those steps
        run again; the trackers, which cannot drop, are not given those steps again (`hyperparameters`: the flat
        resolved config, given to TensorBoard once, as a new run starts). metrics.jsonl is always written: it is the
        run's own record, which a resume, `report` and `plot` read; `loggers` adds TensorBoard. The trackers stay
        open when it closes: whoever opened them closes them."""
        self.path = run_dir / METRICS_FILE
        self._failed = False
        self._file = self._tensorboard = None
        self._trackers = list(trackers)
        self._logged_before = start_step
        """The last step an earlier session logged (the trackers have it): steps up to it are not logged again."""
        with self._refused_as("when opening"):
            if self.path.exists():
                records = read_metrics(self.path)
                self._logged_before = max([start_step, *(r.get("step", 0) for r in records)])
                write_records(self.path, [r for r in records if r.get("step", 0) <= start_step])
            self._file = open_for_append(self.path)
            if "tensorboard" in loggers:
                self._tensorboard = _summary_writer()(str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1)
                if hyperparameters and start_step == 0:
                    _write_hyperparameters(self._tensorboard, hyperparameters)
        _quiet_tensorboard_nan_warnings()

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        with self._refused_as(f"at step {step}"):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            scalars = tracker_scalars(record)
            if self._tensorboard is not None:
                for name, value in scalars.items():
                    self._tensorboard.add_scalar(name, value, step)
        if step > self._logged_before:
            for tracker in self._trackers:
                tracker.log(step, scalars)

    def close(self) -> None:
        """After a refused write the files are closed without a word: that line is lost and the error said so."""
        with contextlib.suppress(OSError) if self._failed else self._refused_as("when closing"):
            for log in (self._file, self._tensorboard):
                if log is not None:
                    log.close()

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


def _write_hyperparameters(writer: Any, hyperparameters: dict[str, Any]) -> None:
    """The config as TensorBoard's hyperparameters (its HPARAMS tab), in the run's own event file (tensorboardX's
    add_hparams would make a run of its own); values it cannot show are shown as text."""
    from tensorboardX.summary import hparams

    shown = {key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
             for key, value in hyperparameters.items()}
    for summary in hparams(shown, {"train/loss": 0.0, "eval/loss": 0.0}):  # the metrics it shows beside them
        writer.file_writer.add_summary(summary)


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

"""Run logs: metrics.jsonl (one JSON object per logged step) and TensorBoard event files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

from xlatrain.jsonl import open_for_append, read_records, write_records


class MetricsWriter:
    def __init__(self, run_dir: Path, resume_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            _drop_records_after(self.path, resume_step)
        purge = None if resume_step is None else resume_step + 1
        self._file = open_for_append(self.path)
        self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tensorboard.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        self._tensorboard.close()


class DiscardedMetrics:
    """The writer of processes other than 0 in a multi-process run: only process 0 owns the logs."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return read_records(path) if path.exists() else []


def _drop_records_after(path: Path, step: int) -> None:
    """On resume, records past the checkpoint are about to be produced again: keep the log consistent."""
    write_records(path, [r for r in read_metrics(path) if r.get("step", 0) <= step])

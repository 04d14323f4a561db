"""Callbacks: the training loop's events as host values, for code that watches a run from Python (xlatrain.Trainer).

A callback subclasses `Callback` and defines the methods it needs. They run on the host at step boundaries, in
the order the callbacks were given, with the values already fetched from the device (a step's metrics are read
one boundary later, as the loop reads them); on every process of a multi-process run alike. `on_step` and
`on_eval` may ask the run to stop by returning a reason (a string, or True): it stops at a step boundary soon
after, saving a checkpoint there, as on SIGTERM, and every process stops at the same step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

Stop = str | bool | None
"""What on_step and on_eval return: a reason to stop the run (a string, or True), or None / False to go on."""


class Callback:
    def on_step(self, step: int, metrics: dict[str, float]) -> Stop:
        """After each optimizer step: its metrics (loss, accuracy, grad_norm, lr, ...; throughput where a rate is
        known)."""
        return None

    def on_eval(self, step: int, metrics: dict[str, float]) -> Stop:
        """After each evaluation: eval_loss, eval_accuracy (cross-entropy), averaged over trainer.eval_batches."""
        return None

    def on_checkpoint(self, step: int, directory: Path) -> None:
        """A checkpoint of `step` is being written (asynchronously) into `directory`."""

    def on_end(self, result: Any) -> None:
        """The run ended: finished, or stopped (a signal, a callback); `result` is its xlatrain.trainer.TrainResult."""


class EarlyStopping(Callback):
    """Stops the run when an evaluated metric has not improved for `patience` evaluations in a row (by more than
    `min_delta`); a non-finite value counts as no improvement."""

    def __init__(self, metric: str = "eval_loss", patience: int = 3, min_delta: float = 0.0,
                 mode: Literal["min", "max"] = "min"):
        if patience < 1 or min_delta < 0 or mode not in ("min", "max"):
            raise ValueError("EarlyStopping: patience must be at least 1, min_delta at least 0, mode min or max")
        self.metric, self.patience, self.min_delta, self.mode = metric, patience, min_delta, mode
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0

    def on_eval(self, step: int, metrics: dict[str, float]) -> Stop:
        if self.metric not in metrics:
            raise KeyError(f"EarlyStopping: the evaluation gives {sorted(metrics)}, not {self.metric!r}")
        value = metrics[self.metric]
        sign = 1.0 if self.mode == "min" else -1.0
        if math.isfinite(value) and (self.best is None or sign * (self.best - value) > self.min_delta):
            self.best, self.best_step, self.waited = value, step, 0
            return None
        self.waited += 1
        if self.waited < self.patience:
            return None
        return (f"early stopping: {self.metric} has not improved on {self.best:.4g} (step {self.best_step}) for "
                f"{self.waited} evaluations")

"""Samples, tokens and model FLOPs per second of a training run, and its MFU, over windows of boundaries."""

from __future__ import annotations

import time
from typing import Any, Callable


class Throughput:
    """Samples (and tokens) per second of wall time over windows of at least 5 steps. A window ends when its
    last boundary's results reach the host. It begins at its first boundary's dispatch (where dispatching waits
    for the step before, when that call returns: runtime/cpu_devices.py) or, when the
    host was seen waiting for the boundary before it to finish (an asynchronous device runs one step while the
    host dispatches the next), at the end of that wait: a queued step cannot start before the step before it has
    finished. A rate is thus overstated by at most the time a boundary's metrics take to reach the host,
    however the reads bunch up (fused steps, the final flush); every step of a fused group
    (trainer.steps_per_sync) reports its window's rate.

    A boundary whose results its own host work fetched early (evaluation or a checkpoint read them before the next
    dispatch) does not end a window that already has a rate to show: the host work of the boundary after it
    (its data, its dispatch) belongs to the training's pace, and a window ended at that early read would leave it
    out (with fused steps, rates of 5-14x the true one at checkpoint steps); such a boundary, the last one
    included, reports the rate of the window before. Evaluation and checkpoints
    (`excluded`: their seconds so far) are not training, and are taken out of the windows they fall in."""

    def __init__(self, samples: int, tokens: int, flops_per_device: float, peak_flops: float | None,
                 clock: Callable[[], float] = time.perf_counter, excluded: Callable[[], float] = lambda: 0.0):
        """Per step: `samples`, `tokens` (0: not token data) and the model's FLOPs per device (0: not counted);
        `peak_flops`: one device's peak (None: unknown, no MFU); `excluded()`: the seconds spent so far on what is
        not training (evaluation, checkpoints)."""
        self.samples = samples
        self.tokens = tokens
        self.flops_per_device = flops_per_device
        self.peak_flops = peak_flops
        self.clock = clock
        self.excluded = excluded
        self.dispatched: dict[int, float] = {}
        self.window: tuple[float, int, float] | None = None
        """(when it began, the steps it counts, excluded() when it began)"""
        self.previous_finished = float("-inf")
        self.last: dict[str, float] = {}

    def dispatching(self, first_step: int) -> None:
        self.dispatched[first_step] = self.clock()

    def boundary_done(self, first_step: int, steps: int, seen_finishing: float | None = None,
                      early: bool = False) -> None:
        """The results of steps first_step.. reached the host; `seen_finishing`: when the host, waiting for
        them, saw their executable finish (None if they were ready before it waited); `early`: fetched by the
        boundary's own host work, before the next dispatch."""
        began, counted, excluded_before = self.window or (
            max(self.dispatched[first_step], self.previous_finished), 0, self.excluded())
        del self.dispatched[first_step]
        counted += steps
        self.previous_finished = float("-inf") if seen_finishing is None else seen_finishing
        if (counted < 5 or early) and self.last:
            self.window = (began, counted, excluded_before)
            return
        seconds = max(self.clock() - began - (self.excluded() - excluded_before), 1e-9)
        self.last = {"samples_per_sec": self.samples * counted / seconds}
        if self.tokens:
            self.last["tokens_per_sec"] = self.tokens * counted / seconds
        if self.flops_per_device:
            self.last["tflops_per_sec_per_device"] = self.flops_per_device * counted / seconds / 1e12
            if self.peak_flops:
                self.last["mfu"] = self.flops_per_device * counted / seconds / self.peak_flops
        self.window = None

    def rates(self, numeric: bool = False) -> dict[str, Any]:
        if numeric:
            return {k: float(f"{v:.4g}") if k in ("tflops_per_sec_per_device", "mfu") else round(v, 2)
                    for k, v in self.last.items()}
        shown = {"samples_per_sec": ("samples/s", "{:,.0f}"), "tokens_per_sec": ("tokens/s", "{:,.0f}"),
                 "tflops_per_sec_per_device": ("TFLOP/s/dev", "{:.3g}"), "mfu": ("MFU", "{:.1%}")}
        return {shown[k][0]: shown[k][1].format(v) for k, v in self.last.items()}

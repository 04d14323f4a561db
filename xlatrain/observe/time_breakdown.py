"""Where the training loop's wall time goes, on the host's timeline.

The loop dispatches step N before it reads step N-1's results, so device compute overlaps host work and
cannot be timed directly without stalling it. What the host can time exactly is what it was blocked on;
each interval's wall time is split into:

  data        blocked in the device loader, waiting for the next batch
  compile     compiling a step for a batch shape it had not seen (recompilations)
  device      blocked until step results reached the host: device compute that host work did not hide
  eval        evaluation, from its dispatch until its results are ready
  checkpoint  saving a checkpoint
  host        everything else: dispatch, hooks, step closures, logging, the progress bar

The parts of an interval add up to its wall time. A span inside another (a recompilation during evaluation)
counts once, in the inner category.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

CLAIMED = ("data", "compile", "device", "eval", "checkpoint")
CATEGORIES = (*CLAIMED, "host")


class TimeBreakdown:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.start(clock())

    def start(self, now: float) -> None:
        """Begin the session's first interval at `now` (the loop's start)."""
        self._mark = now
        self._interval = dict.fromkeys(CLAIMED, 0.0)
        self._inner: list[float] = []
        self.session = dict.fromkeys(CATEGORIES, 0.0)
        self.within = dict.fromkeys(CLAIMED, 0.0)
        """Seconds inside each category's spans since the start (spans inside them included), the interval in
        progress too."""

    @contextmanager
    def spending(self, category: str) -> Iterator[None]:
        began = self._clock()
        self._inner.append(0.0)
        try:
            yield
        finally:
            seconds = self._clock() - began
            self.claim(category, seconds, inner=self._inner.pop())
            self.within[category] += seconds

    def claim(self, category: str, seconds: float, inner: float = 0.0) -> None:
        """Count `seconds` that just elapsed (of which `inner` was already counted by spans inside)."""
        self._interval[category] += seconds - inner
        if self._inner:
            self._inner[-1] += seconds

    def cut(self) -> dict[str, float]:
        """End the interval: seconds per category (host is the remainder) since the previous cut."""
        now = self._clock()
        wall, self._mark = now - self._mark, now
        spent = {**self._interval, "host": max(wall - sum(self._interval.values()), 0.0)}
        for category, seconds in spent.items():
            self.session[category] += seconds
        self._interval = dict.fromkeys(CLAIMED, 0.0)
        return spent


def fractions(spent: dict[str, float]) -> dict[str, float]:
    """Each category's share of the interval's wall time, as metrics (time_data, time_device, ...)."""
    wall = sum(spent.values()) or 1.0
    return {f"time_{category}": round(seconds / wall, 4) for category, seconds in spent.items()}


def describe(spent: dict[str, float]) -> str:
    wall = sum(spent.values()) or 1.0
    return ", ".join(f"{category} {seconds / wall:.1%} ({seconds:.2f}s)" for category, seconds in spent.items())

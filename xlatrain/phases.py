"""What the training loop is doing, in one vocabulary: each `Phase` says what the three reports of a run call it.

- the watchdog (runtime/watchdog.py): the phase other processes see, whose distributed.stall_timeout key holds
  a stall in it;
- the compile log (lowering/compile.py): the phase summary.jsonl counts the compilations made in it under;
- the time breakdown (observe/time_breakdown.py): the category of metrics.jsonl (time_<category>) that its wall
  time counts as; unnamed, it is host time.

None in a place leaves what the enclosing phase set there. Those three names are formats (config keys, summary
and metrics fields) and stay as they are; the loop speaks only of phases.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol


@dataclass(frozen=True)
class Phase:
    watchdog: str | None
    compilations: str | None
    time: str | None


SETTING_UP = Phase("compiling", "set-up", None)
"""Building the program: the data, the model's output check, a pipeline's costs, the state's shardings."""
COMPILING_STEPS = Phase("compiling", "steps", None)
CREATING_STATE = Phase("compiling", "state", None)
"""Initialising or restoring the state, the replica check, the checkpoint's fingerprints."""
TRAINING = Phase("training", "steps", None)
LOADING_DATA = Phase("loading_data", None, "data")
IN_A_HOOK = Phase("hook", None, None)
WAITING_FOR_THE_DEVICE = Phase(None, None, "device")
EVALUATING = Phase("evaluating", None, "eval")
CHECKPOINTING = Phase("checkpointing", "checkpoints", "checkpoint")


class _Watchdog(Protocol):
    def during(self, phase: str): ...


class _CompileLog(Protocol):
    def phase(self, name: str): ...


class _TimeBreakdown(Protocol):
    def spending(self, category: str): ...


@dataclass(frozen=True)
class Phases:
    """Enters a phase in the watchdog's progress, the compile log and the time breakdown at once."""

    progress: _Watchdog
    compile_log: _CompileLog
    breakdown: _TimeBreakdown

    @contextmanager
    def entered(self, phase: Phase) -> Iterator[None]:
        with ExitStack() as stack:
            if phase.watchdog is not None:
                stack.enter_context(self.progress.during(phase.watchdog))
            if phase.compilations is not None:
                stack.enter_context(self.compile_log.phase(phase.compilations))
            if phase.time is not None:
                stack.enter_context(self.breakdown.spending(phase.time))
            yield

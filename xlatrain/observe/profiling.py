"""trainer.profile_steps: a jax.profiler trace of a window of training steps, in RUN_DIR/profile.

The trace opens in TensorBoard's profile plugin (`tensorboard --logdir RUN_DIR/profile`), in xprof, and in
Perfetto (`perfetto_trace.json.gz`); processes other than 0 write theirs into RUN_DIR/profile/process-<i>.
The step's phases carry `jax.named_scope` names (lowering/step.py, lowering/pipeline/gradients.py), so the device
ops read as the forward (`jvp(forward)`, as jax names it under differentiation), the backward
(`transpose(jvp(forward))`), sync, unscale (fp16), grad_norm, finite_check, clip, update, and a pipeline's slots
(`pipeline_slot`, then the slot's action: `forward_first`, `backward`, ...).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import jax

from xlatrain.compat.monitoring import abandon_profile
from xlatrain.errors import FILE_SYSTEM_REFUSALS, warn

PROFILE_DIR = "profile"
TRACE_SESSIONS = Path("plugins", "profile")
"""Where under its log directory jax.profiler writes each trace, in a folder named by the time it stopped."""
_REFUSALS = {os.strerror(code) for code in (*FILE_SYSTEM_REFUSALS, errno.EACCES)}
LONG_WINDOW = 100
"""More traced steps than this earn a warning: jax's profiler holds every event of the window in host memory
until it stops (about 0.5 MB a step for the default GPT: a 10-step trace wrote 4.6 MB)."""


class ProfileWindow:
    """Steps a..b (numbered as in metrics.jsonl, from 1): the trace starts before the executable that runs
    step a is dispatched and stops once the one that runs step b has finished (whole executables: with
    trainer.steps_per_sync > 1 the window widens to the fused groups it touches)."""

    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, echo: Callable[[str], None]):
        self.steps = steps
        if steps is not None and steps[1] - steps[0] + 1 > LONG_WINDOW:
            warn(f"trainer.profile_steps=[{steps[0]}, {steps[1]}] traces {steps[1] - steps[0] + 1:,} steps, and "
                 "jax's profiler keeps every event of them in host memory until the last one: a long window can "
                 f"exhaust it, where a few steps show what a step does (e.g. [{steps[0]}, {steps[0] + 2}])")
        self.first_traced = steps[0] if steps else None  # later when a resumed session starts inside the window
        self.directory = trace_directory(run_dir)
        self.echo = echo
        self.tracing = False
        self.done = False
        self._sessions_before: set[Path] = set()

    def touches(self, first: int, last: int) -> bool:
        """Whether steps `first`..`last` overlap the traced steps."""
        return self.steps is not None and first <= self.steps[1] and last >= self.steps[0]

    def before_dispatch(self, first: int, last: int) -> None:
        """`first`..`last`: the steps of the executable about to be dispatched."""
        if self.steps is None or self.tracing or self.done:
            return
        a, b = self.steps
        if first > b:
            self.echo(f"  trainer.profile_steps [{a}, {b}] lie before step {first}, where this session starts: "
                      "nothing traced")
            self.done = True
        elif last >= a:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._sessions_before = set(self._sessions())
            self.first_traced = max(a, first)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.tracing = True

    def after_boundary(self, step: int, state: Any) -> None:
        if self.tracing and step >= self.steps[1]:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run stops early)."""
        if not self.tracing:
            return
        self.tracing, self.done = False, True
        try:
            jax.profiler.stop_trace()
        except (OSError, jax.errors.JaxRuntimeError) as err:
            reason = _file_system_refusal(err)
            if reason is None:
                raise
            self._abandon(reason)
            return
        self.echo(f"  profile of steps {self.first_traced}..{self.steps[1]} written to {self.directory}: open it with "
                  f"`tensorboard --logdir {self.directory}` (profile tab), or load its perfetto_trace.json.gz "
                  "at ui.perfetto.dev")

    def _abandon(self, reason: str) -> None:
        """A trace the file system refused: what it left is removed (a truncated trace would not open), the
        run's training is not affected."""
        abandon_profile()
        for partial in set(self._sessions()) - self._sessions_before:
            shutil.rmtree(partial, ignore_errors=True)
        warn(f"the profile of steps {self.first_traced}..{self.steps[1]} could not be written to {self.directory} "
             f"({reason}); its partial trace is removed, the training is not affected: make room, then trace again "
             "with `xlatrain profile`")

    def _sessions(self) -> list[Path]:
        sessions = self.directory / TRACE_SESSIONS
        return list(sessions.iterdir()) if sessions.is_dir() else []


def trace_directory(run_dir: Path) -> Path:
    """Where this process writes its trace: processes of one host would write the same <host>.xplane.pb, so
    each but the first has its own folder."""
    index = jax.process_index()
    return run_dir / PROFILE_DIR / (f"process-{index}" if index else "")


def _file_system_refusal(err: Exception) -> str | None:
    """Why writing the trace failed, when the file system refused it (jax's profiler reports that as a runtime
    error naming the errno's text); None for any other failure, which keeps its traceback."""
    if isinstance(err, OSError):
        return err.strerror if err.strerror in _REFUSALS else None
    return next((reason for reason in sorted(_REFUSALS) if reason in str(err)), None)

"""`xlatrain profile`: train the first steps of a config into a fresh run directory, never into the config's own
run, with a jax.profiler trace of steps A..B in RUN_DIR/profile."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Callable

from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.observe.profiling import TRACE_SESSIONS, trace_directory
from xlatrain.runtime.distributed import as_primary_has_it, is_primary
from xlatrain.runtime.signals import stop_signals

TrainCommand = Callable[[str | None, list[str], Callable[[], list[str]]], int]
"""train(config_path, overrides, once_joined) -> exit code: the `xlatrain train` command; `once_joined()` gives
more overrides, found after this process joined the others."""


def profile(config_path: str | None, overrides: list[str], steps: tuple[int, int], train: TrainCommand) -> int:
    """Trains steps 1..B (rounded up to whole fused groups) into RUN_DIR-profile-<time>."""
    config = load_config(config_path, overrides)
    first, last = steps
    k = config.trainer.steps_per_sync
    stamp = time.strftime('%Y%m%d-%H%M%S')
    run_dir = Path()

    def in_a_fresh_directory() -> list[str]:
        """Process 0 claims the directory and every process of the run takes its name."""
        nonlocal run_dir
        claimed = str(claim_profile_dir(config.run_dir(), stamp)) if is_primary() else ""
        run_dir = Path(as_primary_has_it("profile_dir", claimed))
        return [f"trainer.run_dir={run_dir}"]

    with stop_signals() as stop:
        code = train(config_path, [*overrides, f"trainer.steps={-(-last // k) * k}",
                                   f"trainer.profile_steps=[{first},{last}]"], in_a_fresh_directory)
    if code != 0 or stop.requested:
        return code
    traces = trace_directory(run_dir)
    if not any((traces / TRACE_SESSIONS).glob("*/*.xplane.pb")):
        raise UserError(f"profile: no trace was written to {traces} (the warning above says why)")
    return code


def claim_profile_dir(run_dir: Path, stamp: str) -> Path:
    """Creates RUN_DIR-profile-STAMP, or -STAMP-2, -3...: two profiles started in the same second would otherwise
    share a directory, and the second would resume the first's finished run instead of tracing."""
    for n in itertools.count(1):
        candidate = Path(f"{run_dir}-profile-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError:
            pass  # train's check of trainer.run_dir says what is wrong with the place
        return candidate

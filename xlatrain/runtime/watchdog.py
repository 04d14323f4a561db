"""The watchdog of multi-process runs: a dead or stuck process becomes one clear failure within seconds.

Every process publishes its progress (a heartbeat counter, its step and phase) through jax.distributed's
key-value store once per BEAT_S, and reads everyone's. Each process judges by its own clock when it last saw
another's heartbeat counter or (step, phase) change, so hosts' clocks never need to agree. A process whose
heartbeat stopped for `distributed.heartbeat_timeout` is dead; one that stayed at the same step and phase
longer than that phase's `distributed.stall_timeout` is stuck, but only when no other process is behind it
(the others are then merely waiting for it in a collective). Either way every process prints one line naming
the rank, its host, its last step and phase and the last checkpoint, and exits with WATCHDOG_EXIT at once:
never through XLA's or gloo's own failure paths, which hang for minutes and then dump C++ stacks. The checkpoint
named is the newest one on disk written whole once a save in flight had a moment to finish (one whose parts
were all written before a peer died still is), so it is the one a rerun resumes from.

When process 0 dies, jax's runtime aborts every other process within milliseconds, before any Python code can
run; `guard_against_runtime_abort` has a native thread print xlatrain's line about rank 0 in its place.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import jax

from xlatrain.compat.multihost import key_value_dir_get, key_value_set
from xlatrain.config import DistributedConfig
from xlatrain.errors import first_line
from xlatrain.runtime.signals import StoppedBeforeFirstStep

BEAT_S = 0.5
WATCHDOG_EXIT = 3
KEY_PREFIX = "xlatrain/watchdog/"
VERDICT_KEY = KEY_PREFIX + "verdict"
COORDINATOR_LINGER_S = 4 * BEAT_S
"""How long process 0, which hosts the key-value store, waits before exiting on a failure, so that the others
read the verdict (or its failure) and exit with xlatrain's line: once it is gone, jax's runtime aborts them."""
SAVE_SETTLE_S = 4 * BEAT_S
"""How long the process that judges waits for a save in flight to be written whole before naming the last
checkpoint (process 0 finishes one whose parts were all written, also when a peer died since)."""
PHASES = ("starting", "compiling", "training", "hook", "evaluating", "checkpointing", "loading_data")
"""In the order a process passes them within one step (for telling who is behind whom)."""
DONE = ("finished", "failed")
RUNTIME_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
RUNTIME_FATAL_PREAMBLE = "Polled an error from coordination service"
"""The fatal line of jax's coordination-service client when it loses the service (process 0), and the line just
before it: both are held back by the stderr guard."""
WORDS = {"loading_data": "loading data", "hook": "in a hook"}


@dataclass
class Progress:
    """This process's progress: written by the training loop, published by the watchdog thread."""

    step: int = 0
    phase: str = "starting"
    error: str = ""
    newest_checkpoint: Callable[[float], int | None] = field(default=lambda wait_s: None)
    """The newest checkpoint written whole, after waiting up to wait_s seconds for a save in flight to end. Called
    on the watchdog's thread while the training thread may hang in a collective: it must never block."""

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        before = self.phase
        self.phase = phase
        try:
            yield
        finally:
            self.phase = before


@dataclass
class Seen:
    """A process's last published progress and when this process saw it change (its own clock)."""

    host: str
    beat: int
    step: int
    phase: str
    last_checkpoint: int | None
    error: str
    beat_changed_at: float
    progress_changed_at: float

    @property
    def order(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else len(PHASES)


@dataclass
class Observer:
    """Everything one process knows about every process, updated from each read of the key-value store."""

    seen: dict[int, Seen] = field(default_factory=dict)
    unreachable_since: float | None = None

    def update(self, published: dict[int, dict], now: float) -> None:
        for rank, p in published.items():
            old = self.seen.get(rank)
            moved = old is None or (old.step, old.phase) != (p["step"], p["phase"])
            self.seen[rank] = Seen(p["host"], p["beat"], p["step"], p["phase"], p["last_checkpoint"], p["error"],
                                   now if old is None or old.beat != p["beat"] else old.beat_changed_at,
                                   now if moved else old.progress_changed_at)

    def store_unreachable(self, now: float) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = now


def verdict(observer: Observer, processes: int, now: float, config: DistributedConfig,
            reached: int | None = None) -> str | None:
    """What failed, to stop every process with (`final_line` adds the last checkpoint), or None while every
    process is alive and moving. `reached`: the newest checkpoint written whole, which every process that has begun
    its steps has passed: a step published before it is older than the process's own (it publishes every BEAT_S)."""
    seen = observer.seen

    def at(s: Seen) -> int:
        return s.step if reached is None or s.step == 0 else max(s.step, reached)

    if observer.unreachable_since is not None and now - observer.unreachable_since > config.heartbeat_timeout:
        return coordinator_lost(seen, f"the key-value store has been unreachable for "
                                      f"{now - observer.unreachable_since:.0f} s")
    missing = [rank for rank in range(processes) if rank not in seen]
    running = {rank: s for rank, s in seen.items() if s.phase not in DONE}
    for rank, s in sorted(seen.items()):
        if s.phase == "failed":
            return f"rank {rank} (host {s.host}) failed at step {at(s)}: {s.error}"
    for rank, s in sorted(running.items()):
        silent = now - s.beat_changed_at
        if silent > config.heartbeat_timeout:
            return (f"rank {rank} (host {s.host}) stopped responding at step {at(s)} while {_words(s.phase)} "
                    f"(no heartbeat for {silent:.0f} s)")
    if missing or not running:
        return None  # a process that has not published yet is still joining: its start is covered by jax
    behind = min(s.order for s in running.values())
    for rank, s in sorted(running.items()):
        stuck = now - s.progress_changed_at
        limit = getattr(config.stall_timeout, s.phase, None)
        if limit is not None and stuck > limit and s.order == behind:
            everyone = all(other.order == behind for other in running.values()) and len(running) > 1
            who = "every process" if everyone else f"rank {rank} (host {s.host})"
            return (f"{who} has been {_words(s.phase)} at step {at(s)} for {stuck:.0f} s, longer than "
                    f"distributed.stall_timeout.{s.phase}={limit:g}")
    return None


def coordinator_lost(seen: dict[int, Seen], why: str) -> str:
    """The line for a lost rank 0, which hosts jax's distributed service and the key-value store."""
    coordinator = seen.get(0)
    if coordinator is None:
        return f"rank 0 (the coordinator) stopped responding while starting: {why}"
    return (f"rank 0 (the coordinator, host {coordinator.host}) stopped responding at step {coordinator.step} while "
            f"{_words(coordinator.phase)}: {why}")


def _words(phase: str) -> str:
    return WORDS.get(phase, phase)


def newest_checkpoint(seen: dict[int, Seen], mine: int | None = None) -> int | None:
    """The newest checkpoint any process published or this one found written since."""
    steps = [s.last_checkpoint for s in seen.values() if s.last_checkpoint is not None]
    steps += [mine] if mine is not None else []
    return max(steps, default=None)


def final_line(what: str, seen: dict[int, Seen], mine: int | None = None) -> str:
    """The failure with the newest checkpoint (newest_checkpoint)."""
    newest = newest_checkpoint(seen, mine)
    return f"{what}; last checkpoint: step {newest}" if newest is not None else f"{what}; no checkpoint yet"


class Watchdog:
    """The thread that publishes this process's progress and stops the process on a verdict."""

    def __init__(self, config: DistributedConfig, progress: Progress, host: str,
                 on_verdict: Callable[[str], None] | None = None):
        self.config = config
        self.progress = progress
        self.host = host
        self.rank = jax.process_index()
        self.processes = jax.process_count()
        self.observer = Observer()
        self.on_verdict = on_verdict or _exit_with
        self.beat = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="xlatrain-watchdog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Publish the final phase (finished or failed) and stop watching."""
        self.done.set()
        self.thread.join()
        try:
            self.publish()
        except Exception:  # process 0, and the store with it, may have ended already
            return
        if self.progress.phase == "failed" and self.rank == 0:
            time.sleep(COORDINATOR_LINGER_S)

    def publish(self) -> None:
        self.beat += 1
        key_value_set(f"{KEY_PREFIX}{self.rank}", json.dumps(self._mine()).encode())

    def _stop_everyone(self, now: float) -> None:
        mine = self.progress.newest_checkpoint(SAVE_SETTLE_S)
        what = verdict(self.observer, self.processes, now, self.config, newest_checkpoint(self.observer.seen, mine))
        line = final_line(what, self.observer.seen, mine)
        try:
            key_value_set(VERDICT_KEY, line.encode())
        except Exception:
            pass
        if self.rank == 0:
            time.sleep(COORDINATOR_LINGER_S)
        self.on_verdict(line)

    def _loop(self) -> None:
        while not self.done.wait(BEAT_S):
            now = time.monotonic()
            try:
                self.publish()
                entries = dict(key_value_dir_get(KEY_PREFIX))
            except Exception:  # the store lives in process 0: unreachable means process 0 is gone
                self.observer.store_unreachable(now)
                entries = {}
            else:
                self.observer.unreachable_since = None
            if VERDICT_KEY in entries and not self.done.is_set():
                self.on_verdict(entries[VERDICT_KEY].decode())  # another process judged first
                return
            published = {int(key.rsplit("/", 1)[1]): json.loads(value) for key, value in entries.items()}
            published[self.rank] = self._mine()  # judged like the others, by the value it just published
            self.observer.update(published, now)
            if self.rank != 0:
                _stderr_guard().set_message(_runtime_abort_line(self.observer.seen))
            if verdict(self.observer, self.processes, now, self.config) is not None and not self.done.is_set():
                self._stop_everyone(now)
                return

    def _mine(self) -> dict:
        p = self.progress
        return {"host": self.host, "beat": self.beat, "step": p.step, "phase": p.phase,
                "last_checkpoint": p.newest_checkpoint(0), "error": p.error}


def _exit_with(message: str) -> None:
    say_error(message)
    leave_now(WATCHDOG_EXIT)


def say_error(message: str) -> None:
    """The error line, on a line of its own also while the training's progress bar is on the terminal (this runs on
    the watchdog's thread, in the middle of the bar's line): tqdm clears the bar first."""
    from tqdm import tqdm

    tqdm.write(f"xlatrain: error: {message}", file=sys.stderr)


def leave_now(code: int) -> None:
    """End the process at once, after what it wrote (native stderr included) is out."""
    sys.stdout.flush()
    sys.stderr.flush()
    release_stderr()
    os._exit(code)


def _stderr_guard():
    from xlatrain.runtime import _stderr_guard

    return _stderr_guard


def _runtime_abort_line(seen: dict[int, Seen]) -> str:
    return f"xlatrain: error: {final_line(coordinator_lost(seen, 'jax.distributed lost its connection to it'), seen)}\n"


def guard_against_runtime_abort() -> None:
    """On a process other than 0 of a multi-process run: native writes to stderr go through the guard, which
    replaces the runtime's fatal abort on losing process 0 by xlatrain's line (kept current by the watchdog)
    and exit code. Python's sys.stderr then writes to the real stderr directly."""
    if jax.process_index() == 0:
        return
    atexit.register(release_stderr)
    real = _stderr_guard().start(RUNTIME_FATAL, RUNTIME_FATAL_PREAMBLE, WATCHDOG_EXIT, _runtime_abort_line({}))
    sys.stderr.flush()
    sys.stderr = open(real, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")


def release_stderr() -> None:
    """Give stderr back to the process after passing on what native code wrote (before os._exit too)."""
    if "xlatrain.runtime._stderr_guard" in sys.modules:
        _stderr_guard().release()


@contextmanager
def watching(config: DistributedConfig, host: str) -> Iterator[Progress]:
    """This process's Progress, published and watched while the block runs (with more than one process)."""
    progress = Progress()
    if jax.process_count() == 1:
        yield progress
        return
    watchdog = Watchdog(config, progress, host)
    watchdog.start()
    try:
        yield progress
    except StoppedBeforeFirstStep:
        progress.phase = "finished"  # every process got the signal: each ends its start-up by itself
        raise
    except jax.errors.JaxRuntimeError:
        # A collective whose peer died fails here, with the runtime's words: the watchdog names the peer, once the
        # judge has waited for a save in flight and process 0 has lingered (exiting first would abort the runtime).
        watchdog.thread.join(timeout=config.heartbeat_timeout + 4 * BEAT_S + SAVE_SETTLE_S + COORDINATOR_LINGER_S)
        progress.phase, progress.error = "failed", "a runtime error (see its log)"
        raise
    except BaseException as err:
        progress.phase, progress.error = "failed", first_line(err) or type(err).__name__
        raise
    else:
        progress.phase = "finished"
    finally:
        watchdog.stop()

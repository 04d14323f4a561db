"""SIGTERM and SIGINT from the first second of `xlatrain train`.

Before the training loop a signal ends start-up at once (`StoppedBeforeFirstStep`: nothing to save yet; the
CLI exits 0). Inside the loop it only asks for a stop, and the loop saves a checkpoint at the next step
boundary. A second signal exits the process at once.

Python runs signal handlers only between bytecodes of the main thread, so a main thread blocked in C++ (a long
compilation, jax.distributed waiting for its coordinator, a collective) would not notice. A watcher thread
therefore reads the signal numbers that the interpreter's C-level handler writes to a wakeup pipe: it exits on
the second signal, and, before the first step, also when the main thread has not ended start-up within
START_UP_GRACE_S of the first (nothing is written before the first step but whole files renamed into place).

That is the `xlatrain` command's way ("exit"). A Python caller (xlatrain.Trainer) may choose "raise": the same
handlers, but nothing ends the process: a second signal raises KeyboardInterrupt where Python runs the handler, so
that a notebook's kernel survives; or "none": no handlers at all. The loop also stops, as on a signal, when a
callback asks (`StopSignals.ask`).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Literal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SignalHandling = Literal["exit", "raise", "none"]
START_UP_GRACE_S = 5.0
STOPPED_BEFORE_FIRST_STEP = "stopped before the first step; nothing to save"


class StoppedBeforeFirstStep(BaseException):
    """A stop signal arrived during start-up (config, devices, data, compilation, restore).

    A BaseException, like KeyboardInterrupt, so that no library's `except Exception` swallows it."""


class StopSignals:
    """`stopped`, `stopped_code`: what a command says, and its exit status (None: 128 + the signal's number, the
    shell's convention for a process a signal ended), when start-up does not end within the grace period."""

    def __init__(self, stopped: str = STOPPED_BEFORE_FIRST_STEP, stopped_code: int | None = 0,
                 handling: SignalHandling = "exit") -> None:
        self.stopped, self.stopped_code, self.handling = stopped, stopped_code, handling
        self.received: list[int] = []
        self.asked = ""
        """Why a callback asked the loop to stop ("": none did)."""
        self.in_loop = False
        self.start_up_deadline: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return bool(self.received or self.asked)

    def ask(self, reason: str) -> None:
        """Stop the loop at a step boundary, with a checkpoint, as a signal does (the first reason is kept)."""
        self.asked = self.asked or reason

    def cause(self) -> str:
        """What stopped the loop: "signal", a callback's reason, or "" (nothing: it finished)."""
        return "signal" if self.received else self.asked

    def begin_loop(self) -> None:
        """From now on a signal only sets the flag that the loop checks at each boundary. A signal that came
        during start-up ends it here if its exception was lost: Python runs a handler at whatever bytecode the
        main thread is at, which may be a `__del__` or a callback from C++, where an exception is printed and
        dropped."""
        if self.received:
            raise StoppedBeforeFirstStep(signal.Signals(self.received[0]).name)
        self.in_loop = True

    def _handle(self, signum: int, frame) -> None:
        self.received.append(signum)
        if not self.in_loop and len(self.received) == 1 and not _drops_exceptions(frame):
            raise StoppedBeforeFirstStep(signal.Signals(signum).name)
        if self.handling == "raise" and len(self.received) > 1:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopped without saving")


def _drops_exceptions(frame) -> bool:
    """Whether the main thread was inside a `__del__` or a garbage-collector callback (jax has one), where Python
    would print the handler's exception as "Exception ignored" with its traceback and drop it: begin_loop (or
    the start-up deadline) stops start-up instead."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code in callbacks:
            return True
        frame = frame.f_back
    return False


_current: StopSignals | None = None


@contextmanager
def stop_signals(stopped: str = STOPPED_BEFORE_FIRST_STEP, stopped_code: int | None = 0,
                 handling: SignalHandling = "exit") -> Iterator[StopSignals]:
    """Install the handlers (main thread only; elsewhere signals stay as they are). Nested uses share the
    outermost, with its `stopped`, `stopped_code` and `handling` (StopSignals)."""
    global _current
    if _current is not None or threading.current_thread() is not threading.main_thread():
        yield _current if _current is not None else StopSignals(stopped, stopped_code, handling)
        return
    stop = _current = StopSignals(stopped, stopped_code, handling)
    if handling != "exit":
        previous = {sig: signal.signal(sig, stop._handle) for sig in STOP_SIGNALS} if handling == "raise" else {}
        try:
            yield stop
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _current = None
        return
    previous = {sig: signal.signal(sig, stop._handle) for sig in STOP_SIGNALS}
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_end, stop), name="xlatrain-stop", daemon=True).start()
    try:
        yield stop
    finally:
        if stop.start_up_deadline is not None:
            stop.start_up_deadline.cancel()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(write_end)
        _current = None


def _watch(read_end: int, stop: StopSignals) -> None:
    seen = 0
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(64):
            for signum in chunk:
                if signum not in STOP_SIGNALS:
                    continue
                seen += 1
                name = signal.Signals(signum).name
                if seen >= 2:
                    _exit_now(f"second {name}: exiting now, without saving", 128 + signum)
                if not stop.in_loop and stop.start_up_deadline is None:
                    stop.start_up_deadline = threading.Timer(START_UP_GRACE_S, _exit_if_still_starting,
                                                             (stop, signum))
                    stop.start_up_deadline.daemon = True
                    stop.start_up_deadline.start()


def _exit_if_still_starting(stop: StopSignals, signum: int) -> None:
    if not stop.in_loop:
        code = 128 + signum if stop.stopped_code is None else stop.stopped_code
        _exit_now(f"{signal.Signals(signum).name}: {stop.stopped}", code)


def _exit_now(message: str, code: int) -> None:
    print(f"xlatrain: {message}", file=sys.stderr if code else sys.stdout, flush=True)
    os._exit(code)

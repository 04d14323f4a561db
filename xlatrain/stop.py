"""SIGTERM and SIGINT from the first second of `xlatrain train`.

Before the training loop a signal ends start-up at once (`StoppedBeforeFirstStep`: nothing to save yet; the
CLI exits 0). Inside the loop it only asks for a stop, and the loop saves a checkpoint at the next step
boundary. A second signal exits the process at once, even while the main thread is inside a long compilation
or a collective: Python runs signal handlers only between bytecodes of the main thread, so a watcher thread
reads the signal numbers that the interpreter's C-level handler writes to a wakeup pipe.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedBeforeFirstStep(BaseException):
    """A stop signal arrived during start-up (config, devices, data, compilation, restore).

    A BaseException, like KeyboardInterrupt, so that no library's `except Exception` swallows it."""


class StopSignals:
    def __init__(self) -> None:
        self.received: list[int] = []
        self.in_loop = False

    def __bool__(self) -> bool:
        return bool(self.received)

    @contextmanager
    def loop(self) -> Iterator[None]:
        """While inside, a signal only sets the flag that the loop checks at each boundary."""
        self.in_loop = True
        try:
            yield
        finally:
            self.in_loop = False

    def _handle(self, signum: int, _frame) -> None:
        self.received.append(signum)
        if not self.in_loop and len(self.received) == 1:
            raise StoppedBeforeFirstStep(signal.Signals(signum).name)


_current: StopSignals | None = None


@contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """Install the handlers (main thread only; elsewhere signals stay as they are). Nested uses share one."""
    global _current
    if _current is not None or threading.current_thread() is not threading.main_thread():
        yield _current or StopSignals()
        return
    stop = _current = StopSignals()
    previous = {sig: signal.signal(sig, stop._handle) for sig in STOP_SIGNALS}
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_exit_on_second_signal, args=(read_end,), name="xlatrain-stop", daemon=True).start()
    try:
        yield stop
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(write_end)
        _current = None


def _exit_on_second_signal(read_end: int) -> None:
    seen = 0
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(64):
            for signum in chunk:
                seen += signum in STOP_SIGNALS
                if seen >= 2:
                    print(f"xlatrain: second {signal.Signals(signum).name}: exiting now, without saving",
                          file=sys.stderr, flush=True)
                    os._exit(128 + signum)

"""`xlatrain launch`: N local processes of `xlatrain train` joined through jax.distributed on 127.0.0.1.

Each process writes its whole output to RUN_DIR/logs/rank-<i>.log. The terminal shows rank 0's output and
every rank's `xlatrain` lines (errors, warnings), prefixed with the rank; XLA's and gloo's own logs stay in the
files. The first process to fail makes the launcher stop the others (SIGTERM, then SIGKILL after
GRACE_S) and exit with that process's code and one line naming it. SIGINT/SIGTERM to the launcher is passed
on once to every process (each saves a checkpoint at the same step and exits 0); a second one kills them.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from xlatrain.config import load_config
from xlatrain.run.directory import LOGS_DIR, check_writable

GRACE_S = 10.0
POLL_S = 0.1
_RUNTIME_NOISE = re.compile(r"\[Gloo\]|connected peer ranks")
"""What gloo prints to stdout (from several threads at once, so lines can interleave): kept in the logs only."""
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(base: dict[str, str], rank: int, devices_per_process: int | None) -> dict[str, str]:
    """The environment of one process: its own CPU device count, and its own GPUs when the host has any."""
    env = dict(base)
    if devices_per_process is not None:
        flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
        if Path("/dev/nvidia0").exists():
            first = rank * devices_per_process
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(devices_per_process))
    return env


def rank_command(rank: int, processes: int, port: int, config_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "xlatrain.cli", "train", *config_args,
            f"distributed.coordinator=127.0.0.1:{port}", f"distributed.num_processes={processes}",
            f"distributed.process_id={rank}"]


def _die_with_launcher() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM if the launcher dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Rank:
    index: int
    process: subprocess.Popen
    log: IO[bytes]
    last_error: str = ""
    readers: list[threading.Thread] = field(default_factory=list)

    def describe_exit(self, log_path: Path) -> str:
        code = self.process.returncode
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
        said = f": {self.last_error}" if self.last_error else ""
        return f"rank {self.index} {how}{said} (its output: {log_path})"


class Terminal:
    """What reaches the launcher's terminal from the processes' output streams."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def pump(self, rank: Rank, stream: IO[bytes], terminal: IO[str], everything: bool) -> None:
        """Copy `stream` to the rank's log; to the terminal all of it (`everything`) or its `xlatrain` lines."""
        prefix = "" if rank.index == 0 else f"[rank {rank.index}] "
        pending = b""
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            with self.lock:
                rank.log.write(chunk)
                rank.log.flush()
            pending += chunk
            *pieces, pending = re.split(rb"(?<=[\r\n])", pending)
            for piece in pieces:
                self._show(rank, piece.decode(errors="replace"), prefix, terminal, everything)
        if pending:
            self._show(rank, pending.decode(errors="replace") + "\n", prefix, terminal, everything)

    def _show(self, rank: Rank, piece: str, prefix: str, terminal: IO[str], everything: bool) -> None:
        text = piece.rstrip("\r\n")
        if _RUNTIME_NOISE.search(text):
            return
        ours = text.lstrip().startswith("xlatrain")
        if ours and "error" in text:
            rank.last_error = text.strip()
        progress_bar = rank.index == 0 and piece.endswith("\r")
        if everything or ours or progress_bar:
            with self.lock:
                terminal.write(prefix + piece if text else piece)
                terminal.flush()


def launch(processes: int, devices_per_process: int | None, config_path: str | None, overrides: list[str]) -> int:
    """Run the processes to the end; the launcher's exit code (0, or the first failing process's)."""
    config = load_config(config_path, overrides)
    config_args = [config_path, *overrides] if config_path else overrides
    check_writable(config.run_dir())
    logs = config.run_dir() / LOGS_DIR
    logs.mkdir(exist_ok=True)
    port = free_port()
    print(f"xlatrain launch: {processes} processes"
          + (f" x {devices_per_process} devices" if devices_per_process else "")
          + f" on 127.0.0.1:{port}; each one's output in {logs}/rank-<i>.log", flush=True)
    terminal = Terminal()
    ranks = []
    for index in range(processes):
        process = subprocess.Popen(rank_command(index, processes, port, config_args),
                                   env=rank_environment(dict(os.environ), index, devices_per_process),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                   start_new_session=True, preexec_fn=_die_with_launcher)
        rank = Rank(index, process, open(logs / f"rank-{index}.log", "ab"))
        for stream, out, everything in ((process.stdout, sys.stdout, index == 0), (process.stderr, sys.stderr, False)):
            reader = threading.Thread(target=terminal.pump, args=(rank, stream, out, everything), daemon=True)
            reader.start()
            rank.readers.append(reader)
        ranks.append(rank)
    return _supervise(ranks, logs)


def _supervise(ranks: list[Rank], logs: Path) -> int:
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    failed: Rank | None = None
    kill_at: float | None = None
    forwarded = 0
    try:
        while any(rank.process.poll() is None for rank in ranks):
            if len(signals) > forwarded:
                forwarded = len(signals)
                _send(ranks, signal.SIGTERM if forwarded == 1 else signal.SIGKILL)
            if failed is None:
                failed = _first_failure(ranks)
                if failed is not None:
                    _send(ranks, signal.SIGTERM)
                    kill_at = time.monotonic() + GRACE_S
            if kill_at is not None and time.monotonic() > kill_at:
                _send(ranks, signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for rank in ranks:
        for reader in rank.readers:
            reader.join(timeout=5)
        rank.log.close()
    failed = failed or _first_failure(ranks)
    if failed is None:
        return 0
    print(f"xlatrain launch: error: {failed.describe_exit(logs / f'rank-{failed.index}.log')}", file=sys.stderr,
          flush=True)
    return failed.process.returncode if failed.process.returncode > 0 else 1


def _first_failure(ranks: list[Rank]) -> Rank | None:
    """A rank that failed, preferring one killed by a signal, then one that aborted: its peers' failures are
    usually the consequence, and an abort is how jax's coordination client ends a process whose peer vanished."""
    failed = [r for r in ranks if r.process.returncode not in (None, 0)]
    return min(failed, key=lambda r: (r.process.returncode >= 0, r.process.returncode == -signal.SIGABRT, r.index),
               default=None)


def _send(ranks: list[Rank], sig: int) -> None:
    for rank in ranks:
        if rank.process.poll() is None:
            try:
                rank.process.send_signal(sig)
            except ProcessLookupError:
                pass

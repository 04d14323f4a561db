"""Faults a long run meets: corrupt or incomplete checkpoints, a broken run directory, signals from the first
second. Each must end in one clear line and a run that resumes; nothing is deleted or rewritten too early."""

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import DIGITS_MLP, REPO, run_cli

from xlatrain.run.metrics import read_metrics
from xlatrain.runtime.signals import StoppedBeforeFirstStep, StopSignals

STEPS = ["trainer.checkpoint_every=2", "trainer.keep_checkpoints=5"]


def _run(run_dir, steps, *extra) -> list[str]:
    """The digits MLP's overrides for a run of `steps` steps in run_dir."""
    return [*DIGITS_MLP, *STEPS, f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", *extra]


def _train(run_dir, steps, *extra):
    return run_cli("train", *_run(run_dir, steps, *extra))


def _flip_bytes_inside_the_arrays(step_dir):
    """Silent corruption: change bytes in the middle of the largest array file, keeping its size."""
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    for offset in range(len(data) // 2, len(data) // 2 + 64):
        data[offset] ^= 0x5A
    largest.write_bytes(bytes(data))


def test_corrupt_latest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_newest_that_verifies(tmp_path):
    run_dir, horizon = tmp_path / "run", "optimizer.decay_steps=8"
    assert _train(run_dir, 6, horizon).returncode == 0
    _flip_bytes_inside_the_arrays(run_dir / "checkpoints" / "6")
    (run_dir / "checkpoints" / "4" / "state" / "_METADATA").unlink()  # an incomplete checkpoint
    reference = _train(tmp_path / "reference", 8, horizon)

    result = _train(run_dir, 8, horizon)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("xlatrain: warning:")]
    assert len(warnings) == 2 and "checkpoint 6 is unusable" in warnings[0], result.stderr
    assert "checkpoint 4 is unusable" in warnings[1] and "Traceback" not in result.stderr
    assert "resuming from checkpoint at step 2 (verified)" in result.stdout
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert {"4.corrupt", "6.corrupt"} <= set(names) and "2" in names and "8" in names
    # Resumed from step 2, the run repeats steps 3..8 exactly as an uninterrupted run.
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
    expected = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "reference" / "metrics.jsonl") if "loss" in r}
    assert reference.returncode == 0 and losses == pytest.approx(expected, rel=1e-6)


def test_a_checkpoint_whose_index_is_garbage_is_one_short_warning_without_the_readers_noise(tmp_path):
    """The OCDBT b-tree nodes of checkpoint 4 (state/d/) overwritten: TensorStore's error names the file, not its
    kilobytes of spec, and the reads orbax abandoned print nothing (they did, while its restore unwound)."""
    run_dir = tmp_path / "run"
    assert _train(run_dir, 4).returncode == 0
    nodes = list((run_dir / "checkpoints" / "4" / "state" / "d").iterdir())
    assert nodes
    for node in nodes:
        node.write_bytes(os.urandom(node.stat().st_size))
    result = _train(run_dir, 6)
    assert result.returncode == 0, result.stderr[-3000:]
    warning, = [line for line in result.stderr.splitlines() if line.startswith("xlatrain: warning:")]
    assert "checkpoint 4 is unusable (ValueError: DATA_LOSS" in warning and "state/d/" in warning, warning
    assert "tensorstore_spec" not in warning and len(warning) < 1000, warning
    assert "Traceback" not in result.stderr and "resuming from checkpoint at step 2 (verified)" in result.stdout


def test_when_no_checkpoint_verifies_nothing_is_rewritten_and_the_error_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    assert _train(run_dir, 4).returncode == 0
    for step in ("2", "4"):
        _flip_bytes_inside_the_arrays(run_dir / "checkpoints" / step)
    saved = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    result = _train(run_dir, 6)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if not line.startswith("xlatrain: warning:")]
    assert len(errors) == 1 and "no checkpoint in" in errors[0] and "4.corrupt, 2.corrupt" in errors[0], errors
    assert {name: (run_dir / name).read_bytes() for name in saved} == saved
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2.corrupt", "4.corrupt"]


@pytest.mark.parametrize("content", ["- a list\n- not a config\n", "model: [unclosed\n", "model: {layerz: 3}\n"])
def test_run_dir_with_an_invalid_config_yaml_is_refused(tmp_path, content):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(content)
    result = _train(run_dir, 2)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(run_dir / "config.yaml") in result.stderr
    assert (run_dir / "config.yaml").read_text() == content


def _start(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "xlatrain.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                     **(env or {})})


def _wait_for_line(process, text, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if text in line:
            return
        assert line or process.poll() is None, process.stderr.read()
    raise AssertionError(f"no line with {text!r} within {timeout}s")


@pytest.mark.parametrize("where", ["__del__", "gc callback"])
def test_a_start_up_signal_inside_a_finalizer_raises_nothing_there_and_stops_before_the_loop(where, monkeypatch):
    """Python may run the handler inside a `__del__` or a garbage-collector callback (jax registers one), where
    an exception would be printed with its traceback ("Exception ignored in ...") and dropped; the handler
    leaves it to entering the loop to stop start-up."""
    stop, dropped = StopSignals(), []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    if where == "__del__":
        class Collected:
            def __del__(self):
                stop._handle(signal.SIGTERM, sys._getframe())

        Collected()
    else:
        def callback(_phase, _info):
            stop._handle(signal.SIGTERM, sys._getframe())

        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
    assert stop.requested and dropped == []
    with pytest.raises(StoppedBeforeFirstStep, match="SIGTERM"):
        stop.begin_loop()
    assert not stop.in_loop


def test_sigterm_during_start_up_exits_zero_with_one_line_and_the_run_starts_again(tmp_path):
    from xlatrain.config import load_config
    from xlatrain.trainer import train

    run_dir = tmp_path / "run"
    process = _start("train", *DIGITS_MLP, "trainer.steps=50", f"trainer.run_dir={run_dir}")
    _wait_for_line(process, f"-> {run_dir}")  # the program is built; state init and compilation follow
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "SIGTERM: stopped before the first step; nothing to save" in out and "Traceback" not in err, (out, err)
    assert not list((run_dir / "checkpoints").glob("[0-9]*"))
    # whatever the stopped start left (the lock and an empty checkpoints/ were refused as a foreign directory; also
    # config.yaml when the signal came once the state existed), the same run starts again
    assert train(load_config(None, [*DIGITS_MLP, "trainer.steps=2", f"trainer.run_dir={run_dir}"]),
                 echo=lambda _: None).final_step == 2


def _unused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _waiting_for_a_coordinator(tmp_path):
    """Process 1 of 2 whose coordinator never comes: its main thread blocks inside jax.distributed (C++).

    Returns once the process has said it is joining, and a second more: on a loaded machine the imports before
    it can take longer than any fixed wait, and a signal during them is handled by Python, not the watcher."""
    process = _start("train", *DIGITS_MLP, f"trainer.run_dir={tmp_path / 'run'}",
                     f"distributed.coordinator=127.0.0.1:{_unused_port()}", "distributed.num_processes=2",
                     "distributed.process_id=1")
    _wait_for_line(process, "joining the other processes through distributed.coordinator=")
    time.sleep(1)
    return process


def test_a_signal_stops_start_up_even_while_blocked_in_cpp(tmp_path):
    process = _waiting_for_a_coordinator(tmp_path)
    process.send_signal(signal.SIGINT)
    began = time.monotonic()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0 and time.monotonic() - began < 15, (out, err)
    assert "SIGINT: stopped before the first step; nothing to save" in out and "Traceback" not in err


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    process = _waiting_for_a_coordinator(tmp_path)
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    began = time.monotonic()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT and time.monotonic() - began < 2, (out, err)
    assert err.strip().splitlines() == ["xlatrain: second SIGINT: exiting now, without saving"]


def test_throughput_with_fused_steps_matches_wall_time(tmp_path):
    """Each fused group of 10 steps takes at least the 50 ms a hook sleeps, so the rate is bounded by wall time."""
    from xlatrain.config import load_config
    from xlatrain.trainer import train

    config = load_config(None, [*DIGITS_MLP, "trainer.steps=60", "trainer.steps_per_sync=10", "trainer.log_every=10",
                                f"trainer.run_dir={tmp_path / 'run'}"])
    train(config, hooks=[lambda boundary: time.sleep(0.05)], echo=lambda _: None)
    rates = [r["samples_per_sec"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    bound = 32 * 10 / 0.05  # global batch 32, 10 steps per 50 ms at most
    assert len(rates) == 6 and all(0 < rate <= bound for rate in rates), rates
    assert max(rates[1:]) > bound / 4, rates  # and not wildly low either: the device work is much shorter


def test_summary_accounts_for_every_compilation(tmp_path):
    result = _train(tmp_path / "run", 2)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.jsonl").read_text().splitlines()[-1])
    assert sum(summary["compilations_by_phase"].values()) == summary["compilations"]
    assert summary["compilations_by_phase"]["steps"] == len(summary["step_compilations"]) == 2
    assert "compilations" in result.stdout and "set-up" in result.stdout


def _lrs(run_dir):
    return {r["step"]: r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if "lr" in r}


def test_the_learning_rate_horizon_is_fixed_when_the_run_is_created(tmp_path):
    from xlatrain.config import load_config
    from xlatrain.trainer import train

    def train_to(run_dir, steps, *extra) -> str:
        """In this process: what the run printed."""
        lines = []
        train(load_config(None, _run(run_dir, steps, "optimizer.warmup_steps=4", *extra)), echo=lines.append)
        return "\n".join(lines)

    kept, stretched, fresh = tmp_path / "kept", tmp_path / "stretched", tmp_path / "fresh"
    for run_dir in (kept, stretched):
        train_to(run_dir, 10)
        assert "decay_steps: 10" in (run_dir / "config.yaml").read_text()
    resumed = train_to(kept, 20)
    assert "keeping this run's horizon of 10 steps" in resumed, resumed
    final = 3e-3 * 0.1  # optimizer.lr x optimizer.final_lr_fraction: past the horizon, the schedule has ended
    assert [_lrs(kept)[s] for s in range(11, 21)] == pytest.approx([final] * 10)

    changed = train_to(stretched, 20, "optimizer.decay_steps=20")
    assert "horizon changed from 10 to 20 steps" in changed, changed
    train_to(fresh, 20)
    later = range(11, 21)
    assert [_lrs(stretched)[s] for s in later] == pytest.approx([_lrs(fresh)[s] for s in later], rel=1e-6)


def test_a_checkpoint_that_does_not_fit_stops_the_run_in_one_line_and_the_run_resumes_from_the_one_before(
        tmp_path, monkeypatch):
    """Refused before orbax starts writing, from the state's size and the directory's free space."""
    import shutil

    from xlatrain.config import load_config
    from xlatrain.run.checkpoints import CheckpointNotWritten
    from xlatrain.trainer import train

    run = _run(tmp_path / "run", 6)
    free = iter([10**9, 0])  # the first checkpoint fits, then the disk is full
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=next(free)))
    with pytest.raises(CheckpointNotWritten, match=rf"checkpoint 4 could not be written to {tmp_path}/run/checkpoints "
                       r"\(its \d+\.\d KiB do not fit in the 0 B free there\); the newest one written, 2, is kept: "
                       "make room or repair the directory, then run the same command to resume"):
        train(load_config(None, run), echo=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
    monkeypatch.undo()
    lines = []
    assert train(load_config(None, run), echo=lines.append).final_step == 6
    assert "  resuming from checkpoint at step 2 (verified)" in lines


def test_a_save_the_file_system_refuses_midway_is_one_line_and_any_other_failure_keeps_its_traceback(tmp_path):
    import jax.numpy as jnp

    from xlatrain.run.checkpoints import CheckpointNotWritten, Checkpoints

    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=2)
    checkpoints.save(1, {"w": jnp.ones(4)}, {"position": 1})
    checkpoints.wait_until_written()
    failures = iter([ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file '
                                "...: Failed to write 16 bytes to file 12: No space left on device "
                                "[os_error_code='28']"),
                     ValueError('NOT_FOUND: Error writing "step/0" in OCDBT database at local file "/x/2.orbax-'
                                'checkpoint-tmp/ocdbt.process_0/": Error reading Byte range [0, 398) of local file '
                                '"/x/d/43b25f39"'),  # the directory was removed while it was written
                     ValueError("an orbax bug")])

    def fail():
        raise next(failures)

    checkpoints._manager.wait_until_finished = fail
    checkpoints._in_flight = 2  # a save of step 2 in flight, which the file system refuses
    with pytest.raises(CheckpointNotWritten, match=r"checkpoint 2 could not be written to .*/checkpoints \(No space "
                       r"left on device\); the newest one written, 1, is kept"):
        checkpoints.save(3, {"w": jnp.ones(4)}, {"position": 3})
    checkpoints._in_flight = 3
    with pytest.raises(CheckpointNotWritten, match=r"checkpoint 3 could not be written to .*/checkpoints \(No such "
                       r"file or directory\)"):
        checkpoints.wait_until_written()
    checkpoints._in_flight = 4
    with pytest.raises(ValueError, match="an orbax bug"):
        checkpoints.wait_until_written()


def test_the_checkpoint_the_watchdog_names_is_one_written_whole(tmp_path, monkeypatch):
    """Read from the directory only (never through orbax, whose barriers hang with a dead peer): a save in flight is
    named once it has landed, a temporary directory never, and a save that never lands is waited for a bounded time."""
    import jax.numpy as jnp

    from xlatrain.run.checkpoints import Checkpoints

    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    assert checkpoints.newest_written() is None

    def hangs():
        raise AssertionError("asked orbax")

    monkeypatch.setattr(checkpoints._manager, "is_saving_in_progress", hangs)
    checkpoints.save(1, {"w": jnp.ones(4)}, {"position": 1})
    checkpoints.wait_until_written()
    checkpoints.save(2, {"w": jnp.ones(4)}, {"position": 2})
    assert checkpoints.newest_written(wait_s=60) == 2  # waited for the save in flight
    checkpoints.wait_until_written()
    (checkpoints.directory / "3.orbax-checkpoint-tmp-1").mkdir()
    checkpoints._in_flight = 3  # a save that never lands (its write failed, or a peer died before its part)
    began = time.monotonic()
    assert checkpoints.newest_written(wait_s=0.3) == 2 and 0.3 <= time.monotonic() - began < 5
    checkpoints._in_flight = None
    checkpoints.close()


def test_orbax_logs_of_a_write_the_file_system_refused_are_dropped_and_others_kept(tmp_path, caplog):
    import logging

    from xlatrain.run.checkpoints import Checkpoints

    Checkpoints(tmp_path / "checkpoints", keep=1).close()  # installs the filter
    absl = logging.getLogger("absl")
    for failure in (FileNotFoundError(2, "No such file or directory"), ValueError("an orbax bug")):
        try:
            raise failure
        except Exception:
            absl.error("Save Finalize thread (save_finalize) failed.", exc_info=True)
    absl.error("an error without an exception")
    assert [(r.message, r.exc_info and type(r.exc_info[1])) for r in caplog.records if r.name == "absl"] == [
        ("Save Finalize thread (save_finalize) failed.", ValueError), ("an error without an exception", None)]


def test_the_error_that_stopped_a_run_is_reported_and_the_save_it_left_unwritten_is_said_too(tmp_path, monkeypatch,
                                                                                             capsys):
    from xlatrain.config import load_config
    from xlatrain.run.checkpoints import Checkpoints
    from xlatrain.trainer import train

    def refused(self):
        if self._in_flight is not None:
            raise self._not_written(self._in_flight, "No space left on device")

    def fail_at_step_3(boundary):
        if boundary.step == 3:
            raise RuntimeError("a hook failed")

    monkeypatch.setattr(Checkpoints, "wait_until_written", refused)
    with pytest.raises(RuntimeError, match="a hook failed"):
        train(load_config(None, _run(tmp_path / "run", 4)), hooks=[fail_at_step_3], echo=lambda _: None)
    assert "xlatrain: warning: checkpoint 2 could not be written" in capsys.readouterr().err


def test_a_log_line_the_file_system_refuses_stops_the_run_in_one_line(tmp_path, monkeypatch):
    from xlatrain.config import load_config
    from xlatrain.run import metrics
    from xlatrain.trainer import train

    monkeypatch.setattr(metrics, "open_for_append", lambda path: open("/dev/full", "a"))  # writes: ENOSPC
    with pytest.raises(metrics.LogNotWritten, match=r"/run/metrics.jsonl or its TensorBoard events could not "
                       r"be written at step 1 \(No space left on device\): make room or repair the directory, then run "
                       "the same command to resume from the newest checkpoint"):
        train(load_config(None, [*DIGITS_MLP, "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}"]),
              echo=lambda _: None)


def test_a_full_or_read_only_file_system_anywhere_is_one_line_naming_the_file(tmp_path):
    import errno

    from xlatrain.errors import UserError, file_system_refusals_named
    from xlatrain.run.atomic import replace_file

    def fill_the_disk(partial):
        partial.write_text("half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a failed write or flush raises it: no file name

    with pytest.raises(UserError, match=rf"^{tmp_path}/config.yaml could not be written \(No space left on device\): "
                       "make room or repair the file system, then run the same command again$"):
        with file_system_refusals_named(tmp_path):
            replace_file(tmp_path / "config.yaml", fill_the_disk)
    assert not list(tmp_path.iterdir())
    with pytest.raises(UserError, match=rf"^a file in {tmp_path} could not be written \(Read-only file system\)"):
        with file_system_refusals_named(tmp_path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    with pytest.raises(PermissionError):  # not the file system's state: the traceback stays
        with file_system_refusals_named(tmp_path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def test_a_checkpoint_of_other_shapes_is_refused_naming_them_and_is_not_moved_aside(tmp_path):
    """The model takes its input width from the data: a data.path that now holds wider inputs changes the
    shapes. Those checkpoints are sound, so none is called corrupt."""
    import numpy as np

    from xlatrain.config import load_config
    from xlatrain.errors import UserError
    from xlatrain.trainer import train

    def write_data(width):
        rng = np.random.default_rng(0)
        np.savez(tmp_path / "data.npz", inputs=rng.normal(size=(64, width)).astype(np.float32),
                 targets=rng.integers(0, 3, 64).astype(np.int32))

    run = ["model.name=mlp", "model.hidden=[8]", "data.source=arrays", f"data.path={tmp_path / 'data.npz'}",
           "batch.global_size=16", "trainer.progress=false", *STEPS, f"trainer.run_dir={tmp_path / 'run'}"]
    write_data(4)
    train(load_config(None, [*run, "trainer.steps=4"]), echo=lambda _: None)
    write_data(5)
    with pytest.raises(UserError, match=r"checkpoint 4 in .*/checkpoints holds params/hidden/0/kernel of shape "
                       r"\(4, 8\) where the run's state has \(5, 8\); opt_state/0/mu/hidden/0/kernel .*: the model's "
                       r"shapes changed since the run was written .* Nothing was moved aside"):
        train(load_config(None, [*run, "trainer.steps=6"]), echo=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4"]


def test_a_resume_on_data_other_than_its_checkpoint_was_trained_on_says_so(tmp_path, capsys):
    """Same shapes, other examples: the checkpoint restores, but the run cannot continue exactly. What counts is the
    data the resumed checkpoint was trained on, not what the start before it saw."""
    import numpy as np

    from xlatrain.config import load_config
    from xlatrain.trainer import train

    def resume_with(rows, shift=0.0, steps=2):
        rng = np.random.default_rng(0)
        inputs = rng.normal(size=(64, 4)).astype(np.float32) + shift
        np.savez(tmp_path / "data.npz", inputs=inputs[:rows], targets=rng.integers(0, 3, 64).astype(np.int32)[:rows])
        train(load_config(None, [*run, f"trainer.steps={steps}"]), echo=lambda _: None)
        return [line for line in capsys.readouterr().err.splitlines() if "the data is not what" in line]

    run = ["model.name=mlp", "model.hidden=[8]", "data.source=arrays", f"data.path={tmp_path / 'data.npz'}",
           "batch.global_size=8", "trainer.progress=false", *STEPS, f"trainer.run_dir={tmp_path / 'run'}"]
    assert resume_with(64) == []
    assert resume_with(64, steps=4) == []
    fewer, = resume_with(40, steps=4)  # nothing to train: checkpoint 4 stays the one trained on 64 rows
    assert "data.path=" in fewer and "58 training and 6 held-out examples then, 36 and 4 now" in fewer
    assert "checkpoint 4 was trained on" in fewer and "put back the data it was trained on" in fewer
    assert resume_with(64, steps=6) == []  # checkpoint 4's data again, though the start before saw other data
    again, = resume_with(40, steps=8)
    assert "goes on from step 6" in again
    assert resume_with(40, steps=10) == []  # checkpoint 8 was trained on these 40 rows
    edited, = resume_with(40, shift=1.0, steps=12)
    assert "as many examples, but sampled ones differ" in edited


def test_what_a_library_prints_after_a_failure_already_reported_is_dropped_and_nothing_else(monkeypatch):
    import threading

    from xlatrain import errors

    printed = []
    monkeypatch.setattr(errors, "_dropping", set())
    monkeypatch.setattr(sys, "unraisablehook", lambda args: printed.append(("unraisable", args.exc_value)))
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(("thread", args.exc_value)))
    follow_up = RuntimeError("Event loop is closed")
    errors.drop_follow_up_errors("library", lambda args: args.exc_value is follow_up, threads=True)
    errors.drop_follow_up_errors("library", lambda args: True, threads=True)  # once per name: ignored
    other = ValueError("a bug of its own")
    for hook in (sys.unraisablehook, threading.excepthook):
        hook(SimpleNamespace(exc_value=follow_up))
        hook(SimpleNamespace(exc_value=other))
    assert printed == [("unraisable", other), ("thread", other)]


@pytest.mark.parametrize("stopped_code, expected", [(0, 0), (None, 128 + signal.SIGTERM)])
def test_start_up_that_outlives_the_grace_period_exits_with_the_commands_line_and_status(monkeypatch, stopped_code,
                                                                                           expected):
    from xlatrain.runtime import signals as stop_module

    exits = []
    monkeypatch.setattr(stop_module, "_exit_now", lambda message, code: exits.append((message, code)))
    stop_module._exit_if_still_starting(StopSignals("what stopped", stopped_code), signal.SIGTERM)
    assert exits == [("SIGTERM: what stopped", expected)]

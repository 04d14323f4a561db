"""Data parallel vs one device, gradient accumulation, exact resume, signals, non-finite losses, compiles."""

import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import DIGITS_MLP, REPO, TINY_GPT

from xlatrain.config import load_config
from xlatrain.errors import NonFiniteLoss
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train


def losses(overrides, tmp_path, name, devices=None):
    config = load_config(None, [*overrides, f"trainer.run_dir={tmp_path / name}"])
    return train(config, devices=devices, echo=lambda _: None)


def trajectory(result):
    return np.array([result.losses[s] for s in sorted(result.losses)])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicated", "zero1", "fsdp"])
def test_eight_devices_match_one_device(strategy, devices, tmp_path):
    common = [*TINY_GPT, "trainer.steps=20", "batch.global_size=16"]
    single = losses([*common, "mesh.data=1"], tmp_path, "one", devices=devices[:1])
    sharded = losses([*common, f"parallel.strategy={strategy}"], tmp_path, "eight")
    assert len(trajectory(single)) == 20
    assert trajectory(single)[-1] < trajectory(single)[0] - 0.5
    np.testing.assert_allclose(trajectory(sharded), trajectory(single), rtol=2e-4)


def test_gradient_accumulation_equals_large_batch(tmp_path):
    common = [*DIGITS_MLP, "trainer.steps=8", "batch.global_size=64", "optimizer.schedule=constant"]
    large = losses(common, tmp_path, "large")
    accumulated = losses([*common, "batch.microbatches=4"], tmp_path, "accumulated")
    np.testing.assert_allclose(trajectory(accumulated), trajectory(large), rtol=1e-5)


def test_train_step_compiles_exactly_once(tmp_path):
    result = losses([*DIGITS_MLP, "trainer.steps=20", "trainer.eval_every=5"], tmp_path, "once")
    assert result.compile_log.count("train_step") == 1
    assert result.compile_log.count("eval_step") == 1


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    common = [*TINY_GPT, "optimizer.schedule=constant", "trainer.checkpoint_every=5", "data.prefetch=3"]
    straight = losses([*common, "trainer.steps=12"], tmp_path, "straight")
    first = losses([*common, "trainer.steps=7"], tmp_path, "resumed")
    second = losses([*common, "trainer.steps=12"], tmp_path, "resumed")
    assert first.final_step == 7 and second.start_step == 7
    resumed = {**first.losses, **second.losses}
    assert [resumed[s] for s in range(1, 13)] == [straight.losses[s] for s in range(1, 13)]
    logged = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, 13))


def test_finished_run_is_not_trained_again(tmp_path):
    common = [*DIGITS_MLP, "trainer.steps=3"]
    losses(common, tmp_path, "done")
    again = losses(common, tmp_path, "done")
    assert again.start_step == again.final_step == 3 and not again.losses


def test_a_run_that_died_before_its_first_checkpoint_logs_its_steps_once_when_started_again(tmp_path):
    def die_at_step_8(boundary):
        if boundary.step == 8:
            raise RuntimeError("killed")

    config = load_config(None, [*DIGITS_MLP, "trainer.steps=10", f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(RuntimeError, match="killed"):
        train(config, hooks=[die_at_step_8], echo=lambda _: None)
    logged = tmp_path / "run" / "metrics.jsonl"
    assert [r["step"] for r in read_metrics(logged) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert not list((tmp_path / "run" / "checkpoints").iterdir())
    train(config.model_copy(update={"trainer": config.trainer.model_copy(update={"steps": 3})}), echo=lambda _: None)
    assert [r["step"] for r in read_metrics(logged) if "loss" in r] == [1, 2, 3]


def _empty(run_dir):
    for path in run_dir.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.name != ".lock":
            path.unlink()


def _replace(run_dir):
    run_dir.rename(run_dir.with_name("moved"))
    run_dir.mkdir()


@pytest.mark.parametrize(("change", "said", "left"), [(shutil.rmtree, "was removed", None),
                                                      (_empty, "lost its config.yaml", [".lock"]),
                                                      (_replace, "was replaced by another directory", [])])
def test_a_run_directory_removed_or_replaced_while_training_stops_the_run_before_it_writes_there(
        tmp_path, change, said, left):
    from xlatrain.errors import UserError

    run_dir = tmp_path / "run"

    def change_at_step_3(boundary):  # once checkpoint 2, written in the background, is in place
        while boundary.step == 3 and not (run_dir / "checkpoints" / "2").is_dir():
            time.sleep(0.01)
        if boundary.step == 3:
            change(run_dir)

    config = load_config(None, [*DIGITS_MLP, "trainer.steps=6", "trainer.checkpoint_every=2",
                                f"trainer.run_dir={run_dir}"])
    with pytest.raises(UserError, match=rf"^trainer.run_dir='{run_dir}' {said} while the run trained; the run stops "
                       "without writing checkpoint 4: restore the directory to resume the run, or start it over$"):
        train(config, hooks=[change_at_step_3], echo=lambda _: None)
    assert (sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None) == left


def test_run_dir_of_another_config_is_refused(tmp_path):
    from xlatrain.errors import UserError

    losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "taken")
    before = {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in (tmp_path / "taken").iterdir()
              if path.is_file()}
    with pytest.raises(UserError, match=r"model.hidden differ"):
        losses([*DIGITS_MLP, "trainer.steps=2", "model.hidden=[16]"], tmp_path, "taken")
    assert {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in (tmp_path / "taken").iterdir()
            if path.is_file()} == before  # its lock file included: the refused start wrote nothing


def test_foreign_directory_is_never_overwritten(tmp_path):
    from xlatrain.errors import UserError

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an xlatrain run directory"):
        losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "mine")
    assert [path.name for path in (tmp_path / "mine").iterdir()] == ["notes.txt"]  # no lock written there either
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("content, said", [
    ("- a\n", "does not hold an xlatrain config (a mapping of keys)"),
    (b"\xff\xfe", "is not a UTF-8 text file"),
    ("name: x\nbogus: 1\n", "is not a valid xlatrain config (config: unknown key 'bogus'"),
    ("name: [x\n", "config.yaml:2:1: expected ',' or ']'"),
])
def test_a_run_directory_whose_config_yaml_is_unreadable_is_refused_in_one_clean_sentence(tmp_path, content, said):
    from xlatrain.errors import UserError

    (tmp_path / "run").mkdir()
    saved = tmp_path / "run" / "config.yaml"
    saved.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError) as refused:
        losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "run")
    message = str(refused.value)
    assert said in message and message.count(str(saved)) == 1, message
    assert message.count("move the run directory aside or choose another trainer.run_dir") == 1, message
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["config.yaml"]


def test_what_a_first_start_leaves_before_its_run_exists_is_started_again(tmp_path):
    """A first start stopped while it compiled leaves the lock and an empty checkpoints/ (launch also logs/)."""
    run_dir = tmp_path / "stopped"
    for directory in ("checkpoints", "logs"):
        (run_dir / directory).mkdir(parents=True)
    (run_dir / ".lock").touch()
    assert losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "stopped").final_step == 2


def test_a_start_refused_before_its_run_exists_removes_the_directories_it_made_and_only_those(tmp_path):
    """A config mistake found while the step is built (here the mesh) is found after the run directory is made and
    locked; the directories made for it go again. One that existed before stays, with the lock in it."""
    from xlatrain.errors import UserError

    mismatched = [*DIGITS_MLP, "trainer.steps=2", "mesh.data=4"]
    with pytest.raises(UserError, match="mesh.data=4 needs 4 devices but 8 cpu device"):
        losses(mismatched, tmp_path, "new/run")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    with pytest.raises(UserError, match="mesh.data=4 needs 4 devices"):
        losses(mismatched, tmp_path, "mine/run")
    assert list(tmp_path.iterdir()) == [tmp_path / "mine"] and not any((tmp_path / "mine").iterdir())
    with pytest.raises(UserError, match="mesh.data=4 needs 4 devices"):
        losses(mismatched, tmp_path, "mine")
    assert [path.name for path in (tmp_path / "mine").iterdir()] == [".lock"]
    assert losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "mine").final_step == 2


HOLD_RUN_DIR = """import sys, time
from pathlib import Path
from xlatrain.run.directory import exclusive_run_dir
with exclusive_run_dir(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_run_directory_in_use_is_refused_untouched_and_free_once_its_holder_is_killed(tmp_path):
    from xlatrain.errors import UserError

    run_dir = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_DIR, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UserError, match=rf"trainer.run_dir='{run_dir}' is in use by another run \(xlatrain "
                           rf"process {holder.pid} on .*\), which holds .lock; wait for it to end or stop it"):
            losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "held")
        assert [path.name for path in run_dir.iterdir()] == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    assert losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "held").final_step == 2


def test_a_file_system_without_locks_is_a_warning_and_a_lock_file_that_cannot_be_opened_an_error(
        tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from xlatrain.errors import UserError

    (tmp_path / "odd" / ".lock").mkdir(parents=True)
    with pytest.raises(UserError, match=r"odd/.lock cannot be opened to lock the run directory \(Is a directory\); "
                       "remove it or choose another trainer.run_dir"):
        losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "odd")

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert losses([*DIGITS_MLP, "trainer.steps=2"], tmp_path, "nfs").final_step == 2
    assert "nfs/.lock cannot be locked (No locks available): nothing stops a second run from training into " \
        in capsys.readouterr().err


def _nan_arrays(tmp_path):
    """Finite inputs (NaN ones are refused when the data opens) so large that the forward overflows."""
    inputs = np.full((64, 4), np.finfo(np.float32).max, np.float32)
    np.savez(tmp_path / "nan.npz", inputs=inputs, targets=np.zeros(64, np.int32))
    return ["model.name=mlp", "model.hidden=[8]", "data.source=arrays", f"data.path={tmp_path / 'nan.npz'}",
            "batch.global_size=16", "trainer.progress=false", "trainer.log_every=1"]


def test_nonfinite_loss_stops_naming_the_step_and_saves_no_broken_state(tmp_path):
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 1, before any update .* so the learning rate is "
                       "not the cause"):
        losses([*_nan_arrays(tmp_path), "trainer.steps=5", "trainer.checkpoint_every=1"], tmp_path, "nan")
    assert not [p for p in (tmp_path / "nan" / "checkpoints").iterdir() if p.name.isdigit()]


def test_nonfinite_loss_can_skip_updates(tmp_path, caplog):
    result = losses([*_nan_arrays(tmp_path), "trainer.steps=3", "trainer.on_nonfinite=skip"], tmp_path, "skip")
    assert result.final_step == 3
    records = read_metrics(tmp_path / "skip" / "metrics.jsonl")
    assert [r["skipped"] for r in records if "loss" in r] == [True, True, True]
    assert "NaN or Inf" not in caplog.text  # tensorboardX's warning of each: the run reports them itself


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_saves_a_checkpoint_and_resumes_exactly(signum, tmp_path):
    common = [*DIGITS_MLP, "optimizer.schedule=constant", "trainer.steps=100000", "trainer.checkpoint_every=100000"]
    run_dir = tmp_path / "signalled"
    process = subprocess.Popen([sys.executable, "-m", "xlatrain.cli", "train", *common,
                                f"trainer.run_dir={run_dir}"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and len(read_metrics(metrics)) < 3 and process.poll() is None:
        time.sleep(0.1)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "stopped by signal" in out
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    stopped_at = saved[-1]
    assert 3 <= stopped_at < 100000
    interrupted = {r["step"]: r["loss"] for r in read_metrics(metrics) if "loss" in r}
    assert max(interrupted) == stopped_at

    finish = [*common[:-2], f"trainer.steps={stopped_at + 3}", "trainer.checkpoint_every=100000"]
    resumed = losses(finish, tmp_path, "signalled")
    straight = losses(finish, tmp_path, "straight")
    combined = {**interrupted, **resumed.losses}
    assert [combined[s] for s in sorted(straight.losses)] == [straight.losses[s] for s in sorted(straight.losses)]

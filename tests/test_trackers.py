"""Experiment trackers (trainer.loggers), read back through each one's own library: Weights & Biases offline
(its run files), MLflow (its client, on the run's file store) and TensorBoard (its event reader). The same scalars
under train/, eval/ and perf/, the config as hyperparameters, a resume going on in the same tracker runs without
logging a step twice, and only process 0 logging."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import test_multiprocess as multiprocess_tests
from conftest import DIGITS_MLP

from xlatrain.commands.launch import free_port
from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.trainer import train

pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")
pytest.importorskip("tensorboard", reason="the tensorboard package (its event reader) is not installed")

TRACKED = [*DIGITS_MLP, "trainer.log_every=5", "trainer.eval_every=10", "trainer.checkpoint_every=10",
           "trainer.loggers=[tensorboard,wandb,mlflow]", "optimizer.schedule=constant"]
"""Without jsonl: metrics.jsonl is written all the same (the run's own record, which a resume reads to give no tracker a
step twice)."""


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B with no network, its settings and cache in the test's directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's own MlflowClient, which reads them


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (a LevelDB-style log of the protobuf records wandb defines)."""
    from wandb.proto import wandb_internal_pb2

    data, position, block, pending, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        elif kind == 0:
            break
    return records


def wandb_history(run_file: Path) -> tuple[str, dict[int, dict], dict]:
    """(run id, {step: scalars}, config) of one W&B run file."""
    run_id, history, config = None, {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = run_id or record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":  # a name with "/" is kept as its parts
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
    return run_id, history, config


def mlflow_history(run_dir: Path, metric: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    known = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(known["tracking_uri"])
    return sorted((m.step, m.value) for m in client.get_metric_history(known["run_id"], metric))


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))  # every session's file, as TensorBoard reads them
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_every_tracker_gets_the_same_scalars_and_the_config_and_a_resume_logs_no_step_twice(tmp_path, offline):
    run_dir = tmp_path / "run"
    common = [*TRACKED, f"trainer.run_dir={run_dir}"]
    first = train(load_config(None, [*common, "trainer.steps=15"]), echo=lambda _: None)
    # as if the run was killed after logging step 15 but before its checkpoint of step 15 was written
    shutil.rmtree(run_dir / "checkpoints" / "15")
    resumed = train(load_config(None, [*common, "trainer.steps=20"]), echo=lambda _: None)
    assert resumed.start_step == 10 and resumed.final_step == 20
    logged = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert sorted(logged) == [5, 10, 15, 20]
    assert logged[15]["loss"] == pytest.approx(first.losses[15], rel=1e-6)  # an exact resume: step 15 again

    # MLflow: one run, each step once, the config as its params
    assert mlflow_history(run_dir, "train/loss") == [(s, pytest.approx(logged[s]["loss"])) for s in (5, 10, 15, 20)]
    assert [s for s, _ in mlflow_history(run_dir, "eval/loss")] == [10, 15, 20]  # 15: the first session's end
    assert [s for s, _ in mlflow_history(run_dir, "perf/samples_per_sec")] == [5, 10, 15, 20]
    from mlflow.tracking import MlflowClient

    known = json.loads((run_dir / "trackers.json").read_text())
    run = MlflowClient(known["mlflow"]["tracking_uri"]).get_run(known["mlflow"]["run_id"])
    assert run.data.params["model.hidden"] == "[32]" and run.data.params["trainer.log_every"] == "5"

    # W&B: two sessions of one run id; the second does not log step 15 again
    sessions = [wandb_history(f) for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))]
    assert len(sessions) == 2 and {run_id for run_id, _, _ in sessions} == {known["wandb"]["id"]}
    (_, before, config), (_, after, _) = sessions
    assert sorted(before) == [5, 10, 15] and sorted(after) == [20]
    assert before[5]["train/loss"] == pytest.approx(logged[5]["loss"]) and "perf/samples_per_sec" in before[5]
    assert after[20]["eval/loss"] == pytest.approx(resumed.eval_losses[20])
    assert config["model.hidden"] == [32] and config["trainer.loggers"] == ["tensorboard", "wandb", "mlflow"]

    # TensorBoard: the same tags, the resumed steps written again over the dropped ones, the config as hparams
    expected = [(s, pytest.approx(logged[s]["loss"])) for s in (5, 10, 15, 20)]
    assert tensorboard_scalars(run_dir, "train/loss") == expected
    assert [s for s, _ in tensorboard_scalars(run_dir, "eval/accuracy")] == [10, 20]
    events = b"".join(p.read_bytes() for p in (run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert b"_hparams_/session_start_info" in events and b"model.hidden" in events


def test_an_mlflow_server_that_cannot_be_reached_is_one_line_within_seconds_and_leaves_no_run(tmp_path, offline):
    """It took 251 s of urllib3's retries and 8 lines, and left the run directory with its lock, config.yaml and an
    empty checkpoints/."""
    port = free_port()  # nothing listens on it
    config = load_config(None, [*DIGITS_MLP, "trainer.loggers=[mlflow]", f"trainer.mlflow.tracking_uri=http://127.0.0.1:"
                                f"{port}", f"trainer.run_dir={tmp_path / 'new' / 'run'}"])
    began = time.monotonic()
    with pytest.raises(UserError) as refused:
        train(config, echo=lambda _: None)
    assert time.monotonic() - began < 5 + 5  # one attempt of at most 5 s, and the start before it
    message = str(refused.value)
    assert message.startswith(f"trainer.mlflow.tracking_uri: MLflow could not start its run at http://127.0.0.1:{port}")
    assert "\n" not in message and not (tmp_path / "new").exists()
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # only the start is hurried


def test_a_tracker_whose_package_is_missing_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match=r"trainer.loggers: wandb needs the wandb package: pip install wandb"):
        load_config(None, ["trainer.loggers=[jsonl,wandb]"])
    with pytest.raises(UserError, match="names jsonl more than once"):
        load_config(None, ["trainer.loggers=[jsonl,jsonl]"])


@pytest.mark.slow
def test_only_process_0_of_two_logs_to_the_trackers(tmp_path, offline):
    run_dir = tmp_path / "two"
    multiprocess_tests.succeed(multiprocess_tests.start(
        run_dir, free_port(), ["trainer.steps=10", "trainer.loggers=[jsonl,wandb,mlflow]", "trainer.log_every=5"],
        devices=2))
    assert [s for s, _ in mlflow_history(run_dir, "train/loss")] == [5, 10]
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    assert len(list((run_dir / "mlruns").glob("*/*/meta.yaml"))) == 1  # one MLflow run
    assert os.environ["WANDB_MODE"] == "offline"

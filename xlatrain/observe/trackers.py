"""Experiment trackers a run logs to beside metrics.jsonl (trainer.loggers): Weights & Biases and MLflow, each
through its own client, on process 0 only. A run's tracker runs are named in RUN_DIR/trackers.json when they are
made, so that a resumed run goes on in the same ones; the resolved config is their hyperparameters.

MLflow 3 keeps runs in a SQLite store by default and refuses its file store unless MLFLOW_ALLOW_FILE_STORE=true.
Measured (bench.trackers): the SQLite store takes 1.1 s to open a run and 5.2 ms to log a step's 14 scalars, the
file store 0.035 s and 0.85 ms (and needs no sqlalchemy and alembic); with no tracking URI configured, a run's
MLflow store is a file store in its directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import string
import time
from pathlib import Path
from typing import Any, Iterator

from xlatrain.config import Config, MlflowConfig, WandbConfig, flatten
from xlatrain.errors import UserError, first_line
from xlatrain.run.atomic import replace_file
from xlatrain.run.metrics import Tracker

TRACKERS_FILE = "trackers.json"
"""RUN_DIR/trackers.json: {"wandb": {"id": ...}, "mlflow": {"tracking_uri": ..., "run_id": ...}}."""
MLFLOW_DIR = "mlruns"


def open_trackers(config: Config, run_dir: Path, hyperparameters: dict[str, Any]) -> list[Tracker]:
    """The trackers trainer.loggers names, each joined to the run it began (trackers.json) or a new one;
    `hyperparameters`: hyperparameters_of(config)."""
    known = _read_known(run_dir)
    trackers: list[Tracker] = []
    try:
        for name in config.trainer.loggers:
            if name == "wandb":
                trackers.append(WandbTracker(config.trainer.wandb, config.name, run_dir, known, hyperparameters))
            elif name == "mlflow":
                trackers.append(MlflowTracker(config.trainer.mlflow, config.name, run_dir, known, hyperparameters))
    except UserError:
        for opened in trackers:  # one that refused ends the start: those opened before it end with it
            opened.close()
        raise
    return trackers


def hyperparameters_of(config: Config) -> dict[str, Any]:
    """The resolved config as flat hyperparameters (model.layers: 4, ...)."""
    return flatten(config.model_dump(mode="json"))


class WandbTracker:
    def __init__(self, settings: WandbConfig, name: str, run_dir: Path, known: dict, hyperparameters: dict):
        import wandb

        run_id = known.get("wandb", {}).get("id") or new_run_id()
        try:
            self.run = wandb.init(project=settings.project, entity=settings.entity, name=name, id=run_id,
                                  resume="allow", dir=str(run_dir), config=hyperparameters, reinit="create_new",
                                  settings=wandb.Settings(console="off", silent=True))
        except Exception as err:  # wandb raises its own errors (no API key, no network, a refused project)
            raise UserError(f"trainer.loggers: wandb could not start its run ({type(err).__name__}: "
                            f"{first_line(err)}); log in (wandb login), or log offline with WANDB_MODE=offline, or "
                            "drop wandb from trainer.loggers") from None
        _remember(run_dir, known, "wandb", {"id": run_id, "project": settings.project})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, settings: MlflowConfig, name: str, run_dir: Path, known: dict, hyperparameters: dict):
        from mlflow.tracking import MlflowClient

        uri = (settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or (run_dir / MLFLOW_DIR).resolve().as_uri())
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's condition for its file store
        previous = known.get("mlflow", {})
        try:
            with _one_attempt():
                self.client = MlflowClient(tracking_uri=uri)
                if previous.get("tracking_uri") == uri and previous.get("run_id"):
                    self.run_id = previous["run_id"]
                    self.client.update_run(self.run_id, status="RUNNING")
                else:
                    experiment_name = settings.experiment or name
                    experiment = self.client.get_experiment_by_name(experiment_name)
                    experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                        experiment_name)
                    self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
                    self._log_params(hyperparameters)
        except Exception as err:  # MLflow raises its own errors (a store it cannot reach, a bad URI)
            raise UserError(f"trainer.mlflow.tracking_uri: MLflow could not start its run at {uri} "
                            f"({type(err).__name__}: {first_line(err)[:200]}); start the server or set "
                            "trainer.mlflow.tracking_uri to one that answers, or drop mlflow from trainer.loggers"
                            ) from None
        _remember(run_dir, known, "mlflow", {"tracking_uri": uri, "run_id": self.run_id})

    def _log_params(self, hyperparameters: dict) -> None:
        from mlflow.entities import Param

        params = [Param(key, json.dumps(value) if not isinstance(value, str) else value)
                  for key, value in hyperparameters.items()]
        for begin in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[begin:begin + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


MLFLOW_FIRST_CONTACT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
"""How a run's start talks to an MLflow server: one attempt, 5 s (MLflow's own defaults, 7 retries with backoff and
120 s each, spend minutes on a server that is not there before the run could say so); its logging later keeps
MLflow's defaults, or the user's settings of these variables."""


@contextlib.contextmanager
def _one_attempt() -> Iterator[None]:
    before = {name: os.environ.get(name) for name in MLFLOW_FIRST_CONTACT}
    os.environ.update(MLFLOW_FIRST_CONTACT)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def new_run_id() -> str:
    """A W&B run id as wandb makes them: 8 lower-case letters and digits."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _read_known(run_dir: Path) -> dict:
    path = run_dir / TRACKERS_FILE
    if not path.is_file():
        return {}
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not the JSON xlatrain wrote ({first_line(err)}); remove it to start new tracker "
                        "runs for this run") from None
    return known if isinstance(known, dict) else {}


def _remember(run_dir: Path, known: dict, tracker: str, entry: dict) -> None:
    """Name the tracker's run in trackers.json (written whole, or not at all)."""
    if known.get(tracker) == entry:
        return
    known[tracker] = entry
    text = json.dumps(known, indent=2)
    replace_file(run_dir / TRACKERS_FILE, lambda partial: partial.write_text(text, encoding="utf-8"))

"""What each experiment tracker of trainer.loggers costs the training loop: the seconds to open it (a run made,
the config given as hyperparameters) and to log 200 records of the default GPT's scalars, against metrics.jsonl +
TensorBoard (the default) in the same run; and MLflow's two local stores, the file store xlatrain uses when no
tracking URI is set against the SQLite store MLflow 3 prefers (which needs sqlalchemy and alembic: where they are
not installed, that row says so). W&B logs offline (WANDB_MODE=offline).

    python3 -m bench.trackers    # writes bench/results/trackers.json
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import write_results
from xlatrain.config import load_config
from xlatrain.observe.trackers import MlflowTracker, WandbTracker, hyperparameters_of
from xlatrain.run.metrics import MetricsWriter, tracker_scalars

RECORDS = 200
ROUNDS = 3
RECORD = {"loss": 2.5, "accuracy": 0.4, "grad_norm": 1.2, "param_norm": 80.0, "lr": 3e-3, "skipped": False,
          "samples_per_sec": 250.0, "tokens_per_sec": 16000.0, "tflops_per_sec_per_device": 0.08, "mfu": 0.4}


def timed(open_it, log) -> tuple[float, float]:
    """(seconds to open, seconds per record logged), the medians of ROUNDS, each in a fresh directory."""
    opens, per_record = [], []
    for _ in range(ROUNDS):
        with tempfile.TemporaryDirectory() as scratch:
            began = time.perf_counter()
            sink = open_it(Path(scratch))
            opened = time.perf_counter()
            for step in range(1, RECORDS + 1):
                log(sink, step)
            sink.close()
            opens.append(opened - began)
            per_record.append((time.perf_counter() - opened) / RECORDS)
    return statistics.median(opens), statistics.median(per_record)


def main() -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    config = load_config(None)
    hyperparameters = hyperparameters_of(config)
    scalars = tracker_scalars(RECORD)
    candidates = {
        "jsonl + tensorboard (the default)": (
            lambda d: MetricsWriter(d, 0, ("jsonl", "tensorboard"), hyperparameters),
            lambda sink, step: sink.write({"step": step, **RECORD})),
        "wandb, offline": (lambda d: WandbTracker(config.trainer.wandb, "bench", d, {}, hyperparameters),
                           lambda sink, step: sink.log(step, scalars)),
        "mlflow, file store (xlatrain's with no tracking URI)": (
            lambda d: MlflowTracker(config.trainer.mlflow, "bench", d, {}, hyperparameters),
            lambda sink, step: sink.log(step, scalars)),
    }
    if importlib.util.find_spec("sqlalchemy") and importlib.util.find_spec("alembic"):
        candidates["mlflow, SQLite store (MLflow 3's default)"] = (
            lambda d: MlflowTracker(config.trainer.mlflow.model_copy(update={"tracking_uri": f"sqlite:///{d}/m.db"}),
                                    "bench", d, {}, hyperparameters),
            lambda sink, step: sink.log(step, scalars))
    results = {}
    for name, (open_it, log) in candidates.items():
        opened, per_record = timed(open_it, log)
        results[name] = {"open_seconds": round(opened, 4), "ms_per_record": round(1e3 * per_record, 4)}
        print(f"{name:55s} open {opened:6.3f} s, {1e3 * per_record:7.3f} ms per record")
    if not any("SQLite" in name for name in results):
        print("mlflow, SQLite store: not measured (sqlalchemy and alembic are not installed)")
    path = write_results("trackers", "python3 -m bench.trackers",
                         {"records": RECORDS, "scalars_per_record": len(scalars), "rounds": ROUNDS,
                          "trackers": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Side-by-side runs: train two configs for N steps and find the first step where they diverge.

The source documents' advice for convergence problems ("run with and without the compiler, same
hyperparameters") as a tool: fp32 vs another precision, 1 vs 8 devices, replicated vs FSDP, ...
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax

from xlatrain.config import Config
from xlatrain.observe.plot import plot_runs
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train

COMPARED = ("loss", "param_norm")


@dataclass(frozen=True)
class Divergence:
    step: int
    metric: str
    a: float
    b: float

    @property
    def relative(self) -> float:
        return abs(self.a - self.b) / max(abs(self.a), abs(self.b), 1e-12)


@dataclass(frozen=True)
class ParityReport:
    steps: int
    rtol: float
    first: Divergence | None
    largest: Divergence | None

    def summary(self) -> str:
        if self.first is None:
            worst = f"; largest relative difference {self.largest.relative:.2e} ({self.largest.metric} at step " \
                    f"{self.largest.step})" if self.largest else ""
            return f"parity: no divergence over {self.steps} steps (rtol {self.rtol:g}){worst}"
        d = self.first
        return (f"parity: first divergence at step {d.step}: {d.metric} A={d.a:.6g} B={d.b:.6g} "
                f"(relative difference {d.relative:.2e} > rtol {self.rtol:g})")


def parity_config(config: Config, steps: int, run_dir: Path) -> Config:
    """The config as parity runs it: N steps, every step logged to metrics.jsonl only (no tracker runs), in a
    scratch run directory."""
    trainer = config.trainer.model_copy(update={"steps": steps, "log_every": 1, "progress": False,
                                                "run_dir": str(run_dir), "checkpoint_every": steps,
                                                "eval_every": steps, "loggers": ("jsonl",)})
    return config.model_copy(update={"trainer": trainer})


def run_parity(config_a: Config, config_b: Config, steps: int, rtol: float, plot: Path | None = None) -> ParityReport:
    """`plot`: also draw both sides' curves (`xlatrain plot`) into this PNG."""
    with tempfile.TemporaryDirectory(prefix="xlatrain-parity-") as scratch:
        sides = [Path(scratch) / name for name in ("A", "B")]
        records = [trajectory(parity_config(c, steps, side)) for c, side in zip((config_a, config_b), sides,
                                                                                  strict=True)]
        if plot is not None:
            plot_runs(sides, plot)
    return compare(records[0], records[1], steps, rtol)


def compare(a: dict[int, dict], b: dict[int, dict], steps: int, rtol: float) -> ParityReport:
    first, largest = None, None
    for step in range(1, steps + 1):
        for metric in COMPARED:
            d = Divergence(step, metric, a[step][metric], b[step][metric])
            if largest is None or d.relative > largest.relative:
                largest = d
            if first is None and not d.relative <= rtol:
                first = d
    return ParityReport(steps, rtol, first, largest)


def side_devices(config: Config) -> list:
    """A side whose mesh (mesh.data x mesh.stage) needs fewer devices than are present uses the first ones."""
    devices = jax.devices()
    return devices if config.mesh.data == -1 else devices[: config.mesh.data * config.mesh.stage]


class SideStopped(Exception):
    """A stop signal ended a side before its last step: there is nothing to compare."""


def trajectory(config: Config) -> dict[int, dict]:
    """Per-step metrics of one side."""
    if train(config, devices=side_devices(config), echo=lambda _: None).interrupted:
        raise SideStopped(f"a stop signal ended the side in {config.run_dir()} before step {config.trainer.steps}")
    return {r["step"]: r for r in read_metrics(config.run_dir() / "metrics.jsonl") if "loss" in r}

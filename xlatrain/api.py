"""xlatrain from Python: `Trainer(config, callbacks=[...]).fit()` (or `xlatrain.train(config)`), in a script or a
notebook. The `xlatrain` command is the same loop (xlatrain/trainer.py) behind the command line; what differs is who
owns the process: the command exits on a second signal, a Trainer never ends the process it runs in.

    import xlatrain
    result = xlatrain.Trainer("examples/configs/digits_mlp.yaml", ["trainer.steps=100"],
                              callbacks=[xlatrain.EarlyStopping(patience=2)]).fit()
    result.metrics["loss"], result.eval_metrics, result.run_dir
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from xlatrain.callbacks import Callback
from xlatrain.config import Config, load_config
from xlatrain.errors import UserError
from xlatrain.program import apply_cpu_devices
from xlatrain.runtime.signals import (
    STOPPED_BEFORE_FIRST_STEP,
    SignalHandling,
    StoppedBeforeFirstStep,
    stop_signals,
)
from xlatrain.trainer import TrainResult
from xlatrain.trainer import train as train_loop


class Trainer:
    """A run from a config: a Config, a mapping of its keys, a YAML file, or None (the built-in default), then
    `overrides` (`key=value` strings, as on the command line).

    `signals`: what SIGTERM and SIGINT (Ctrl-C, a notebook's interrupt) do while it trains. "raise" (the
    default): the first stops the run at the next step boundary with a checkpoint, and fit() returns; one during
    start-up, or a second, raises KeyboardInterrupt; nothing ends the process. "exit": as the `xlatrain` command
    (a second signal ends the process at once). "none": xlatrain installs no handlers. `devices`: the JAX devices
    to train on (default: every device; on CPU, as many as the config's mesh asks for, when JAX has not started
    yet). `echo`: where the run's lines go (print; None: nowhere)."""

    def __init__(self, config: Config | dict | str | Path | None = None, overrides: Sequence[str] = (), *,
                 callbacks: Callback | Sequence[Callback] = (), signals: SignalHandling = "raise",
                 devices: list | None = None, echo: Callable[[str], None] | None = print):
        if isinstance(config, Config) and overrides:
            config = config.model_dump(mode="json")  # loaded again with the overrides, as a mapping
        self.config = config if isinstance(config, Config) else load_config(config, overrides)
        self.callbacks = callbacks_given(callbacks)
        self.signals = signals
        self.devices = devices
        self.echo = echo or (lambda _: None)

    def fit(self) -> TrainResult:
        """Train (or resume: a run directory that holds this config's run continues from its newest checkpoint)
        to trainer.steps, or until a signal or a callback stops it. The result has the run directory, the last
        step's metrics and the last evaluation's, every step's loss, and what stopped it (`stopped_by`). A mistake
        in the config, data or devices raises xlatrain.errors.UserError, whose message is one line naming it."""
        apply_cpu_devices(self.config)
        with stop_signals(handling=self.signals):
            try:
                return train_loop(self.config, devices=self.devices, echo=self.echo, callbacks=self.callbacks)
            except StoppedBeforeFirstStep as stop:
                raise KeyboardInterrupt(f"{stop}: {STOPPED_BEFORE_FIRST_STEP}") from None


def callbacks_given(callbacks: object) -> list[Callback]:
    """`callbacks` as a list: one Callback, or a list or tuple of them; anything else is refused here, before the
    run starts, rather than at the first event the loop would give it."""
    if isinstance(callbacks, Callback):
        return [callbacks]
    if not isinstance(callbacks, (list, tuple)):
        raise UserError(f"Trainer(callbacks=...) takes a Callback or a list of them, not {type(callbacks).__name__}")
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            shown = callback.__name__ if isinstance(callback, type) else type(callback).__name__
            hint = " (a class: pass an instance of it)" if isinstance(callback, type) else ""
            raise UserError(f"Trainer(callbacks=...)[{index}] is {shown}{hint}, not a Callback: subclass "
                            "xlatrain.Callback and define the events it needs (on_step, on_eval, on_checkpoint, "
                            "on_end)")
    return list(callbacks)


def train(config: Config | dict | str | Path | None = None, overrides: Sequence[str] = (), **options) -> TrainResult:
    """`Trainer(config, overrides, **options).fit()`."""
    return Trainer(config, overrides, **options).fit()

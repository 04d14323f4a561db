"""xlatrain: config-driven JAX/XLA training; the whole step compiled into one XLA program. The map of the code is
docs/design.md; the command line is xlatrain.cli; from Python, `xlatrain.Trainer(config).fit()` (xlatrain/api.py).

The names below are imported when first used, so that `import xlatrain` stays as quick as it was (no JAX)."""

from importlib import import_module

_EXPORTS = {"Trainer": "xlatrain.api", "train": "xlatrain.api", "load_config": "xlatrain.config",
            "Callback": "xlatrain.callbacks", "EarlyStopping": "xlatrain.callbacks",
            "TrainResult": "xlatrain.trainer", "UserError": "xlatrain.errors"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xlatrain' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)

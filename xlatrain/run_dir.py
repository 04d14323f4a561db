"""The run directory: the resolved config is saved there, and a second run into it must be a resume."""

from __future__ import annotations

from pathlib import Path

import yaml

from xlatrain import compat
from xlatrain.config import Config, Derived, config_to_yaml, validate_config
from xlatrain.distributed import is_primary
from xlatrain.errors import UserError, first_line

CONFIG_FILE = "config.yaml"
RESUMABLE_SECTIONS = ("trainer", "derived", "distributed")
"""Sections that may differ between a run and its resumption (more steps, other devices or processes)."""


def prepare_run_dir(config: Config, derived: Derived) -> Path:
    """Check that an existing run directory belongs to this config, then (process 0) save the config."""
    run_dir = config.run_dir()
    saved_path = run_dir / CONFIG_FILE
    if run_dir.exists() and any(run_dir.iterdir()):
        if not saved_path.is_file():
            raise UserError(f"trainer.run_dir={str(run_dir)!r} exists and is not an xlatrain run directory "
                            f"(no {CONFIG_FILE}); choose another trainer.run_dir so nothing there is overwritten")
        _check_same_run(config, saved_path)
    compat.barrier("xlatrain-run-dir-checked")
    if is_primary():
        run_dir.mkdir(parents=True, exist_ok=True)
        text = config_to_yaml(config) + yaml.safe_dump({"derived": derived.as_dict()}, sort_keys=False)
        partial = saved_path.with_suffix(".yaml.partial")
        partial.write_text(text)
        partial.replace(saved_path)
    compat.barrier("xlatrain-run-dir-ready")
    return run_dir


def _check_same_run(config: Config, saved_path: Path) -> None:
    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    current = _flatten(config.model_dump(mode="json"))
    changed = sorted(key for key in set(saved) | set(current)
                     if saved.get(key) != current.get(key) and key.split(".")[0] not in RESUMABLE_SECTIONS)
    if changed:
        raise UserError(f"trainer.run_dir={str(saved_path.parent)!r} holds a run with a different config "
                        f"({', '.join(changed)} differ); resume it with the same settings or choose a new "
                        "trainer.run_dir")


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_run_config(run_dir: Path) -> Config:
    """The config a run directory was created with (its saved `config.yaml`)."""
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        raise UserError(f"{str(run_dir)!r} is not an xlatrain run directory (no {CONFIG_FILE})")
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(f"{saved_path} is not valid YAML ({first_line(err)})") from None
    if not isinstance(saved, dict):
        raise UserError(f"{saved_path} does not hold an xlatrain config (a mapping of keys)")
    saved.pop("derived", None)
    return validate_config(saved)

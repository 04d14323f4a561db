"""The README stays true: every config key is documented, and its commands are the ones CI runs."""

import typing

from conftest import REPO
from pydantic import BaseModel

from xlatrain.config import Config

README = (REPO / "README.md").read_text()


def config_keys(cls: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in cls.model_fields.items():
        options = typing.get_args(field.annotation) or (field.annotation,)
        models = [c for c in options if isinstance(c, type) and issubclass(c, BaseModel)]
        if models:
            for model in models:
                keys |= config_keys(model, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_every_config_key_is_in_the_reference():
    keys = config_keys(Config)
    assert "model.layers" in keys and "optimizer.nesterov" in keys and "data.glob" in keys
    missing = sorted(k for k in keys if f"`{k}`" not in README and f"`{k}`," not in README)
    assert not missing, f"README config reference lacks {missing}"


def test_ci_runs_the_readme_test_command():
    test_command = ("python3 -m pip install torch==2.13.0 && python3 -m pip install -e '.[test,torch]' && "
                    "python3 -m pytest")
    assert test_command in README
    assert test_command in (REPO / ".ci/run").read_text()

"""`model.target`: "package.module:Name" of the user's model, imported with errors that name it."""

from __future__ import annotations

import importlib
from typing import Any

from xlatrain.errors import UserError, first_line


def import_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        found = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"config: model.target={target!r}: cannot import {module_name!r} ({err}); "
                        "make sure the package is installed or on PYTHONPATH") from None
    except Exception as err:  # the user's module raised (or has a syntax error) while being imported
        raise UserError(f"config: model.target={target!r}: importing {module_name!r} raised "
                        f"{type(err).__name__}: {first_line(err)}") from None
    for part in attr.split("."):
        if not hasattr(found, part):
            raise UserError(f"config: model.target={target!r}: {module_name!r} has no {attr!r}")
        found = getattr(found, part)
    return found

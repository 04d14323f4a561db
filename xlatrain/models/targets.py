"""`model.target`: "package.module:Name" of the user's model, imported with errors that name it."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

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


def check_kwargs(target: str, kwargs: dict[str, Any], constructor: Callable, skip_self: bool,
                 supplied: tuple[str, ...] = ()) -> None:
    """model.kwargs against the constructor's signature: an unknown or missing argument is one error that lists
    the accepted ones. `supplied`: arguments xlatrain passes itself (e.g. rngs)."""
    try:
        signature = inspect.signature(constructor)
    except (TypeError, ValueError):
        return
    parameters = list(signature.parameters.values())[1 if skip_self else 0:]
    accepted = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and p.name not in supplied]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters)
    unknown = [k for k in kwargs if (k not in accepted and not takes_any) or k in supplied]
    if unknown:
        raise UserError(f"config: model.kwargs.{unknown[0]} is not an argument of {target!r}; it accepts "
                        f"{', '.join(accepted) or 'no arguments'}")
    missing = [p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
               p.KEYWORD_ONLY) and p.name not in kwargs and p.name not in supplied]
    if missing:
        raise UserError(f"config: {target!r} needs model.kwargs.{missing[0]} (required arguments: "
                        f"{', '.join(missing)})")

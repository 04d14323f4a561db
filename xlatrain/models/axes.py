"""Logical axis names on parameters: models declare them, config rules map them to mesh axes."""

from typing import Any

from flax import nnx

LOGICAL_AXES = "logical_axes"


def axes(*names: str | None) -> dict[str, Any]:
    """Variable metadata naming each dimension of a parameter, e.g. `kernel_metadata=axes("embed", "mlp")`."""
    return {LOGICAL_AXES: tuple(names)}


def logical_axes_of(variable: nnx.Variable) -> tuple[str | None, ...]:
    """A parameter's logical names, padded on the left with None for stacked (scanned) leading axes."""
    names = tuple(variable.get_metadata().get(LOGICAL_AXES, ()))
    ndim = len(variable.shape) if hasattr(variable, "shape") else variable.value.ndim
    return (None,) * (ndim - len(names)) + names[-ndim:] if ndim else ()

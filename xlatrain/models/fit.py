"""Does the model's output fit the loss and the targets? Checked from abstract shapes, before compiling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError, first_line
from xlatrain.models.interface import ModelDef, documents_of, outputs_and_reports
from xlatrain.precision import Policy, cast_floats

DOCUMENTS_CONTRACT = ("a flax model's __call__ (a BlockStack's before_blocks and blocks) takes a keyword `documents`, "
                      "a torch module's forward a keyword `segment_ids` (and `positions`) (docs/models.md)")

_ROWS = 2
"""Rows of the abstract batch: more than one, so an output that would broadcast ([1, C]) is caught."""


def check_model_outputs(model: ModelDef, spec: DataSpec, loss: str, policy: Policy, name: str) -> None:
    """`name` says which model (e.g. "model.target='pkg.mod:Net'") in the error."""
    if spec.documents and not model.takes_documents:
        raise UserError(f"model: {name} cannot keep attention inside the documents of data.packing=true: "
                        f"{DOCUMENTS_CONTRACT}; or set data.packing=false")
    params, model_state = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    inputs = jax.ShapeDtypeStruct((_ROWS, *spec.input_shape), spec.input_dtype)
    documents = documents_of(spec.abstract_batch((_ROWS,)))
    for key in (jax.ShapeDtypeStruct((2,), jnp.uint32), None):
        try:
            outputs = jax.eval_shape(
                lambda p, s, x, k, d: model.run(cast_floats(p, policy.compute), s, cast_floats(x, policy.compute), k,
                                                d), params, model_state, inputs, key, documents)[0]
            outputs = outputs_and_reports(outputs)[0]
        except UserError:
            raise
        except Exception as err:
            raise UserError(f"model: {name} failed on a batch of inputs {list(inputs.shape)} {inputs.dtype} "
                            f"({'training' if key is not None else 'evaluation'}): {type(err).__name__}: "
                            f"{first_line(err)}") from None
        problem = output_problem(tuple(outputs.shape), np.dtype(outputs.dtype), spec, loss)
        if problem:
            raise UserError(f"model: {name} returns {list(outputs.shape)} {np.dtype(outputs.dtype)} for inputs "
                            f"{list(inputs.shape)}, but {problem}")


def output_problem(shape: tuple[int, ...], dtype: np.dtype, spec: DataSpec, loss: str) -> str | None:
    """Why outputs of `shape` and `dtype` (for a batch of _ROWS examples) do not fit, or None."""
    targets = (_ROWS, *spec.target_shape)
    if not jnp.issubdtype(dtype, jnp.floating):
        return f"model.loss={loss} needs floating-point outputs"
    if loss == "mse":
        if shape[:1] != targets[:1] or math.prod(shape[1:]) != math.prod(targets[1:]):
            return f"model.loss=mse needs outputs shaped like the targets {list(targets)}"
        return None
    if shape[:-1] != targets:
        return (f"model.loss=cross_entropy needs logits shaped [*targets, classes] = {[*targets, 'classes']} "
                f"(targets {list(targets)})")
    if shape[-1] < spec.num_outputs:
        return (f"{spec.origin} has labels up to {spec.num_outputs - 1} ({spec.num_outputs} classes), more than its "
                f"{shape[-1]} outputs")
    return None

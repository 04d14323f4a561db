"""Reading and rewriting traced programs (jaxprs): which inputs an output reads, dead-code elimination,
exact roundings dropped, and evaluating a jaxpr or one equation in the current trace."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def used_inputs(fn: Callable, *args: Any) -> list[bool]:
    """Per flattened input of fn(*args): whether the traced program reads it (jaxpr variables)."""
    closed = jax.make_jaxpr(fn)(*args)
    read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
    read |= {id(v) for v in closed.jaxpr.outvars}
    return [id(v) in read for v in closed.jaxpr.invars]


def outputs_reading(fn: Callable, args: tuple,
                    watched: tuple[int, ...]) -> list[tuple[bool | None, jax.ShapeDtypeStruct]]:
    """Per flattened output of fn(*args), with its shape and dtype: None when it is one of the inputs itself,
    else whether computing it reads any input of the args at positions `watched` (jax's dead-code elimination of
    the traced program, which follows values through loops and branches)."""
    from jax._src.interpreters import partial_eval as pe

    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    ends = np.cumsum([len(jax.tree.leaves(a)) for a in args])
    watched_vars = {i for position in watched for i in range(ends[position] - len(jax.tree.leaves(args[position])),
                                                              ends[position])}
    inputs = {id(v) for v in jaxpr.invars}
    result: list[tuple[bool | None, jax.ShapeDtypeStruct]] = []
    for index, (out, aval) in enumerate(zip(jaxpr.outvars, closed.out_avals, strict=True)):
        shape = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        if id(out) in inputs:
            result.append((None, shape))
            continue
        _, used = pe.dce_jaxpr(jaxpr, [i == index for i in range(len(jaxpr.outvars))])
        result.append((any(used[i] for i in watched_vars), shape))
    return result


def without_dead_code(jaxpr: Any) -> Any:
    """The jaxpr without the equations none of its outputs needs (jax's dead-code elimination, which follows
    values into loops and calls), as XLA's compilation drops them."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def without_exact_roundings(closed_jaxpr: Any) -> Any:
    """The closed jaxpr less its top-level `reduce_precision` equations that round a float32 or float64 value to
    its own precision. jax's remat puts one on each residual it saves that the forward uses too, against excess
    precision (a bfloat16 value kept in float32 inside an XLA fusion); a float32 or float64 value has none, so
    each is the identity, yet XLA:CPU compiles it into a copy of the residual."""
    from jax._src.core import Var
    from jax._src.lax.lax import reduce_precision_p

    def exact(eqn) -> bool:
        if eqn.primitive is not reduce_precision_p:
            return False
        dtype = eqn.invars[0].aval.dtype
        return dtype in (jnp.float32, jnp.float64) and (eqn.params["exponent_bits"], eqn.params["mantissa_bits"]
                                                        ) == (jnp.finfo(dtype).nexp, jnp.finfo(dtype).nmant)

    renamed: dict = {}

    def source(var):
        return renamed.get(var, var) if isinstance(var, Var) else var

    eqns = []
    for eqn in closed_jaxpr.jaxpr.eqns:
        if exact(eqn):
            renamed[eqn.outvars[0]] = source(eqn.invars[0])
        else:
            eqns.append(eqn.replace(invars=[source(v) for v in eqn.invars]))
    jaxpr = closed_jaxpr.jaxpr.replace(eqns=eqns, outvars=[source(v) for v in closed_jaxpr.jaxpr.outvars])
    return type(closed_jaxpr)(jaxpr, closed_jaxpr.consts)


def evaluate(closed_jaxpr: Any, inputs: list[Any]) -> list[Any]:
    """The outputs of a closed jaxpr (from jax.make_jaxpr) on `inputs`, its equations bound into the current
    trace with their name stacks."""
    from jax.extend.core import jaxpr_as_fun

    return list(jaxpr_as_fun(closed_jaxpr)(*inputs))


def bind_equation(eqn: Any, inputs: list[Any]) -> list[Any]:
    """Run one equation of a jaxpr on `inputs` (values or tracers, one per eqn.invars, literals included), as
    jax's own interpreter (`jax.core.eval_jaxpr`) does, keeping the equation's name stack."""
    from jax._src import source_info_util

    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        outputs = eqn.primitive.bind(*inputs, **params)
    return list(outputs) if eqn.primitive.multiple_results else [outputs]

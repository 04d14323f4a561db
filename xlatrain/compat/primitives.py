"""New primitives and FFI targets (jax.extend and jax.interpreters are not stable API): the custom-call
collectives' and the dense layer's."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax


def manual_axes() -> tuple[tuple[str, int], ...]:
    """(name, size) of the mesh axes the current shard_map/pmap body is manual over, in mesh order."""
    from jax.sharding import AxisType

    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
        return ()
    return tuple((name, size) for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types,
                                                         strict=True) if kind == AxisType.Manual)


def define_linear_primitive(name: str, *, abstract_eval: Callable, batch: Callable, transpose: Callable,
                            differentiable: Callable[..., bool], lowerings: dict[str, Callable]) -> Any:
    """A primitive `prim.bind(x, *static_operands, **params)` that is linear in `x` (its other operands are
    integer metadata). `transpose(ct, *static_operands, **params)` returns the cotangent of x;
    `differentiable(**params)` is False for the nonlinear variants (max, min), whose derivative is an
    error. `batch(x, bdim, *static_operands, **params) -> (out, out_bdim)` handles an unnamed vmap axis on x.
    `lowerings` maps a platform to an MLIR lowering rule."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive(name)
    prim.def_impl(lambda *args, **params: jax.jit(partial(prim.bind, **params))(*args))
    prim.def_abstract_eval(abstract_eval)

    def batch_rule(args, dims, **params):
        x, *static = args
        if any(d is not None for d in dims[1:]):  # None: not mapped
            raise NotImplementedError(f"{name}: vmap over the collective's own axis is not supported; run it "
                                      "inside jax.shard_map (or pmap) over that axis instead")
        return batch(x, dims[0], *static, **params)

    batching.primitive_batchers[prim] = batch_rule

    def jvp(primals, tangents, **params):
        x, *static = primals
        out = prim.bind(x, *static, **params)
        if type(tangents[0]) is ad.Zero:
            return out, ad.Zero.from_primal_value(out)
        if not differentiable(**params):
            raise NotImplementedError(f"{name} with {params} is not differentiable")
        return out, prim.bind(ad.instantiate_zeros(tangents[0]), *static, **params)

    def transpose_rule(ct, x, *static, **params):
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval), *(None for _ in static)]
        return [transpose(ct, *static, **params), *(None for _ in static)]

    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose_rule
    for platform, rule in lowerings.items():
        # Not cacheable: each lowered instance must get its own call-site id (see custom_calls/backend.py).
        mlir.register_lowering(prim, rule, platform=platform, cacheable=False)
    return prim


def define_primitive(name: str, *, compute: Callable, jvp: Callable, transpose: Callable, batch: Callable) -> Any:
    """A primitive `prim.bind(*operands, **params)` computed as the jax function `compute(*operands, **params)`
    (its implementation, shape and lowering on every platform), differentiated and batched by its own rules:
    `jvp(primals, tangents, **params)` gives the output's tangent (a zero tangent is None);
    `transpose(ct, *operands, **params)` gives each operand's cotangent, for the operands that are
    `jax.interpreters.ad.UndefinedPrimal` (being transposed), None for the others; and
    `batch(operands, dims, **params) -> (out, out_dim)` (an operand not mapped has dim None)."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive(name)
    prim.def_impl(compute)  # eagerly, op by op, as any jax function

    def abstract_eval(*avals, **params):
        out = jax.eval_shape(partial(compute, **params), *avals)
        return jax.core.ShapedArray(out.shape, out.dtype)

    def jvp_rule(primals, tangents, **params):
        tangents = [None if type(t) is ad.Zero else t for t in tangents]
        return prim.bind(*primals, **params), jvp(primals, tangents, **params)

    def transpose_rule(ct, *operands, **params):
        if type(ct) is ad.Zero:
            return [ad.Zero(o.aval) if ad.is_undefined_primal(o) else None for o in operands]
        return transpose(ct, *operands, **params)

    prim.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = jvp_rule
    ad.primitive_transposes[prim] = transpose_rule
    batching.primitive_batchers[prim] = batch
    mlir.register_lowering(prim, mlir.lower_fun(compute, multiple_results=False))
    return prim


def is_being_transposed(operand: Any) -> bool:
    """In a `define_primitive` transpose rule: whether `operand` is one the cotangent is wanted for."""
    from jax.interpreters import ad

    return ad.is_undefined_primal(operand)


def ffi_lowering(target: str) -> Callable:
    """Lowered as side-effecting: XLA then issues these calls in program order on every device and never
    merges or drops one. NCCL needs every rank to issue its collectives in the same order; the CPU
    backend tells calls apart by call site and does not depend on it."""
    return jax.ffi.ffi_lowering(target, has_side_effect=True)


def lowering_mesh(ctx: Any) -> jax.sharding.Mesh | None:
    """The concrete mesh a shard_map being lowered runs on (None under pmap, or for an abstract mesh)."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    return mesh if isinstance(mesh, jax.sharding.Mesh) else None


# XLA's names of the platforms that jax lowers for. jaxlib maps "cpu" (to "Host") but not "cuda": a target
# registered for "cuda" waits for a "cuda" plugin that never comes, and the GPU compile finds no handler.
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}


def register_ffi_targets(handlers: dict[str, Any], prefix: str, platform: str) -> None:
    for op, capsule in handlers.items():
        jax.ffi.register_ffi_target(f"{prefix}{op}", capsule, platform=_XLA_PLATFORM[platform])

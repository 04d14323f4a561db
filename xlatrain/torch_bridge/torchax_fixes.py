"""torchax's behaviour mended where it differs from PyTorch, for the torch and torchax the `torch` extra pins.

torchax (from the torch_xla project) traces a module's forward into JAX. With torch 2.13 it needs the named-dimension
overloads torch dropped to resolve; and where it computes otherwise than PyTorch (BatchNorm's running statistics,
in-place ops on views, values under torch.no_grad() or read through `.data`) the environment and the modes here
make it compute what PyTorch does. It also routes scaled_dot_product_attention and F.linear to the formulations
xlatrain's flax models use (models/attention.py, models/linear.py).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import jax.numpy as jnp

_NAMED_DIMENSION_OVERLOAD = re.compile(r"(?i)dimname|names")
"""Overloads taking named dimensions (`aten.prod.dim_Dimname`, `aten.norm.names_ScalarOpt_dim`, ...):
newer torch releases dropped them, while torchax's op tables still name them."""


@dataclass(frozen=True)
class MissingTorchOverload:
    """An inert stand-in for an overload this torch does not have: a hashable dict key nothing calls."""

    name: str


def _tolerate_missing_named_overloads() -> None:
    """Make `torch.ops.aten.<op>.<named-dimension overload>` resolve to a MissingTorchOverload instead of
    raising AttributeError. Stays installed: some of torchax's tables are built lazily. Idempotent."""
    from torch._ops import OpOverloadPacket

    original = OpOverloadPacket.__getattr__
    if getattr(original, "xlatrain_shim", False):
        return

    def getattr_tolerant(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if _NAMED_DIMENSION_OVERLOAD.search(key):
                return MissingTorchOverload(f"{self._qualified_op_name}.{key}")
            raise

    getattr_tolerant.xlatrain_shim = True
    OpOverloadPacket.__getattr__ = getattr_tolerant


def import_torchax() -> Any:
    """torchax, importable with the torch we pin (see _tolerate_missing_named_overloads)."""
    _tolerate_missing_named_overloads()
    import torchax

    return torchax


def torchax_environment() -> Any:
    """A torchax Environment for tracing a module's forward inside a jitted JAX function:

    - tensors a forward creates with a factory (`torch.ones(...)` for a mask, `torch.arange`) become JAX
      values too, whatever device they name (torchax keeps "cpu" ones as torch tensors, and mixing them
      with traced values fails);
    - BatchNorm in training mode writes its running statistics back into the buffers, with PyTorch's
      unbiased variance (torchax 0.0.13 computes the update and drops it);
    - F.scaled_dot_product_attention without a mask, dropout or grouped heads is xlatrain.models.attention's, the
      attention xlatrain's flax GPT uses (torchax's reference builds an explicit -inf bias);
    - F.linear is xlatrain.models.linear's, whose weight gradient transposes the smaller operand on XLA:CPU.
    """
    import torch

    from xlatrain.models.attention import attention
    from xlatrain.models.linear import dense_dot_general

    import_torchax()
    from torchax.tensor import Environment, Tensor

    class TracingEnvironment(Environment):
        def _should_use_torchax_tensor(self, device):
            return True

    env = TracingEnvironment()

    def native_batch_norm(input, weight, bias, running_mean, running_var, training=False, momentum=0.1,
                          eps=1e-5):
        x = input.jax()
        axes = (0, *range(2, x.ndim))
        per_channel = (1, -1) + (1,) * (x.ndim - 2)
        if training or running_mean is None:
            mean, var = jnp.mean(x, axis=axes), jnp.var(x, axis=axes)
            if training and running_mean is not None:
                count = x.size // x.shape[1]
                unbiased = var * (count / max(count - 1, 1))
                running_mean.apply_jax_(lambda r: ((1 - momentum) * r + momentum * mean).astype(r.dtype))
                running_var.apply_jax_(lambda r: ((1 - momentum) * r + momentum * unbiased).astype(r.dtype))
        else:
            mean, var = running_mean.jax(), running_var.jax()
        rstd = jax.lax.rsqrt(var.astype(jnp.float32) + eps)
        y = (x - mean.reshape(per_channel)) * rstd.reshape(per_channel)
        if weight is not None:
            y = y * weight.jax().reshape(per_channel)
        if bias is not None:
            y = y + bias.jax().reshape(per_channel)
        return Tensor(y.astype(x.dtype), env), Tensor(mean, env), Tensor(rstd, env)

    for op in (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default):
        env.override_op_definition(op, native_batch_norm)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    reference = env._ops[sdpa].func

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if attn_mask is not None or dropout_p > 0 or enable_gqa or query.ndim != 4:
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        q, k, v = (jnp.swapaxes(t.jax(), 1, 2) for t in (query, key, value))  # [B, H, L, K] -> [B, L, H, K]
        return Tensor(jnp.swapaxes(attention(q, k, v, is_causal=is_causal, scale=scale), 1, 2), env)

    env.override_op_definition(sdpa, scaled_dot_product_attention)

    reference_linear = env._ops[torch.nn.functional.linear].func

    def linear(input, weight, bias=None):
        x, w = input.jax(), weight.jax()
        b = None if bias is None else bias.jax()
        if w.ndim != 2 or x.ndim < 1 or x.dtype != w.dtype:
            return Tensor(reference_linear(x, w, b), env)
        y = dense_dot_general(x, w.T, (((x.ndim - 1,), (0,)), ((), ())))
        return Tensor(y if b is None else y + b, env)

    env.override_op_definition(torch.nn.functional.linear, linear)
    return env


@contextlib.contextmanager
def torch_in_place_on_views() -> Iterator[None]:
    """torchax hands an in-place op a view as a copy unless the op is one of its own in-place ops (mul_, add_,
    copy_ ...), so `h[:, :4].zero_()` (zero_, fill_, clamp_: ops it decomposes) would change the copy and leave `h`
    as it was. While open, an in-place op on a view runs on the view's value and writes the result back through
    the view, as PyTorch's in-place ops on views do."""
    from torch.overrides import TorchFunctionMode
    from torchax.view import View

    def in_place(func: Any) -> bool:
        name = getattr(func, "__name__", "")
        return name.endswith("_") and not name.startswith("_")

    class InPlaceOnViews(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not (args and isinstance(args[0], View) and in_place(func)):
                return func(*args, **(kwargs or {}))
            view, value = args[0], args[0].torch()
            before = value._elem
            out = func(value, *args[1:], **(kwargs or {}))
            if value._elem is not before:
                view.update(value)
            return view if out is value else out

    with InPlaceOnViews():
        yield


@contextlib.contextmanager
def torch_gradient_cuts(env: Any) -> Iterator[None]:
    """torchax traces every op into JAX whatever torch's autograd would record, so what a forward computes
    under torch.no_grad() (or inference_mode), or reads through `.data`, would get the gradient PyTorch never
    gives it. While open, those values are stopped (jax.lax.stop_gradient): the new values ops return with
    grad mode off, and every `.data`; a tensor an op hands back under torch.no_grad() (an in-place op's, a no-op
    conversion's) keeps its gradient, as in PyTorch. A view made under torch.no_grad() stays a view of its source,
    so that an in-place op on it (`h[:, :4].zero_()`) changes the source. A tensor an op changes in place under
    torch.no_grad() takes the new value and passes its gradient on unchanged, as autograd, which does not record
    the op, does. Grad mode starts on, as in a PyTorch training step."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves, tree_map
    from torchax.tensor import Tensor
    from torchax.view import View

    def root(value: Any) -> Any:
        """The tensor an in-place op on `value` writes into: a view's source (torchax's View.replace_source_jax)."""
        while isinstance(value, View):
            value = value.parent
        return value

    class StoppedView(View):
        """A view whose reads have no gradient; writes reach its source as a view's do."""

        def jax(self) -> jax.Array:
            return jax.lax.stop_gradient(super().jax())

        def create_sub_view(self, view_info: Any) -> View:
            return StoppedView(self, view_info, self._env)

    def cut(value: Any) -> Any:
        if isinstance(value, View):
            return StoppedView(value.parent, value.view_info, env)
        return Tensor(jax.lax.stop_gradient(value.jax()), env) if isinstance(value, Tensor) else value

    class GradientCuts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if torch.is_grad_enabled():
                return func(*args, **(kwargs or {}))
            leaves = tree_leaves((args, kwargs))
            written = {id(tensor): (tensor, tensor._elem) for tensor in map(root, leaves) if isinstance(tensor, Tensor)}
            out = func(*args, **(kwargs or {}))
            for tensor, before in written.values():
                if tensor._elem is not before and jnp.issubdtype(before.dtype, jnp.inexact):
                    tensor._elem = _gradient_passed_on(before, tensor._elem)
            given = {id(value) for value in leaves}
            return tree_map(lambda value: value if id(value) in given else cut(value), out)

    # torchax's Tensor.data is a Python property handing back the tensor itself, which no mode sees
    data = Tensor.data
    Tensor.data = property(lambda tensor: Tensor(jax.lax.stop_gradient(tensor.jax()), env), data.fset)
    try:
        with torch.enable_grad(), GradientCuts():
            yield
    finally:
        Tensor.data = data


@jax.custom_jvp
def _gradient_passed_on(before: jax.Array, after: jax.Array) -> jax.Array:
    """`after`'s value with `before`'s tangent: an op autograd did not record, between them."""
    return after


@_gradient_passed_on.defjvp
def _gradient_passed_on_jvp(primals, tangents):
    before, after = primals
    return after, tangents[0].astype(after.dtype)


def torchax_operator_not_found() -> type[Exception]:
    from torchax.tensor import OperatorNotFound

    return OperatorNotFound

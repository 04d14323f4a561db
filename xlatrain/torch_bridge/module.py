"""A PyTorch nn.Module as xlatrain's model interface, traced into the one compiled step by torchax.

The module is built once on the host (CPU), seeded from the run's `seed`, only to read its structure
and its initial weights. Its parameters become xlatrain's trainable params and its buffers the model
state: a dict keyed by the module's own dotted names. Inside the step, the forward runs through
`torch.func.functional_call` on torchax tensors that wrap the traced JAX values, so every torch op
becomes JAX ops of the same XLA program; in-place buffer updates (BatchNorm's running statistics) are
read back as the new model state, and dropout draws from xlatrain's per-step key.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import importlib.util
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from xlatrain.compat.jaxprs import outputs_reading
from xlatrain.config import TorchModelConfig
from xlatrain.data.spec import DataSpec
from xlatrain.errors import UserError, first_line
from xlatrain.models.interface import PARTLY_FROZEN, Documents, ModelDef, documents_of
from xlatrain.models.targets import check_kwargs, import_target
from xlatrain.torch_bridge.blocks import (
    BlockStacking,
    TorchBlockParts,
    block_stacking,
    differentiable,
    document_arguments,
    takes_segment_ids,
)
from xlatrain.torch_bridge.torchax_fixes import (
    torch_gradient_cuts,
    torch_in_place_on_views,
    torchax_environment,
    torchax_operator_not_found,
)

SHARDED = "sharded"
"""The logical name of the dimension zero1/fsdp shard in a torch parameter; mapped to `data` unless
parallel.logical_rules says otherwise."""
TENSOR_SPLIT = "tensor_split"
"""The logical name of the dimension model.tensor_dims splits over `tensor` (and zero1/fsdp over `data` too)."""

_JAX_DTYPE = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32),
              np.dtype(np.uint64): np.dtype(np.uint32), np.dtype(np.complex128): np.dtype(np.complex64)}
"""64-bit host values become 32-bit JAX values (JAX runs without x64); export restores the module's dtypes."""


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or importlib.util.find_spec("torchax") is None:
        raise UserError("config: model.name=torch needs PyTorch and torchax: pip install -e '.[torch]' "
                        "(where a CPU build is at hand, pip install torch==2.13.0 first)")
    return torch


@dataclasses.dataclass
class TorchModule:
    """The host module and how its tensors map to xlatrain's params and model state."""

    module: Any
    """The torch module on CPU, holding the initial weights (never trained itself)."""
    target: str
    stack: BlockStacking | None = None
    """How the module's repeated blocks are stacked into params["blocks"] (None: params keep flat names)."""
    without_gradient: frozenset[str] = frozenset()
    """Params the training forward gives no gradient (`params_without_gradient`, set by `with_frozen_known`)."""

    @cached_property
    def env(self) -> Any:
        """torchax's environment, made at the first trace: making it starts JAX (it draws a key), and sizing a
        replica's state must not, so that `mesh.cpu_devices` can still set the device count (cpu_devices.py)."""
        return torchax_environment()

    def _params(self) -> list[tuple[str, Any]]:
        """The module's parameters that are xlatrain's params (tied ones once)."""
        return [(name, p) for name, p in self.module.named_parameters() if differentiable(p)]

    def initial_params(self) -> dict[str, np.ndarray]:
        return {name: to_host_array(p) for name, p in self._params()}

    def initial_buffers(self) -> dict[str, np.ndarray]:
        """The buffers, and the integer parameters (quantized weights): torch cannot train them either."""
        integers = [(name, p) for name, p in self.module.named_parameters() if not differentiable(p)]
        return {name: to_host_array(b) for name, b in [*self.module.named_buffers(), *integers]}

    def params_without_gradient(self, spec: DataSpec) -> frozenset[str]:
        """The params a training forward gives no gradient: requires_grad=False, never read, read through
        .detach() or only under torch.no_grad(). torch.optim leaves a parameter whose .grad is None as it is,
        weight decay included."""
        params = {name: jax.ShapeDtypeStruct(tuple(p.shape), host_dtype(p)) for name, p in self._params()}
        buffers = self.initial_buffers()
        inputs = jax.ShapeDtypeStruct((2, *spec.input_shape), spec.input_dtype)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        documents = documents_of(spec.abstract_batch((2,)))

        def gradients(p, x, k, d):
            # of half the outputs' squared sum: the backward starts from the outputs, which read the arguments, so
            # every gradient the forward gives reads them too (a constant cotangent would leave a bias's constant)
            return jax.grad(lambda q: 0.5 * jnp.sum(jnp.square(self.call(self.module, q, buffers, x, k, d)[0])))(p)

        reads = outputs_reading(gradients, (params, inputs, key, documents), watched=(0, 1, 2))
        return frozenset(name for name, (read, _) in zip(sorted(params), reads, strict=True) if not read)

    def frozen(self) -> dict | None:
        """ModelDef.frozen of the params as `initial_params` and the stacking give them; None when all train."""
        flat = {name: name in self.without_gradient for name, _ in self._params()}
        if not any(flat.values()):
            return None
        if self.stack is None:
            return flat
        stacked = self.stack.stack({name: np.array(value) for name, value in flat.items()})
        return jax.tree.map(lambda layers: PARTLY_FROZEN if layers.any() and not layers.all() else bool(layers.all()),
                            stacked)

    def describe_frozen(self) -> str:
        """How many elements of the params do not train, and why (tied ones once)."""
        named = [p for name, p in self.module.named_parameters() if name in self.without_gradient]
        frozen = sum(p.numel() for p in named if not p.requires_grad)
        unused = sum(p.numel() for p in named if p.requires_grad)
        parts = [f"{frozen:,} frozen: requires_grad=False"] if frozen else []
        if unused:
            parts.append(f"{unused:,} without a gradient in the forward: unused, detached or under torch.no_grad()")
        return "; ".join(parts)

    def state_dict(self, params: dict, buffers: dict) -> dict[str, Any]:
        """A torch state_dict of these values, in the module's own dtypes (tied weights under every name)."""
        torch = import_torch()
        params = self.flat_params(params)
        module = copy.deepcopy(self.module)
        with torch.no_grad():
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                value = params[name] if name in params else buffers.get(name)
                if value is not None:
                    tensor.copy_(to_torch(value, tensor.dtype))
        return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}

    def run(self, params: dict, buffers: dict, inputs: jax.Array, key: jax.Array | None,
            documents: Documents | None = None) -> tuple[jax.Array, dict]:
        """The forward as JAX: train mode with a key (dropout draws from it), eval mode without."""
        return self.call(self.module, self.flat_params(params), buffers, inputs, key, documents)

    def flat_params(self, params: dict) -> dict:
        """Params by the module's own names (blocks stacked for a pipeline are taken apart)."""
        return params if self.stack is None else self.stack.unstack(params)

    def call(self, module: Any, params: dict, buffers: dict, inputs: jax.Array, key: jax.Array | None,
             documents: Documents | None = None) -> tuple[jax.Array, dict]:
        """`module`'s forward as JAX, its params and buffers named relative to it. Buffers not given are the
        module's initial ones, as constants; the given ones come back updated. `documents`: given to the forward
        as the keywords it takes (document_arguments)."""
        torch = import_torch()
        env = self.env
        module.train(key is not None)
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        params = {name: jax.lax.stop_gradient(value) if name in frozen else value for name, value in params.items()}
        initial = {name: to_host_array(b) for name, b in module.named_buffers() if name not in buffers}
        given = {**jax.tree.map(jnp.asarray, initial), **buffers}
        extra = document_arguments(module.forward, documents)
        params_in, given, inputs, extra = jax.tree.map(jnp.asarray, (params, given, inputs, extra))
        t_params, t_buffers, t_inputs, t_extra = env.j2t_iso((params_in, given, inputs, extra))
        prng = key if key is not None else jax.random.PRNGKey(0)
        trains = {id(t_params[name]): (name, name not in frozen) for name in t_params}
        # The gradient cuts watch what an in-place op writes through a view, so they run first (the mode last in).
        # PyTorch broadcasts by rank and promotes dtypes its own way; a strict JAX setting must not apply here.
        with env, env.override_property(prng=prng), torch_in_place_on_views(), \
                torch_gradient_cuts(env), \
                _requires_grad_kept(self.target, trains), _module_path(module) as where, \
                jax.numpy_rank_promotion("allow"), \
                jax.numpy_dtype_promotion("standard"), warnings.catch_warnings():
            # .long() and .double() are 32-bit here, as the module's docstring says; JAX warns at each one.
            warnings.filterwarnings("ignore", r"Explicitly requested dtype (int64|uint64|float64|complex128)")
            try:
                out = torch.func.functional_call(module, {**t_params, **t_buffers}, (t_inputs,), t_extra,
                                                 tie_weights=True, strict=False)
            except torchax_operator_not_found() as err:
                raise UserError(f"model: model.target={self.target!r}: torchax cannot lower an op in module "
                                f"{where()!r} ({first_line(err)}); rewrite that part of the forward with "
                                "supported ops or use a flax model") from None
            except UserError:
                raise
            except Exception as err:  # the forward failed on traced values (data-dependent shapes, a bad reshape)
                raise UserError(f"model: model.target={self.target!r}: the forward of module {where()!r} cannot be "
                                f"traced by torchax ({type(err).__name__}: {first_line(err)})") from None
        if not isinstance(out, torch.Tensor):
            raise UserError(f"model: model.target={self.target!r}: forward returned {type(out).__name__}; "
                            "xlatrain needs one tensor (logits for cross_entropy, predictions for mse)")
        changed = [name for name, tensor in t_params.items() if tensor.jax() is not params_in[name]]
        if changed:
            raise UserError(f"model: model.target={self.target!r}: the forward changes parameter {changed[0]!r} in "
                            "place (as a weight clamp_ under torch.no_grad() does), which a traced forward cannot "
                            "keep: only the optimizer updates parameters here; compute with the changed value "
                            "instead (e.g. F.linear(x, self.fc.weight.clamp(-c, c))), or make it a buffer")
        new_buffers = {name: t_buffers[name].jax().astype(buffers[name].dtype) for name in buffers}
        return env.t2j_iso(out), new_buffers


def with_frozen_known(model: ModelDef, spec: DataSpec) -> ModelDef:
    """A torch model with ModelDef.frozen: the params its training forward on `spec`'s inputs gives no gradient."""
    model.torch.without_gradient = model.torch.params_without_gradient(spec)
    return dataclasses.replace(model, frozen=model.torch.frozen())


def to_host_array(tensor: Any) -> np.ndarray:
    return tensor.detach().cpu().numpy().astype(host_dtype(tensor))


def host_dtype(tensor: Any) -> np.dtype:
    """The dtype of `tensor` as a host array: 64-bit ones narrowed (_JAX_DTYPE)."""
    torch = import_torch()
    dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
    return _JAX_DTYPE.get(dtype, dtype)


def to_torch(value: Any, dtype: Any) -> Any:
    """A host copy of a JAX or numpy value as a torch tensor of `dtype`."""
    torch = import_torch()
    array = np.asarray(value)
    if array.dtype.kind not in "biufc":  # bfloat16 and other ml_dtypes: widen exactly
        array = array.astype(np.float32)
    return torch.from_numpy(np.array(array, order="C")).to(dtype)


@contextlib.contextmanager
def _requires_grad_kept(target: str, trains: dict[int, tuple[str, bool]]) -> Iterator[None]:
    """PyTorch stops training a parameter whose forward calls requires_grad_(False) on it (or sets its
    .requires_grad), and starts one set to True. Here the forward runs on stand-ins (`trains`: by their ids, the
    parameter's name and whether it trains) and which parameters train is read from the module when the run
    starts, so the change would be lost without a word: it is one clear error instead."""
    torch = import_torch()
    from torch.overrides import TorchFunctionMode

    def sets_requires_grad(func: Any) -> bool:
        setter = getattr(func, "__name__", None) == "__set__" and getattr(func, "__self__", None) is not None
        return func is torch.Tensor.requires_grad_ or (setter and func.__self__.__name__ == "requires_grad")

    class RequiresGradKept(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if args and id(args[0]) in trains and sets_requires_grad(func):
                name, trainable = trains[id(args[0])]
                wanted = bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
                if wanted != trainable:
                    alone = ("" if wanted else
                             f", or, to stop its gradient in this forward alone, use self.{name}.detach()")
                    raise UserError(
                        f"model: model.target={target!r}: the forward sets requires_grad={wanted} on parameter "
                        f"{name!r}, which xlatrain reads from the module once, when the run starts: set it where "
                        f"the module is built instead (in __init__, or the function model.target names){alone}")
            return func(*args, **kwargs)

    with RequiresGradKept():
        yield


@contextlib.contextmanager
def _module_path(module: Any) -> Iterator[Callable[[], str]]:
    """While open, the dotted name of the innermost submodule whose forward is running (for errors)."""
    names = {id(m): name or type(module).__name__ for name, m in module.named_modules()}
    stack: list[str] = []

    def enter(m, _args):
        stack.append(names.get(id(m), type(m).__name__))

    def leave(_m, _args, _out):
        stack.pop()

    handles = [h for m in module.modules() for h in (m.register_forward_pre_hook(enter),
                                                     m.register_forward_hook(leave))]
    try:
        yield lambda: stack[-1] if stack else names[id(module)]
    finally:
        for handle in handles:
            handle.remove()


def load_module(config: TorchModelConfig, seed: int) -> Any:
    """Build the user's module on CPU with torch's generator seeded from `seed` (global RNG untouched)."""
    torch = import_torch()
    target = import_target(config.target)
    is_class = isinstance(target, type)
    if is_class and not issubclass(target, torch.nn.Module) or not callable(target):
        raise UserError(f"config: model.target={config.target!r} is not a torch.nn.Module subclass or a function "
                        "returning one")
    check_kwargs(config.target, config.kwargs, target.__init__ if is_class else target, skip_self=is_class)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with torch.device("cpu"):
                module = target(**config.kwargs)
        except Exception as err:
            raise UserError(f"config: model.target={config.target!r} raised {type(err).__name__} when built with "
                            f"model.kwargs={config.kwargs}: {first_line(err)}") from None
    if not isinstance(module, torch.nn.Module):
        raise UserError(f"config: model.target={config.target!r} returned {type(module).__name__}, not a "
                        "torch.nn.Module")
    if config.init_from is not None:
        load_state_dict_file(module, Path(config.init_from), "model.init_from")
    return module


def load_state_dict_file(module: Any, path: Path, field: str) -> None:
    """Load a torch state_dict into `module`; missing, unexpected or misshapen keys are one clear error."""
    torch = import_torch()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"config: {field}={str(path)!r} is not a readable torch state_dict ({type(err).__name__}: "
                        f"{first_line(err)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"config: {field}={str(path)!r} does not hold a state_dict (a dict of name -> tensor)")
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    misshapen = [f"{k} {list(state[k].shape)} (module: {list(v.shape)})" for k, v in expected.items()
                 if k in state and tuple(state[k].shape) != tuple(v.shape)]
    problems = [f"{label}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                    ("wrong shapes", misshapen)) if keys]
    if problems:
        raise UserError(f"config: {field}={str(path)!r} does not fit {type(module).__name__}: {'; '.join(problems)}")
    module.load_state_dict(state, strict=True)


def tensor_split_names(names: tuple[str | None, ...], name: str, shape: tuple[int, ...],
                       styles: dict[str, str]) -> tuple[str | None, ...]:
    """`names` with TENSOR_SPLIT on the dimension the first matching pattern of model.tensor_dims splits over
    `tensor` (column: dimension 0; row: the last, none of a 1-D parameter). Where that is the dimension zero1/fsdp
    chose for `data`, TENSOR_SPLIT's rule splits it over both."""
    style = next((style for pattern, style in styles.items() if fnmatch.fnmatchcase(name, pattern)), None)
    if style is None or not shape or (style == "row" and len(shape) < 2):
        return names
    dim = 0 if style == "column" else len(shape) - 1
    return tuple(TENSOR_SPLIT if d == dim else n for d, n in enumerate(names))


def unmatched_tensor_patterns(styles: dict[str, str], names: list[str]) -> list[str]:
    return [pattern for pattern in styles if not any(fnmatch.fnmatchcase(name, pattern) for name in names)]


def shard_names(name: str, shape: tuple[int, ...], patterns: dict[str, int | None], data_parallel: int,
                ) -> tuple[str | None, ...]:
    """Logical names of one parameter: SHARDED on the dimension zero1/fsdp split over `data`, None elsewhere.

    The first pattern of model.shard_dims matching the name chooses the dimension (null: none); otherwise
    the largest dimension the data axis divides (the first of equals), or none."""
    for pattern, dim in patterns.items():
        if fnmatch.fnmatchcase(name, pattern):
            if dim is None:
                return (None,) * len(shape)
            if not -len(shape) <= dim < len(shape):
                raise UserError(f"config: model.shard_dims[{pattern!r}]={dim} is out of range for parameter "
                                f"{name} of shape {list(shape)}")
            dim %= len(shape)
            if shape[dim] % data_parallel:
                raise UserError(f"config: model.shard_dims[{pattern!r}]={dim}: dimension {dim} of parameter {name} "
                                f"{list(shape)} is not divisible by the data axis ({data_parallel})")
            return tuple(SHARDED if d == dim else None for d in range(len(shape)))
    divisible = [d for d, size in enumerate(shape) if size % data_parallel == 0]
    if not divisible:
        return (None,) * len(shape)
    chosen = max(divisible, key=lambda d: (shape[d], -d))
    return tuple(SHARDED if d == chosen else None for d in range(len(shape)))


def torch_model(config: TorchModelConfig, seed: int, data_parallel: int) -> ModelDef:
    """xlatrain's model interface for the config's torch module. A module that keeps its repeated blocks as
    the contract says (see torch_bridge/blocks.py) gets them stacked into params["blocks"], so it can be pipelined."""
    module = load_module(config, seed)
    stack, not_stackable = block_stacking(module, config.blocks)
    torch_module = TorchModule(module, config.target, stack)
    flat, buffers = torch_module.initial_params(), torch_module.initial_buffers()
    unmatched = unmatched_tensor_patterns(config.tensor_dims, list(flat))
    if unmatched:
        raise UserError(f"config: model.tensor_dims[{unmatched[0]!r}] matches no parameter of {config.target!r}; its "
                        f"parameters are {', '.join(list(flat)[:8])}{' ...' if len(flat) > 8 else ''}")
    axes = {name: tensor_split_names(shard_names(name, value.shape, config.shard_dims, data_parallel), name,
                                     value.shape, config.tensor_dims) for name, value in flat.items()}
    params = flat
    if stack is not None:
        params, axes = stack.stack(flat), stack.stack_axes(axes)

    def initial_values() -> tuple[dict, dict]:
        """The module's own initialisation (seeded when it was built), not a JAX key's."""
        return params, buffers

    def init(_key: jax.Array) -> tuple[dict, dict]:
        # Host arrays, not jnp ones: the abstract uses (eval_shape) then copy nothing to a device.
        return initial_values()

    parts = None if stack is None else TorchBlockParts(torch_module, stack)
    return ModelDef(axes, init, torch_module.run, logical_rules={SHARDED: ("data",), TENSOR_SPLIT: ("tensor", "data")},
                    initial_values=initial_values,
                    blocks=parts, torch=torch_module, not_pipelinable=not_stackable,
                    takes_documents=takes_segment_ids(module.forward))

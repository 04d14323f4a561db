"""Train state: abstract init, shardings from logical-axis rules, and the same-on-every-replica check."""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlatrain.compat.mapping import shard_map
from xlatrain.compat.multihost import gather_to_host
from xlatrain.errors import UserError
from xlatrain.mesh import CONTEXT, DATA, EXPERT, TENSOR
from xlatrain.models.interface import ModelDef
from xlatrain.models.lora import has_adapters, joined
from xlatrain.precision import LossScale, Policy, cast_floats, initial_loss_scale
from xlatrain.run.fingerprints import fingerprint
from xlatrain.sharding import (
    named,
    optimizer_specs,
    param_specs,
    rules_over,
    specs_following_params,
)


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    model_state: Any
    """Non-trainable model values the forward updates (e.g. BatchNorm running statistics); replicated."""
    opt_state: Any
    rng: jax.Array
    """Base key; step s uses fold_in(rng, s), so resuming reproduces the same randomness."""
    loss_scale: LossScale


def init_variables(model: ModelDef, key: jax.Array, policy: Policy, given: Any = None) -> tuple[Any, Any]:
    """(params in the stored (master) dtype, model state) of a new model; `given`: its (params, model state)
    when the model comes with values (see ModelDef.initial_values)."""
    params, model_state = model.init(key) if given is None else given
    return cast_floats(params, policy.param), model_state


def make_init(model: ModelDef, tx: optax.GradientTransformation, seed: int, policy: Policy,
              arrange: Callable[[Any], Any] | None = None) -> Callable[[Any], TrainState]:
    """init(given=None, arranged=False) -> the train state. `arrange` lays the model's params out for training (a
    pipeline's stage layout); `arranged`: the given params are laid out so already."""

    def init(given: Any = None, arranged: bool = False) -> TrainState:
        init_key, train_key = jax.random.split(jax.random.PRNGKey(seed))
        params, model_state = init_variables(model, init_key, policy, given)
        if given is not None and model.frozen is not None and has_adapters(model.frozen):
            # LoRA from checkpoints: the base's (model.init_from) or the adapters' (model.lora.init_from) or both;
            # what neither gives is the model's own (XLA drops the rest of that initialisation)
            own = cast_floats(model.init(init_key)[0], policy.param)
            params = joined(arrange(own) if arrange is not None and arranged else own, params)
        params = arrange(params) if arrange is not None and not arranged else params
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                          opt_state=tx.init(params), rng=train_key, loss_scale=initial_loss_scale(policy))

    return init


def state_specs(init: Callable[[], TrainState], model: ModelDef, tx: optax.GradientTransformation,
                strategy: str, rules: dict, mesh: Mesh, fixed_param_specs: Callable[[Any], Any] | None = None,
                fixed_optimizer_specs: Callable[[Any], Any] | None = None) -> tuple[TrainState, TrainState]:
    """(abstract state, PartitionSpecs of the state) for replicated, zero1 or fsdp; or, when given,
    `fixed_param_specs(abstract params)` with the optimizer state following the params, or following
    `fixed_optimizer_specs(abstract params)` when that is given too (pipelines, and their ZeRO-1 and FSDP)."""
    abstract = jax.eval_shape(init)
    if fixed_param_specs is not None:
        params = fixed_param_specs(abstract.params)
        wanted = (fixed_optimizer_specs or fixed_param_specs)(abstract.params)
        opt = specs_following_params(tx, abstract.opt_state, abstract.params, wanted)
    else:
        params = param_specs(abstract.params, model.logical_axes, rules_over(rules, split_axes(strategy, "params")),
                             mesh)
        opt = optimizer_specs(tx, abstract.opt_state, abstract.params, model.logical_axes,
                              rules_over(rules, split_axes(strategy, "optimizer")), mesh)
    return abstract, TrainState(step=P(), params=params, model_state=jax.tree.map(lambda _: P(), abstract.model_state),
                                opt_state=opt, rng=P(), loss_scale=jax.tree.map(lambda _: P(), abstract.loss_scale))


def split_axes(strategy: str, held: str) -> tuple[str, ...]:
    """The mesh axes the params (`held`="params") or the optimizer state ("optimizer") are split over: `tensor` and
    `expert` always, `data` (and `context` and `expert`, where the rules name them beside `data`) for fsdp's params
    and zero1's and fsdp's optimizer state."""
    over_data = strategy == "fsdp" or (held == "optimizer" and strategy == "zero1")
    return (TENSOR, EXPERT, DATA, CONTEXT) if over_data else (TENSOR, EXPERT)


def create_state(init: Callable[..., TrainState], specs: TrainState, mesh: Mesh, given: Any = None,
                 arranged: bool = False) -> TrainState:
    """Initialise straight into the target shardings: the full state never sits on one device. Values the
    model comes with (`given`: host arrays, or global arrays already in the state's layout when `arranged`) are
    arguments of the init program, never constants in it."""
    return jax.jit(lambda values: init(values, arranged), out_shardings=named(mesh, specs))(given)


def with_shardings(abstract: Any, specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, named(mesh, specs), is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def verify_replicas_identical(state: Any, specs: Any, mesh: Mesh) -> None:
    """Every replicated leaf must hold the same bits on every device (and every process)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    spec_leaves = treedef.flatten_up_to(specs)
    checked = [(path, leaf) for (path, leaf), spec in zip(leaves, spec_leaves, strict=True)
               if all(axis is None for axis in spec)]
    if not checked or mesh.size == 1:
        return
    prints = gather_to_host(_fingerprints(mesh, [leaf for _, leaf in checked]))
    devices = list(mesh.devices.flat)
    bad = [(jax.tree_util.keystr(path), [str(devices[d]) for d in np.flatnonzero(prints[:, i] != prints[0, i])])
           for i, (path, _) in enumerate(checked) if np.any(prints[:, i] != prints[0, i])]
    if bad:
        listed = "; ".join(f"{name} differs on {', '.join(devs)}" for name, devs in bad[:5])
        raise UserError(f"state: replicas are not identical after init ({listed}). Every process must use "
                        "the same seed and the same model code; initialisation must not read per-process state")


def _fingerprints(mesh: Mesh, leaves: list[jax.Array]) -> jax.Array:
    """[devices, leaves] uint32: an order-sensitive checksum of each device's copy of each leaf."""
    axes = mesh.axis_names

    def per_device(*local):
        return jnp.stack([fingerprint(x) for x in local])[None]

    mapped = shard_map(per_device, mesh, in_specs=tuple(P() for _ in leaves), out_specs=P(axes))
    return jax.jit(mapped)(*leaves)

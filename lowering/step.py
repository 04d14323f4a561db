"""Pure step functions: `train_step(state, batch) -> (state, metrics)` and `eval_step(state, batch)`.

No jit, shardings or donation here (lowering/compile.py applies them once). Training batches are
[microbatches, rows, ...] with rows split evenly over the data replicas. The step runs the AMP order
of DESIGN.md in the order the code reads:

1. each replica differentiates its *scaled* loss, accumulating float32 gradients over microbatches;
2. the replicas' gradients are summed in the communication dtype, still scaled;
3. the sum is unscaled, checked for inf/NaN (one check on the synchronised gradients, so every
   replica agrees) and clipped by its global norm;
4. the optimizer update is applied, or skipped (and the loss scale backed off) on a non-finite step;
5. the step boundary: the function returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from xlatrain.lowering.grad_sync import ExplicitReplicas, PartitionedReplicas
from xlatrain.lowering.preference import Preference, pairs_as_rows, preference_sums, sequence_log_probs

from xlatrain.errors import UserError
from xlatrain.models.context import balanced_order, current_context_group
from xlatrain.models.experts import ROUTER_SUMS
from xlatrain.models.interface import Documents, Reported, documents_of, outputs_and_reports
from xlatrain.optim import evaluated_params
from xlatrain.precision import Policy, cast_floats, next_loss_scale
from xlatrain.sharding import context_split
from xlatrain.state import ModelDef, TrainState
from xlatrain.tensor_group import current_group, group_maximum, group_total, part_offset

Metrics = dict[str, jax.Array]
Tree = Any


def per_position_weights(batch: dict) -> jax.Array:
    """1 for every target value that counts towards the loss, 0 for padding (the batch's `mask`, if any)."""
    if "mask" in batch:
        return batch["mask"].astype(jnp.float32)
    return jnp.ones(batch["targets"].shape, jnp.float32)


def objective_sums(outputs: jax.Array, batch: dict, loss: str | Preference) -> Metrics:
    """loss_sums over the tokens, or with a Preference DPO's objective over the batch's pairs (lowering/preference.py),
    the outputs the model's of pairs_as_rows(batch)."""
    if not isinstance(loss, Preference):
        return loss_sums(outputs, batch, loss)
    return preference_sums(pair_token_log_probs(outputs, batch), batch, loss)


def pair_token_log_probs(outputs: jax.Array, batch: dict) -> jax.Array:
    """[..., pairs, 2, L] float32: each target's log-probability under the model's outputs for pairs_as_rows(batch),
    the policy's in the step and the reference's before it, computed alike."""
    targets = pairs_as_rows(batch)["targets"]
    return -cross_entropy_with_integer_labels(outputs, targets).astype(jnp.float32).reshape(batch["mask"].shape)


def reference_log_probs(forward: Callable, params: Tree, model_state: Tree, batch: dict) -> jax.Array:
    """[..., pairs, 2]: each row's weighted tokens' log-probabilities summed, from make_forward's `forward` at
    evaluation (no dropout): what preference_sums takes as the pairs' `reference`."""
    outputs = outputs_and_reports(forward(params, model_state, pairs_as_rows(batch)["inputs"], None, None)[0])[0]
    return sequence_log_probs(pair_token_log_probs(outputs, batch), batch["mask"].astype(jnp.float32), mean=False)


def model_inputs(batch: dict, loss: str | Preference) -> jax.Array:
    """The inputs the model runs: the batch's, or its pairs' rows."""
    return pairs_as_rows(batch)["inputs"] if isinstance(loss, Preference) else batch["inputs"]


def objective_weight(batch: dict, loss: str | Preference) -> jax.Array:
    """What the objective's sums are divided by, this device's share: the weighted tokens, or the pairs."""
    if isinstance(loss, Preference):
        return jnp.asarray(math.prod(batch["reference"].shape[:-1]), jnp.float32)
    return jnp.sum(per_position_weights(batch))


def loss_sums(outputs: jax.Array, batch: dict, loss: str) -> Metrics:
    """Weighted sums (not means) of the loss and accuracy, so they add up across replicas and microbatches."""
    weights = per_position_weights(batch)
    targets = batch["targets"]
    if loss == "mse":
        err = jnp.square(outputs.astype(jnp.float32) - targets.reshape(outputs.shape).astype(jnp.float32))
        return {"loss": jnp.sum(err * weights.reshape(err.shape)), "weight": jnp.sum(weights)}
    label_logits = logit_of_label(outputs, targets)
    per_position = cross_entropy_with_integer_labels(outputs, targets, label_logits).astype(jnp.float32)
    correct = (label_logits >= group_maximum(jnp.max(outputs, axis=-1))).astype(jnp.float32)
    return {"loss": jnp.sum(per_position * weights), "weight": jnp.sum(weights),
            "accuracy": jnp.sum(correct * weights)}


def cross_entropy_with_integer_labels(logits: jax.Array, labels: jax.Array,
                                      label_logits: jax.Array | None = None) -> jax.Array:
    """optax's softmax_cross_entropy_with_integer_labels over the last axis, the same values, with the label's
    logit from `logit_of_label` (given, or taken here): vocabulary-parallel, and no scatter in its gradient."""
    label_logits = logit_of_label(logits, labels) if label_logits is None else label_logits
    return vocabulary_logsumexp(logits) - label_logits


def vocabulary_logsumexp(logits: jax.Array) -> jax.Array:
    """logsumexp over the last axis; inside a tensor group (xlatrain/tensor_group.py) over every device's part of
    the vocabulary, jax.nn.logsumexp's terms summed across them."""
    if current_group() is None:
        return jax.nn.logsumexp(logits, axis=-1)
    largest = group_maximum(jnp.max(logits, axis=-1))
    return jnp.log(group_total(jnp.sum(jnp.exp(logits - largest[..., None]), axis=-1))) + largest


def logit_of_label(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Each position's logit of its label, picked by comparison with the vocabulary's indices and a sum over it,
    not a gather: with the vocabulary split over `tensor` each device sums its part and the partitioner (or, in a
    per-device program, the tensor group) adds the parts (a gather would assemble every device's logits), and the
    gradient is a select: no scatter, which XLA would constant-fold into an array built into the step. A position
    is correct when no logit exceeds its label's."""
    vocabulary = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1) + part_offset(logits.shape[-1])
    return group_total(jnp.sum(jnp.where(vocabulary == labels[..., None], logits, 0), axis=-1))


def means(sums: Metrics) -> Metrics:
    """The metrics from their sums; per-layer arrays (a router's loads: ROUTER_SUMS) are left to the model's
    `reports.metrics`."""
    return {k: v / sums["weight"] for k, v in sums.items() if k != "weight" and k not in ROUTER_SUMS}


def weighted_means(values: Metrics, weight: jax.Array) -> Metrics:
    """Scalars as sums that `means` turns back into them (x weight / the total weight); arrays as they are."""
    return {k: v * weight if v.ndim == 0 else v for k, v in values.items()}


def make_forward(model: ModelDef, policy: Policy, compute_params: Callable[[Tree], Tree] = lambda p: p):
    """params, model state, inputs, key, documents -> (outputs, new model state): params and floating inputs in the
    compute dtype, outputs in the output dtype, the model state kept in its own dtypes. `compute_params`
    lays params out for compute (FSDP gathers them)."""

    def forward(params: Tree, model_state: Tree, inputs: jax.Array, key: jax.Array | None = None,
                documents: Documents | None = None) -> tuple[jax.Array, Tree]:
        in_compute = cast_floats(compute_params(params), policy.compute)
        outputs, new_state = model.run(in_compute, model_state, cast_floats(inputs, policy.compute), key, documents)
        new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, model_state)
        outputs, reports = outputs_and_reports(outputs)
        outputs = outputs.astype(policy.output)
        return (outputs if reports is None else Reported(outputs, reports)), new_state

    return forward


class WholeTrees:
    """Parameter-shaped trees that every device holds whole (or that the partitioner sees whole)."""

    @staticmethod
    def norm(tree: Tree) -> jax.Array:
        return optax.tree.norm(tree)

    param_norm = norm
    """The params are whole too."""


@dataclass(frozen=True)
class SplitTrees:
    """Parameter-shaped trees whose leaves a per-device program holds in parts over some mesh axes (a pipeline's
    blocks over `stage`, tensor-parallel leaves over `tensor`): a norm sums each leaf's squares over the axes it
    is split over. With FSDP the params are also split over `data`: `gather` assembles this device's share."""

    split_over: Tree
    """Per leaf, the mesh axes it is split over (a tuple, empty when every device holds it whole)."""
    sums: Mapping[str, Callable[[jax.Array], jax.Array]]
    """Per mesh axis, the sum over it."""
    gather: Callable[[Tree], Tree] = lambda params: params

    def param_norm(self, params: Tree) -> jax.Array:
        return self.norm(self.gather(params))

    def norm(self, tree: Tree) -> jax.Array:
        axes_of = jax.tree.leaves(self.split_over, is_leaf=lambda x: isinstance(x, tuple))
        groups: dict[tuple[str, ...], list[jax.Array]] = {}
        for leaf, axes in zip(jax.tree.leaves(tree), axes_of, strict=True):
            groups.setdefault(axes, []).append(leaf)
        total = jnp.zeros((), jnp.float32)
        for axes, leaves in sorted(groups.items(), key=lambda item: -len(item[0])):
            squares = optax.tree.norm(leaves, squared=True)
            for axis in axes:
                squares = self.sums[axis](squares)
            total = total + squares
        return jnp.sqrt(total)


def loss_scale(state: TrainState, policy: Policy) -> jax.Array:
    """The scale the loss is multiplied by: the state's dynamic scale, or a constant 1 when the policy does not
    scale, which XLA folds away (no scaling and no unscaling pass over the gradients)."""
    return state.loss_scale.scale if policy.dynamic_scale else jnp.ones((), jnp.float32)


def reported_objective(balance: Any, reports: Tree, across: Callable[[jax.Array], jax.Array], scale: jax.Array,
                       total_weight: jax.Array, microbatches: int) -> tuple[jax.Array, Metrics]:
    """The layers' own losses (ModelDef.reports' objective: an MoE's router losses) scaled as the loss is, each
    microbatch's over the global microbatch and their mean over the step's `microbatches`; and their metric sums."""
    layer_loss, layer_sums = balance.objective(reports, across)
    return layer_loss * scale / microbatches, weighted_means(layer_sums, total_weight / microbatches)


def make_gradient_step(model: ModelDef, loss: str | Preference, policy: Policy, *,
                       replicas: PartitionedReplicas | ExplicitReplicas,
                       compute_params: Callable[[Tree], Tree] = lambda p: p, gradients: Callable | None = None,
                       ) -> Callable[[TrainState, dict], tuple[Tree, Metrics, Tree]]:
    """Steps (1) and (2) of the AMP order and the unscale: the replicas' synchronised float32 gradients, the
    metric sums and the new model state (each replica updates it through its microbatches in order, like
    eager PyTorch; the replicas' results are averaged). `gradients(params, batch, key, scale, total_weight)`
    replaces the microbatch loop below for one replica of a model without model state (a pipeline:
    lowering/pipeline/gradients.py)."""
    forward = make_forward(model, policy, compute_params)

    def scaled_objective(params, model_state, micro, key, scale, total_weight, microbatches):
        with jax.named_scope("forward"):  # the backward's ops are named transpose(jvp(forward))
            outputs, model_state = forward(params, model_state, model_inputs(micro, loss), key, documents_of(micro))
            outputs, reports = outputs_and_reports(outputs)
            sums = objective_sums(outputs, micro, loss)
            objective = sums["loss"] * scale / total_weight
            if reports is not None:
                layer_loss, layer_sums = reported_objective(model.reports, reports, replicas.across, scale,
                                                            total_weight, microbatches)
                objective, sums = objective + layer_loss, {**sums, **layer_sums}
            return objective, (sums, model_state)

    grad_fn = jax.grad(scaled_objective, has_aux=True)

    def replica_gradients(params, model_state, batch, key, scale, total_weight):
        """(1) One replica's scaled float32 gradients, metric sums and model state over its microbatches."""
        count = jax.tree.leaves(batch)[0].shape[0]
        first = jax.tree.map(lambda x: x[0], batch)
        if count == 1:
            grads, (sums, model_state) = grad_fn(params, model_state, first, key, scale, total_weight, count)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads), sums, model_state

        def one(carry, indexed):
            total, model_state = carry
            index, micro = indexed
            grads, (sums, model_state) = grad_fn(params, model_state, micro, jax.random.fold_in(key, index), scale,
                                                 total_weight, count)
            return (jax.tree.map(lambda t, x: t + x.astype(jnp.float32), total, (grads, sums)), model_state), None

        grad_shapes, (sum_shapes, _) = jax.eval_shape(grad_fn, params, model_state, first, key, scale, total_weight,
                                                      count)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (grad_shapes, sum_shapes))
        (grads, sums), model_state = jax.lax.scan(one, (zeros, model_state), (jnp.arange(count), batch))[0]
        return grads, sums, model_state

    def pipeline_gradients(params, model_state, batch, key, scale, total_weight):
        return *gradients(compute_params(params), batch, key, scale, total_weight), model_state

    def gradient_step(state: TrainState, batch: dict) -> tuple[Tree, Metrics, Tree]:
        batch = in_context_order(batch)
        step_key = jax.random.fold_in(state.rng, state.step)
        scale = loss_scale(state, policy)
        total_weight = replicas.total(objective_weight(batch, loss))
        by_replica = replicas.split(batch)
        keys = jax.vmap(lambda r: jax.random.fold_in(step_key, r))(replicas.indices())
        per_replica = pipeline_gradients if gradients is not None else replica_gradients
        grads_R, sums_R, model_state_R = replicas.each(per_replica)(state.params, state.model_state, by_replica,
                                                                    keys, scale, total_weight)
        # (2) Synchronise across replicas in the scaled domain, in the communication dtype.
        with jax.named_scope("sync"):
            grads = replicas.sum_gradients(grads_R, policy.communication)
            sums = replicas.sum_metrics(sums_R)
            model_state = replicas.mean_model_state(model_state_R)
        with jax.named_scope("unscale"):
            grads = jax.tree.map(lambda g: g / scale, grads)
        return grads, sums, model_state

    return gradient_step


def make_train_step(model: ModelDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    loss: str | Preference, policy: Policy, *, clip_norm: float | None, skip_nonfinite: bool,
                    replicas: PartitionedReplicas | ExplicitReplicas,
                    compute_params: Callable[[Tree], Tree] = lambda p: p,
                    gradients: Callable | None = None, trees: Any = WholeTrees(),
                    ) -> Callable[[TrainState, dict], tuple[TrainState, Metrics]]:
    """`replicas` says where the data replicas live and how their gradients are summed
    (lowering/grad_sync.py): one global program for the partitioner, or a per-device shard_map body.
    `gradients`: see make_gradient_step. `trees` takes norms of trees that may be split
    over devices (WholeTrees, or a pipeline's StagedTrees)."""
    gradient_step = make_gradient_step(model, loss, policy, replicas=replicas, compute_params=compute_params,
                                       gradients=gradients)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, Metrics]:
        scale = loss_scale(state, policy)
        grads, sums, model_state = gradient_step(state, batch)
        if model.reports is not None:
            model_state = model.reports.rebalance(model_state, sums["router_load"])
        # (3) Agree on finiteness, clip by the global norm of the synchronised, unscaled gradients. The norm is
        # finite exactly when every gradient is (an inf or NaN anywhere carries into it), unless it overflows
        # float32, and then no update from it is usable either; one pass over the gradients serves both.
        with jax.named_scope("grad_norm"):
            grad_norm = trees.norm(grads)
        with jax.named_scope("finite_check"):
            finite = jnp.isfinite(grad_norm) & jnp.isfinite(sums["loss"])
        with jax.named_scope("clip"):
            if clip_norm is not None:
                grads = clip_to_norm(grads, grad_norm, clip_norm)
        # (4) Update, or keep params and optimizer state when a gradient overflowed.
        with jax.named_scope("update"):
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
            params, opt_state = replicas.apply_update(tx, grads, state.opt_state, state.params)
            if skip_nonfinite or policy.dynamic_scale:
                # A skipped step leaves the whole model as it was, model state (running statistics) included.
                params, opt_state, model_state = jax.tree.map(
                    lambda new, old: jnp.where(finite, new, old), (params, opt_state, model_state),
                    (state.params, state.opt_state, state.model_state))
        new = state.replace(step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state,
                            loss_scale=next_loss_scale(state.loss_scale, finite, policy.loss_scale))
        metrics = {**means(sums), "grad_norm": grad_norm, "param_norm": trees.param_norm(params),
                   "lr": schedule(state.step), "finite": finite}
        if model.reports is not None:
            metrics.update(model.reports.metrics(sums))
        if policy.dynamic_scale:
            metrics["loss_scale"] = scale
        return new, metrics

    return train_step


def fuse_steps(train_step: Callable, steps: int) -> Callable:
    """k optimizer steps in one executable: lax.scan over a leading axis of k batches; metrics stack."""
    if steps == 1:
        return train_step

    def fused_train_step(state, batches):
        return jax.lax.scan(train_step, state, batches)

    return fused_train_step


def clip_to_norm(grads: Tree, norm: jax.Array, max_norm: float) -> Tree:
    """optax.clip_by_global_norm with the norm given (it may add parts held on other devices)."""
    keep = norm < max_norm
    return jax.tree.map(lambda g: jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm), grads)


def make_eval_step(model: ModelDef, loss: str | Preference, policy: Policy,
                   compute_params: Callable[[Tree], Tree] = lambda p: p) -> Callable[[TrainState, dict], Metrics]:
    forward = make_forward(model, policy, compute_params)

    def eval_step(state: TrainState, batch: dict) -> Metrics:
        batch = in_context_order(batch)
        params = evaluated_params(state.opt_state, state.params)
        outputs = forward(params, state.model_state, model_inputs(batch, loss), None, documents_of(batch))[0]
        return eval_metrics(objective_sums(outputs_and_reports(outputs)[0], batch, loss))

    return eval_step


def in_context_order(batch: dict) -> dict:
    """With context parallelism (the traced step splits the sequence over `context`, or is one device's program in
    a context group): every entry's sequence in balanced_order (xlatrain/models/context.py), or in a per-device
    program this device's part of it, the tokens' positions and segment ids among them (positions 0, 1, ... and
    one segment where the data does not pack documents), which attention and RoPE read; the loss, a mean over the
    tokens, is the same in any order. The batch as it is otherwise."""
    layout, group = context_split(), current_context_group()
    if layout is None and group is None:
        return batch
    size = layout.context if layout is not None else group.size
    shape = batch["inputs"].shape
    if shape[-1] % (2 * size):
        raise UserError(f"mesh.context={size} cuts each row into {2 * size} equal chunks, and the data's rows "
                        f"hold {shape[-1]} tokens: give rows of a multiple of {2 * size}")
    order = jnp.asarray(balanced_order(shape[-1], size))
    if group is not None:
        order = order.reshape(size, -1)[group.index()]
    whole = {"positions": jnp.broadcast_to(jnp.arange(shape[-1], dtype=jnp.int32), shape),
             "segment_ids": jnp.ones(shape, jnp.int32), **batch}
    return {key: jnp.take(value, order, axis=-1) for key, value in whole.items()}


def eval_metrics(sums: Metrics) -> Metrics:
    return {f"eval_{k}": v for k, v in means(sums).items()}

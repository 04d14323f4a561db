"""Pure step functions: `train_step(state, batch) -> (state, metrics)` and `eval_step(state, batch)`.

No jit, shardings or donation here (lowering/compile.py applies them once). Training batches are
[microbatches, rows, ...]; gradients are accumulated over the microbatches with lax.scan, so the
step equals one step on the whole batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
import optax.losses

from xlatrain.state import ModelDef, TrainState

Metrics = dict[str, jax.Array]


def loss_and_metrics(outputs: jax.Array, targets: jax.Array, loss: str) -> tuple[jax.Array, Metrics]:
    if loss == "mse":
        err = jnp.mean(jnp.square(outputs.astype(jnp.float32) - targets.reshape(outputs.shape)))
        return err, {}
    logits = outputs.astype(jnp.float32)
    value = jnp.mean(optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets))
    accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))
    return value, {"accuracy": accuracy}


def make_train_step(model: ModelDef, tx: optax.GradientTransformation, schedule: optax.Schedule, loss: str,
                    skip_nonfinite: bool, compute_params: Callable[[Any], Any] = lambda p: p,
                    ) -> Callable[[TrainState, dict], tuple[TrainState, Metrics]]:
    """`compute_params` lays params out for the forward pass (FSDP: gather them; their gradients are
    then reduce-scattered back to the stored layout by the partitioner)."""

    def objective(params, micro, key):
        outputs = model.apply(compute_params(params), micro["inputs"], key)
        return loss_and_metrics(outputs, micro["targets"], loss)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def accumulate(params, batch, step_key):
        """Mean loss, metrics and f32 gradients over the microbatches (the leading batch axis)."""
        count = jax.tree.leaves(batch)[0].shape[0]
        if count == 1:
            (value, aux), grads = grad_fn(params, jax.tree.map(lambda x: x[0], batch), step_key)
            return value, aux, grads

        def one(total, indexed):
            index, micro = indexed
            (value, aux), grads = grad_fn(params, micro, jax.random.fold_in(step_key, index))
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            return jax.tree.map(jnp.add, total, (value, aux, grads)), None

        _, aux_shapes = jax.eval_shape(objective, params, jax.tree.map(lambda x: x[0], batch), step_key)
        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shapes),
                 jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        total, _ = jax.lax.scan(one, zeros, (jnp.arange(count), batch))
        return jax.tree.map(lambda x: x / count, total)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, Metrics]:
        step_key = jax.random.fold_in(state.rng, state.step)
        value, aux, grads = accumulate(state.params, batch, step_key)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if skip_nonfinite:
            new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state.replace(step=state.step + 1))
        metrics = {"loss": value, "grad_norm": grad_norm, "param_norm": optax.tree.norm(new.params),
                   "lr": schedule(state.step), "finite": finite, **aux}
        return new, metrics

    return train_step


def make_eval_step(model: ModelDef, loss: str) -> Callable[[TrainState, dict], Metrics]:
    def eval_step(state: TrainState, batch: dict) -> Metrics:
        outputs = model.apply(state.params, batch["inputs"])
        value, aux = loss_and_metrics(outputs, batch["targets"], loss)
        return {"eval_loss": value, **{f"eval_{k}": v for k, v in aux.items()}}

    return eval_step

"""DPO's objective (model.dpo) on a batch of preference pairs: inputs, targets and mask [pairs, 2, L] (the chosen row
first), and each row's reference log-probability [pairs, 2] (its weighted tokens' sum), precomputed.

A sequence's log-probability is the sum of its weighted targets' log-probabilities (the answer's tokens). With
the policy's log-ratios r = logp - reference of the chosen (c) and rejected (r) rows:
- sigmoid (DPO): loss = -log sigmoid(beta (r_c - r_r));
- ipo (IPO, as TRL computes it): the log-probabilities averaged over each sequence's weighted tokens, loss =
  ((r_c - r_r) - 1 / (2 beta))^2.
Rewards are beta r (TRL's rewards/chosen and rewards/rejected), their margin, and whether the chosen's is the larger
(rewards/accuracies). Every metric is a sum over pairs with the pairs' count as the weight, so that replicas and
microbatches add up as the token losses do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

Metrics = dict[str, jax.Array]
PAIRED = ("inputs", "targets", "mask")
"""The batch entries with a pair axis."""


@dataclass(frozen=True)
class Preference:
    beta: float
    loss: str
    """sigmoid or ipo."""


def objective_of(model: Any) -> str | Preference:
    """What a step minimises: model.loss over the tokens, or DPO's objective where model.dpo is set."""
    dpo = getattr(model, "dpo", None)
    return model.loss if dpo is None else Preference(dpo.beta, dpo.loss)


def pairs_as_rows(batch: dict) -> dict:
    """[..., pairs, 2, L] entries as [..., 2 pairs, L] rows (each pair's two side by side), what the model runs."""
    return {key: value.reshape(*value.shape[:-3], -1, value.shape[-1]) for key, value in batch.items()
            if key in PAIRED}


def sequence_log_probs(token_log_probs: jax.Array, mask: jax.Array, mean: bool) -> jax.Array:
    """[..., L] -> [...]: the weighted tokens' log-probabilities summed (or averaged, `mean`)."""
    total = jnp.sum(token_log_probs * mask, axis=-1)
    return total / jnp.maximum(jnp.sum(mask, axis=-1), 1.0) if mean else total


def preference_sums(token_log_probs: jax.Array, batch: dict, preference: Preference) -> Metrics:
    """The objective's and its metrics' sums over the batch's pairs; `token_log_probs` [..., pairs, 2, L], the
    policy's log-probability of each target."""
    mask = batch["mask"].astype(jnp.float32)
    mean = preference.loss == "ipo"
    policy = sequence_log_probs(token_log_probs, mask, mean)
    reference = batch["reference"].astype(jnp.float32)  # sums: IPO's mean divides them as the policy's
    ratios = policy - (reference / jnp.maximum(jnp.sum(mask, axis=-1), 1.0) if mean else reference)
    margin = ratios[..., 0] - ratios[..., 1]
    if preference.loss == "sigmoid":
        losses = -jax.nn.log_sigmoid(preference.beta * margin)
    else:
        losses = jnp.square(margin - 1.0 / (2.0 * preference.beta))
    rewards = preference.beta * jax.lax.stop_gradient(ratios)
    return {"loss": jnp.sum(losses), "weight": jnp.asarray(losses.size, jnp.float32),
            "rewards_chosen": jnp.sum(rewards[..., 0]), "rewards_rejected": jnp.sum(rewards[..., 1]),
            "rewards_margin": jnp.sum(rewards[..., 0] - rewards[..., 1]),
            "rewards_accuracy": jnp.sum((rewards[..., 0] > rewards[..., 1]).astype(jnp.float32)),
            "logps_chosen": jnp.sum(jax.lax.stop_gradient(policy[..., 0])),
            "logps_rejected": jnp.sum(jax.lax.stop_gradient(policy[..., 1]))}


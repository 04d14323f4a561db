"""xlatrain's compiled train step vs a hand-written `jax.jit` + optax loop on the same model and batch.

Both sides use the same nnx module, the same data, adam with the same clipping and cosine schedule,
donation of the state, and one host sync per step. Run on the default (single) device:

    python3 -m bench.step_overhead            # writes bench/results/step_overhead.json
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from flax import nnx

from bench.common import interleaved_medians, write_results
from xlatrain.config import load_config
from xlatrain.data.loader import make_global
from xlatrain.mesh import train_batch_sharding
from xlatrain.models import model_factory
from xlatrain.program import build_program

CASES = {
    "mlp": ["model.name=mlp", "data.source=digits", "batch.global_size=64", "optimizer.weight_decay=0"],
    "gpt": [],
}
STEPS_PER_ROUND = {"mlp": 200, "gpt": 10}
"""Enough steps that a round of the 0.2 ms MLP step is not lost in scheduling noise."""
ROUNDS = 10


def host_batch(program) -> dict[str, np.ndarray]:
    rows = [program.dataset.train[i] for i in range(program.derived.global_batch)]
    return {k: np.stack([r[k] for r in rows]) for k in ("inputs", "targets")}


def xlatrain_runner(program, batch):
    device_batch = make_global({k: v[None] for k, v in batch.items()}, train_batch_sharding(program.mesh), 1, 1)
    box = {"state": program.create_state()}
    step = program.train_step

    def run():
        box["state"], metrics = step(box["state"], device_batch)
        return metrics["loss"]

    return run


def handwritten_runner(program, batch):
    """What a user would write by hand with flax + optax for the same computation."""
    config = program.config
    model = model_factory(config.model, program.dataset.spec)(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    schedule = optax.cosine_decay_schedule(program.derived.effective_lr, config.trainer.steps,
                                           alpha=config.optimizer.final_lr_fraction)
    tx = optax.chain(optax.clip_by_global_norm(config.optimizer.clip_norm), optax.adam(schedule))
    opt_state = tx.init(params)
    inputs, targets = jax.device_put(batch["inputs"]), jax.device_put(batch["targets"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    box = {"params": params, "opt_state": opt_state}

    def run():
        box["params"], box["opt_state"], loss = step(box["params"], box["opt_state"], inputs, targets)
        return loss

    return run


def main() -> None:
    results = {}
    for name, overrides in CASES.items():
        program = build_program(load_config(None, [*overrides, "mesh.data=1"]), jax.devices()[:1])
        batch = host_batch(program)
        medians = interleaved_medians({"xlatrain": xlatrain_runner(program, batch),
                                       "handwritten": handwritten_runner(program, batch)},
                                      rounds=ROUNDS, steps_per_round=STEPS_PER_ROUND[name], warmup=5)
        results[name] = {"median_step_seconds": medians, "ratio_xlatrain_over_handwritten":
                         medians["xlatrain"] / medians["handwritten"],
                         "steps_per_candidate": ROUNDS * STEPS_PER_ROUND[name],
                         "params": program.param_count, "global_batch": program.derived.global_batch}
        print(f"{name}: xlatrain {medians['xlatrain'] * 1e3:.3f} ms, hand-written "
              f"{medians['handwritten'] * 1e3:.3f} ms, ratio {results[name]['ratio_xlatrain_over_handwritten']:.3f}")
    path = write_results("step_overhead", "python3 -m bench.step_overhead",
                         {"target": "ratio <= 1.05", "cases": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

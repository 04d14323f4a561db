"""Where a pipeline slot should write a forward's residuals, and how it should skip the actions that are not its
own. Three ways, over the same slots:

- after the switch: each branch of a `lax.switch` returns a slot-sized buffer, zeros from the branches that
  keep nothing, and one dynamic-update-slice writes it into the pool (how lowering/pipeline/gradients.py did it);
- inside the branch: the pool passed through the switch, written in place by the forward branch alone, read by
  the backward branch, untouched by an idle one;
- in a while loop: each action a `while_loop` of zero or one trips over the pool (lowering/pipeline/gradients.py's
  `run_when`, how it runs now), the forward writing into the pool and the backward reading it in place.

The second and third move fewer bytes on paper; this measures whether XLA:CPU keeps the pool in place.

The slots loop like a 1F1B step's (idle, forward, backward in turn) over a pool of 4 buffers of the bench
GPT's residuals per microbatch (3.2 MB); one device.

    python3 -m bench.residual_pool            # writes bench/results/residual_pool.json
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from xlatrain.lowering.pipeline.gradients import run_when

from bench.common import interleaved_medians, write_results

BUFFERS, RESIDUAL_FLOATS, SLOTS = 4, 800_000, 22
WEIGHT = jnp.full((256, 256), 0.01)


def forward(x: jax.Array) -> jax.Array:
    """A slot-sized residual buffer from a small activation."""
    values = jnp.tanh(x @ WEIGHT).ravel()
    return jnp.tile(values, RESIDUAL_FLOATS // values.size + 1)[:RESIDUAL_FLOATS]


def backward(residuals: jax.Array, x: jax.Array) -> jax.Array:
    return x + residuals[:x.size].reshape(x.shape) * 1e-3


def after_the_switch(pool: jax.Array, x: jax.Array):
    def slot(carry, i):
        pool, x = carry
        branches = [lambda read, x: (jnp.zeros((RESIDUAL_FLOATS,)), x),
                    lambda read, x: (forward(x), x),
                    lambda read, x: (jnp.zeros((RESIDUAL_FLOATS,)), backward(read, x))]
        written, x = jax.lax.switch(i % 3, branches, pool[i % BUFFERS], x)
        return (jax.lax.dynamic_update_index_in_dim(pool, written, (i + 1) % BUFFERS, 0), x), None

    return jax.lax.scan(slot, (pool, x), jnp.arange(SLOTS))[0]


def inside_the_branch(pool: jax.Array, x: jax.Array):
    def slot(carry, i):
        pool, x = carry
        branches = [lambda pool, x: (pool, x),
                    lambda pool, x: (jax.lax.dynamic_update_index_in_dim(pool, forward(x), (i + 1) % BUFFERS, 0), x),
                    lambda pool, x: (pool, backward(jax.lax.dynamic_index_in_dim(pool, i % BUFFERS, 0, False), x))]
        return jax.lax.switch(i % 3, branches, pool, x), None

    return jax.lax.scan(slot, (pool, x), jnp.arange(SLOTS))[0]


def in_a_while_loop(pool: jax.Array, x: jax.Array):
    def slot(carry, i):
        def forward_action(state, i):
            pool, x = state
            return jax.lax.dynamic_update_index_in_dim(pool, forward(x), (i + 1) % BUFFERS, 0), x

        def backward_action(state, i):
            pool, x = state
            return pool, backward(jax.lax.dynamic_index_in_dim(pool, i % BUFFERS, 0, False), x)

        state = run_when(i % 3 == 1, forward_action, carry, i)
        return run_when(i % 3 == 2, backward_action, state, i), None

    return jax.lax.scan(slot, (pool, x), jnp.arange(SLOTS))[0]


WAYS = {"after_the_switch": after_the_switch, "inside_the_branch": inside_the_branch,
        "in_a_while_loop": in_a_while_loop}


def runner(fn):
    x = jnp.ones((64, 256))
    compiled = jax.jit(fn, donate_argnums=0).lower(jnp.zeros((BUFFERS, RESIDUAL_FLOATS)), x).compile()
    pool_bytes = BUFFERS * RESIDUAL_FLOATS * 4
    whole_pool_copies = len(re.findall(rf"f32\[{BUFFERS},{RESIDUAL_FLOATS}\]\S* copy\(", compiled.as_text()))
    box = {"pool": jnp.zeros((BUFFERS, RESIDUAL_FLOATS))}

    def run():
        box["pool"], y = compiled(box["pool"], x)
        return y

    return run, {"whole_pool_copies_in_hlo": whole_pool_copies, "pool_bytes": pool_bytes}


def main() -> None:
    candidates, hlo = {}, {}
    for name, fn in WAYS.items():
        candidates[name], hlo[name] = runner(fn)
    medians = interleaved_medians(candidates, rounds=6, steps_per_round=10, warmup=3)
    ratios = {name: seconds / medians["after_the_switch"] for name, seconds in medians.items()}
    for name, seconds in medians.items():
        print(f"{name}: {seconds * 1e3:.2f} ms per {SLOTS} slots ({ratios[name]:.2f}x after the switch), "
              f"whole-pool copies in the HLO: {hlo[name]['whole_pool_copies_in_hlo']}")
    path = write_results("residual_pool", "python3 -m bench.residual_pool",
                         {"median_seconds": medians, "hlo": hlo, "ratio_to_after_the_switch": ratios,
                          "slots": SLOTS, "buffers": BUFFERS, "residual_bytes": RESIDUAL_FLOATS * 4})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

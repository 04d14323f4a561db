"""The routed experts' matmuls four ways (xlatrain/models/moe.py: `sorted` through jax.lax.ragged_dot, `dense`
every expert on every token, `padded` a capacity-padded batched matmul, `blocked` blocks of rows sorted by expert,
each multiplied by its expert's weights), forward and backward of one MoE layer's
experts on one CPU device: 8 experts, top-2, at two sizes, and 32 experts, top-4 (experts / top_k decides what
`dense` and `padded` waste); seconds per call as the median of interleaved rounds, each against `sorted` in the
same run, and XLA's FLOPs of each compiled program.

    python3 -m bench.moe_routing                     # writes bench/results/moe_routing.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.common import interleaved_medians, write_results
from xlatrain.models.moe import route, routed_experts

SHAPES = ({"experts": 8, "top_k": 2, "tokens": 2048, "width": 256, "hidden": 512},
          {"experts": 8, "top_k": 2, "tokens": 4096, "width": 512, "hidden": 1024},
          {"experts": 32, "top_k": 4, "tokens": 2048, "width": 256, "hidden": 256})
FORMULATIONS = ("sorted", "dense", "padded", "blocked")


def step_of(formulation: str, shape: dict):
    keys = jax.random.split(jax.random.key(0), 5)
    e, t, d, f = shape["experts"], shape["tokens"], shape["width"], shape["hidden"]
    x = jax.random.normal(keys[0], (t, d))
    params = {"router": jax.random.normal(keys[1], (d, e)) / d ** 0.5,
              "gate": jax.random.normal(keys[2], (e, d, f)) / d ** 0.5,
              "up": jax.random.normal(keys[3], (e, d, f)) / d ** 0.5,
              "down": jax.random.normal(keys[4], (e, f, d)) / f ** 0.5}

    def loss(params, x):
        routing = route(x @ params["router"], shape["top_k"])
        return jnp.mean(routed_experts(x, routing, params["gate"], params["up"], params["down"], formulation) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
    flops = (compiled.cost_analysis() or {}).get("flops")
    return (lambda: compiled(params, x)), flops


def main() -> None:
    rows = []
    for shape in SHAPES:
        steps = {name: step_of(name, shape) for name in FORMULATIONS}
        seconds = interleaved_medians({name: run for name, (run, _) in steps.items()}, rounds=6, steps_per_round=5,
                                      warmup=2)
        for name in FORMULATIONS:
            rows.append({**shape, "formulation": name, "median_seconds": seconds[name],
                         "vs_sorted": seconds[name] / seconds["sorted"], "xla_flops": steps[name][1]})
            print(f"{shape}: {name:>7} {seconds[name] * 1e3:8.2f} ms ({seconds[name] / seconds['sorted']:.2f}x "
                  f"sorted), XLA FLOPs {steps[name][1]:.3g}", flush=True)
    path = write_results("moe_routing", "python3 -m bench.moe_routing",
                         {"what": "forward and backward of one layer's routed experts (router included), float32, "
                          "one CPU device", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Where a CPU train step's time goes: the matmuls' share of xlatrain's step and of eager PyTorch's, on the same
shapes (bench.cpu_speed's GPTs, one device).

    PYTHONPATH=examples/torch_model python3 -m bench.cpu_profile    # writes bench/results/cpu_profile.json

XLA's side: every dot of the compiled step (optimised HLO, each counted as often as the loops around it run) is
timed alone as XLA:CPU compiles that one dot (less a trivial call's dispatch), and the same product as a batched
matmul in PyTorch (its MKL or oneDNN kernels) and in numpy (the OpenBLAS its wheel bundles: what a BLAS custom call
would run); their sums against the step's time give the matmuls' share and what the rest costs. PyTorch's side:
`torch.profiler`'s self CPU time per operator over a few eager steps, the matmul operators' share (its fused
attention kernel apart).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX or torch start a thread

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from xlatrain.lowering.kernels import kernels, parse_computations  # noqa: E402

from bench.common import interleaved_medians, train_runner, write_results  # noqa: E402
from bench.cpu_speed import SHAPES, programs  # noqa: E402
from bench.torch_bridge import eager_runner  # noqa: E402

TORCH_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")
"""PyTorch operators whose self time is a matmul kernel's (their callers' self time is what they add beside it)."""
_DIMS = ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims")


@dataclass(frozen=True)
class Dot:
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    dims: tuple[tuple[int, ...], ...]  # lhs contracting, rhs contracting, lhs batch, rhs batch

    @classmethod
    def of(cls, lhs: list[int], rhs: list[int], text: str) -> Dot:
        """From a dot's operand dimensions and its line of HLO."""
        found = {key: re.search(rf"{key}={{([\d,]*)}}", text) for key in _DIMS}
        return cls(tuple(lhs), tuple(rhs), tuple(tuple(int(d) for d in found[key].group(1).split(",") if d)
                                                 if found[key] else () for key in _DIMS))

    def canonical(self) -> tuple[int, int, int, int]:
        """(batch, rows, contracted, columns) of the same product as a batched matmul."""
        batch = int(np.prod([self.lhs[d] for d in self.dims[2]]))
        contracted = int(np.prod([self.lhs[d] for d in self.dims[0]]))
        rows = int(np.prod(self.lhs)) // (batch * contracted)
        return batch, rows, contracted, int(np.prod(self.rhs)) // (batch * contracted)

    def flops(self) -> int:
        return 2 * int(np.prod(self.canonical()))


def step_dots(hlo: str) -> Counter:
    """Every dot of an optimised HLO module, with the number of times a step runs it (lowering/kernels.py's
    kernels: a loop's body as many times as its known trip count)."""
    computations, entry = parse_computations(hlo)
    runs: Counter = Counter()
    for kernel in kernels(computations, entry):
        for lhs, rhs, text in kernel.dots:
            runs[Dot.of(lhs, rhs, text)] += kernel.trips
    return runs


def _random(shape) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, np.float32)


def _kernel_seconds(product, trivial, calls: int) -> float:
    """A call's time less that of a trivial call on the same operands (the dispatch: about 30 us a call through
    jax, a few through torch or numpy), interleaved."""
    medians = interleaved_medians({"product": product, "trivial": trivial}, rounds=3, steps_per_round=calls // 3,
                                  warmup=3)
    return max(0.0, medians["product"] - medians["trivial"])


def xla_seconds(dot: Dot, calls: int = 30) -> float:
    """The dot as XLA:CPU compiles it alone, with the step's dimension numbers."""
    lhs, rhs = (jax.device_put(_random(shape), jax.devices()[0]) for shape in (dot.lhs, dot.rhs))
    contracting, batch = (dot.dims[0], dot.dims[1]), (dot.dims[2], dot.dims[3])
    product = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (contracting, batch))).lower(lhs, rhs).compile()
    trivial = jax.jit(lambda a, b: a.ravel()[0] + b.ravel()[0]).lower(lhs, rhs).compile()
    return _kernel_seconds(lambda: product(lhs, rhs), lambda: trivial(lhs, rhs), calls)


def library_seconds(dot: Dot, matmul, calls: int = 30) -> float:
    """The same product as a batched matmul of operands laid out for it (`matmul`: torch's or numpy's)."""
    b, m, k, n = dot.canonical()
    lhs, rhs = _random((b, m, k)), _random((b, k, n))
    if matmul is torch.matmul:
        lhs, rhs = torch.from_numpy(lhs), torch.from_numpy(rhs)
    return _kernel_seconds(lambda: matmul(lhs, rhs), lambda: lhs[0, 0, 0] + rhs[0, 0, 0], calls)


def torch_operator_shares(run, steps: int = 5) -> dict[str, float]:
    """Each PyTorch operator's share of the eager step's self CPU time (the matmul operators summed apart)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            run()
    self_us = {event.key: event.self_cpu_time_total for event in profile.key_averages()}
    total = sum(self_us.values())
    top = dict(sorted(((k, v / total) for k, v in self_us.items()), key=lambda kv: -kv[1])[:8])
    return {"matmuls": sum(v for k, v in self_us.items() if k in TORCH_MATMULS) / total, **top}


def profile(width: int, seq_len: int) -> dict:
    built = programs(width, seq_len)
    xla_step = built["unrolled"]
    steps = interleaved_medians({"xlatrain": train_runner(xla_step), "pytorch_eager": eager_runner(built["torch"])},
                                rounds=6, steps_per_round=10, warmup=5)
    dots = step_dots(xla_step.train_step.first.compiled.as_text())
    on_xla = sum(times * xla_seconds(dot) for dot, times in dots.items())
    in_torch = sum(times * library_seconds(dot, torch.matmul) for dot, times in dots.items())
    in_openblas = sum(times * library_seconds(dot, np.matmul) for dot, times in dots.items())
    return {"step_seconds": steps, "dots_per_step": sum(dots.values()), "distinct_dots": len(dots),
            "dot_gflops_per_step": sum(times * dot.flops() for dot, times in dots.items()) / 1e9,
            "xla_dots_seconds": on_xla, "the_same_dots_in_torch_seconds": in_torch,
            "the_same_dots_in_numpys_openblas_seconds": in_openblas,
            "xla_dots_share_of_step": on_xla / steps["xlatrain"],
            "xla_step_beside_its_dots_seconds": steps["xlatrain"] - on_xla,
            "torch_operator_shares": torch_operator_shares(eager_runner(built["torch"]))}


def main() -> None:
    results = {}
    for label, shape in SHAPES.items():
        r = results[label] = profile(**shape)
        steps, shares = r["step_seconds"], r["torch_operator_shares"]
        torch_dots = shares["matmuls"] * steps["pytorch_eager"]
        print(f"{label}: xlatrain {steps['xlatrain'] * 1e3:.1f} ms, "
              f"PyTorch eager {steps['pytorch_eager'] * 1e3:.1f} ms")
        print(f"  matmuls: XLA {r['xla_dots_seconds'] * 1e3:.1f} ms ({r['xla_dots_share_of_step']:.0%} of its step; "
              f"{r['dots_per_step']} dots, {r['dot_gflops_per_step']:.2f} GFLOP), the same dots in PyTorch "
              f"{r['the_same_dots_in_torch_seconds'] * 1e3:.1f} ms, in numpy's OpenBLAS "
              f"{r['the_same_dots_in_numpys_openblas_seconds'] * 1e3:.1f} ms; "
              f"PyTorch's own step {torch_dots * 1e3:.1f} ms "
              f"({shares['matmuls']:.0%})")
        print(f"  the rest: XLA {r['xla_step_beside_its_dots_seconds'] * 1e3:.1f} ms, "
              f"PyTorch {(steps['pytorch_eager'] - torch_dots) * 1e3:.1f} ms")
    path = write_results("cpu_profile", "PYTHONPATH=examples/torch_model python3 -m bench.cpu_profile",
                         {"torch_threads": torch.get_num_threads(), "malloc": MALLOC, "shapes": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The CUDA/NCCL custom-call collectives on this machine's GPUs against lax's (XLA's own NCCL collectives): every op
and reduction x dtype, gradients, and the FFI stream path: the custom call runs on XLA's stream, between the
kernels that make its input and read its output, many times in one program.

On one GPU every op runs over a one-rank NCCL communicator: that checks the FFI binding, the stream, the buffers,
the dtypes and the gradients' rules, not NCCL's traffic between GPUs (which needs two or more). Run with
XLATRAIN_TEST_GPU=1 (tests/conftest.py) on a machine with a GPU and the CUDA extension built
(-Ccmake.define.XLATRAIN_CUDA=ON); elsewhere the module is skipped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_collectives import assert_matches, in_float32, per_device
from xlatrain.custom_calls.ops import all_gather, all_reduce, all_to_all, broadcast, ppermute, reduce_scatter

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a GPU: run with XLATRAIN_TEST_GPU=1 on a machine with one")

DTYPES = ["float32", "bfloat16", "float16", "int32"]


@pytest.fixture(scope="module")
def mesh():
    from xlatrain.custom_calls import nccl

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    nccl.setup_communicators(mesh)
    return mesh


def cases(n: int) -> dict:
    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        **{f"all_reduce-{r}": (lambda x, r=r: all_reduce.all_reduce(x, "d", r),
                               lambda x, r=r: all_reduce.reference(x, "d", r)) for r in ("sum", "mean", "max", "min")},
        "all_gather": (lambda x: all_gather.all_gather(x, "d"), lambda x: all_gather.reference(x, "d")),
        "all_gather-tiled": (lambda x: all_gather.all_gather(x, "d", tiled=True),
                             lambda x: all_gather.reference(x, "d", tiled=True)),
        **{f"reduce_scatter-{r}": (lambda x, r=r: reduce_scatter.reduce_scatter(x, "d", r),
                                   lambda x, r=r: reduce_scatter.reference(x, "d", r)) for r in ("sum", "mean")},
        "all_to_all": (lambda x: all_to_all.all_to_all(x, "d", 0, 1, tiled=True),
                       lambda x: all_to_all.reference(x, "d", 0, 1, tiled=True)),
        "ppermute-ring": (lambda x: ppermute.ppermute(x, "d", ring), lambda x: ppermute.reference(x, "d", ring)),
        "broadcast": (lambda x: broadcast.broadcast(x, "d", n - 1), lambda x: broadcast.reference(x, "d", n - 1)),
    }


NAMES = list(cases(1))
DIFFERENTIABLE = [name for name in NAMES if not name.endswith(("-max", "-min"))]


def sample(dtype: str, rows: int, seed: int = 0) -> jax.Array:
    data = np.random.default_rng(seed).normal(size=(rows, 1000)) * 4
    return jnp.asarray(data.round() if dtype == "int32" else data).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_every_op_equals_xlas_collective(name, dtype, mesh):
    if name.endswith("-mean") and dtype == "int32":
        pytest.skip("mean of integers is refused (tests/test_collectives.py)")
    n = mesh.size
    ours, reference = cases(n)[name]
    x = sample(dtype, 2 * n * n)  # rows that reduce_scatter splits over n, for every device's block
    program = per_device(ours, mesh)
    assert "xlatrain_cuda_" in program.lower(x).compile().as_text()
    # 16-bit floats are reduced in float32 and rounded once (as on CPU), so the reference is lax's in float32
    assert_matches(program(x), per_device(in_float32(reference, dtype), mesh)(x), dtype)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradients_equal_xlas(name, mesh):
    n = mesh.size
    ours, reference = cases(n)[name]
    x = sample("float32", 2 * n * n)
    weights = sample("float32", 2 * n ** 3, seed=1).reshape(-1)  # as many as all_gather returns

    def loss(fn):
        def total(v):
            out = per_device(fn, mesh)(v)
            return jnp.sum(out.reshape(-1) * weights[:out.size])

        return total

    np.testing.assert_allclose(jax.grad(loss(ours))(x), jax.grad(loss(reference))(x), rtol=1e-5, atol=1e-5)


def test_the_call_runs_on_xlas_stream_between_the_kernels_around_it(mesh):
    """Each of 64 iterations computes the call's input in a kernel, reduces it, and computes on the result: a call
    on another stream, or one that returned before its result was written, would read or leave a stale buffer."""
    n = mesh.size

    def steps(reduce):
        def body(_, v):
            return jnp.tanh(reduce(jnp.sin(v) * 1.5 + 0.25) / n) * 2.0

        return lambda v: jax.lax.fori_loop(0, 64, body, v)

    x = sample("float32", 4 * n).repeat(256, axis=1)  # 256,000 floats per row: kernels long enough to overlap
    ours = per_device(steps(lambda v: all_reduce.all_reduce(v, "d")), mesh)
    hlo = ours.lower(x).compile().as_text()
    assert 'custom_call_target="xlatrain_cuda_all_reduce"' in hlo and "API_VERSION_TYPED_FFI" in hlo
    np.testing.assert_allclose(ours(x), per_device(steps(lambda v: jax.lax.psum(v, "d")), mesh)(x), rtol=1e-5,
                               atol=1e-5)


def test_one_communicator_per_group_spans_the_mesh_axis(mesh):
    """What this run's NCCL traffic covers: one rank per GPU of the axis (one, on a machine with one GPU)."""
    x = jnp.ones((mesh.size, 4), jnp.int32)
    assert np.asarray(per_device(lambda v: all_reduce.all_reduce(v, "d"), mesh)(x)).tolist() == [[mesh.size] * 4] * \
        mesh.size

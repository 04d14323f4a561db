"""The custom-call collectives against their lax references on 8 CPU devices: every op x dtype x shape
class, gradients, vmap, a 2-D mesh, the timeout error, and the CUDA extension's compile check."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from conftest import REPO
from jax.sharding import PartitionSpec as P
from xlatrain.custom_calls.ops import all_gather, all_reduce, all_to_all, broadcast, ppermute, reduce_scatter

from xlatrain.compat.mapping import shard_map

DTYPES = ["float32", "float64", "bfloat16", "float16", "int32"]
SHAPES = {"empty": (0,), "one": (1,), "odd": (3, 7), "large": (2, 1000)}
"""Per-device shapes: no elements, one element, 21 (not a multiple of 8), 2000."""
RING = [(i, (i + 1) % 8) for i in range(8)]
PARTIAL = [(0, 3), (3, 5), (6, 1)]


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("d",))


def per_device(fn, mesh):
    """Run fn on each device's block of a [8 * rows, ...] array; results are stacked the same way."""
    return jax.jit(shard_map(fn, mesh, P("d"), P("d")))


def sample(dtype, shape, seed=0):
    data = np.random.default_rng(seed).normal(size=(8, *shape)) * 4
    return jnp.asarray(data.round() if dtype == "int32" else data).astype(dtype)


def in_float32(reference, dtype):
    """16-bit floats are reduced in float32 (then rounded once), so that is the reference."""
    if dtype not in ("bfloat16", "float16"):
        return reference
    return lambda x: reference(x.astype(jnp.float32)).astype(dtype)


def expected(reference, x):
    """The reference's result; for empty inputs, which XLA's collectives reject, its (empty) shape."""
    if x.size == 0:
        out = jax.eval_shape(reference, x)
        return jnp.zeros(out.shape, out.dtype)
    return reference(x)


def assert_matches(got, want, dtype):
    got, want = np.asarray(got.astype(jnp.float64 if dtype == "float64" else jnp.float32)), \
        np.asarray(want.astype(jnp.float64 if dtype == "float64" else jnp.float32))
    assert got.shape == want.shape
    if dtype == "int32":
        np.testing.assert_array_equal(got, want)
    else:
        tol = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


CASES = {
    "all_reduce-sum": (lambda x: all_reduce.all_reduce(x, "d"), lambda x: all_reduce.reference(x, "d")),
    "all_reduce-mean": (lambda x: all_reduce.all_reduce(x, "d", "mean"),
                        lambda x: all_reduce.reference(x, "d", "mean")),
    "all_reduce-max": (lambda x: all_reduce.all_reduce(x, "d", "max"), lambda x: all_reduce.reference(x, "d", "max")),
    "all_reduce-min": (lambda x: all_reduce.all_reduce(x, "d", "min"), lambda x: all_reduce.reference(x, "d", "min")),
    "all_gather": (lambda x: all_gather.all_gather(x, "d"), lambda x: all_gather.reference(x, "d")),
    "all_gather-tiled": (lambda x: all_gather.all_gather(x, "d", tiled=True),
                         lambda x: all_gather.reference(x, "d", tiled=True)),
    "ppermute-ring": (lambda x: ppermute.ppermute(x, "d", RING), lambda x: ppermute.reference(x, "d", RING)),
    "ppermute-partial": (lambda x: ppermute.ppermute(x, "d", PARTIAL), lambda x: ppermute.reference(x, "d", PARTIAL)),
    "broadcast": (lambda x: broadcast.broadcast(x, "d", 5), lambda x: broadcast.reference(x, "d", 5)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_op_matches_its_reference(case, shape, dtype, mesh):
    if case == "all_reduce-mean" and dtype == "int32":
        pytest.skip("mean of integers: see test_integer_mean_is_refused")
    ours, reference = CASES[case]
    with jax.enable_x64(dtype == "float64"):
        x = sample(dtype, shape).reshape(8 * shape[0], *shape[1:])
        assert_matches(per_device(ours, mesh)(x), expected(per_device(in_float32(reference, dtype), mesh), x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 3], ids=["empty", "one-block", "odd-blocks"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduce_scatter_matches_psum_scatter(reduction, rows, dtype, mesh):
    if reduction == "mean" and dtype == "int32":
        pytest.skip("mean of integers")
    with jax.enable_x64(dtype == "float64"):
        x = sample(dtype, (8 * rows, 5)).reshape(64 * rows, 5)
        ours = per_device(lambda v: reduce_scatter.reduce_scatter(v, "d", reduction), mesh)(x)
        want = expected(per_device(in_float32(lambda v: reduce_scatter.reference(v, "d", reduction), dtype), mesh), x)
        assert_matches(ours, want, dtype)


def test_reduce_scatter_of_an_axis_that_does_not_split_is_a_clear_error(mesh):
    with pytest.raises(ValueError, match=r"axis 0 of shape \(3, 2\) does not split over 8 participants"):
        per_device(lambda v: reduce_scatter.reduce_scatter(v, "d"), mesh)(jnp.zeros((24, 2)))


def test_integer_mean_is_refused(mesh):
    with pytest.raises(ValueError, match="mean of integers is not defined"):
        per_device(lambda v: all_reduce.all_reduce(v, "d", "mean"), mesh)(jnp.ones((8, 2), jnp.int32))


GRAD_CASES = ["all_reduce-sum", "all_reduce-mean", "all_gather", "all_gather-tiled", "ppermute-ring",
              "ppermute-partial", "broadcast"]


@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_match_the_reference(case, mesh):
    ours, reference = CASES[case]
    x = sample("float32", (3, 4))
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(8 * 3 * 8 * 4,)), jnp.float32)

    def loss(fn):
        def total(v):
            out = per_device(fn, mesh)(v.reshape(24, 4))
            return jnp.sum(out.reshape(-1) * weights[:out.size])

        return total

    np.testing.assert_allclose(jax.grad(loss(ours))(x), jax.grad(loss(reference))(x), rtol=1e-5, atol=1e-5)


ALL_TO_ALL = {"tiled-split1-concat2": (1, 2, True, (16, 3)), "tiled-split1-concat1": (1, 1, True, (8, 5)),
              "stacked-split1-concat0": (1, 0, False, (8, 3)), "tiled-empty": (1, 2, True, (0, 3))}
"""(split axis, concat axis, tiled, per-device shape after a leading row) of all_to_all."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ALL_TO_ALL, ids=ALL_TO_ALL.keys())
def test_all_to_all_matches_lax(case, dtype, mesh):
    split, concat, tiled, shape = ALL_TO_ALL[case]
    x = sample(dtype, shape)
    ours = per_device(lambda v: all_to_all.all_to_all(v, "d", split, concat, tiled=tiled), mesh)
    reference = per_device(lambda v: all_to_all.reference(v, "d", split, concat, tiled=tiled), mesh)
    assert_matches(ours(x), expected(reference, x), dtype)


def test_all_to_all_differentiates_and_vmaps_like_lax(mesh):
    x = sample("float32", (16, 3))
    weights = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)

    def loss(op):
        return lambda v: jnp.sum(per_device(lambda u: op(u, "d", 1, 2, tiled=True), mesh)(v).reshape(x.shape) * weights)

    np.testing.assert_allclose(jax.grad(loss(all_to_all.all_to_all))(x), jax.grad(loss(all_to_all.reference))(x),
                               rtol=1e-6)
    batched = per_device(jax.vmap(lambda v: all_to_all.all_to_all(v, "d", 0, 1, tiled=True)), mesh)
    reference = per_device(jax.vmap(lambda v: all_to_all.reference(v, "d", 0, 1, tiled=True)), mesh)
    np.testing.assert_allclose(batched(x), reference(x))


def test_reduce_scatter_and_all_gather_transpose_to_each_other(mesh):
    x = sample("float32", (16, 3)).reshape(128, 3)
    fn = per_device(lambda v: reduce_scatter.reduce_scatter(v, "d") * 2.0, mesh)
    ref = per_device(lambda v: reduce_scatter.reference(v, "d") * 2.0, mesh)
    cotangent = sample("float32", (2, 3), seed=2).reshape(16, 3)
    ours = jax.vjp(fn, x)[1](cotangent)[0]
    np.testing.assert_allclose(ours, jax.vjp(ref, x)[1](cotangent)[0], rtol=1e-6)
    jaxpr = str(jax.make_jaxpr(lambda c: jax.vjp(fn, x)[1](c))(cotangent))
    assert "xlatrain_all_gather" in jaxpr and "xlatrain_reduce_scatter" not in jaxpr.split("xlatrain_all_gather")[1]


def test_check_grads_of_a_collective_inside_shard_map(mesh):
    fn = per_device(lambda v: jnp.sin(all_reduce.all_reduce(v, "d", "mean")) * v, mesh)
    jax.test_util.check_grads(fn, (sample("float32", (2,)).reshape(16) / 4,), order=1, modes=["rev"],
                              atol=1e-2, rtol=1e-2)


def test_max_is_not_differentiable_like_lax(mesh):
    with pytest.raises(NotImplementedError, match="not differentiable"):
        jax.grad(lambda v: jnp.sum(per_device(lambda u: all_reduce.all_reduce(u, "d", "max"), mesh)(v)))(
            jnp.ones(8))


def test_vmap_inside_and_outside_shard_map(mesh):
    x = sample("float32", (4, 3)).reshape(32, 3)
    inside = per_device(jax.vmap(lambda v: all_gather.all_gather(v, "d")), mesh)(x)
    inside_ref = per_device(jax.vmap(lambda v: all_gather.reference(v, "d")), mesh)(x)
    np.testing.assert_allclose(inside, inside_ref)
    scattered = per_device(jax.vmap(lambda v: reduce_scatter.reduce_scatter(v, "d"), in_axes=1, out_axes=1), mesh)
    ref = per_device(jax.vmap(lambda v: reduce_scatter.reference(v, "d"), in_axes=1, out_axes=1), mesh)
    y = sample("float32", (16, 3)).reshape(128, 3)
    np.testing.assert_allclose(scattered(y), ref(y), rtol=1e-6)
    batch = jnp.stack([x, 2 * x])
    outside = jax.vmap(per_device(lambda v: all_reduce.all_reduce(v, "d"), mesh))(batch)
    np.testing.assert_allclose(outside[1], 2 * outside[0], rtol=1e-6)


def summed_in_rank_order(shards: np.ndarray) -> np.ndarray:
    """The shards added one at a time in rank order: what a custom all_reduce's sum gives, bit for bit."""
    total = shards[0].copy()
    for shard in shards[1:]:
        total += shard
    return total


@pytest.mark.parametrize("participants", [8, 5, 4])
def test_a_float32_sum_adds_the_participants_in_rank_order_bit_for_bit(participants):
    """Several inputs per pass over the accumulator (and wide vectors) must not change a bit of the result:
    sizes over one block of 4096 elements with a tail, values of mixed magnitudes so that order shows."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:participants]), ("d",))
    rng = np.random.default_rng(1)
    shards = (rng.normal(size=(participants, 4096 * 2 + 37)) * 10.0 ** rng.integers(-4, 5, (participants, 1)))
    shards = shards.astype(np.float32)
    got = per_device(lambda v: all_reduce.all_reduce(v, "d"), mesh)(shards.reshape(-1)).reshape(participants, -1)
    in_rank_order = summed_in_rank_order(shards)
    assert not np.array_equal(in_rank_order, shards[::-1].sum(0, dtype=np.float32))  # the order shows
    np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(in_rank_order, got.shape))


def test_collectives_past_the_last_level_cache_stream_their_outputs_and_stay_exact(mesh):
    """A reduction or gather whose inputs and outputs do not fit the last-level cache together writes them with
    non-temporal stores: the results must not change (sums in rank order, bit for bit; odd share sizes, so the
    shares' starts are not aligned; 16-bit floats, rounded once; a gather's pieces of an odd size, each in place)."""
    from xlatrain.custom_calls import _cpu

    cache = _cpu.last_level_cache_bytes()
    if cache == 0:
        pytest.skip("this host does not describe its caches in /sys/devices/system/cpu/cpu0/cache: nothing streams")
    count = 8 * (cache // (2 * 8 * 2 * 8) + 4097)  # per device: 2 x 8 devices x count x 2 bytes > cache
    shards = (np.random.default_rng(2).normal(size=(8, count)) * 100).astype(np.float32)
    in_rank_order = summed_in_rank_order(shards)
    summed = per_device(lambda v: all_reduce.all_reduce(v, "d"), mesh)(shards.reshape(-1)).reshape(8, -1)
    np.testing.assert_array_equal(np.asarray(summed), np.broadcast_to(in_rank_order, summed.shape))
    scattered = per_device(lambda v: reduce_scatter.reduce_scatter(v, "d"), mesh)(shards.reshape(-1))
    np.testing.assert_array_equal(np.asarray(scattered), in_rank_order)
    halves = jnp.asarray(shards).astype(jnp.bfloat16)
    mean = per_device(lambda v: all_reduce.all_reduce(v, "d", "mean"), mesh)(halves.reshape(-1)).reshape(8, -1)
    want = (np.asarray(halves.astype(jnp.float32)).sum(0) / 8).astype(jnp.bfloat16)
    assert_matches(mean, jnp.broadcast_to(want, mean.shape), "bfloat16")
    pieces = shards[:, :(cache // (8 * 9 * 4) + 1) | 1]  # odd; per device: 8 x (a piece + all 8 pieces) > cache
    gathered = per_device(lambda v: all_gather.all_gather(v, "d", tiled=True), mesh)(pieces.reshape(-1))
    np.testing.assert_array_equal(np.asarray(gathered).reshape(8, -1), np.tile(pieces.reshape(-1), (8, 1)))


def test_each_row_of_a_2d_mesh_meets_on_its_own():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("rows", "cols"))
    x = jnp.arange(8.0).reshape(2, 4)
    run = lambda fn: jax.jit(shard_map(fn, mesh, P("rows", "cols"), P("rows", "cols")))(x)  # noqa: E731
    np.testing.assert_array_equal(run(lambda v: all_reduce.all_reduce(v, "cols")),
                                  [[6.0] * 4, [22.0] * 4])
    np.testing.assert_array_equal(run(lambda v: all_reduce.all_reduce(v, "rows")), [[4, 6, 8, 10]] * 2)


def test_a_collective_called_in_a_loop_and_under_pmap_matches(mesh):
    def looped(v):
        return jax.lax.fori_loop(0, 3, lambda _, a: all_reduce.all_reduce(a, "d", "mean") + 1.0, v)

    x = sample("float32", (2,)).reshape(16)
    want = per_device(lambda v: jax.lax.fori_loop(0, 3, lambda _, a: jax.lax.pmean(a, "d") + 1.0, v), mesh)(x)
    np.testing.assert_allclose(per_device(looped, mesh)(x), want, rtol=1e-6)
    pmapped = jax.pmap(lambda v: all_reduce.all_reduce(v, "p"), axis_name="p")(x.reshape(8, 2))
    np.testing.assert_allclose(pmapped[3], x.reshape(8, 2).sum(0), rtol=1e-6)


def test_a_missing_participant_times_out_with_an_error_naming_the_op_and_the_ranks(mesh):
    def rank_three_skips(v):
        rank = jax.lax.axis_index("d")
        return jax.lax.cond(rank == 3, lambda a: a, lambda a: all_reduce.all_reduce(a, "d", timeout_s=0.5), v)

    with pytest.raises(Exception, match=r"(?s)xlatrain all_reduce .*timed out after 500 ms.*arrived ranks "
                                        r"\[0, 1, 2, 4, 5, 6, 7\], missing ranks \[3\]"):
        jax.block_until_ready(per_device(rank_three_skips, mesh)(jnp.ones(8)))


def test_a_collective_outside_shard_map_is_a_clear_error():
    with pytest.raises(ValueError, match="not a manual mesh axis here"):
        jax.jit(lambda v: all_reduce.all_reduce(v, "d"))(jnp.ones(4))


def test_lowering_for_a_gpu_without_the_cuda_extension_says_how_to_build_it(mesh):
    from xlatrain.custom_calls.backend import extension

    from xlatrain.errors import UserError

    if extension("cuda") is not None:
        pytest.skip("the CUDA extension is built here")
    step = per_device(lambda v: all_reduce.all_reduce(v, "d"), mesh)
    with pytest.raises(UserError, match=r"needs the CUDA extension.*XLATRAIN_CUDA=ON"):
        step.trace(jnp.ones(8)).lower(lowering_platforms=("cuda",))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA compiler) is not installed")
def test_the_cuda_extension_compiles(tmp_path):
    """No GPU needed: configure with XLATRAIN_CUDA=ON and build the NCCL extension with nvcc."""
    pytest.importorskip("nvidia.nccl", reason="nvidia-nccl-cu13 (NCCL headers) is not installed")
    configure = subprocess.run(["cmake", "-S", str(REPO), "-B", str(tmp_path), "-DXLATRAIN_CUDA=ON",
                                f"-DPython_EXECUTABLE={sys.executable}"], capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    build = subprocess.run(["cmake", "--build", str(tmp_path), "--target", "_cuda", "-j", str(os.cpu_count())],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    assert list(tmp_path.glob("_cuda*.so"))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (runs on CPU-only machines as a skip)")
def test_nccl_all_reduce_on_gpus():
    from xlatrain.custom_calls import nccl

    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    nccl.setup_communicators(mesh)
    x = jnp.arange(len(devices) * 4.0)
    got = per_device(lambda v: all_reduce.all_reduce(v, "d"), mesh)(x)
    np.testing.assert_allclose(got, per_device(lambda v: all_reduce.reference(v, "d"), mesh)(x))

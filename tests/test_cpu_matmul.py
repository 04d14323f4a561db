"""The dense layers' matmuls through a CPU BLAS (runtime.cpu_matmul): the custom call against XLA's dot, a step on
it, the choice kept on resume, XLA's step unchanged where no BLAS is chosen, the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import TINY_GPT
from xlatrain.custom_calls import blas
from xlatrain.custom_calls.ops.matmul import matmul, reference

from xlatrain.config import load_config
from xlatrain.errors import UserError
from xlatrain.program import build_program
from xlatrain.run.directory import pinned_cpu_matmul
from xlatrain.trainer import train

LIBRARIES = ["openblas", pytest.param("mkl", marks=pytest.mark.skipif(
    blas.find("mkl") is None, reason="MKL is not installed (pip install -e '.[mkl]')"))]
GEMM = "xlatrain_cpu_gemm"
RUN = [*TINY_GPT, "mesh.data=1", "trainer.checkpoint_every=2", "optimizer.schedule=constant"]


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_the_matmul_differentiates_to_any_order_as_xlas_dot(library, trans_a, trans_b):
    rng = np.random.default_rng(0)
    m, k, n = 67, 96, 45  # uneven blocks over the pool's threads; large enough to be split
    a = jnp.asarray(rng.standard_normal((k, m) if trans_a else (m, k)) / k ** 0.5, jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, k) if trans_b else (k, n)), jnp.float32)  # products about 1

    def loss_of(product):
        return lambda a, b: jnp.sum(jnp.tanh(product(a, b, trans_a=trans_a, trans_b=trans_b)) ** 2)

    def derivatives(product):
        loss = loss_of(product)
        grads = jax.grad(loss, argnums=(0, 1))(a, b)
        hessian_vector = jax.jvp(lambda a: jax.grad(loss)(a, b), (a,), (jnp.ones_like(a),))[1]
        return product(a, b, trans_a=trans_a, trans_b=trans_b), *grads, hessian_vector

    blas_matmul = jax.jit(lambda a, b: derivatives(lambda *o, **t: matmul(*o, **t, library=library)))
    assert GEMM in blas_matmul.lower(a, b).as_text()
    for got, want in zip(blas_matmul(a, b), derivatives(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def _train(tmp_path, name, steps, *overrides):
    config = load_config(None, [*RUN, f"trainer.steps={steps}", f"trainer.run_dir={tmp_path / name}", *overrides])
    result = train(config, devices=jax.devices()[:1], echo=lambda _: None)
    return result, yaml.safe_load((tmp_path / name / "config.yaml").read_text())["derived"]["cpu_matmul"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 steps on XLA's dots and on OpenBLAS, each in one go."""
    tmp = tmp_path_factory.mktemp("straight")
    return {library: _train(tmp, library, 4, f"runtime.cpu_matmul={library}")[0].losses
            for library in ("xla", "openblas")}


def test_a_step_on_openblas_equals_xlas_to_float32_rounding(straight):
    xla, openblas = (np.array([run[s] for s in sorted(run)]) for run in (straight["xla"], straight["openblas"]))
    assert len(xla) == 4 and not np.array_equal(xla, openblas)  # other kernels: another summation order
    np.testing.assert_allclose(openblas, xla, rtol=1e-5)


def test_auto_resumes_a_run_on_the_kernels_it_chose(straight, tmp_path, monkeypatch):
    monkeypatch.setattr(blas, "extra_installed", lambda name: name == "openblas")
    first, chosen = _train(tmp_path, "run", 2)
    assert chosen == "openblas"
    monkeypatch.setattr(blas, "extra_installed", lambda name: False)  # auto would choose xla for a new run now
    second, kept = _train(tmp_path, "run", 4)
    assert kept == "openblas" and second.start_step == 2
    assert {**first.losses, **second.losses} == straight["openblas"]


def test_a_run_from_before_the_choice_resumes_on_xlas_dots(straight, tmp_path, monkeypatch):
    first, _ = _train(tmp_path, "old", 2, "runtime.cpu_matmul=xla")
    saved = yaml.safe_load((tmp_path / "old" / "config.yaml").read_text())
    del saved["runtime"], saved["derived"]["cpu_matmul"]  # config.yaml as versions before runtime.cpu_matmul wrote it
    (tmp_path / "old" / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    monkeypatch.setattr(blas, "extra_installed", lambda name: True)
    second, kept = _train(tmp_path, "old", 4)
    assert kept == "xla" and {**first.losses, **second.losses} == straight["xla"]


def test_where_no_blas_is_chosen_the_step_is_xlas_own(tmp_path, monkeypatch):
    def train_step_hlo(*overrides, pinned=None):
        config = load_config(None, [*RUN, f"trainer.run_dir={tmp_path}", *overrides])
        return build_program(config, jax.devices()[:1], pinned_cpu_matmul=pinned).train_step.first.lowered.as_text()

    monkeypatch.setattr(blas, "extra_installed", lambda name: False)
    xla = train_step_hlo("runtime.cpu_matmul=xla")
    assert GEMM not in xla and "dot_general" in xla
    assert train_step_hlo() == xla  # auto with no BLAS extra installed
    monkeypatch.setattr(blas, "extra_installed", lambda name: True)
    assert train_step_hlo(pinned="xla") == xla  # auto resuming a run that chose XLA
    assert GEMM in train_step_hlo("runtime.cpu_matmul=openblas")


@pytest.mark.parametrize("requested, pinned, where, message", [
    ("openblas", None, dict(platform="cpu", partitioned=True, built_in_model=True), "parallel.mode=shard_map"),
    ("openblas", None, dict(platform="gpu", partitioned=False, built_in_model=True), "devices are gpu devices"),
    ("openblas", None, dict(platform="cpu", partitioned=False, built_in_model=False), "model.name=torch"),
    ("mkl", None, dict(platform="cpu", partitioned=False, built_in_model=True), "pip install -e '.[mkl]'"),
    ("auto", "mkl", dict(platform="cpu", partitioned=False, built_in_model=True), "chose runtime.cpu_matmul=mkl"),
])
def test_a_blas_that_cannot_run_is_refused_in_one_line(requested, pinned, where, message, monkeypatch):
    monkeypatch.setattr(blas, "find", lambda name: None if name == "mkl" else blas.BlasLibrary("x", "", ""))
    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("[", r"\[")) as refused:
        blas.choose(requested, pinned, **where)
    assert "\n" not in str(refused.value)


def test_auto_keeps_xlas_dots_where_a_blas_cannot_run(monkeypatch):
    monkeypatch.setattr(blas, "extra_installed", lambda name: True)
    monkeypatch.setattr(blas, "find", lambda name: blas.BlasLibrary("x", "", ""))
    assert blas.choose("auto", None, platform="cpu", partitioned=False, built_in_model=True) == "mkl"
    assert blas.choose("auto", "openblas", platform="cpu", partitioned=False, built_in_model=True) == "openblas"
    for where in (dict(platform="cpu", partitioned=True, built_in_model=True),
                  dict(platform="gpu", partitioned=False, built_in_model=True),
                  dict(platform="cpu", partitioned=False, built_in_model=False)):
        assert blas.choose("auto", None, **where) == "xla"


def test_a_saved_choice_that_is_no_kernel_names_the_file(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"derived": {"cpu_matmul": "fast"}}))
    with pytest.raises(UserError, match="derived.cpu_matmul='fast'"):
        pinned_cpu_matmul(tmp_path)

"""Every test process sees 8 CPU devices and compiles without LLVM's optimisations (COMPILE_FASTER); JAX must not
have started before these lines run. The suite's processes share one persistent compilation cache
(trainer.compile_cache: auto), empty at the start."""

import atexit
import os
import shutil
import tempfile

COMPILE_FASTER = "--xla_backend_optimization_level=0"
"""LLVM's optimisations off in every test process. The suite's programs are tiny, so compiling them is most of its
time: this takes about a quarter off a pipeline test. XLA's own passes (fusion, layouts, buffer assignment,
collectives) run as in production; float32 results may differ in their last bits from an optimised build's."""


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with `devices` CPU devices."""
    return f"{COMPILE_FASTER} --xla_force_host_platform_device_count={devices}"


os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), xla_flags(8)]).strip()
# XLATRAIN_TEST_GPU=1 makes the GPU jax's default backend, for the tests that need one (e.g. `-k nccl`); the
# rest of the suite expects the 8 CPU devices.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-evaluation-harness tasks read local files only
os.environ["JAX_PLATFORMS"] = "cuda,cpu" if os.environ.get("XLATRAIN_TEST_GPU") == "1" else "cpu"
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="xlatrain-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "tests/conftest.py must set the device count before JAX starts"
    return jax.devices()


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 300,
            ) -> subprocess.CompletedProcess:
    """`xlatrain ARGS` in a fresh process (so it owns its JAX runtime and signals)."""
    return subprocess.run([sys.executable, "-m", "xlatrain.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


# Small enough for the suite: every config below trains in well under a second per step on 2 cores. The GPT reads
# the standard library's top-level modules only: listing every module under it (site-packages included) for the
# default data.glob costs about a second per program built.
TINY_GPT = ["model.layers=2", "model.width=32", "model.heads=2", "data.seq_len=32", "data.max_bytes=400000",
            "data.glob='*.py'", "trainer.progress=false", "trainer.eval_every=1000", "trainer.log_every=1"]
DIGITS_MLP = ["model.name=mlp", "data.source=digits", "model.hidden=[32]", "batch.global_size=32",
              "trainer.progress=false", "trainer.eval_every=1000", "trainer.log_every=1"]


def token_batch(program):
    """The first global batch of `program`'s training data, split into its microbatches and placed as its train
    step takes it."""
    from xlatrain.data.loader import make_global, split_microbatches
    from xlatrain.mesh import train_batch_sharding

    rows = [program.dataset.train[i] for i in range(program.derived.global_batch)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return make_global(split_microbatches(batch, program.derived.microbatches), train_batch_sharding(program.mesh),
                       1, 1)

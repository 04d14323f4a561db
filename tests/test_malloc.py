"""glibc's malloc keeps freed memory for reuse (xlatrain/runtime/malloc.py): a program whose temporary buffer is
larger than a glibc arena heap stops page-faulting it in on every run. Each case needs a fresh process, whose allocator
nothing has touched yet."""

import os
import platform
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from xlatrain.errors import UserError
from xlatrain.runtime.malloc import allocator_chosen_by_environment

needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt")

# A dot whose [196608, 128] float32 result (96 MiB) is a temporary, reduced along both axes: each run allocates and
# frees the temporary, as a train step does its activations. (Reduced along one axis alone, XLA:CPU may fuse the
# reduction into the dot and keep no temporary.)
RUNS_OF_A_LARGE_TEMPORARY = """
import ctypes, resource, sys, time
from xlatrain.runtime.malloc import tune_malloc
print(tune_malloc())
import jax, jax.numpy as jnp

class MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallocInfo

def bytes_in_use():
    info = mallinfo2()
    return info.uordblks + info.hblkhd

def run(step, a, w):
    # XLA frees a run's temporary on its worker thread after the result is ready. The next run must not start
    # before that, or both temporaries are live at once and the heap grows, which is not what is measured here.
    idle = bytes_in_use()
    jax.block_until_ready(step(a, w))
    deadline = time.monotonic() + 10
    while bytes_in_use() > idle + 2**24 and time.monotonic() < deadline:
        time.sleep(0.001)

a, w = jnp.ones((196608, 128), jnp.float32), jnp.ones((128, 128), jnp.float32)
def dot_reduced_twice(a, w):
    y = a @ w
    return y.T.max(axis=1), y.sum(axis=1)

step = jax.jit(dot_reduced_twice).lower(a, w).compile()
print(step.memory_analysis().temp_size_in_bytes)
for _ in range(12):  # the heap grows a few times first
    run(step, a, w)
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run(step, a, w)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[5])  # the median run
"""


def page_faults_per_run(env: dict) -> tuple[str, float]:
    result = subprocess.run([sys.executable, "-c", RUNS_OF_A_LARGE_TEMPORARY], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    status, temp_bytes, faults = result.stdout.split("\n")[:3]
    assert int(temp_bytes) > 64 * 2**20, "the temporary must be larger than a glibc arena heap to test anything"
    return status, float(faults)


@needs_glibc
def test_a_large_temporary_is_reused_instead_of_page_faulted_in_on_every_run():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    status, kept = page_faults_per_run(environ)
    assert status.startswith("freed memory kept for reuse")
    assert kept < 500, kept
    status, released = page_faults_per_run({**environ, "XLATRAIN_MALLOC": "release"})
    assert status == "left to the environment (XLATRAIN_MALLOC)"
    assert released > 20_000, released  # 96 MiB of fresh 4 KiB pages in every run


def test_an_allocator_the_environment_chose_is_left_alone():
    assert allocator_chosen_by_environment({"PATH": "/usr/bin"}) is None
    assert allocator_chosen_by_environment({"MALLOC_ARENA_MAX": "4"}) == "MALLOC_ARENA_MAX"
    assert allocator_chosen_by_environment({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "LD_PRELOAD"
    assert allocator_chosen_by_environment({"LD_PRELOAD": "/opt/libprofiler.so"}) is None
    assert allocator_chosen_by_environment({"XLATRAIN_MALLOC": "release"}) == "XLATRAIN_MALLOC"
    assert allocator_chosen_by_environment({"XLATRAIN_MALLOC": "keep"}) is None
    with pytest.raises(UserError, match="XLATRAIN_MALLOC='relase': use keep .* or release"):
        allocator_chosen_by_environment({"XLATRAIN_MALLOC": "relase"})
    # the variable's earlier name still works, and the new one wins over it
    assert allocator_chosen_by_environment({"XLATRAIN_HOST_MEMORY": "release"}) == "XLATRAIN_HOST_MEMORY"
    assert allocator_chosen_by_environment({"XLATRAIN_HOST_MEMORY": "release", "XLATRAIN_MALLOC": "keep"}) is None


@needs_glibc
def test_the_xlatrain_command_keeps_freed_memory_and_says_so():
    assert run_cli("config").stdout.splitlines()[-1] == (
        "# malloc: freed memory kept for reuse (glibc: one heap, no mmap)")
    released = run_cli("config", env={"XLATRAIN_MALLOC": "release"})
    assert released.stdout.splitlines()[-1] == "# malloc: left to the environment (XLATRAIN_MALLOC)"
    misspelt = run_cli("config", env={"XLATRAIN_MALLOC": "no"})
    assert misspelt.returncode == 2 and misspelt.stderr.splitlines() == [
        "xlatrain: error: XLATRAIN_MALLOC='no': use keep (the default: freed memory is kept for reuse) or "
        "release (the system allocator's defaults)"]

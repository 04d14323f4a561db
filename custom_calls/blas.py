"""The BLAS libraries the dense layers' CPU matmul may call (runtime.cpu_matmul), found in their wheels and loaded
into the CPU extension single-threaded (it splits each product over XLA's own thread pool).

- openblas: the scipy-openblas32 wheel (`pip install -e '.[openblas]'`), else the OpenBLAS that scipy ships
  (scipy comes with jax), so it is always present.
- mkl: Intel's MKL wheel (`pip install -e '.[mkl]'`, large and under Intel's licence), through its single dynamic
  library with the sequential threading layer.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from xlatrain.errors import UserError

LIBRARIES = ("openblas", "mkl")
"""The gemm handler's `library` attribute is the index in this tuple."""


@dataclass(frozen=True)
class BlasLibrary:
    path: str
    prefix: str
    """Prefixed to `cblas_sgemm` (the wheels' OpenBLAS names its symbols scipy_*)."""
    single_threaded_by: str
    """Called with 1 once loaded: OpenBLAS's thread count, or MKL's threading layer (1 = MKL_THREADING_SEQUENTIAL)."""


def _wheel_file(distribution: str, pattern: str) -> str | None:
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(str(f.locate()) for f in files if fnmatch.fnmatch(Path(str(f)).name, pattern))
    return os.path.realpath(found[0]) if found else None


def _scipy_openblas() -> str | None:
    spec = importlib.util.find_spec("scipy")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(list(spec.submodule_search_locations)[0]).parent / "scipy.libs"
    found = sorted(glob.glob(str(libs / "libscipy_openblas*.so")))
    return found[0] if found else None


_WHEELS = {"mkl": ("mkl", "libmkl_rt.so*"), "openblas": ("scipy-openblas32", "libscipy_openblas*.so")}
"""Each BLAS's own wheel (its extra) and its library's file name."""


@functools.cache
def find(name: str) -> BlasLibrary | None:
    """Where the named BLAS is on this machine, or None when it is not installed."""
    path = _wheel_file(*_WHEELS[name])
    if name == "mkl":
        return None if path is None else BlasLibrary(path, "", "MKL_Set_Threading_Layer")
    path = path or _scipy_openblas()
    return None if path is None else BlasLibrary(path, "scipy_", "scipy_openblas_set_num_threads")


def extra_installed(name: str) -> bool:
    """Whether the BLAS's own extra is installed (not scipy's copy of OpenBLAS): what `auto` chooses from."""
    return _wheel_file(*_WHEELS[name]) is not None


@functools.cache
def load(name: str) -> int:
    """Loads the named BLAS into the CPU extension once; the index the gemm handler's `library` attribute takes."""
    from xlatrain.custom_calls.backend import cpu_extension

    library = find(name)
    if library is None:
        raise UserError(f"runtime.cpu_matmul={name}: its library is not installed; install it with "
                        f"`python3 -m pip install -e '.[{name}]'`, or set runtime.cpu_matmul=xla")
    index = LIBRARIES.index(name)
    failure = cpu_extension().load_blas(index, library.path, library.prefix, library.single_threaded_by)
    if failure:
        raise UserError(f"runtime.cpu_matmul={name}: {library.path} does not load ({failure}); reinstall it with "
                        f"`python3 -m pip install -e '.[{name}]'`, or set runtime.cpu_matmul=xla")
    return index


def choose(requested: str, pinned: str | None, *, platform: str, partitioned: bool, built_in_model: bool) -> str:
    """The kernels of a run's dense layers on CPU: `requested` (runtime.cpu_matmul), or for auto the one the run
    chose at its first start (`pinned`, derived.cpu_matmul), else MKL with the `mkl` extra installed, else OpenBLAS
    with the `openblas` extra installed, else XLA's. A BLAS runs as a custom call, which XLA cannot split over
    devices: auto keeps XLA's dots where XLA partitions the program (`partitioned`), on other platforms, and for a
    PyTorch module (whose layers are not xlatrain's); asked for there, a BLAS is refused."""
    usable = platform == "cpu" and not partitioned and built_in_model
    if requested == "auto":
        if not usable:
            return "xla"
        if pinned is None:
            return "mkl" if extra_installed("mkl") else "openblas" if extra_installed("openblas") else "xla"
        if pinned != "xla" and find(pinned) is None:
            raise UserError(f"config: the run chose runtime.cpu_matmul={pinned} at its first start "
                            f"(derived.cpu_matmul), which is not installed here: install it with `python3 -m pip "
                            f"install -e '.[{pinned}]'`, or set runtime.cpu_matmul=xla or openblas (the resumed "
                            "steps then round differently)")
        return pinned
    if requested == "xla":
        return "xla"
    if not usable:
        why = (f"the run's devices are {platform} devices:" if platform != "cpu" else
               "XLA splits this step over the devices (parallel.mode=jit), and it cannot split a custom call: set "
               "parallel.mode=shard_map, or" if partitioned else "model.name=torch runs PyTorch's own layers:")
        raise UserError(f"config: runtime.cpu_matmul={requested} runs the built-in models' dense layers on a CPU "
                        f"BLAS, but {why} set runtime.cpu_matmul=auto or xla")
    if find(requested) is None:
        raise UserError(f"config: runtime.cpu_matmul={requested}: its library is not installed; install it with "
                        f"`python3 -m pip install -e '.[{requested}]'`, or set runtime.cpu_matmul=auto or xla")
    return requested

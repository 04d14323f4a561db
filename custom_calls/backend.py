"""Loads the compiled collectives and registers them with XLA: the C++ CPU extension (always built) and
the CUDA/NCCL one (built only with -Ccmake.define.XLATRAIN_CUDA=ON)."""

from __future__ import annotations

import functools
import hashlib
import importlib
import itertools
from typing import Any, Callable

import numpy as np

from xlatrain import compat
from xlatrain.errors import UserError

PREFIX = {"cpu": "xlatrain_cpu_", "cuda": "xlatrain_cuda_"}
_EXTENSION = {"cpu": "xlatrain.custom_calls._cpu", "cuda": "xlatrain.custom_calls._cuda"}
_sites = itertools.count()


@functools.cache
def extension(platform: str) -> Any | None:
    """The loaded extension module for `platform` with its targets registered, or None if not built."""
    try:
        module = importlib.import_module(_EXTENSION[platform])
    except ImportError:
        return None
    compat.register_ffi_targets(module.handlers(), PREFIX[platform], platform)
    return module


def cpu_extension() -> Any:
    module = extension("cpu")
    if module is None:
        raise UserError("the xlatrain CPU collectives extension is not built: reinstall with "
                        "`python3 -m pip install -e .` (it compiles custom_calls/csrc with CMake)")
    return module


def cuda_extension() -> Any:
    module = extension("cuda")
    if module is None:
        raise UserError("collectives.impl=custom on GPU needs the CUDA extension, which was not built: reinstall "
                        "with `python3 -m pip install -e '.[cuda]' -Ccmake.define.XLATRAIN_CUDA=ON`, or set "
                        "collectives.impl=xla")
    return module


def communicator_key(axis_name: str) -> int:
    """The same int64 on every process for a mesh axis (Python's hash of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(axis_name.encode(), digest_size=8).digest(), "little", signed=True)


def lowering(op: str, attributes: Callable[..., dict[str, Any]]) -> dict[str, Callable]:
    """MLIR lowering rules per platform for `op`. `attributes(**params)` gives the handler's attributes;
    every lowered instance gets its own call-site id (how the CPU rendezvous tells calls apart)."""

    def rule_for(platform: str) -> Callable:
        def rule(ctx, x, where, **params):
            if platform == "cpu":
                cpu_extension()
            else:
                cuda_extension()
            axis_name = params.pop("axis_name")
            attrs = {**attributes(**params), "site": np.int64(next(_sites))}
            if platform == "cuda":
                attrs["comm"] = np.int64(communicator_key(axis_name))
            return compat.ffi_lowering(PREFIX[platform] + op)(ctx, x, where, **attrs)

        return rule

    return {platform: rule_for(platform) for platform in PREFIX}

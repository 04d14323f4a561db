"""jax's backends: whether they started, the CPU device count, compile-only GPUs from jax's CUDA plugin,
and the jaxlib release."""

from __future__ import annotations

import functools
from typing import Any

import jax

from xlatrain.errors import UserError, first_line


def backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def set_cpu_device_count(count: int) -> None:
    """Make `count` XLA:CPU devices; JAX takes the count only before its backends start (a process that has
    them already may go on only with the same count)."""
    if not backends_started():
        jax.config.update("jax_num_cpu_devices", count)
        return
    present = len(jax.devices("cpu"))
    if present != count:
        raise UserError(f"mesh.cpu_devices: this process started JAX with {present} CPU device(s) before the "
                        f"config asked for {count}: run through the xlatrain command, or call "
                        "xlatrain.program.apply_cpu_devices(config) before any JAX operation")


def installed_cuda_plugin() -> str | None:
    """The module of jax's CUDA plugin that is installed ("xla_cuda13", "xla_cuda12"), or None."""
    import importlib.util

    if importlib.util.find_spec("jax_plugins") is None:
        return None
    return next((name for name in ("xla_cuda13", "xla_cuda12") if importlib.util.find_spec(f"jax_plugins.{name}")),
                None)


def compile_only_gpus(target_config: str, count: int, asked: str) -> list:
    """`count` compile-only GPUs described by `target_config` (XLA's GpuTargetConfigProto as text; `asked`
    names it in errors), from jax's CUDA plugin; no GPU needed. Must run before jax starts its backends: the
    plugin checks the host's CUDA libraries when jax loads it, and refuses a host without them unless told to
    skip the check."""
    import os

    from jax.experimental import topologies

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                                target_config=target_config)
    except NotImplementedError:
        plugin = installed_cuda_plugin()
        why = (f"jax_plugins.{plugin} is installed but did not load (see the log above)" if plugin
               else "it is not installed")
        raise UserError(f"--target {asked}: compiling for a GPU needs jax's CUDA plugin (not the GPU): {why}; "
                        f"install it with pip install jax-cuda13-plugin=={jax.__version__} "
                        f"jax-cuda13-pjrt=={jax.__version__}") from None
    except jax.errors.JaxRuntimeError as error:
        raise UserError(f"--target {asked}: XLA did not take the GPU target config: {first_line(error)}") from None
    return list(topology.devices)


def is_compile_only(device: Any) -> bool:
    """Whether `device` belongs to a compile-only client (a topology described, not attached): it has no memory
    statistics and runs nothing."""
    return type(device.client).__name__ == "CompileOnlyPyClient"


def jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


@functools.cache
def cudnn_missing() -> str | None:
    """Why jax cannot use cuDNN here (its fused attention falls back to XLA's), or None where it can."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except Exception as err:  # RuntimeError("cuDNN not found."), or an older or newer jax without it
        return str(err).strip().rstrip(".") or type(err).__name__
    return None

"""Every JAX API that is private, experimental or changed between jax 0.10 and 0.12 is used from here."""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass
from functools import partial, wraps
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from xlatrain.errors import UserError, first_line

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""Recorded by jax (jax/_src/dispatch.py) once per XLA backend compilation, with a `fun_name`."""
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""Recorded by jax once per executable loaded from the persistent compilation cache."""


def shard_map(fn: Callable, mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any,
              check: bool = False) -> Callable:
    """jax.shard_map; `check` is replication/varying-axis checking (check_vma, formerly check_rep)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)


def gather_to_host(array: jax.Array) -> np.ndarray:
    """The whole of a global array as numpy on every process."""
    if jax.process_count() == 1:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def use_gloo_for_cpu_collectives() -> None:
    """CPU collectives across processes need gloo; must run before the CPU backend starts."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def keep_our_signal_handlers() -> None:
    """jax.distributed's preemption service installs its own SIGTERM handler in C++, which would replace
    xlatrain's (xlatrain/stop.py); xlatrain agrees on the stopping step itself (distributed.StopAgreement)."""
    jax.config.update("jax_enable_preemption_service", False)


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


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
                        "xlatrain.cpu_devices.apply_cpu_devices(config) before any JAX operation")


def abandon_profile() -> None:
    """Forget a jax.profiler trace whose stop_trace raised while writing it: jax leaves it registered as
    running, and a later start_trace in this process would be refused."""
    from jax._src import profiler

    with profiler._profile_state.lock:
        profiler._profile_state.reset()


def set_persistent_compile_cache(path: Path | None) -> None:
    """JAX reads its cache directory once, at the first compilation after a reset; None turns the cache off."""
    from jax.experimental.compilation_cache import compilation_cache

    wanted = None if path is None else str(path)
    if jax.config.jax_compilation_cache_dir != wanted:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", wanted)


CACHE_ENTRY_SUFFIX = "-cache"
"""jax/_src/lru_cache.py stores a persistent-cache entry as KEY-cache in the cache directory."""


def _cache_entry(cache_key: str) -> Path:
    return Path(jax.config.jax_compilation_cache_dir) / f"{cache_key}{CACHE_ENTRY_SUFFIX}"


def drop_unreadable_cache_entries(report: Callable[[str], None]) -> None:
    """JAX writes a cache entry in place, so a kill or a full disk during the write leaves it cut short. JAX then
    warns and compiles at every later start, and never writes that entry again, since one exists. Around JAX's
    read, an entry that cannot be read is deleted and reported instead, so the compilation that follows writes
    a good one; so is an entry holding another program's executable (a file renamed or copied over another:
    its module's name is not the one in its key), which JAX would load and fail on with an AssertionError.
    Installed once per process; jax_raise_persistent_cache_errors still raises."""
    from jax._src import compilation_cache

    read = compilation_cache.get_executable_and_time
    if getattr(read, "drops_unreadable_entries", False):
        return

    def drop(cache_key: str, why: str) -> tuple[None, None]:
        entry = _cache_entry(cache_key)
        entry.unlink(missing_ok=True)
        report(f"compile cache entry {entry} {why}; removed it, so this compilation is written there again")
        return None, None

    @wraps(read)
    def read_or_drop(cache_key: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        try:
            executable, seconds = read(cache_key, *args, **kwargs)
        except Exception as err:
            if jax.config.jax_raise_persistent_cache_errors or not jax.config.jax_compilation_cache_dir:
                raise
            return drop(cache_key, f"could not be read ({type(err).__name__}: {first_line(err)})")
        held = None if executable is None else _module_name(executable)
        if held is not None and held != cache_key.rsplit("-", 1)[0]:
            return drop(cache_key, f"holds the executable of another program ({held})")
        return executable, seconds

    read_or_drop.drops_unreadable_entries = True  # type: ignore[attr-defined]
    compilation_cache.get_executable_and_time = read_or_drop


def _module_name(executable: Any) -> str | None:
    """The name of the HLO module a loaded executable was compiled from, where the runtime tells it."""
    try:
        return executable.hlo_modules()[0].name
    except Exception:
        return None


def report_unwritable_cache_entries(report: Callable[[str], None]) -> None:
    """Around JAX's write of a cache entry: a file system that refuses it (full, read-only) is reported once per
    process instead of in JAX's warning for every entry, and the entry it cut short is removed (a later start
    would read it); compilations go on as without the cache. Installed once per process; other errors keep JAX's
    warning, and jax_raise_persistent_cache_errors still raises."""
    from jax._src import compilation_cache

    write = compilation_cache.put_executable_and_time
    if getattr(write, "reports_unwritable_entries", False):
        return
    reported = False

    @wraps(write)
    def write_or_report(cache_key: str, *args: Any, **kwargs: Any) -> None:
        nonlocal reported
        try:
            write(cache_key, *args, **kwargs)
        except OSError as err:
            if jax.config.jax_raise_persistent_cache_errors or not jax.config.jax_compilation_cache_dir:
                raise
            entry = _cache_entry(cache_key)
            entry.unlink(missing_ok=True)
            if not reported:
                reported = True
                report(f"compile cache {entry.parent}: entries cannot be written ({err.strerror or first_line(err)}); "
                       "compilations are not cached until there is room (said once)")

    write_or_report.reports_unwritable_entries = True  # type: ignore[attr-defined]
    compilation_cache.put_executable_and_time = write_or_report


@contextlib.contextmanager
def backend_compile_listener(callback: Callable[[str, float], None], on_cache_hit: Callable[[], None]
                             ) -> Iterator[None]:
    """Calls callback(function_name, seconds) for every XLA compilation while the context is open, and
    on_cache_hit() for each executable loaded from the persistent cache instead (it is reported as a compilation
    too, lasting the load)."""

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            callback(str(kwargs.get("fun_name", "?")), duration)

    def hit(event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            on_cache_hit()

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(hit)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(hit)


def cost_analysis(compiled: Any) -> dict[str, float]:
    """Compiled.cost_analysis() is a dict in new jax and a one-element list of dicts in older ones."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return dict(analysis or {})


def used_inputs(fn: Callable, *args: Any) -> list[bool]:
    """Per flattened input of fn(*args): whether the traced program reads it (jaxpr variables)."""
    closed = jax.make_jaxpr(fn)(*args)
    read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
    read |= {id(v) for v in closed.jaxpr.outvars}
    return [id(v) in read for v in closed.jaxpr.invars]


def outputs_reading(fn: Callable, args: tuple,
                    watched: tuple[int, ...]) -> list[tuple[bool | None, jax.ShapeDtypeStruct]]:
    """Per flattened output of fn(*args), with its shape and dtype: None when it is one of the inputs itself,
    else whether computing it reads any input of the args at positions `watched` (jax's dead-code elimination of
    the traced program, which follows values through loops and branches)."""
    from jax._src.interpreters import partial_eval as pe

    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    ends = np.cumsum([len(jax.tree.leaves(a)) for a in args])
    watched_vars = {i for position in watched for i in range(ends[position] - len(jax.tree.leaves(args[position])),
                                                              ends[position])}
    inputs = {id(v) for v in jaxpr.invars}
    result: list[tuple[bool | None, jax.ShapeDtypeStruct]] = []
    for index, (out, aval) in enumerate(zip(jaxpr.outvars, closed.out_avals, strict=True)):
        shape = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        if id(out) in inputs:
            result.append((None, shape))
            continue
        _, used = pe.dce_jaxpr(jaxpr, [i == index for i in range(len(jaxpr.outvars))])
        result.append((any(used[i] for i in watched_vars), shape))
    return result


def without_dead_code(jaxpr: Any) -> Any:
    """The jaxpr without the equations none of its outputs needs (jax's dead-code elimination, which follows
    values into loops and calls), as XLA's compilation drops them."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def without_exact_roundings(closed_jaxpr: Any) -> Any:
    """The closed jaxpr less its top-level `reduce_precision` equations that round a float32 or float64 value to
    its own precision. jax's remat puts one on each residual it saves that the forward uses too, against excess
    precision (a bfloat16 value kept in float32 inside an XLA fusion); a float32 or float64 value has none, so
    each is the identity, yet XLA:CPU compiles it into a copy of the residual."""
    from jax._src.core import Var
    from jax._src.lax.lax import reduce_precision_p

    def exact(eqn) -> bool:
        if eqn.primitive is not reduce_precision_p:
            return False
        dtype = eqn.invars[0].aval.dtype
        return dtype in (jnp.float32, jnp.float64) and (eqn.params["exponent_bits"], eqn.params["mantissa_bits"]
                                                        ) == (jnp.finfo(dtype).nexp, jnp.finfo(dtype).nmant)

    renamed: dict = {}

    def source(var):
        return renamed.get(var, var) if isinstance(var, Var) else var

    eqns = []
    for eqn in closed_jaxpr.jaxpr.eqns:
        if exact(eqn):
            renamed[eqn.outvars[0]] = source(eqn.invars[0])
        else:
            eqns.append(eqn.replace(invars=[source(v) for v in eqn.invars]))
    jaxpr = closed_jaxpr.jaxpr.replace(eqns=eqns, outvars=[source(v) for v in closed_jaxpr.jaxpr.outvars])
    return type(closed_jaxpr)(jaxpr, closed_jaxpr.consts)


def evaluate(closed_jaxpr: Any, inputs: list[Any]) -> list[Any]:
    """The outputs of a closed jaxpr (from jax.make_jaxpr) on `inputs`, its equations bound into the current
    trace with their name stacks."""
    from jax.extend.core import jaxpr_as_fun

    return list(jaxpr_as_fun(closed_jaxpr)(*inputs))


def bind_equation(eqn: Any, inputs: list[Any]) -> list[Any]:
    """Run one equation of a jaxpr on `inputs` (values or tracers, one per eqn.invars, literals included), as
    jax's own interpreter (`jax.core.eval_jaxpr`) does, keeping the equation's name stack."""
    from jax._src import source_info_util

    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        outputs = eqn.primitive.bind(*inputs, **params)
    return list(outputs) if eqn.primitive.multiple_results else [outputs]


_HOST_READS = threading.local()


def _guard_array_reads() -> None:
    """Make implicit reads of jax.Array values (float(x), np.asarray(x), x.tolist()) check a per-thread
    flag. Needed on XLA:CPU, where arrays already live in host memory and jax's transfer guard does not
    count reading them as a device-to-host transfer. Idempotent."""
    from jax._src.array import ArrayImpl

    original = ArrayImpl.__dict__["_value"]
    if getattr(original.fget, "xlatrain_guarded", False):
        return

    def value(self):
        if getattr(_HOST_READS, "forbidden", False):
            raise RuntimeError(f"Disallowed device-to-host transfer: implicit read of a {self.aval.str_short()} "
                               "array between step boundaries")
        return original.fget(self)

    value.xlatrain_guarded = True
    ArrayImpl._value = property(value)


@contextlib.contextmanager
def _host_reads(forbidden: bool, guard: str) -> Iterator[None]:
    previous = getattr(_HOST_READS, "forbidden", False)
    _HOST_READS.forbidden = forbidden
    try:
        with jax.transfer_guard(guard):
            yield
    finally:
        _HOST_READS.forbidden = previous


def forbid_implicit_transfers() -> contextlib.AbstractContextManager[None]:
    """jax.transfer_guard("disallow") on this thread, plus implicit array reads on every backend."""
    _guard_array_reads()
    return _host_reads(True, "disallow")


def allow_transfers() -> contextlib.AbstractContextManager[None]:
    """Undo forbid_implicit_transfers inside it (step boundaries: closures, checkpoints)."""
    return _host_reads(False, "allow")


# --- Primitives for the custom-call collectives (jax.extend and jax.interpreters are not stable API). ---

def manual_axes() -> tuple[tuple[str, int], ...]:
    """(name, size) of the mesh axes the current shard_map/pmap body is manual over, in mesh order."""
    from jax.sharding import AxisType

    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or not mesh.axis_names:
        return ()
    return tuple((name, size) for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types,
                                                         strict=True) if kind == AxisType.Manual)


def define_linear_primitive(name: str, *, abstract_eval: Callable, batch: Callable, transpose: Callable,
                            differentiable: Callable[..., bool], lowerings: dict[str, Callable]) -> Any:
    """A primitive `prim.bind(x, *static_operands, **params)` that is linear in `x` (its other operands are
    integer metadata). `transpose(ct, *static_operands, **params)` returns the cotangent of x;
    `differentiable(**params)` is False for the nonlinear variants (max, min), whose derivative is an
    error. `batch(x, bdim, *static_operands, **params) -> (out, out_bdim)` handles an unnamed vmap axis on x.
    `lowerings` maps a platform to an MLIR lowering rule."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive(name)
    prim.def_impl(lambda *args, **params: jax.jit(partial(prim.bind, **params))(*args))
    prim.def_abstract_eval(abstract_eval)

    def batch_rule(args, dims, **params):
        x, *static = args
        if any(d is not None for d in dims[1:]):  # None: not mapped
            raise NotImplementedError(f"{name}: vmap over the collective's own axis is not supported; run it "
                                      "inside jax.shard_map (or pmap) over that axis instead")
        return batch(x, dims[0], *static, **params)

    batching.primitive_batchers[prim] = batch_rule

    def jvp(primals, tangents, **params):
        x, *static = primals
        out = prim.bind(x, *static, **params)
        if type(tangents[0]) is ad.Zero:
            return out, ad.Zero.from_primal_value(out)
        if not differentiable(**params):
            raise NotImplementedError(f"{name} with {params} is not differentiable")
        return out, prim.bind(ad.instantiate_zeros(tangents[0]), *static, **params)

    def transpose_rule(ct, x, *static, **params):
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval), *(None for _ in static)]
        return [transpose(ct, *static, **params), *(None for _ in static)]

    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose_rule
    for platform, rule in lowerings.items():
        # Not cacheable: each lowered instance must get its own call-site id (see custom_calls/backend.py).
        mlir.register_lowering(prim, rule, platform=platform, cacheable=False)
    return prim


def define_primitive(name: str, *, compute: Callable, jvp: Callable, transpose: Callable, batch: Callable) -> Any:
    """A primitive `prim.bind(*operands, **params)` computed as the jax function `compute(*operands, **params)`
    (its implementation, shape and lowering on every platform), differentiated and batched by its own rules:
    `jvp(primals, tangents, **params)` gives the output's tangent (a zero tangent is None);
    `transpose(ct, *operands, **params)` gives each operand's cotangent, for the operands that are
    `jax.interpreters.ad.UndefinedPrimal` (being transposed), None for the others; and
    `batch(operands, dims, **params) -> (out, out_dim)` (an operand not mapped has dim None)."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    prim = Primitive(name)
    prim.def_impl(compute)  # eagerly, op by op, as any jax function

    def abstract_eval(*avals, **params):
        out = jax.eval_shape(partial(compute, **params), *avals)
        return jax.core.ShapedArray(out.shape, out.dtype)

    def jvp_rule(primals, tangents, **params):
        tangents = [None if type(t) is ad.Zero else t for t in tangents]
        return prim.bind(*primals, **params), jvp(primals, tangents, **params)

    def transpose_rule(ct, *operands, **params):
        if type(ct) is ad.Zero:
            return [ad.Zero(o.aval) if ad.is_undefined_primal(o) else None for o in operands]
        return transpose(ct, *operands, **params)

    prim.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = jvp_rule
    ad.primitive_transposes[prim] = transpose_rule
    batching.primitive_batchers[prim] = batch
    mlir.register_lowering(prim, mlir.lower_fun(compute, multiple_results=False))
    return prim


def is_being_transposed(operand: Any) -> bool:
    """In a `define_primitive` transpose rule: whether `operand` is one the cotangent is wanted for."""
    from jax.interpreters import ad

    return ad.is_undefined_primal(operand)


def ffi_lowering(target: str) -> Callable:
    """Lowered as side-effecting: XLA then issues these calls in program order on every device and never
    merges or drops one. NCCL needs every rank to issue its collectives in the same order; the CPU
    backend tells calls apart by call site and does not depend on it."""
    return jax.ffi.ffi_lowering(target, has_side_effect=True)


def lowering_mesh(ctx: Any) -> jax.sharding.Mesh | None:
    """The concrete mesh a shard_map being lowered runs on (None under pmap, or for an abstract mesh)."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    return mesh if isinstance(mesh, jax.sharding.Mesh) else None


# XLA's names of the platforms that jax lowers for. jaxlib maps "cpu" (to "Host") but not "cuda": a target
# registered for "cuda" waits for a "cuda" plugin that never comes, and the GPU compile finds no handler.
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}


def register_ffi_targets(handlers: dict[str, Any], prefix: str, platform: str) -> None:
    for op, capsule in handlers.items():
        jax.ffi.register_ffi_target(f"{prefix}{op}", capsule, platform=_XLA_PLATFORM[platform])


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


def distributed_client():
    """jax.distributed's client (its key-value store), or None before jax.distributed.initialize."""
    from jax._src import distributed

    return distributed.global_state.client


def key_value_set(name: str, value: bytes) -> None:
    """Publish bytes to every process (jax.distributed's key-value store; a no-op with one process); a later
    value replaces an earlier one."""
    if jax.process_count() > 1:
        distributed_client().key_value_set_bytes(name, value, allow_overwrite=True)


def key_value_get(name: str, timeout_s: float = 300) -> bytes:
    return distributed_client().blocking_key_value_get_bytes(name, int(timeout_s * 1000))


def key_value_dir_get(prefix: str) -> list[tuple[str, bytes]]:
    """Every (key, value) under `prefix`, without waiting."""
    return distributed_client().key_value_dir_get_bytes(prefix)


def detected_cluster() -> str | None:
    """The name of the cluster environment jax.distributed would auto-detect ("slurm", "ompi", "k8s", ...),
    or None; only the kinds jax detects without being asked."""
    from jax._src import clusters

    found = next((env for env in clusters.ClusterEnv._cluster_types
                  if not env.opt_in_only_method and env.is_env_present()), None)
    if found is None:
        return None
    return getattr(found, "name", "") or found.__name__.removesuffix("Cluster").lower()


def jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def pmap_over_rows(fn: Callable, axis_name: str, devices: list, rows_axis: int) -> Callable:
    """fn(state, batch) through jax.pmap: state broadcast to every device, the batch's `rows_axis` split
    into one block per device (in `devices` order, so blocks stay where the batch sharding put them),
    outputs taken from the (identical) replicas. Callable inside jit."""
    n = len(devices)
    mapped = jax.pmap(fn, axis_name=axis_name, in_axes=(None, rows_axis), out_axes=None, devices=devices)

    def split_rows(x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:rows_axis], n, x.shape[rows_axis] // n, *x.shape[rows_axis + 1:])

    return lambda state, batch: mapped(state, jax.tree.map(split_rows, batch))


# --- torchax (PyTorch modules as JAX functions); imported only when a torch model is used. ---

_NAMED_DIMENSION_OVERLOAD = re.compile(r"(?i)dimname|names")
"""Overloads taking named dimensions (`aten.prod.dim_Dimname`, `aten.norm.names_ScalarOpt_dim`, ...):
newer torch releases dropped them, while torchax's op tables still name them."""


@dataclass(frozen=True)
class MissingTorchOverload:
    """An inert stand-in for an overload this torch does not have: a hashable dict key nothing calls."""

    name: str


def _tolerate_missing_named_overloads() -> None:
    """Make `torch.ops.aten.<op>.<named-dimension overload>` resolve to a MissingTorchOverload instead of
    raising AttributeError. Stays installed: some of torchax's tables are built lazily. Idempotent."""
    from torch._ops import OpOverloadPacket

    original = OpOverloadPacket.__getattr__
    if getattr(original, "xlatrain_shim", False):
        return

    def getattr_tolerant(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if _NAMED_DIMENSION_OVERLOAD.search(key):
                return MissingTorchOverload(f"{self._qualified_op_name}.{key}")
            raise

    getattr_tolerant.xlatrain_shim = True
    OpOverloadPacket.__getattr__ = getattr_tolerant


def import_torchax() -> Any:
    """torchax, importable with the torch we pin (see _tolerate_missing_named_overloads)."""
    _tolerate_missing_named_overloads()
    import torchax

    return torchax


def torchax_environment() -> Any:
    """A torchax Environment for tracing a module's forward inside a jitted JAX function:

    - tensors a forward creates with a factory (`torch.ones(...)` for a mask, `torch.arange`) become JAX
      values too, whatever device they name (torchax keeps "cpu" ones as torch tensors, and mixing them
      with traced values fails);
    - BatchNorm in training mode writes its running statistics back into the buffers, with PyTorch's
      unbiased variance (torchax 0.0.13 computes the update and drops it);
    - F.scaled_dot_product_attention without a mask, dropout or grouped heads is xlatrain.attention's, the
      attention xlatrain's flax GPT uses (torchax's reference builds an explicit -inf bias);
    - F.linear is xlatrain.models.linear's, whose weight gradient transposes the smaller operand on XLA:CPU.
    """
    import torch

    from xlatrain.attention import attention
    from xlatrain.models.linear import dense_dot_general

    import_torchax()
    from torchax.tensor import Environment, Tensor

    class TracingEnvironment(Environment):
        def _should_use_torchax_tensor(self, device):
            return True

    env = TracingEnvironment()

    def native_batch_norm(input, weight, bias, running_mean, running_var, training=False, momentum=0.1,
                          eps=1e-5):
        x = input.jax()
        axes = (0, *range(2, x.ndim))
        per_channel = (1, -1) + (1,) * (x.ndim - 2)
        if training or running_mean is None:
            mean, var = jnp.mean(x, axis=axes), jnp.var(x, axis=axes)
            if training and running_mean is not None:
                count = x.size // x.shape[1]
                unbiased = var * (count / max(count - 1, 1))
                running_mean.apply_jax_(lambda r: ((1 - momentum) * r + momentum * mean).astype(r.dtype))
                running_var.apply_jax_(lambda r: ((1 - momentum) * r + momentum * unbiased).astype(r.dtype))
        else:
            mean, var = running_mean.jax(), running_var.jax()
        rstd = jax.lax.rsqrt(var.astype(jnp.float32) + eps)
        y = (x - mean.reshape(per_channel)) * rstd.reshape(per_channel)
        if weight is not None:
            y = y * weight.jax().reshape(per_channel)
        if bias is not None:
            y = y + bias.jax().reshape(per_channel)
        return Tensor(y.astype(x.dtype), env), Tensor(mean, env), Tensor(rstd, env)

    for op in (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default):
        env.override_op_definition(op, native_batch_norm)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    reference = env._ops[sdpa].func

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if attn_mask is not None or dropout_p > 0 or enable_gqa or query.ndim != 4:
            return reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, env=env)
        q, k, v = (jnp.swapaxes(t.jax(), 1, 2) for t in (query, key, value))  # [B, H, L, K] -> [B, L, H, K]
        return Tensor(jnp.swapaxes(attention(q, k, v, is_causal=is_causal, scale=scale), 1, 2), env)

    env.override_op_definition(sdpa, scaled_dot_product_attention)

    reference_linear = env._ops[torch.nn.functional.linear].func

    def linear(input, weight, bias=None):
        x, w = input.jax(), weight.jax()
        b = None if bias is None else bias.jax()
        if w.ndim != 2 or x.ndim < 1 or x.dtype != w.dtype:
            return Tensor(reference_linear(x, w, b), env)
        y = dense_dot_general(x, w.T, (((x.ndim - 1,), (0,)), ((), ())))
        return Tensor(y if b is None else y + b, env)

    env.override_op_definition(torch.nn.functional.linear, linear)
    return env


@contextlib.contextmanager
def torch_in_place_on_views() -> Iterator[None]:
    """torchax hands an in-place op a view as a copy unless the op is one of its own in-place ops (mul_, add_,
    copy_ ...), so `h[:, :4].zero_()` (zero_, fill_, clamp_: ops it decomposes) would change the copy and leave `h`
    as it was. While open, an in-place op on a view runs on the view's value and writes the result back through
    the view, as PyTorch's in-place ops on views do."""
    from torch.overrides import TorchFunctionMode
    from torchax.view import View

    def in_place(func: Any) -> bool:
        name = getattr(func, "__name__", "")
        return name.endswith("_") and not name.startswith("_")

    class InPlaceOnViews(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not (args and isinstance(args[0], View) and in_place(func)):
                return func(*args, **(kwargs or {}))
            view, value = args[0], args[0].torch()
            before = value._elem
            out = func(value, *args[1:], **(kwargs or {}))
            if value._elem is not before:
                view.update(value)
            return view if out is value else out

    with InPlaceOnViews():
        yield


@contextlib.contextmanager
def torch_gradient_cuts(env: Any) -> Iterator[None]:
    """torchax traces every op into JAX whatever torch's autograd would record, so what a forward computes
    under torch.no_grad() (or inference_mode), or reads through `.data`, would get the gradient PyTorch never
    gives it. While open, those values are stopped (jax.lax.stop_gradient): the new values ops return with
    grad mode off, and every `.data`; a tensor an op hands back under torch.no_grad() (an in-place op's, a no-op
    conversion's) keeps its gradient, as in PyTorch. A view made under torch.no_grad() stays a view of its source,
    so that an in-place op on it (`h[:, :4].zero_()`) changes the source. A tensor an op changes in place under
    torch.no_grad() takes the new value and passes its gradient on unchanged, as autograd, which does not record
    the op, does. Grad mode starts on, as in a PyTorch training step."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves, tree_map
    from torchax.tensor import Tensor
    from torchax.view import View

    def root(value: Any) -> Any:
        """The tensor an in-place op on `value` writes into: a view's source (torchax's View.replace_source_jax)."""
        while isinstance(value, View):
            value = value.parent
        return value

    class StoppedView(View):
        """A view whose reads have no gradient; writes reach its source as a view's do."""

        def jax(self) -> jax.Array:
            return jax.lax.stop_gradient(super().jax())

        def create_sub_view(self, view_info: Any) -> View:
            return StoppedView(self, view_info, self._env)

    def cut(value: Any) -> Any:
        if isinstance(value, View):
            return StoppedView(value.parent, value.view_info, env)
        return Tensor(jax.lax.stop_gradient(value.jax()), env) if isinstance(value, Tensor) else value

    class GradientCuts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if torch.is_grad_enabled():
                return func(*args, **(kwargs or {}))
            leaves = tree_leaves((args, kwargs))
            written = {id(tensor): (tensor, tensor._elem) for tensor in map(root, leaves) if isinstance(tensor, Tensor)}
            out = func(*args, **(kwargs or {}))
            for tensor, before in written.values():
                if tensor._elem is not before and jnp.issubdtype(before.dtype, jnp.inexact):
                    tensor._elem = _gradient_passed_on(before, tensor._elem)
            given = {id(value) for value in leaves}
            return tree_map(lambda value: value if id(value) in given else cut(value), out)

    # torchax's Tensor.data is a Python property handing back the tensor itself, which no mode sees
    data = Tensor.data
    Tensor.data = property(lambda tensor: Tensor(jax.lax.stop_gradient(tensor.jax()), env), data.fset)
    try:
        with torch.enable_grad(), GradientCuts():
            yield
    finally:
        Tensor.data = data


@jax.custom_jvp
def _gradient_passed_on(before: jax.Array, after: jax.Array) -> jax.Array:
    """`after`'s value with `before`'s tangent: an op autograd did not record, between them."""
    return after


@_gradient_passed_on.defjvp
def _gradient_passed_on_jvp(primals, tangents):
    before, after = primals
    return after, tangents[0].astype(after.dtype)


def torchax_operator_not_found() -> type[Exception]:
    from torchax.tensor import OperatorNotFound

    return OperatorNotFound

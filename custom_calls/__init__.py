"""xlatrain's own collectives as XLA FFI custom calls: C++ across the devices of a process on CPU,
NCCL on XLA's CUDA stream on GPU. Call them inside `jax.shard_map` (or `jax.pmap`) over the named
axis; they differentiate and vmap like their lax references (each op's module names its reference)."""

from xlatrain.custom_calls.ops.all_gather import all_gather
from xlatrain.custom_calls.ops.all_reduce import all_reduce
from xlatrain.custom_calls.ops.all_to_all import all_to_all
from xlatrain.custom_calls.ops.broadcast import broadcast
from xlatrain.custom_calls.ops.ppermute import ppermute
from xlatrain.custom_calls.ops.reduce_scatter import reduce_scatter

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "ppermute", "reduce_scatter"]

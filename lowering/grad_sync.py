"""How a train step's replicas meet: who holds which rows, and how their gradients are summed.

`PartitionedReplicas` (parallel.mode=jit) keeps every replica in one global program, vmapped over a
leading replica axis pinned to the `data` shards; the sum over that axis is where XLA's partitioner
puts the all-reduce. `ExplicitReplicas` (parallel.mode=shard_map or pmap) is the per-device program:
each device is one replica and the gradient sum is written out as balanced fusion buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from xlatrain.mesh import CONTEXT, EXPERT

Tree = Any


REPLICAS = "replicas"
"""The name of PartitionedReplicas' vmap over replicas, for sums across them inside it."""


@dataclass(frozen=True)
class PartitionedReplicas:
    replicas: int
    pin: Callable[[Tree], Tree]
    """Lays a tree with a leading replica axis out one replica per data shard."""
    spmd_axis: str | None = None
    """The mesh axis the vmap over replicas names (jax.vmap's spmd_axis_name), so that a shard_map inside a
    replica (context parallelism's attention) keeps each replica on its `data` shard; None: not named."""

    def split(self, batch: dict) -> dict:
        return self.pin(jax.tree.map(lambda x: split_replicas(x, self.replicas), batch))

    def each(self, per_replica: Callable) -> Callable:
        """per_replica(params, model_state, batch, key, *shared) over the leading replica axis of batch and keys."""
        return jax.vmap(per_replica, in_axes=(None, None, 0, 0, None, None), spmd_axis_name=self.spmd_axis,
                        axis_name=REPLICAS)

    @staticmethod
    def across(local: jax.Array) -> jax.Array:
        """Inside `each`: a value summed over the replicas."""
        return jax.lax.psum(local, REPLICAS)

    def indices(self) -> jax.Array:
        return self.pin(jnp.arange(self.replicas))

    def total(self, local: jax.Array) -> jax.Array:
        return local

    def sum_gradients(self, grads_R: Tree, dtype: jnp.dtype) -> Tree:
        grads_R = self.pin(grads_R)
        return jax.tree.map(lambda g: sum_replicas(g, dtype), grads_R)

    def sum_metrics(self, sums_R: Tree) -> Tree:
        return jax.tree.map(lambda s: jnp.sum(s, axis=0), sums_R)

    def mean_model_state(self, model_state_R: Tree) -> Tree:
        return jax.tree.map(lambda x: mean_of_sum(jnp.sum(widened(x), axis=0), self.replicas, x.dtype), model_state_R)

    def apply_update(self, tx: optax.GradientTransformation, grads: Tree, opt_state: Tree,
                     params: Tree) -> tuple[Tree, Tree]:
        """The partitioner lays the update out from the state's shardings (zero1 / fsdp included)."""
        return update(tx, grads, opt_state, params)


@dataclass(frozen=True)
class ExplicitReplicas:
    """Inside shard_map over `axis`: this device's rows are one replica (a leading replica axis of 1)."""

    axis: str
    participants: int
    bucket_bytes: int
    reduce_scatter: Callable
    all_gather: Callable
    all_reduce: Callable
    shard_dims: Tree | None = None
    """ZeRO-1: per param, the dimension its optimizer state is split along over `axis` (None: whole)."""
    params_split: bool = False
    """FSDP: the params too are stored split along `shard_dims` (`gather` assembles them for compute)."""
    buckets_by_all_reduce: bool = False
    """Sum each bucket with one all-reduce instead of reduce-scatter + all-gather (the two-level custom
    all-reduce across processes, which reduces inside each process first anyway)."""
    complete: Callable[[Tree], Tree] | None = None
    """Sums the gradients that each device of a tensor group holds a part of over the group, before the
    replicas meet (lowering/tensor_link.py)."""
    context: int = 1
    """Devices over CONTEXT that share this replica's rows, each holding a part of the sequence: its sums (the
    gradients', the metrics', the loss weights') are summed over them too."""
    expert: int = 1
    """Devices over EXPERT that share this replica's rows, each holding some of them and its own experts: its sums
    are summed over them too, but for the gradients of the experts' own weights (`expert_leaves`)."""
    expert_leaves: Tree | None = None
    """Per param, whether it is split over EXPERT (an expert's own weights: each device's gradient is its own)."""

    def split(self, batch: dict) -> dict:
        return jax.tree.map(lambda x: x[None], batch)

    def each(self, per_replica: Callable) -> Callable:
        """This device's one replica: per_replica(params, model_state, batch, key, *shared), outputs given the
        replica axis."""

        def one(params, model_state, batch_R, keys_R, *shared):
            first = jax.tree.map(lambda x: x[0], (batch_R, keys_R))
            return jax.tree.map(lambda x: x[None], per_replica(params, model_state, *first, *shared))

        return one

    def indices(self) -> jax.Array:
        """This device's place among every part of every replica (its replica's, where no context splits it):
        what its random draws (dropout) fold in."""
        index = jax.lax.axis_index(self.axis)
        if self.expert > 1:
            index = index + self.participants * jax.lax.axis_index(EXPERT)
        if self.context > 1:
            index = index + self.participants * self.expert * jax.lax.axis_index(CONTEXT)
        return index[None]

    def total(self, local: jax.Array) -> jax.Array:
        return self._within_replica(self.all_reduce(local, self.axis), over_expert=True)

    across = total
    """Inside `each`: a value summed over the replicas (and the parts of each)."""

    def sum_gradients(self, grads_R: Tree, dtype: jnp.dtype) -> Tree:
        grads = jax.tree.map(lambda g: g[0], grads_R)
        if self.complete is not None:
            grads = self.complete(grads)
        if self.participants * self.context * self.expert == 1:
            # A pipeline over one data replica: nothing to sum, so no flat copy of the gradients and no rounding
            # to the communication dtype (XLA:CPU would keep the one-device collectives, and their copies).
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        if self.expert == 1:
            return bucketed_sum(grads, self.bucket_bytes, dtype, self.participants, self._bucket_sum(False))
        leaves, tree = jax.tree.flatten(grads)
        own = jax.tree.leaves(self.expert_leaves)
        kinds = [[leaf for leaf, mine in zip(leaves, own, strict=True) if mine is split] for split in (False, True)]
        summed = [iter(bucketed_sum(kind, self.bucket_bytes, dtype, self.participants, self._bucket_sum(not split))
                       if kind else []) for split, kind in zip((False, True), kinds, strict=True)]
        return jax.tree.unflatten(tree, [next(summed[mine]) for mine in own])

    def _bucket_sum(self, over_expert: bool) -> Callable[[jax.Array], jax.Array]:
        """A bucket of gradients summed over the replicas and the parts of each (over `expert` too where
        `over_expert`: the leaves every device of an expert group holds whole)."""
        def reduce_bucket(bucket: jax.Array) -> jax.Array:
            bucket = self._within_replica(bucket, over_expert)
            if self.participants == 1:
                return bucket
            if self.buckets_by_all_reduce:
                return self.all_reduce(bucket, self.axis)
            return self.all_gather(self.reduce_scatter(bucket, self.axis), self.axis)

        return reduce_bucket

    def sum_metrics(self, sums_R: Tree) -> Tree:
        return jax.tree.map(lambda s: self.total(s[0]), sums_R)

    def mean_model_state(self, model_state_R: Tree) -> Tree:
        return jax.tree.map(lambda x: mean_of_sum(self.total(widened(x[0])),
                                                  self.participants * self.context * self.expert, x.dtype),
                            model_state_R)

    def _within_replica(self, x: jax.Array, over_expert: bool) -> jax.Array:
        """`x` summed over the devices that share this replica's rows (over `expert` where `over_expert`)."""
        if self.context > 1:
            x = self.all_reduce(x, CONTEXT)
        return self.all_reduce(x, EXPERT) if over_expert and self.expert > 1 else x

    def gather(self, params: Tree) -> Tree:
        """FSDP's whole params from this device's blocks; otherwise `params` as they are."""
        return self._whole(params) if self.params_split else params

    def _whole(self, blocks: Tree) -> Tree:
        """Each split leaf all-gathered over `axis` along its `shard_dims` dimension."""

        def whole(x, dim):
            if dim is None:
                return x
            return jnp.moveaxis(self.all_gather(jnp.moveaxis(x, dim, 0), self.axis), 0, dim)

        return jax.tree.map(whole, blocks, self.shard_dims)

    def apply_update(self, tx: optax.GradientTransformation, grads: Tree, opt_state: Tree,
                     params: Tree) -> tuple[Tree, Tree]:
        """Replicated: every device updates everything. ZeRO-1: each device updates its block of each
        split param with its block of the optimizer state, then the blocks are all-gathered. FSDP: each
        device updates the block of each param it stores, which stays split."""
        if self.shard_dims is None:
            return update(tx, grads, opt_state, params)
        index = jax.lax.axis_index(self.axis)

        def block(x, dim):
            if dim is None:
                return x
            size = x.shape[dim] // self.participants
            return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)

        grads = jax.tree.map(block, grads, self.shard_dims)
        if self.params_split:
            return update(tx, grads, opt_state, params)
        local, opt_state = update(tx, grads, opt_state, jax.tree.map(block, params, self.shard_dims))
        return self._whole(local), opt_state


def update(tx: optax.GradientTransformation, grads: Tree, opt_state: Tree, params: Tree) -> tuple[Tree, Tree]:
    """(new params, new optimizer state) from one optimizer step."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def explicit_replicas(axis: str, participants: int, bucket_bytes: int, impl: str, timeout_s: float,
                      shard_dims: Tree | None = None, across_processes: bool = False,
                      params_split: bool = False, complete: Callable[[Tree], Tree] | None = None,
                      context: int = 1, expert: int = 1, expert_leaves: Tree | None = None) -> ExplicitReplicas:
    if impl == "custom":
        from xlatrain import custom_calls as ops

        return ExplicitReplicas(
            axis, participants, bucket_bytes,
            reduce_scatter=lambda x, a: ops.reduce_scatter(x, a, timeout_s=timeout_s),
            all_gather=lambda x, a: ops.all_gather(x, a, tiled=True, timeout_s=timeout_s),
            all_reduce=lambda x, a: ops.all_reduce(x, a, timeout_s=timeout_s), shard_dims=shard_dims,
            params_split=params_split, buckets_by_all_reduce=across_processes, complete=complete, context=context,
            expert=expert, expert_leaves=expert_leaves)
    return ExplicitReplicas(axis, participants, bucket_bytes,
                            reduce_scatter=lambda x, a: jax.lax.psum_scatter(x, a, tiled=True),
                            all_gather=lambda x, a: jax.lax.all_gather(x, a, tiled=True),
                            all_reduce=jax.lax.psum, shard_dims=shard_dims, params_split=params_split,
                            complete=complete, context=context, expert=expert, expert_leaves=expert_leaves)


def bucket_bounds(total: int, itemsize: int, bucket_bytes: int, participants: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of a flat buffer of `total` elements, each at most bucket_bytes (but
    never under one element per participant)."""
    per_bucket = max(participants, bucket_bytes // itemsize)
    return [(start, min(start + per_bucket, total)) for start in range(0, total, per_bucket)]


def bucketed_sum(grads: Tree, bucket_bytes: int, dtype: jnp.dtype, participants: int,
                 sum_bucket: Callable[[jax.Array], jax.Array]) -> Tree:
    """Sum gradients across replicas in buckets: the leaves flattened in reverse order (the last layers'
    gradients are ready first in the backward pass), cast to `dtype`, cut into buckets, each padded to
    a multiple of the participants and summed with `sum_bucket` (reduce-scatter + all-gather);
    returned as float32 in the original structure."""
    leaves, treedef = jax.tree.flatten(grads)
    order = list(reversed(range(len(leaves))))
    flat = jnp.concatenate([leaves[i].reshape(-1).astype(dtype) for i in order])
    summed = []
    for start, end in bucket_bounds(flat.size, jnp.dtype(dtype).itemsize, bucket_bytes, participants):
        padding = -(end - start) % participants
        bucket = jnp.pad(flat[start:end], (0, padding))
        summed.append(sum_bucket(bucket)[:end - start])
    flat = jnp.concatenate(summed).astype(jnp.float32)
    out, offset = [None] * len(leaves), 0
    for i in order:
        out[i] = flat[offset:offset + leaves[i].size].reshape(leaves[i].shape)
        offset += leaves[i].size
    return jax.tree.unflatten(treedef, out)


def widened(x: jax.Array) -> jax.Array:
    """Integers and booleans narrower than 32 bits as int32, so that a sum over replicas cannot overflow."""
    if jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize >= 4:
        return x
    return x.astype(jnp.int32)


def mean_of_sum(total: jax.Array, count: int, dtype: Any) -> jax.Array:
    """The replicas' mean from their sum, as `dtype`: floating values divided, integers (counters every replica
    advances alike, quantized weights none changes) floor-divided, so they stay exact."""
    if jnp.issubdtype(total.dtype, jnp.floating):
        return (total / count).astype(dtype)
    return (total // count).astype(dtype)


def split_replicas(x: jax.Array, replicas: int) -> jax.Array:
    """[microbatches, rows, ...] -> [replicas, microbatches, rows / replicas, ...] (rows are replica-major)."""
    return jnp.moveaxis(x.reshape(x.shape[0], replicas, x.shape[1] // replicas, *x.shape[2:]), 1, 0)


def sum_replicas(x_R: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Sum over the leading replica axis *in* `dtype` (jnp.sum would upcast 16-bit floats), as float32."""
    total = jax.lax.reduce(x_R.astype(dtype), jnp.zeros((), dtype), jax.lax.add, (0,))
    return total.astype(jnp.float32)

"""Where a pipelined model's parameters live: its stacked blocks cut into chunks, the chunks on stages.

The model's own layout stacks its L blocks on a leading axis: `params["blocks"]` leaves are [L, ...].
The stage layout is [virtual_stages, stages, width, ...]: position (round, stage) holds chunk
`chunk_at(round, stage)` (round * stages + stage in a loop; in a V the second round runs backwards), whose
`partition[c]` consecutive blocks are zero-padded to `width` (the largest chunk) so that every stage holds
arrays of one shape; the stage axis is sharded over the `stage` mesh axis. Padding blocks are never run,
so their gradients, updates and values stay zero. Everything else (embeddings, head) is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from xlatrain.mesh import DATA, STAGE
from xlatrain.models.blocks import BLOCKS, in_blocks, split_blocks
from xlatrain.pipeline.schedule import Placement, chunk_at, stage_of


@dataclass(frozen=True)
class StageLayout:
    stages: int
    virtual_stages: int
    partition: tuple[int, ...]
    """Blocks per chunk, in model order."""
    placement: Placement = "loop"
    """How chunks sit on stages (xlatrain/pipeline/schedule.py): chunk c runs on `stage_of(c)`."""

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages

    @property
    def layers(self) -> int:
        return sum(self.partition)

    @property
    def width(self) -> int:
        return max(self.partition)

    @property
    def even(self) -> bool:
        return len(set(self.partition)) == 1

    @cached_property
    def starts(self) -> np.ndarray:
        """The first block of each chunk."""
        return np.concatenate([[0], np.cumsum(self.partition)[:-1]]).astype(np.int32)

    @cached_property
    def chunk_table(self) -> np.ndarray:
        """[v, p]: the chunk each stage runs in each of its rounds."""
        return np.array([[chunk_at(r, s, self.stages, self.placement) for s in range(self.stages)]
                         for r in range(self.virtual_stages)], np.int32)

    @cached_property
    def _layer_of_position(self) -> np.ndarray:
        """[v, p, width]: which block sits at each position of the stage layout (-1: padding)."""
        index = np.full((self.virtual_stages, self.stages, self.width), -1, np.int32)
        for chunk, (start, count) in enumerate(zip(self.starts, self.partition, strict=True)):
            stage = stage_of(chunk, self.stages, self.placement)
            index[chunk // self.stages, stage, :count] = np.arange(start, start + count)
        return index

    def layers_at(self, index: tuple[slice, ...]) -> tuple[np.ndarray, tuple[slice, ...]]:
        """The blocks at `index` of a stage-layout leaf [v, p, width, ...] (-1: padding), and the rest of the index."""
        return self._layer_of_position[index[:3]], index[3:]

    def to_stages(self, blocks_Lx: jax.Array) -> jax.Array:
        """[L, ...] -> [v, p, width, ...], padding zero."""
        index = self._layer_of_position
        taken = jnp.take(blocks_Lx, np.maximum(index, 0), axis=0)
        mask = (index >= 0).reshape(*index.shape, *([1] * (blocks_Lx.ndim - 1)))
        return jnp.where(mask, taken, jnp.zeros((), blocks_Lx.dtype))

    def to_layers(self, staged: jax.Array) -> jax.Array:
        """[v, p, width, ...] -> [L, ...] (the padding dropped)."""
        flat = staged.reshape(-1, *staged.shape[3:])
        positions = np.argsort(self._layer_of_position.ravel(), kind="stable")[-self.layers:]
        return jnp.take(flat, positions, axis=0)

    def stage_params(self, params: dict) -> dict:
        return {**params, BLOCKS: jax.tree.map(self.to_stages, params[BLOCKS])}

    def layer_params(self, params: dict) -> dict:
        return {**params, BLOCKS: jax.tree.map(self.to_layers, params[BLOCKS])}

    def model_shapes(self, abstract_params: dict) -> dict:
        """Abstract params of the stage layout in the model's own layout (blocks [L, ...])."""
        return {**abstract_params, BLOCKS: jax.tree.map(
            lambda b: jax.ShapeDtypeStruct((self.layers, *b.shape[3:]), b.dtype), abstract_params[BLOCKS])}

    def param_specs(self, abstract_params: dict, within: dict | None = None) -> dict:
        """Blocks split over the stage axis, everything else replicated; `within`: the model layout's specs of
        what else is split (over `tensor`), the blocks' [L, ...] behind [virtual stages, stages]."""
        if within is None:
            within = jax.tree.map(lambda _: P(), abstract_params)
        specs = {**within, BLOCKS: jax.tree.map(lambda spec: P(None, STAGE, *spec), within[BLOCKS],
                                                is_leaf=lambda x: isinstance(x, P))}
        return jax.tree.map(lambda spec: _trimmed([*spec]), specs, is_leaf=lambda x: isinstance(x, P))

    def split_specs(self, abstract_params: dict, data: int, whole_layers: bool = False,
                    within: dict | None = None) -> dict:
        """`param_specs`, each leaf also split over `data` along its first dimension that `data` divides (past
        the blocks' [virtual stages, stages], and not one already split over `tensor`): how ZeRO-1 stores the
        optimizer state, and FSDP the params too. A leaf that no dimension fits stays whole. `whole_layers`:
        split the blocks along their layer axis (`width`) only and keep the rest whole, so that each layer's
        matrices stay whole on one replica (what an optimizer that reads a whole matrix, adafactor, needs)."""

        def candidates(path: tuple, leaf: jax.ShapeDtypeStruct) -> range:
            if not whole_layers:
                return range(2 if in_blocks(path) else 0, leaf.ndim)
            return range(2, 3) if in_blocks(path) else range(0)  # the blocks' `width` axis, or nothing

        def split(path: tuple, spec: P, leaf: jax.ShapeDtypeStruct) -> P:
            entries = [*spec, *([None] * (leaf.ndim - len(spec)))]
            for dim in candidates(path, leaf):
                if entries[dim] is None and leaf.shape[dim] % data == 0:
                    entries[dim] = DATA
                    return _trimmed(entries)
            return spec

        return jax.tree_util.tree_map_with_path(split, self.param_specs(abstract_params, within), abstract_params,
                                                is_leaf=lambda x: isinstance(x, P))

    def real_size(self, abstract_params: dict) -> int:
        """Parameters of the model, not counting the padding blocks."""
        blocks, rest = split_blocks(abstract_params)
        return (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(rest))
                + self.layers * sum(int(np.prod(x.shape[3:])) for x in jax.tree.leaves(blocks)))

    def describe(self) -> str:
        per_stage = [[self.partition[c] for c in self.chunk_table[:, s]] for s in range(self.stages)]
        text = ", ".join(f"stage {s}: {'+'.join(map(str, counts))}" for s, counts in enumerate(per_stage))
        padding = self.chunks * self.width - self.layers
        return f"blocks per chunk {list(self.partition)} ({text})" + (
            f"; {padding} padding block slot(s) so every stage holds {self.virtual_stages * self.width}"
            if padding else "")


def _trimmed(entries: list) -> P:
    """A PartitionSpec without trailing Nones (which mean the same): P(None, STAGE), not P(None, STAGE, None)."""
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)

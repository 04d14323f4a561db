"""Blocks to chunks: balance compute and memory over the pipeline's chunks.

The costs come from XLA (lowering/pipeline/block_costs.py): FLOPs from cost analysis and bytes from the shapes
and memory analysis of one microbatch through `before_blocks`, one block, and `after_blocks` plus the
loss. The stages run each time slot in lockstep (they exchange activations at its end), so a slot lasts
as long as its slowest chunk, and every stage allocates the largest chunk: `auto_partition` minimises the
largest chunk's share of the total compute or memory, whichever is worse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xlatrain.pipeline.schedule import Placement, stage_of


@dataclass(frozen=True)
class PieceCost:
    """One microbatch through a piece of the model."""

    forward_flops: float
    backward_flops: float
    """The backward action: the piece's forward recomputed, then its backward (the gradient program)."""
    param_bytes: float
    activation_bytes: float
    """XLA's temporaries for the piece's forward and backward."""
    weight_flops: float = 0.0
    """The part of the backward that computes the weight gradients (a split backward's W)."""

    def __add__(self, other: PieceCost) -> PieceCost:
        return PieceCost(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def __mul__(self, count: float) -> PieceCost:
        return PieceCost(*(a * count for a in self.as_tuple()))

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.forward_flops, self.backward_flops, self.param_bytes, self.activation_bytes, self.weight_flops)

    @property
    def flops(self) -> float:
        return self.forward_flops + self.backward_flops

    @property
    def bytes(self) -> float:
        return self.param_bytes + self.activation_bytes


NOTHING = PieceCost(0.0, 0.0, 0.0, 0.0, 0.0)


def action_flops(chunks: list[PieceCost], recompute: bool, split: bool) -> tuple[list[float], ...]:
    """Per chunk, the FLOPs of its F and B actions, and of W when the backward is split (B is then the backward
    less W): the durations `simulate` replays. `recompute`: B runs the forward again (remat: full)."""
    forward = [c.forward_flops for c in chunks]
    backward = [c.backward_flops - (0.0 if recompute else c.forward_flops) for c in chunks]
    if not split:
        return forward, backward
    weight = [c.weight_flops for c in chunks]
    return forward, [b - w for b, w in zip(backward, weight, strict=True)], weight


@dataclass(frozen=True)
class ModelCosts:
    before: PieceCost
    """before_blocks: runs in the first chunk."""
    block: PieceCost
    """One block; the blocks are stacked, so they share one structure and one cost."""
    after: PieceCost
    """after_blocks and the loss: runs in the last chunk."""
    blocks: int
    boundary_bytes: int
    """One microbatch's activation as it passes between chunks (what a stage holds per microbatch)."""

    def chunk(self, index: int, count: int, chunks: int) -> PieceCost:
        return (self.block * count + (self.before if index == 0 else NOTHING)
                + (self.after if index == chunks - 1 else NOTHING))

    def chunks(self, partition: tuple[int, ...]) -> list[PieceCost]:
        return [self.chunk(i, n, len(partition)) for i, n in enumerate(partition)]


def auto_partition(costs: ModelCosts, chunks: int) -> tuple[int, ...]:
    """Consecutive blocks per chunk (one or more each) minimising, over the chunks, the largest of
    (chunk compute / mean compute, chunk memory / mean memory); ties go to the lower compute share."""
    blocks = costs.blocks
    if blocks < chunks:
        raise ValueError(f"{blocks} blocks cannot fill {chunks} chunks")
    total = costs.chunk(0, blocks, 1)
    mean_flops, mean_bytes = total.flops / chunks or 1.0, total.bytes / chunks or 1.0

    def score(index: int, count: int) -> tuple[float, float]:
        piece = costs.chunk(index, count, chunks)
        share = piece.flops / mean_flops
        return (max(share, piece.bytes / mean_bytes), share)

    # best[k][i]: (bottleneck, counts) splitting the first i blocks into k chunks.
    best: list[dict[int, tuple[tuple[float, float], tuple[int, ...]]]] = [{0: ((0.0, 0.0), ())}]
    for k in range(1, chunks + 1):
        row = {}
        for i in range(k, blocks - (chunks - k) + 1):
            options = [(max(best[k - 1][i - n][0], score(k - 1, n)), best[k - 1][i - n][1] + (n,))
                       for n in range(1, i - (k - 1) + 1) if i - n in best[k - 1]]
            row[i] = min(options)
        best.append(row)
    return best[chunks][blocks][1]


@dataclass(frozen=True)
class Balance:
    """Per stage, per microbatch: the FLOPs of its chunks' forward and backward, and their bytes."""

    stage_flops: list[float]
    stage_bytes: list[float]
    stage_blocks: list[int] = field(default_factory=list)
    """Blocks per stage (of all its chunks)."""
    block_flops: float = 0.0
    """One block's FLOPs per microbatch: what the rest of a stage's FLOPs (the model's ends) is worth in blocks."""

    @staticmethod
    def of(costs: ModelCosts, partition: tuple[int, ...], stages: int, placement: Placement = "loop") -> Balance:
        flops, bytes_, blocks = [0.0] * stages, [0.0] * stages, [0] * stages
        for index, (piece, count) in enumerate(zip(costs.chunks(partition), partition, strict=True)):
            stage = stage_of(index, stages, placement)
            flops[stage] += piece.flops
            bytes_[stage] += piece.bytes
            blocks[stage] += count
        return Balance(flops, bytes_, blocks, costs.block.flops)

    def ends_in_blocks(self, stage: int) -> float:
        """What the stage runs besides its blocks (the embedding before them, the head and loss after), in blocks'
        worth of FLOPs; 0 when unknown."""
        if not self.block_flops or not self.stage_blocks:
            return 0.0
        return self.stage_flops[stage] / self.block_flops - self.stage_blocks[stage]

    @property
    def compute_ratio(self) -> float:
        """max / mean over stages; 1.0 is perfect balance."""
        return max(self.stage_flops) / (sum(self.stage_flops) / len(self.stage_flops))

    @property
    def memory_ratio(self) -> float:
        return max(self.stage_bytes) / (sum(self.stage_bytes) / len(self.stage_bytes))

    def describe(self) -> str:
        flops = ", ".join(f"{f:.3g}" for f in self.stage_flops)
        mib = ", ".join(f"{b / 2**20:.2f}" for b in self.stage_bytes)
        return (f"compute per stage [{flops}] FLOPs per microbatch, max/mean {self.compute_ratio:.2f}; "
                f"memory per stage [{mib}] MiB (params + activations), max/mean {self.memory_ratio:.2f}")

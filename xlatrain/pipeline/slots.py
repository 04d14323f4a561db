"""From a schedule table to what each stage's program does in each time slot.

A pipelined step runs the table's slots one after another on every stage at once (one SPMD program):
in each slot a stage runs its action, then every stage hands its output activation to the next stage
and its input gradient to the previous one. This module turns the table into [slots, stages] integer
tables the compiled step indexes by (slot, stage): which branch runs, on which microbatch and chunk, and
where incoming activations and gradients wait until they are used. With the V placement (ZB-V) a stage's
second chunk sends its activations the other way (to the previous stage) and its gradients to the next,
so arrivals come from both neighbours and have a write table per direction; at the V's tip (the last stage,
whose two chunks follow each other) the hand-off stays on the stage and counts as an arrival from stage p.

Each stage keeps its chunks' *input* activations from their arrival until the backward pass of that
microbatch, so the activations a stage holds are counted in microbatches: `activation_buffers` is the most
any stage holds at once (m for GPipe, at most p for 1F1B). The first chunk keeps none: its input is the
tokens. With `remat: full` the backward recomputes the chunk's forward from its input (GPipe's
re-materialisation); with `remat: none` the forward slot also keeps the chunk's residuals until its
backward slot, in `residual_buffers` buffers counted the same way (every chunk, first and last included).
A schedule that splits the backward keeps the residuals until the W slot, and B's stash (what W reads that B
computed) from the B slot to the W slot, in `stash_buffers`. A forward-only schedule (an evaluation) keeps
each activation only until the chunk's forward reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from xlatrain.pipeline.schedule import Action, Placement, Schedule


class Branch(IntEnum):
    IDLE = 0
    FORWARD_FIRST = 1
    """Forward of chunk 0: from the batch's inputs through before_blocks and the chunk's blocks."""
    FORWARD = 2
    FORWARD_LAST = 3
    """Forward of the last chunk: its blocks, after_blocks and the loss (kept for the metrics)."""
    BACKWARD_FIRST = 4
    BACKWARD = 5
    BACKWARD_LAST = 6
    """Backward of the last chunk: starts from the (scaled) loss; needs no incoming gradient."""
    WEIGHT_FIRST = 7
    """The weight gradients of chunk 0 (with a split backward, B of chunk 0 has nothing to compute)."""
    WEIGHT = 8
    WEIGHT_LAST = 9


@dataclass(frozen=True)
class SlotProgram:
    """[slots, stages] tables. A *_write entry names the buffer that receives what arrives at the end of
    that slot (*_write_reverse: what arrives from the other direction, V placement only); the scratch buffer
    (index = the buffer count) takes arrivals nobody needs."""

    branch: np.ndarray
    microbatch: np.ndarray
    round: np.ndarray
    """Which of the stage's chunks (chunk // stages) the action runs; its chunk is `chunk_at(round, stage)`."""
    activation_read: np.ndarray
    cotangent_read: np.ndarray
    activation_write: np.ndarray
    cotangent_write: np.ndarray
    residual_read: np.ndarray
    residual_write: np.ndarray
    stash_read: np.ndarray
    stash_write: np.ndarray
    """Where B's stash waits for W, on the stage itself: written by the B slot, read by the W slot."""
    activation_buffers: int
    cotangent_buffers: int
    residual_buffers: int
    stash_buffers: int
    ring: bool
    """Whether the last stage passes activations on to the first (interleaved: chunk p follows chunk p - 1)."""
    activation_write_reverse: np.ndarray
    cotangent_write_reverse: np.ndarray
    splits_backward: bool = False
    """Whether backwards run as B and W slots (a zero-bubble schedule)."""
    placement: Placement = "loop"

    @property
    def slots(self) -> int:
        return self.branch.shape[0]

    def tables(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ("branch", "microbatch", "round", "activation_read",
                                                       "cotangent_read", "activation_write", "cotangent_write",
                                                       "residual_read", "residual_write", "stash_read",
                                                       "stash_write", "activation_write_reverse",
                                                       "cotangent_write_reverse")}


def slot_program(schedule: Schedule) -> SlotProgram:
    p, chunks = schedule.stages, schedule.stages * schedule.virtual_stages
    when = {action: slot for slot, row in enumerate(schedule.table) for action in row if action is not None}
    shape = (schedule.slots, p)
    branch, microbatch, round_ = (np.zeros(shape, np.int32) for _ in range(3))
    for action, slot in when.items():
        stage = schedule.stage_of(action.chunk)
        branch[slot, stage] = _branch(action, chunks)
        microbatch[slot, stage] = action.microbatch
        round_[slot, stage] = action.chunk // p

    def backward_of(a: Action, kind: str = "B") -> list[int]:
        """The slot of F(c, j)'s backward B(c, j) (or W(c, j)); none in a forward-only schedule."""
        backward = Action(kind, a.microbatch, a.chunk)
        return [when[backward]] if backward in when else []

    def home(a: Action) -> int:
        """The stage that runs a's chunk."""
        return schedule.stage_of(a.chunk)

    def reverse(a: Action) -> bool:
        """Whether what chunk a receives comes the other way: the V's second arm, the tip included."""
        return schedule.placement == "v" and a.chunk >= p

    # An activation for chunk c >= 1 arrives after F(c - 1) and is last read by B(c), or W(c) when split (by
    # F(c) when forward only); a gradient for chunk c < last arrives after B(c + 1) and is read by B(c).
    activations = [(when[Action("F", a.microbatch, a.chunk - 1)], [when[a], *backward_of(a), *backward_of(a, "W")],
                    home(a), reverse(a)) for a in when if a.kind == "F" and a.chunk > 0]
    cotangents = [(when[Action("B", a.microbatch, a.chunk + 1)], [when[a]], home(a), reverse(a))
                  for a in when if a.kind == "B" and a.chunk < chunks - 1]
    # A chunk's residuals are kept from the end of its forward slot until its backward slot (its W, when split);
    # B's stash, from the end of the B slot until the W slot.
    residuals = [(when[a], [*backward_of(a), *backward_of(a, "W")], home(a), False)
                 for a in when if a.kind == "F" and backward_of(a)]
    stashes = [(when[a], [when[Action("W", a.microbatch, a.chunk)]], home(a), False)
               for a in when if a.kind == "B" and schedule.splits_backward]
    activation_read, activation_write, activation_buffers = _assign_buffers(activations, shape)
    cotangent_read, cotangent_write, cotangent_buffers = _assign_buffers(cotangents, shape)
    residual_read, residual_write, residual_buffers = _assign_buffers(residuals, shape)
    stash_read, stash_write, stash_buffers = _assign_buffers(stashes, shape)
    return SlotProgram(branch, microbatch, round_, activation_read, cotangent_read, activation_write[0],
                       cotangent_write[0], residual_read, residual_write[0], stash_read, stash_write[0],
                       activation_buffers, cotangent_buffers, residual_buffers, stash_buffers,
                       ring=schedule.placement == "loop" and schedule.virtual_stages > 1,
                       activation_write_reverse=activation_write[1], cotangent_write_reverse=cotangent_write[1],
                       splits_backward=schedule.splits_backward, placement=schedule.placement)


def _branch(action: Action, chunks: int) -> Branch:
    first, last = action.chunk == 0, action.chunk == chunks - 1
    if action.kind == "F":
        return Branch.FORWARD_FIRST if first else Branch.FORWARD_LAST if last else Branch.FORWARD
    if action.kind == "W":
        return Branch.WEIGHT_FIRST if first else Branch.WEIGHT_LAST if last else Branch.WEIGHT
    return Branch.BACKWARD_FIRST if first else Branch.BACKWARD_LAST if last else Branch.BACKWARD


def _assign_buffers(items: list[tuple[int, list[int], int, bool]], shape: tuple[int, int],
                    ) -> tuple[np.ndarray, np.ndarray, int]:
    """Give each (arrival slot, reading slots, stage, from the reverse direction) item a buffer on its stage,
    reusing a buffer once its last reader has run (interval colouring, optimal for intervals). A buffer
    freed by a read in slot t can take an arrival at the end of slot t. Returns the read table, the write
    tables [usual, reverse] and the buffer count."""
    reads, writes = np.zeros(shape, np.int32), np.full((2, *shape), -1, np.int32)
    free_from: list[list[int]] = [[] for _ in range(shape[1])]
    """Per stage, per buffer: the first slot at whose end it may take a new arrival."""
    for arrival, readers, stage, reverse in sorted(items):
        buffers = free_from[stage]
        index = next((i for i, free in enumerate(buffers) if free <= arrival), len(buffers))
        if index == len(buffers):
            buffers.append(0)
        buffers[index] = max(readers)
        writes[int(reverse), arrival, stage] = index
        for slot in readers:
            reads[slot, stage] = index
    count = max((len(b) for b in free_from), default=0)
    writes[writes < 0] = count
    return reads, writes, count

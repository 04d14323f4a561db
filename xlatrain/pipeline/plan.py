"""A run's pipeline, decided once from the config: the schedule, the block partition, the slot program."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

from xlatrain.config import PipelineConfig, check_block_partition
from xlatrain.errors import UserError
from xlatrain.pipeline.layout import StageLayout
from xlatrain.pipeline.partition import (
    Balance,
    ModelCosts,
    action_flops,
    auto_partition,
)
from xlatrain.pipeline.remat import RematChoice
from xlatrain.pipeline.schedule import (
    Schedule,
    ScheduleError,
    Timeline,
    build,
    dependency_problems,
    forward_only,
    simulate,
)
from xlatrain.pipeline.slots import SlotProgram, slot_program


@dataclass(frozen=True)
class PipelinePlan:
    schedule: Schedule
    layout: StageLayout
    slots: SlotProgram
    partition_source: str
    """"auto" (from the measured costs) or "explicit" (parallel.pipeline.partition)."""
    measure: Callable[[], ModelCosts]
    """XLA's per-piece costs, measured on first use (and then kept)."""
    count_work: Callable[[str], Any]
    """`count_work(remat)`: XLA's FLOPs of the pipelined step beside the unpipelined model's
    (lowering/pipeline/work.py), counted on first use (and then kept)."""
    count_residual_bytes: Callable[[], int]
    """Bytes of one microbatch's kept residuals on a stage with remat: none, counted on first use."""
    count_stash_bytes: Callable[[], int]
    """Bytes of one microbatch's stash from B to W on a stage (a zero-bubble schedule), counted on first use."""
    evaluation: Schedule
    """The eval step's forward-only schedule, over as many microbatches as a train step has in all."""
    eval_slots: SlotProgram

    @property
    def costs(self) -> ModelCosts:
        return self.measure()

    @property
    def balance(self) -> Balance:
        return Balance.of(self.costs, self.layout.partition, self.layout.stages, self.layout.placement)

    def simulated(self) -> Timeline:
        """The schedule replayed with each chunk's forward and backward FLOPs as its durations, in units of
        the mean chunk forward (1 = one slot of the table when chunks are equal). A split backward's B is the
        backward without the recomputed forward and W (remat: none), and W the weight gradients."""
        chunks = self.costs.chunks(self.layout.partition)
        unit = sum(c.forward_flops for c in chunks) / len(chunks) or 1.0
        split = self.schedule.splits_backward
        durations = action_flops(chunks, recompute=not split, split=split)
        return simulate(self.schedule, *([flops / unit for flops in kind] for kind in durations))

    def summary(self, remat: RematChoice | str, rows_per_microbatch: int | None = None,
                count_work: bool = False) -> list[str]:
        """`remat`: the choice, or "auto" before the step has compiled to make it. `count_work`: add XLA's FLOPs
        of the step against the unpipelined model's (compiles every kind of action: seconds, so `xlatrain
        pipeline` asks for it and a training run's start does not)."""
        s, slots = self.schedule, self.slots
        rows = f" of {rows_per_microbatch} rows" if rows_per_microbatch else ""
        chunk = f"{s.virtual_stages} chunks per stage" if s.virtual_stages > 1 else "1 chunk per stage"
        simulated = self.simulated()
        return [
            f"schedule         {s.name}: {s.stages} stages, {s.microbatches} microbatches{rows}, {chunk}, "
            f"{s.slots} time slots",
            f"partition        {self.partition_source}: {self.layout.describe()}",
            f"balance          {self.balance.describe()}",
            f"bubble           {s.bubble():.1%} of device time with equal chunks (theory {_bubble_theory(s)} = "
            f"{s.theoretical_bubble():.1%}); {simulated.bubble():.1%} with the chunks' XLA FLOPs",
            f"activations      each stage holds at most {slots.activation_buffers} microbatch(es) of stage inputs "
            f"(gpipe: {self.gpipe_activation_buffers()}) and {slots.cotangent_buffers} of incoming gradients",
            self.remat_line(remat, count_work),
            f"evaluation       forward only through the stages: {self.evaluation.microbatches} microbatches, "
            f"{self.evaluation.slots} time slots, bubble {self.evaluation.bubble():.1%}",
        ]

    def remat_line(self, remat: RematChoice | str, count_work: bool) -> str:
        if isinstance(remat, str):
            otherwise = "an error: B and W cannot recompute" if self.slots.splits_backward else "full"
            return ("remat            auto: chosen when the train step compiles (none if XLA's memory analysis of "
                    f"the step keeping residuals fits the budget, else {otherwise})")
        done = f"; XLA FLOPs per step {self.count_work(remat.remat).ratio:.2f}x the unpipelined model's" \
            if count_work else ""
        if remat.remat == "none" and self.slots.splits_backward:
            what = (f"chunks keep their residuals from F to W (at most {self.slots.residual_buffers} microbatch(es) "
                    f"of them per stage), and B's stash for W (at most {self.slots.stash_buffers})")
        elif remat.remat == "none":
            what = (f"chunks keep their residuals from forward to backward (at most {self.slots.residual_buffers} "
                    "microbatch(es) of them per stage)")
        else:
            what = "chunks recompute their forward in the backward"
        return f"remat            {remat.remat}: {what}{done}; {remat.reason}"

    def gpipe_activation_buffers(self) -> int:
        """What the same stages and microbatches would hold under GPipe (m per stage)."""
        return slot_program(build("gpipe", self.schedule.stages, self.schedule.microbatches)).activation_buffers

    def table_text(self) -> str:
        """The schedule table: a row per time slot, a column per stage; F/B/W, microbatch, .chunk round."""
        s = self.schedule
        header = "slot  " + "".join(f"stage {i:<4}" for i in range(s.stages))
        lines = [header]
        for slot, row in enumerate(s.table):
            cells = ["." if a is None else f"{a.kind}{a.microbatch}" + (f".{a.chunk // s.stages}"
                                                                          if s.virtual_stages > 1 else "")
                     for a in row]
            lines.append(f"{slot:<6}" + "".join(f"{c:<10}" for c in cells))
        return "\n".join(lines)


def _bubble_theory(schedule: Schedule) -> str:
    if not schedule.splits_backward:
        return "(p-1)/(v*m+p-1)"
    return f"(p-1)/({3 * schedule.virtual_stages}m+p-1), F = B = W"


def plan_pipeline(config: PipelineConfig, stages: int, microbatches: int, blocks: int,
                  measure: Callable[[], ModelCosts], count_work: Callable[[Schedule, tuple[int, ...], str], Any],
                  count_residual_bytes: Callable[[tuple[int, ...], bool], int], eval_microbatches: int | None = None,
                  pinned: tuple[int, ...] | None = None,
                  agree: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda partition: partition) -> PipelinePlan:
    """`count_work(schedule, partition, remat)`: XLA's FLOPs of the step beside the unpipelined model's.
    `count_residual_bytes(partition, stash)`: one microbatch's kept residuals on a stage (remat: none), or its
    stash from B to W (stash=True).
    `eval_microbatches`: how many pieces the eval step cuts a replica's rows into (default `microbatches`).
    `pinned`: the partition `auto` chose at the run's first start, kept on resume.
    `agree(partition)`: the partition every process takes, given the one `auto` chose here."""
    virtual = config.chunks_per_stage()
    try:
        check_block_partition(config, stages, blocks, "the model's block count")
        schedule = build(config.schedule, stages, microbatches, virtual)
        evaluation = forward_only(build(config.schedule, stages, eval_microbatches or microbatches, virtual))
    except (ValueError, ScheduleError) as err:
        raise UserError(f"config: {err}") from None
    for table in (schedule, evaluation):
        problems = dependency_problems(table)
        if problems:  # the builders place actions by their dependencies, so this is a bug, not a config problem
            raise AssertionError(f"{table.name} table breaks its dependencies: {problems[:3]}")
    measure = cache(measure)
    if config.partition != "auto":
        partition, source = tuple(config.partition), "explicit"
    elif pinned is not None:
        if len(pinned) != stages * virtual or sum(pinned) != blocks:
            raise UserError(f"the run directory's config.yaml has derived.pipeline_partition={list(pinned)}, which "
                            f"does not cut {blocks} blocks into {stages * virtual} chunks; restore the file from the "
                            "run's first start, or move the run directory aside")
        partition, source = pinned, "auto (chosen at the run's first start)"
    else:
        partition, source = agree(tuple(auto_partition(measure(), stages * virtual))), "auto"
    layout = StageLayout(stages, virtual, partition, schedule.placement)
    return PipelinePlan(schedule, layout, slot_program(schedule), source,
                        measure, cache(lambda remat: count_work(schedule, partition, remat)),
                        cache(lambda: count_residual_bytes(partition, False)),
                        cache(lambda: count_residual_bytes(partition, True)), evaluation,
                        slot_program(evaluation))

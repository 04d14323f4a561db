"""parallel.pipeline.remat: which way a pipeline's chunks get their backward's residuals.

`auto` keeps them (`none`) when XLA's memory analysis of the train step compiled that way fits the budget
(parallel.pipeline.memory_budget_bytes, or the device's memory), and recomputes them (`full`) otherwise; a
zero-bubble schedule cannot recompute them, so there a step that does not fit is an error. One choice serves
every stage: the stages run one SPMD program, whose buffers have the same shapes on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from xlatrain.errors import UserError
from xlatrain.sizes import readable_bytes


@dataclass(frozen=True)
class RematChoice:
    remat: str
    """"none" or "full"."""
    reason: str

    def describe(self) -> str:
        return f"{self.remat} ({self.reason})"


def configured(remat: str, zero_bubble: str | None = None) -> RematChoice:
    """`zero_bubble`: as in choose_remat; there none is also what the schedule takes when remat is left unset."""
    if zero_bubble:
        return RematChoice(remat, f"parallel.pipeline.remat, {zero_bubble}'s default: its B and W run from the "
                                  "kept residuals")
    return RematChoice(remat, "set by parallel.pipeline.remat")


def choose_remat(measure_with_residuals: Callable[[], int], budget: int | None, budget_source: str,
                 zero_bubble: str | None = None) -> RematChoice:
    """`measure_with_residuals()`: bytes per device of the step compiled with remat: none (it compiles, so it is
    called only when there is a budget to hold it against). `zero_bubble`: the schedule, when it is one whose
    B and W run from the residuals (none is its only way)."""
    if budget is None:
        if zero_bubble:
            return RematChoice("none", f"auto: {zero_bubble} keeps residuals, its only way ({budget_source} is "
                                       "unknown, so nothing was checked)")
        return RematChoice("full", f"auto: {budget_source} is unknown, so residuals are recomputed; set "
                                   "parallel.pipeline.memory_budget_bytes to let auto keep them")
    needed = measure_with_residuals()
    measured = (f"keeping residuals needs {_size(needed)} per device by XLA's memory analysis of the step, "
                f"{'within' if needed <= budget else 'more than'} {budget_source} ({_size(budget)})")
    if zero_bubble and needed > budget:
        raise UserError(f"parallel.pipeline.remat=auto: schedule={zero_bubble} cannot recompute its residuals, and "
                        f"{measured}: cut the batch into more parallel.pipeline.microbatches, use more stages, or a "
                        "schedule that recomputes (1f1b or interleaved with remat auto)")
    return RematChoice("none" if needed <= budget else "full", f"auto: {measured}")


def _size(n: int) -> str:
    """Exact bytes as well: a budget a few bytes short of the need reads the same in MiB."""
    return f"{readable_bytes(n)} = {n:,} bytes"

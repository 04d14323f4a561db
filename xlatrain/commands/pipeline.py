"""`xlatrain pipeline`: a config's pipeline as planned for this host's devices: the summary, the schedule table and
its Gantt chart, the chunks timed by XLA's FLOPs."""

from __future__ import annotations

from pathlib import Path

from xlatrain.config import Config
from xlatrain.errors import UserError
from xlatrain.observe.gantt import draw
from xlatrain.observe.plot import figure_path
from xlatrain.program import build_program


def show_pipeline(config: Config, out: Path) -> None:
    if config.mesh.stage == 1:
        raise UserError("pipeline: this config runs no pipeline (mesh.stage=1); set mesh.stage to the number of "
                        "stages, e.g. mesh.stage=4 parallel.mode=shard_map")
    out = figure_path("pipeline", "--out", out)
    program = build_program(config)
    plan = program.pipeline
    print("\n".join(plan.summary(program.remat, program.derived.pipeline_microbatch_size, count_work=True)))
    print(plan.table_text())
    draw(plan.schedule, out, plan.simulated(), "time (mean chunk forward = 1), from XLA's FLOPs per chunk")
    print(f"wrote {out}")

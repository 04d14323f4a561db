"""What a training session cost, in the spirit of torch_xla's metrics report: compilations and their
causes, executions, time waiting for results and for data, and bytes moved between host and device.

Each session appends one JSON line to RUN/summary.jsonl; `xlatrain report RUN` prints them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xlatrain.errors import UserError
from xlatrain.observe.bottlenecks import Finding
from xlatrain.observe.time_breakdown import describe
from xlatrain.run.jsonl import open_for_append, read_records
from xlatrain.sizes import readable_bytes

SUMMARY_FILE = "summary.jsonl"


@dataclass
class RunSummary:
    start_step: int = 0
    final_step: int = 0
    boundaries: int = 0
    wall_seconds: float = 0.0
    compilations: int = 0
    """Every XLA compilation of the session (steps, init, checks)."""
    compile_seconds: float = 0.0
    compile_cache_hits: int = 0
    """Of the compilations, executables loaded from the persistent cache (trainer.compile_cache)."""
    compilations_by_phase: dict[str, int] = field(default_factory=dict)
    """set-up (model checks, pipeline partition, shardings), state (init, restore, replica check), steps,
    checkpoints (fingerprints, orbax), other."""
    step_compilations: list[dict] = field(default_factory=list)
    """Each compilation of the train/eval steps, with its cause."""
    executions: int = 0
    """Train and eval executables dispatched."""
    dispatch_seconds: float = 0.0
    result_wait_seconds: float = 0.0
    """Host time blocked until device results reached the host at boundaries."""
    data_wait_seconds: float = 0.0
    """Host time blocked waiting for the device loader."""
    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    time_breakdown: dict[str, float] = field(default_factory=dict)
    """The loop's wall time in seconds: data, compile, device, eval, checkpoint, host
    (xlatrain/observe/time_breakdown.py)."""
    findings: list[dict] = field(default_factory=list)
    """The bottleneck rules that fired (xlatrain/observe/bottlenecks.py): rule, step, message."""

    def lines(self, findings_said: bool = False) -> list[str]:
        """`findings_said`: the bottleneck findings were printed as they fired (the run's own end of session), so
        they are named here, not repeated."""
        steps = self.final_step - self.start_step
        per_step = f" ({1e3 * self.wall_seconds / steps:.2f} ms/step)" if steps else ""
        lines = [
            f"steps {self.start_step}..{self.final_step} in {self.boundaries} boundaries, "
            f"{self.wall_seconds:.1f}s{per_step}",
            f"compilations {self.compilations} ({self.compile_seconds:.1f}s, {self.compile_cache_hits} loaded from "
            "the persistent cache): "
            + ", ".join(f"{phase} {count}" for phase, count in self.compilations_by_phase.items())
            + f"; of the steps {len(self.step_compilations)}:",
            *(f"  {c['step']} ({c['seconds']:.2f}s): {c['cause']}" for c in self.step_compilations),
            f"executions {self.executions}, dispatch {self.dispatch_seconds:.2f}s, "
            f"waiting for results {self.result_wait_seconds:.2f}s, waiting for data {self.data_wait_seconds:.2f}s",
            f"host->device {readable_bytes(self.host_to_device_bytes)}, "
            f"device->host {readable_bytes(self.device_to_host_bytes)}",
        ]
        if self.time_breakdown:
            lines.append(f"time: {describe(self.time_breakdown)}")
        findings = [Finding(**f) for f in self.findings]
        if findings_said and findings:
            lines.append("bottlenecks (said above): " + ", ".join(f"{f.rule} {f.where()}" for f in findings))
        else:
            lines += [f.line() for f in findings]
        return lines

    def append_to(self, run_dir: Path) -> None:
        with open_for_append(run_dir / SUMMARY_FILE) as handle:
            handle.write(json.dumps(asdict(self)) + "\n")


def read_summaries(run_dir: Path) -> list[RunSummary]:
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        raise UserError(f"report: {path} not found; give the run directory of a finished or stopped "
                        "`xlatrain train` (trainer.run_dir)")
    try:
        summaries = [RunSummary(**record) for record in read_records(path)]
    except UserError as err:
        raise UserError(f"report: {err}") from None
    except TypeError as err:
        raise UserError(f"report: {path} is not a summary written by xlatrain ({err})") from None
    if not summaries:
        raise UserError(f"report: {path} holds no session summary yet (a run writes one as each session ends)")
    return summaries


def format_report(run_dir: Path) -> str:
    sessions = read_summaries(run_dir)
    parts = []
    for number, session in enumerate(sessions, 1):
        parts.append(f"session {number}:\n" + "\n".join(f"  {line}" for line in session.lines()))
    return "\n".join(parts)



"""`xlatrain parity CONFIG --against torch|torch_xla`: a torch model trained by xlatrain and by PyTorch.

Both sides start from the same module (built from the same seed, or `model.init_from`), see the same
batches in the same order, and use the same hyperparameters: xlatrain's optimizer chain, schedule and
clipping map onto torch.optim (xlatrain/torch_bridge/eager.py); what has no exact equivalent is refused.
The torch side runs eagerly in this process, or under torch_xla (lazy tensors, one `torch_xla.sync()`
per step) in the Python of a virtual environment that has torch_xla (it needs its own torch).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from xlatrain.commands.parity import (
    ParityReport,
    compare,
    parity_config,
    side_devices,
    trajectory,
)
from xlatrain.config import AdamWConfig, Config, SGDConfig, TorchModelConfig, derive
from xlatrain.data.loader import train_iterator
from xlatrain.data.sources import open_dataset
from xlatrain.errors import UserError
from xlatrain.optim import learning_rate_schedule

BACKENDS = ("torch", "torch_xla")
TORCH_XLA_PYTHON = "XLATRAIN_TORCH_XLA_PYTHON"
"""Environment variable: the Python of a virtual environment with torch_xla (for --against torch_xla)."""
TORCH_XLA_TIMEOUT_S = 1800


def run_torch_parity(config: Config, backend: str, steps: int, rtol: float, python: str | None = None,
                     ) -> ParityReport:
    from xlatrain.torch_bridge import eager
    from xlatrain.torch_bridge.module import load_module

    if not isinstance(config.model, TorchModelConfig):
        raise UserError(f"parity --against {backend} compares a torch model (model.name=torch), not "
                        f"model.name={config.model.name}")
    if backend == "torch_xla":
        python = torch_xla_python(python)
    module = load_module(config.model, config.seed)
    refuse_what_differs(config, module)
    batches = host_batches(config, steps)
    with tempfile.TemporaryDirectory(prefix="xlatrain-torch-parity-") as scratch:
        config = parity_config(config, steps, Path(scratch) / "xlatrain")
        spec = optimizer_spec(config, steps)
        ours = trajectory(config)
        if backend == "torch":
            records = eager.train(module, batches, config.batch.microbatches, config.model.loss, spec)
        else:
            records = _run_under_torch_xla(config, module, batches, spec, Path(scratch), python)
    theirs = {r["step"]: r for r in records}
    return compare(ours, theirs, steps, rtol)


def optimizer_spec(config: Config, steps: int):
    from xlatrain.torch_bridge.eager import OptimizerSpec

    opt = config.optimizer
    derived = derive(config, side_devices(config))
    schedule = learning_rate_schedule(opt, derived, config.trainer.steps)
    rates = [float(schedule(step)) for step in range(steps)]
    if isinstance(opt, AdamWConfig):
        return OptimizerSpec("adamw", rates, opt.clip_norm, opt.weight_decay, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    if isinstance(opt, SGDConfig):
        if opt.weight_decay:
            raise UserError("parity --against torch: optimizer.weight_decay with sgd is decoupled in xlatrain but an "
                            "L2 term in torch.optim.SGD, so no exact equivalent exists; set optimizer.weight_decay=0 "
                            "or use adamw")
        return OptimizerSpec("sgd", rates, opt.clip_norm, 0.0, momentum=opt.momentum, nesterov=opt.nesterov)
    raise UserError(f"parity --against torch: optimizer.name={opt.name} has no exact torch.optim equivalent; use "
                    "adamw or sgd")


def refuse_what_differs(config: Config, module) -> None:
    """What would make the two sides differ for reasons other than a bug: refuse it, saying why."""
    import torch

    if config.precision.policy != "fp32" or config.precision.compute_dtype not in (None, "float32"):
        raise UserError("parity --against torch compares fp32 training (PyTorch's autocast rounds differently from "
                        "xlatrain's precision policies); set precision.policy=fp32")
    dropouts = [name for name, m in module.named_modules()
                if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    if dropouts:
        raise UserError(f"parity --against torch: dropout draws differ between PyTorch's and xlatrain's random "
                        f"generators (module {dropouts[0]!r} has p > 0); set the dropout to 0 for the comparison")
    batch_norms = [name for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
    if batch_norms and len(side_devices(config)) > 1:
        raise UserError(f"parity --against torch: module {batch_norms[0]!r} normalises with the statistics of each "
                        "data-parallel replica's rows, PyTorch's with the whole batch; set mesh.data=1")


def host_batches(config: Config, steps: int) -> list[dict[str, np.ndarray]]:
    """The first `steps` global batches, exactly as xlatrain's loader draws them."""
    dataset = open_dataset(config.data, config.model.loss, config.run_dir())
    global_batch = derive(config, side_devices(config)).global_batch
    iterator = train_iterator(dataset.train, seed=config.seed, shuffle=config.data.shuffle, local_batch=global_batch,
                              block=0, blocks=1, buckets=dataset.spec.buckets)
    return [next(iterator) for _ in range(steps)]


def torch_xla_python(python: str | None) -> str:
    """The Python that runs the torch_xla side: --python, else $XLATRAIN_TORCH_XLA_PYTHON; it must exist."""
    python = python or os.environ.get(TORCH_XLA_PYTHON)
    if not python:
        raise UserError(f"parity --against torch_xla: give the Python of a virtual environment with torch_xla (see "
                        f"docs/models.md) as --python PATH or {TORCH_XLA_PYTHON}=PATH")
    if shutil.which(python) is None:
        raise UserError(f"parity --against torch_xla: {python!r} is not an executable Python; give the one of a "
                        "virtual environment with the [torch-xla] extra")
    return python


def _run_under_torch_xla(config: Config, module, batches: list[dict], spec, scratch: Path,
                         python: str) -> list[dict]:
    import torch

    torch.save(module.state_dict(), scratch / "weights.pt")
    np.savez(scratch / "batches.npz", **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()})
    job = {"target": config.model.target, "kwargs": config.model.kwargs, "weights": str(scratch / "weights.pt"),
           "batches": str(scratch / "batches.npz"), "backend": "torch_xla", "microbatches": config.batch.microbatches,
           "loss": config.model.loss, "optimizer": asdict(spec)}
    (scratch / "spec.json").write_text(json.dumps(job))
    script = importlib.util.find_spec("xlatrain.torch_bridge.eager").origin  # run as a script: no import of torch
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    try:
        done = subprocess.run([python, str(script), str(scratch / "spec.json"), str(scratch / "out.json")],
                              capture_output=True, text=True, env=env, timeout=TORCH_XLA_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UserError(f"parity --against torch_xla: could not run {python}: {err}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"parity --against torch_xla: the torch_xla side failed under {python}: {last}")
    return json.loads((scratch / "out.json").read_text())

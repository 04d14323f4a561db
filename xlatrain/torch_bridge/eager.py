"""The same training, in PyTorch itself: the reference side of `xlatrain parity --against torch|torch_xla`.

Imports only torch and numpy (never JAX or the rest of xlatrain), so it also runs as a script under another
Python, e.g. a virtual environment with torch_xla (which needs its own torch):

    python xlatrain/torch_bridge/eager.py SPEC.json OUT.json

It follows xlatrain's train step with torch.optim: gradients of each microbatch's weighted loss sum over
the batch's total weight, accumulated; global-norm clipping (torch.nn.utils.clip_grad_norm_); the
optimizer with decoupled weight decay on parameters of rank >= 2 only; the learning rate of each step
as xlatrain's schedule gives it. After every step it records the loss and the parameter norm.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    """adamw or sgd (the optimizers with an exact torch.optim equivalent)."""
    learning_rates: list[float]
    """The learning rate of each step, 0-based, as xlatrain's schedule gives it."""
    clip_norm: float | None
    weight_decay: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False


def build_optimizer(module: torch.nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    lr = spec.learning_rates[0]
    if spec.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(spec.b1, spec.b2), eps=spec.eps)
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=spec.momentum, nesterov=spec.nesterov)
    raise ValueError(f"optimizer {spec.name!r} has no exact torch.optim equivalent")


def loss_sum(outputs: torch.Tensor, batch: dict[str, torch.Tensor], loss: str) -> torch.Tensor:
    """The weighted sum (not mean) of the loss over a microbatch, as xlatrain's loss_sums."""
    targets = batch["targets"]
    weights = batch.get("mask", torch.ones(targets.shape, dtype=torch.float32, device=targets.device))
    if loss == "mse":
        err = (outputs.float() - targets.reshape(outputs.shape).float()) ** 2
        return (err * weights.reshape(err.shape)).sum()
    per_position = F.cross_entropy(outputs.float().reshape(-1, outputs.shape[-1]), targets.reshape(-1).long(),
                                   reduction="none")
    return (per_position * weights.reshape(-1)).sum()


def train(module: torch.nn.Module, batches: Iterable[dict[str, np.ndarray]], microbatches: int, loss: str,
          spec: OptimizerSpec, device: Any = "cpu", sync: Callable[[], None] = lambda: None) -> list[dict]:
    """One record per step: {"step", "loss", "param_norm"}."""
    module = module.to(device)
    module.train()
    optimizer = build_optimizer(module, spec)
    records = []
    for step, host in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rates[step]
        batch = {k: torch.from_numpy(np.asarray(v)).to(device) for k, v in host.items()}
        total_weight = batch["mask"].sum() if "mask" in batch else float(batch["targets"].numel())
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for index in range(microbatches):
            micro = {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:])[index]
                     for k, v in batch.items()}
            scaled = loss_sum(module(micro["inputs"]), micro, loss) / total_weight
            scaled.backward()
            step_loss = step_loss + scaled.detach()
        if spec.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), spec.clip_norm)
        optimizer.step()
        sync()
        with torch.no_grad():  # over the parameters xlatrain keeps as params: integer ones are its model state
            norm = torch.sqrt(sum((p.abs().float() ** 2).sum() for p in module.parameters()
                                  if p.is_floating_point() or p.is_complex()))
        records.append({"step": step + 1, "loss": float(step_loss), "param_norm": float(norm)})
    return records


def import_module_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    found = importlib.import_module(module_name)
    for part in attr.split("."):
        found = getattr(found, part)
    return found


def main(spec_path: str, out_path: str) -> None:
    """Run a parity spec written by xlatrain/commands/torch_parity.py: the module, its weights, the batches, the
    optimizer."""
    spec = json.loads(open(spec_path).read())
    module = import_module_target(spec["target"])(**spec["kwargs"])
    module.load_state_dict(torch.load(spec["weights"], map_location="cpu", weights_only=True), strict=True)
    with np.load(spec["batches"]) as archive:
        keys = sorted({name.split("/")[1] for name in archive.files})
        steps = len({name.split("/")[0] for name in archive.files})
        batches = [{k: archive[f"{i}/{k}"] for k in keys} for i in range(steps)]
    device, sync = "cpu", (lambda: None)
    if spec["backend"] == "torch_xla":
        import torch_xla

        device, sync = torch_xla.device(), torch_xla.sync
    records = train(module, batches, spec["microbatches"], spec["loss"], OptimizerSpec(**spec["optimizer"]), device,
                    sync)
    open(out_path, "w").write(json.dumps(records))


if __name__ == "__main__":
    main(*sys.argv[1:3])

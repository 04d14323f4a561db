"""LoRA adapters as PEFT keeps them: `adapter_config.json` and `adapter_model.safetensors` (lora_A [rank, in] and
lora_B [out, rank] per adapted module of each layer, hf/names.py's PEFT names), which
`peft.PeftModel.from_pretrained(base, DIR)` loads onto the base model, and which model.lora.init_from reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xlatrain.config.model import LoRAConfig
from xlatrain.errors import UserError, first_line
from xlatrain.hf.names import PROJECTIONS
from xlatrain.hf.weights import HuggingFaceWeights

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model"
"""The stem of the adapter's safetensors file."""
PEFT_NAMING = "peft"


def target_modules(targets: tuple[str, ...]) -> list[str]:
    """PEFT's target_modules of model.lora.targets (q -> q_proj, ...)."""
    return [PROJECTIONS[target][1].split(".")[-1] for target in targets]


def adapter_config(lora: LoRAConfig, base: str | None) -> dict[str, Any]:
    """PEFT's LoraConfig of these adapters, as adapter_config.json holds it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": target_modules(lora.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}, "inference_mode": True}


def adapter_weights(directory: Path, lora: LoRAConfig, named: str, layers: dict[str, tuple[int, ...]]
                    ) -> HuggingFaceWeights:
    """The adapter in `directory` as checkpoint weights to place (hf/weights.py), once its adapter_config.json is
    found to describe model.lora's adapters: PEFT's LoRA, the same rank, scale and targets, none of the variants
    that change the product (rsLoRA, DoRA, per-module ranks, biases)."""
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise UserError(f"{named}: {str(directory)!r} has no {ADAPTER_CONFIG}; give a directory PEFT's "
                        "save_pretrained (or xlatrain export --peft) wrote")
    try:
        given = json.loads(path.read_text(encoding="utf-8"))
        found = {"peft_type": given["peft_type"], "rank": given["r"], "alpha": float(given["lora_alpha"]),
                 "targets": sorted(given["target_modules"])}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{named}: {path} is not a PEFT adapter config ({first_line(err)[:120]})") from None
    wanted = {"peft_type": "LORA", "rank": lora.rank, "alpha": float(lora.alpha),
              "targets": sorted(target_modules(lora.targets))}
    different = [key for key in wanted if found[key] != wanted[key]]
    if different:
        key = different[0]
        raise UserError(f"{named}: the adapter's {key} is {found[key]!r}, where model.lora's is {wanted[key]!r}; "
                        "set model.lora to the adapter's")
    variants = [name for name in ("use_rslora", "use_dora") if given.get(name)] + \
        [name for name in ("rank_pattern", "alpha_pattern", "layers_to_transform") if given.get(name)] + \
        (["bias"] if given.get("bias", "none") != "none" else [])
    if variants:
        raise UserError(f"{named}: the adapter sets {variants[0]}={given[variants[0]]!r}, which xlatrain's LoRA does "
                        "not compute; give a plain LoRA adapter")
    return HuggingFaceWeights(directory, PEFT_NAMING, named, layers)

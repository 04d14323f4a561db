"""A DPO run's reference log-probabilities (model.dpo): computed once, at its start, from the weights it starts
with, and kept in its directory, since a resumed run no longer has those weights. One file, replaced whole, with
the fingerprint of the shards its pairs come from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xlatrain.errors import UserError
from xlatrain.run.atomic import replace_file

REFERENCE_FILE = "reference_log_probs.npz"
SPLITS = ("train", "eval")


def write_reference(path: Path, shards: str, values: dict[str, np.ndarray]) -> None:
    """`values`: per split, [pairs, 2] float32; `shards`: the shard set's fingerprint."""
    replace_file(path, lambda partial: np.savez(partial.open("wb"), shards=np.asarray(shards),
                                                **{split: values[split] for split in SPLITS}))


def read_reference(path: Path, shards: str) -> dict[str, np.ndarray]:
    """What write_reference kept, for the same shards; one line naming the file otherwise."""
    fix = ("it was computed at the run's start from the weights it started with, which the run no longer has: "
           "start a new run (another trainer.run_dir)")
    try:
        with np.load(path) as kept:
            found = {"shards": str(kept["shards"]), **{split: np.asarray(kept[split], np.float32) for split in SPLITS}}
    except FileNotFoundError:
        raise UserError(f"{path} is missing; {fix}") from None
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{path} could not be read ({err}); {fix}") from None
    if found["shards"] != shards:
        raise UserError(f"{path} holds the reference of other shards than data.path's ({found['shards']}, not "
                        f"{shards}); {fix}, or point data.path at the shards it trained on")
    return {split: found[split] for split in SPLITS}

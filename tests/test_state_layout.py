"""The train state's layout, held: every leaf's path, shape, dtype and partition spec of each example config's abstract
train state (on the suite's 8 CPU devices) equals tests/state_layouts.json. Old run directories resume from
checkpoints of that layout: a change that alters it must convert what older runs saved (as the GPT's qkv kernel
reshaped to [width, 3, width] is converted on restore) and say so; then rewrite the file with
`XLATRAIN_WRITE_STATE_LAYOUTS=1 python3 -m pytest -n 0 tests/test_state_layout.py`."""

import json
import os
import sys

import jax
import pytest
import yaml
from conftest import REPO
from jax.sharding import PartitionSpec as P

from xlatrain.commands.prepare import Request, prepare
from xlatrain.config import load_config
from xlatrain.program import build_program

CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))
LAYOUTS = REPO / "tests" / "state_layouts.json"
WRITE = os.environ.get("XLATRAIN_WRITE_STATE_LAYOUTS") == "1"
TEXT_READ_FAST = ["data.glob='*.py'", "data.max_bytes=200000"]
"""The text configs' data read from fewer files: the bytes' vocabulary, and so the layout, are the same."""


def state_layout(program) -> list[list]:
    """[path, shape, dtype, partition spec] of each leaf of the program's abstract train state."""
    leaves = jax.tree_util.tree_flatten_with_path(program.abstract_state)[0]
    specs = jax.tree.leaves(program.specs, is_leaf=lambda leaf: isinstance(leaf, P))
    assert len(leaves) == len(specs)
    return [[jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype), str(spec)]
            for (path, leaf), spec in zip(leaves, specs, strict=True)]


def layouts_text(layouts: dict[str, list[list]]) -> str:
    """The committed file: a config's leaves one a line, so that a change shows as the lines it changes."""
    configs = [f" {json.dumps(name)}: [\n" + ",\n".join(f"  {json.dumps(row)}" for row in rows) + "\n ]"
               for name, rows in sorted(layouts.items())]
    return "{\n" + ",\n".join(configs) + "\n}\n"


def example_overrides(config_path, tmp_path) -> list[str]:
    """What makes an example build here: its data small (text) or made (token shards), its run directory apart."""
    example = yaml.safe_load(config_path.read_text())
    source = example["data"]["source"]
    overrides = [f"trainer.run_dir={tmp_path / 'run'}"]
    if source == "text":
        overrides += TEXT_READ_FAST
    if source == "tokens":
        corpus = tmp_path / "corpus"
        corpus.mkdir()
        for i in range(4):
            if "dpo" in example["model"]:  # preference pairs, in bytes
                (corpus / f"{i}.jsonl").write_text(json.dumps({"prompt": "a few words", "chosen": " again and again",
                                                               "rejected": " of text"}) + "\n")
            else:
                (corpus / f"{i}.txt").write_text("a few words of text, again and again. " * 200)
        prepare(Request((corpus,), tmp_path / "shards", holdout=0.5))
        overrides.append(f"data.path={tmp_path / 'shards'}")
    return overrides


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda path: path.stem)
def test_each_example_configs_train_state_keeps_its_committed_layout(config_path, tmp_path, devices, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(REPO / "examples" / "torch_model"), *sys.path])  # the torch examples
    program = build_program(load_config(str(config_path), example_overrides(config_path, tmp_path)), devices)
    layout = state_layout(program)
    committed = json.loads(LAYOUTS.read_text()) if LAYOUTS.is_file() else {}
    if WRITE:
        committed[config_path.stem] = layout
        LAYOUTS.write_text(layouts_text(committed))
    assert config_path.stem in committed, f"{config_path.name} has no committed layout: write it (module docstring)"
    expected = {row[0]: row[1:] for row in committed[config_path.stem]}
    found = {row[0]: row[1:] for row in layout}
    changed = sorted(path for path in expected.keys() | found.keys() if expected.get(path) != found.get(path))
    shown = changed[:3]
    assert not changed, (f"{config_path.name}: the train state's layout changed at {changed[:5]} (committed "
                         f"{[expected.get(p) for p in shown]}, now {[found.get(p) for p in shown]}); convert older "
                         "checkpoints to the new layout, say so, and rewrite the file (module docstring)")

"""Generated bad input through the CLI: `xlatrain config` with random overrides and config files either works
(exit 0) or says what is wrong in exactly one line that names the field or file (exit 2); never a traceback.

Most examples call the CLI's `main` in this process (fast); a few run `python -m xlatrain.cli` for real."""

import contextlib
import io
import os

import yaml
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xlatrain.cli import main
from xlatrain.config import Config


def _dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            keys += _dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


KNOWN_KEYS = _dotted_keys(Config().model_dump(mode="json")) + [
    "model.hidden", "model.channels", "model.target", "model.kwargs.width", "data.path", "data.holdout",
    "optimizer.momentum", "optimizer.b1", "parallel.pipeline.partition", "trainer.profile", "modle.layers",
    "model", "data", "trainer", "optimizer", "mesh",
]
ENUM_WORDS = ["mlp", "cnn", "gpt", "custom", "torch", "digits", "text", "arrays", "adamw", "sgd", "lion", "adafactor",
              "jit", "shard_map", "pmap", "auto", "fsdp", "zero1", "replicated", "fp16", "bf16", "1f1b", "gpipe",
              "interleaved", "xla", "custom", "mse", "cross_entropy", "float16", "skip", "stop"]
MALFORMED = ["[1,", "{a:", "*x", "&a", "!tag x", "]", "{", "'", '"', "- a", "a: b: c", "%", "@x", "`", "[[]]", "{}",
             "[]", "~", "null", ".nan", "-.inf", "0x1F", "1e309", "--", "=", "a=b", "\t", "é", "\u202e", "💥"]

values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "null", "", *ENUM_WORDS, *MALFORMED]),
    st.lists(st.integers(-3, 300), max_size=4).map(lambda xs: "[" + ",".join(map(str, xs)) + "]"),
    st.text(max_size=12),
)
keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}", fullmatch=True))
overrides = st.lists(st.tuples(keys, values).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=4)

yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=8),
                         st.sampled_from(ENUM_WORDS))
yaml_trees = st.recursive(yaml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from([k.split(".")[-1] for k in KNOWN_KEYS] + ["model", "data", "name"]),
                              st.text(max_size=6)), inner, max_size=4)), max_leaves=12)
config_texts = st.one_of(
    yaml_trees.map(lambda tree: yaml.safe_dump(tree, allow_unicode=True)),
    st.dictionaries(st.sampled_from(["model", "data", "trainer", "optimizer", "mesh", "seed", "name", "batch"]),
                    yaml_trees, max_size=4).map(lambda tree: yaml.safe_dump(tree, allow_unicode=True)),
    st.text(max_size=60),
    st.sampled_from(MALFORMED).map(lambda bad: f"model:\n  name: mlp\n  hidden: {bad}\n"),
    st.binary(max_size=40).map(lambda raw: raw.decode("latin-1")),
)


def _in_process(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code
    return code, err.getvalue()


def _check(code: int, stderr: str, named: list[str]) -> None:
    assert code in (0, 2), (code, stderr)
    assert "Traceback" not in stderr, stderr
    if code == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("xlatrain"), stderr
        assert any(name in lines[0] for name in named), (named, lines[0])


def _names(items: list[str]) -> list[str]:
    """What an error about these overrides may name: a key's first part (the field's section) or the value."""
    names = []
    for item in items:
        key, _, value = item.partition("=")
        names += [key.split(".")[0], value] if value.strip() else [key.split(".")[0]]
    return names


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(items=overrides)
def test_random_overrides(items):
    code, stderr = _in_process(["config", *items])
    _check(code, stderr, _names(items))


@FUZZ
@given(text=config_texts, items=st.lists(st.tuples(keys, values).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=2))
def test_random_config_files(tmp_path, text, items):
    path = tmp_path / "fuzzed.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    code, stderr = _in_process(["config", str(path), *items])
    sections = list(Config.model_fields)
    _check(code, stderr, [str(path), "fuzzed.yaml", *_names(items), *sections])


def _fits_argv(item: str) -> bool:
    """What a process can be given as an argument: no NUL, and text the OS encoding can carry."""
    try:
        os.fsencode(item)
    except UnicodeEncodeError:
        return False
    return "\x00" not in item


@settings(max_examples=8, deadline=None)
@given(items=overrides.filter(lambda items: all(map(_fits_argv, items))))
def test_random_overrides_in_a_real_process(items):
    result = run_cli("config", *items)
    _check(result.returncode, result.stderr, _names(items))

"""The configuration reference, generated from the schema: every key with its default and its description (the
field's docstring). `python3 -m xlatrain.config.reference > docs/configuration.md` writes the page; a test fails
when the page and the schema disagree, or a key has no description."""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from functools import cache
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from xlatrain.config.schema import Config

HEADER = """# Configuration reference

<!-- Generated from xlatrain/config/ by `python3 -m xlatrain.config.reference > docs/configuration.md`;
edit the schema's docstrings, not this page. -->

A config is a YAML file plus dotted overrides on the command line (`xlatrain train run.yaml trainer.steps=100
model.hidden=[64,64]`); with no file, the built-in default below is used. Override values are YAML: quote one that
starts with `*`, `&` or `!` (in a shell: `"data.glob='*.txt'"`). Paths (files and directories, in the config and on
the command line) may start with `~` and hold `$VARIABLES`, expanded as a shell would. A section with kinds
(`model.name`, `data.source`, `optimizer.name`) takes the keys of its kind. `xlatrain config [CONFIG] [key=value
...]` prints the resolved config and the values derived from it, and a run saves both in its `config.yaml`; with
`--keys [SECTION]` it lists each key of that config (its kinds' keys included) with its value and the first
sentence of its meaning. Every mistake (an unknown key, with a did-you-mean; a wrong type; a value out of range; a
batch that does not divide) is one line naming the key, before anything compiles.
"""


def reference() -> str:
    """The whole page (Markdown)."""
    top = {name: field for name, field in Config.model_fields.items() if not _models(field.annotation)}
    lines = [HEADER, f"## Top level\n\n{_description(Config)}\n", *_table(Config, list(top), "")]
    for name, field in Config.model_fields.items():
        if name not in top:
            lines += _section(name, field)
    return "\n".join(lines).rstrip() + "\n"


def described_keys(config: BaseModel, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, its value as YAML, the first sentence of its description) of every key of a config, the keys of
    the kinds it has (its model, data source, optimizer) included: what `xlatrain config --keys` lists."""
    found = []
    names = list(type(config).model_fields)
    kinds = [name for name in ("name", "source") if prefix and name in names]  # a section's kind comes first
    for name in kinds + [name for name in names if name not in kinds]:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            found += described_keys(value, f"{prefix}{name}.")
        else:
            shown = yaml.safe_dump(_plain(value), default_flow_style=True, width=10**6).strip()
            found.append((f"{prefix}{name}", shown.removesuffix("...").strip(), _first_sentence(_field_doc(
                type(config), name))))
    return found


def _first_sentence(doc: str) -> str:
    text = _text(doc).replace("\\|", "|")
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def undescribed() -> list[str]:
    """Keys whose field has no docstring."""
    found = []

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, field in cls.model_fields.items():
            models = _models(field.annotation)
            for model in models:
                walk(model, f"{prefix}{name}.")
            if not models and not _field_doc(cls, name):
                found.append(f"{prefix}{name} ({cls.__name__})")

    walk(Config, "")
    return found


def _section(name: str, field: FieldInfo) -> list[str]:
    models = _models(field.annotation)
    if len(models) == 1:
        return _one_kind(name, models[0], _text(_field_doc(Config, name)), level=2)
    tag = field.discriminator or _discriminator(field.annotation)
    default_kind = getattr(field.default, tag)
    lines = [f"## `{name}`\n", f"{_description(models[0].__mro__[1])}\n",
             f"`{name}.{tag}` chooses the kind (default `{default_kind}`); the keys after it belong to that kind:\n"]
    lines += [f"- `{_tag_of(model, tag)}`: {_text(_field_doc(model, tag))}" for model in models]
    lines.append("")
    shared = [key for key in models[0].model_fields
              if key != tag and all(_same(models[0], other, key) for other in models[1:])]
    rows = [(models[0], key, "") for key in shared]
    rows += [(model, key, f" ({_tag_of(model, tag)})") for model in models
             for key in model.model_fields if key != tag and key not in shared]
    lines += _rows_table([(f"{name}.{key}", model, key, kind) for model, key, kind in rows])
    for model in models:  # a kind's own sections (model.moe, model.rope_scaling of llama)
        for key, f in model.model_fields.items():
            if _models(f.annotation) and key not in shared:
                lines += _one_kind(f"{name}.{key}", _models(f.annotation)[0], _text(_field_doc(model, key)) +
                                   f" ({_tag_of(model, tag)})", level=3)
    return lines


def _one_kind(name: str, model: type[BaseModel], intro: str, level: int) -> list[str]:
    plain = [key for key, f in model.model_fields.items() if not _models(f.annotation)]
    lines = [f"{'#' * level} `{name}`\n", f"{intro or _description(model)}\n", *_table(model, plain, f"{name}.")]
    for key, f in model.model_fields.items():
        if _models(f.annotation):
            lines += _one_kind(f"{name}.{key}", _models(f.annotation)[0], _text(_field_doc(model, key)), level + 1)
    return lines


def _table(model: type[BaseModel], keys: list[str], prefix: str) -> list[str]:
    return _rows_table([(f"{prefix}{key}", model, key, "") for key in keys])


def _rows_table(rows: list[tuple[str, type[BaseModel], str, str]]) -> list[str]:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}`{kind} | {_default(model.model_fields[key])} | {_text(_field_doc(model, key))} |"
              for name, model, key, kind in rows]
    return [*lines, ""]


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10**6).strip()
    return f"`{text.removesuffix('...').strip()}`"


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _same(a: type[BaseModel], b: type[BaseModel], key: str) -> bool:
    if key not in b.model_fields:
        return False
    return ((_field_doc(a, key), _default(a.model_fields[key])) == (_field_doc(b, key), _default(b.model_fields[key])))


def _field_doc(model: type[BaseModel], key: str) -> str:
    """The docstring under `key`'s annotation in the class that declares it (the nearest in the MRO)."""
    return next((_class_field_docs(cls)[key] for cls in model.__mro__ if key in _class_field_docs(cls)), "")


@cache
def _class_field_docs(cls: type) -> dict[str, str]:
    """name -> docstring of the fields a class's own body declares (a string right after `name: type = ...`)."""
    if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
        return {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {node.target.id: inspect.cleandoc(after.value.value) for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)}


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The config classes a field holds: one for a section, several for a section with kinds."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) is not None else (annotation,)
    found = []
    for option in options:
        if isinstance(option, type) and issubclass(option, BaseModel):
            found.append(option)
        elif typing.get_origin(option) is not None:
            found += _models(option)
    return found


def _discriminator(annotation: Any) -> str:
    return next(m.discriminator for m in getattr(annotation, "__metadata__", ()) if hasattr(m, "discriminator"))


def _tag_of(model: type[BaseModel], tag: str) -> str:
    return typing.get_args(model.model_fields[tag].annotation)[0]


def _description(cls: type) -> str:
    return _text(cls.__doc__ or "")


def _text(doc: str | None) -> str:
    return " ".join((doc or "").split()).replace("|", "\\|")


if __name__ == "__main__":
    print(reference(), end="")

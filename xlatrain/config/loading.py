"""YAML files plus dotted overrides (OmegaConf) into a validated Config; every problem one UserError."""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from xlatrain.config.base import expanded
from xlatrain.config.hugging_face import with_checkpoint_architecture
from xlatrain.config.parallel import DEFAULT_LOGICAL_RULES
from xlatrain.config.schema import Config
from xlatrain.errors import UserError, first_line


def load_config(source: str | Path | dict | None = None, overrides: Sequence[str] = ()) -> Config:
    """Config from an optional YAML file (or a mapping of the same keys) plus `key=value` overrides; None means the
    built-in default."""
    if isinstance(source, dict):
        raw, path = copy.deepcopy(source), None
    else:
        path = source
        raw = _read_yaml(Path(expanded(str(path)))) if path is not None else {}
    _reject_malformed_overrides(overrides)
    try:
        merged = OmegaConf.create(raw)
    except (OmegaConfBaseException, TypeError, ValueError) as err:
        raise UserError(f"config: {path or 'the mapping given'}: {first_line(err)}") from None
    for item in overrides:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError, TypeError, ValueError) as err:
            raise UserError(f"config: override {item!r}: {first_line(err) or type(err).__name__}; values are YAML: "
                            "quote ones that start with *, & or ! (e.g. data.glob='*.txt'), and a section takes "
                            "its keys one by one (section.key=value)") from None
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise UserError(f"config: {_holding(getattr(err, 'full_key', None), path, overrides)}: {first_line(err)} (a "
                        "value with ${...} is an interpolation; quote or change it)") from None
    if isinstance(data.get("model"), dict):
        data["model"] = with_checkpoint_architecture(data["model"])
    return validate_config(data)


def _holding(key: str | None, path: str | Path | None, overrides: list[str]) -> str:
    """Where the value of `key` was given: the last override that sets it, else the file."""
    given = [item for item in overrides if item.split("=", 1)[0] == key]
    if given:
        return f"override {given[-1]!r}"
    where = f"{path}: " if path is not None else ""
    return f"{where}{key}" if key else str(path or "the config")


def validate_config(data: dict) -> Config:
    _fill_missing_tags(data)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None


def upgraded_saved_config(data: dict) -> dict:
    """A run directory's config.yaml as this version reads it: what older versions saved, converted, so that an
    older run resumed with the defaults is not refused as a different config. Before model.vocab followed the
    tokenizer (and model.vocab_multiple existed), a GPT trained on bytes saved its default vocab, 256, which is
    what null gives bytes now. Before mesh.tensor existed, the default parallel.logical_rules named `data` alone;
    those defaults are today's (the same layout while mesh.tensor is 1). Before data.add_bos existed, text was
    tokenized without a BOS token, which is what false says."""
    model = data.get("model")
    if isinstance(model, dict) and model.get("name") == "gpt" and "vocab_multiple" not in model \
            and model.get("vocab") == 256:
        data = {**data, "model": {**model, "vocab": None}}
    mesh, parallel = data.get("mesh"), data.get("parallel")
    if isinstance(mesh, dict) and "tensor" not in mesh and isinstance(parallel, dict) \
            and isinstance(parallel.get("logical_rules"), dict):
        rules = {name: list(DEFAULT_LOGICAL_RULES[name]) if axes == "data" and name in DEFAULT_LOGICAL_RULES
                 else axes for name, axes in parallel["logical_rules"].items()}
        data = {**data, "parallel": {**parallel, "logical_rules": rules}}
    source = data.get("data")
    if isinstance(source, dict) and source.get("source") == "text" and "add_bos" not in source:
        data = {**data, "data": {**source, "add_bos": False}}
    return data


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


DERIVED_SECTION = "derived"
"""The section after the config in `xlatrain config`'s output and a run's config.yaml: the values computed from
it (batch sizes, the scan choice, a pipeline's partition...). Reading such a file as a config leaves it out."""


def config_and_derived_to_yaml(config: Config, derived: dict[str, Any]) -> str:
    return config_to_yaml(config) + yaml.safe_dump({DERIVED_SECTION: derived}, sort_keys=False)


def without_derived(data: dict) -> dict:
    """A config file's keys less its derived section, which is computed again; one that is not a mapping stays,
    to be refused as an unknown key."""
    if isinstance(data.get(DERIVED_SECTION), dict):
        return {key: value for key, value in data.items() if key != DERIVED_SECTION}
    return data


def _read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise UserError(f"config: {str(path)!r} is a directory; pass a YAML file (e.g. {str(path / 'config.yaml')!r})")
    if not path.is_file():
        if path.suffix.lower() not in (".yaml", ".yml") and re.fullmatch(r"[A-Za-z_][\w.]*", str(path)):
            raise UserError(f"config: {str(path)!r} is neither a YAML file nor key=value; to set a key write "
                            f"{path}=VALUE")
        raise UserError(f"config: file {str(path)!r} not found; pass a YAML file or no file for the default run")
    data = parse_yaml(_read_text(path), str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config: {path} must hold a mapping of keys at the top level, not a {type(data).__name__}")
    return without_derived(data)


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        if b"\0" in raw:
            raise UnicodeError("it holds NUL bytes")
        return raw.decode("utf-8")
    except UnicodeError as err:
        raise UserError(f"config: {path} is not a UTF-8 text file ({first_line(err)}); a config is YAML text") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys are refused by the schema later
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1}); "
                    "give each key once", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, name: str) -> Any:
    """YAML text as Python values; a syntax error or duplicate key is one line `name:line:column: problem`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        problem = getattr(err, "problem", None) or first_line(err)
        context = getattr(err, "context", None)
        hint = " (YAML indents with spaces, not tabs)" if "\\t" in problem else ""
        raise UserError(f"config: {where}: {problem}{hint}" + (f", {context}" if context else "")) from None


def _reject_malformed_overrides(overrides: list[str]) -> None:
    for item in overrides:
        if not re.match(r"^[A-Za-z_][\w.]*=", item):
            raise UserError(f"config: override {item!r} must look like key.path=value")


_TAGGED_FIELDS = {"model": "name", "data": "source", "optimizer": "name"}


def _fill_missing_tags(data: dict) -> None:
    """`model.layers=2` alone means "the default model with 2 layers": take the tag from the default."""
    defaults = Config()
    for field, tag in _TAGGED_FIELDS.items():
        section = data.get(field)
        if isinstance(section, dict) and tag not in section:
            section[tag] = getattr(getattr(defaults, field), tag)


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        loc = _dotted_loc(item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown key {loc!r}{_did_you_mean(item['loc'])}")
        elif item["type"] in ("model_type", "model_attributes_type", "dict_type") and loc:
            lines.append(f"{loc} must be a mapping of keys (e.g. {loc}.KEY=VALUE), not {item.get('input')!r}")
        else:
            msg = item["msg"].removeprefix("Value error, ")
            got = item.get("input")
            shown = "" if isinstance(got, dict) or loc == "" else f" (got {got!r})"
            names_itself = loc and f"{loc.split('.')[0]}." in msg
            lines.append(msg if names_itself or not loc else f"{loc}: {msg}{shown}")
    return "config: " + "; ".join(lines)


def _dotted_loc(loc: tuple) -> str:
    """('model', 'gpt', 'layerz') -> 'model.layerz': pydantic puts the union's tag into the path."""
    parts = list(loc)
    if len(parts) > 1 and parts[0] in _TAGGED_FIELDS and parts[1] in _tag_classes(parts[0]):
        del parts[1]
    return ".".join(str(p) for p in parts)


def _tag_classes(field: str) -> dict[str, type[BaseModel]]:
    union = Config.model_fields[field].annotation
    tag = _TAGGED_FIELDS[field]
    return {cls.model_fields[tag].annotation.__args__[0]: cls for cls in union.__args__}


def _did_you_mean(loc: tuple) -> str:
    cls: type[BaseModel] = Config
    path = list(loc[:-1])
    if len(path) > 1 and path[0] in _TAGGED_FIELDS:
        cls = _tag_classes(path[0]).get(path[1], cls)
        path = path[2:]
    for part in path:
        annotation = cls.model_fields[part].annotation if part in cls.model_fields else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            cls = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(cls.model_fields), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint}; valid keys here: {', '.join(cls.model_fields)}"


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys (`trainer.steps`); empty mappings stay as values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

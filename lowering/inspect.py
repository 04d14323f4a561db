"""What the compiler did: FLOPs, memory and the collectives of an optimised HLO module."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
# A shape: an array, or a tuple whose elements may be tuples themselves (XLA:GPU's reduce-scatter-start).
_INSTRUCTION = re.compile(r"=\s*(\((?:[^()]|\([^()]*\))*\)|[a-z0-9]+\[[\d,]*\](?:\{[^}]*\})?)\s+("
                          + "|".join(COLLECTIVES) + r")(-start)?\(")

XLATRAIN_TARGET = r'custom_call_target="xlatrain_(?:cpu|cuda)_(\w+)"'
"""An xlatrain custom-call collective in HLO text; the group is its op (all_reduce, ...)."""
_CUSTOM_COLLECTIVE = re.compile(r"=\s*([a-z0-9]+\[[\d,]*\](?:\{[^}]*\})?)\s+custom-call\([^)]*\),\s*"
                                + XLATRAIN_TARGET)


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape such as `f32[256,128]{1,0}` or a tuple `(f32[4], bf16[2,2])`."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    return total


def result_shape(shape_text: str, kind: str, starts_async: bool) -> str:
    """The result's part of a collective's shape. An asynchronous start (XLA:GPU's) other than all-reduce's
    returns (operands, result[, context...]); all-reduce-start returns its results alone."""
    if not starts_async or kind == "all-reduce" or not shape_text.startswith("("):
        return shape_text
    depth, parts, begin = 0, [], 1
    for index, char in enumerate(shape_text):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if (char == "," and depth == 1) or depth == 0:
            parts.append(shape_text[begin:index])
            begin = index + 1
        if depth == 0:
            break
    return parts[1] if len(parts) > 1 else shape_text


def collectives(hlo_text: str, mesh_shape: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """[{kind, count, bytes}] for each collective kind in the HLO text (XLA's own, then xlatrain's custom
    calls as `xlatrain <op>`); async pairs counted once; bytes are the results'. With `mesh_shape` (the mesh's
    axes and sizes, in order) each kind is counted per set of mesh axes its replica groups span, as `over`
    ("data", "tensor", "data+tensor"; "all" where the HLO names no groups)."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    sizes: dict[tuple[str, str], int] = defaultdict(int)
    found = []
    for line in hlo_text.splitlines():
        for shape, kind, start in _INSTRUCTION.findall(line):
            found.append((kind, result_shape(shape, kind, bool(start)), _over(line, mesh_shape)))
        found += [(f"xlatrain {op}", shape, "") for shape, op in _CUSTOM_COLLECTIVE.findall(line)]
    for kind, shape, over in found:
        counts[kind, over] += 1
        sizes[kind, over] += shape_bytes(shape)
    rank = {kind: i for i, kind in enumerate(COLLECTIVES)}
    order = sorted(counts, key=lambda key: (rank.get(key[0], len(rank)), key[0], key[1]))
    return [{"kind": kind, "count": counts[kind, over], "bytes": sizes[kind, over], **({"over": over} if over else {})}
            for kind, over in order]


def _over(line: str, mesh_shape: dict[str, int] | None) -> str:
    if mesh_shape is None:
        return ""
    groups = replica_groups(line)
    return "all" if groups is None else "+".join(axes_spanned(groups, mesh_shape)) or "none"


_LISTED_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                          r"\s*\{([^}]*)\}")


def replica_groups(attributes: str) -> list[list[int]] | None:
    """A collective's replica groups as device ids (positions in the mesh's devices), from any of XLA's forms:
    listed (`{{0,1},{2,3}}`), iota (`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`) or over named mesh axes
    (`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, with `device_ids=([4,2]T(1,0))` where the devices are laid out
    otherwise); None when it names none (one group of every device)."""
    listed = _LISTED_GROUPS.search(attributes)
    if listed:
        groups = [[int(d) for d in group.split(",") if d] for group in re.findall(r"\{([\d,]*)\}", listed.group(1))]
        return groups or None
    iota = _IOTA_GROUPS.search(attributes)
    if iota:
        return _iota(iota.group(3), iota.group(4)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    mesh = _MESH_GROUPS.search(attributes)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
        ids = (_iota(mesh.group(2), mesh.group(3)) if mesh.group(2) else np.arange(int(np.prod(sizes)))).reshape(sizes)
        reduced = [names.index(name) for name in re.findall(r"'([^']+)'", mesh.group(4))]
        kept = [i for i in range(len(sizes)) if i not in reduced]
        size = int(np.prod([sizes[i] for i in reduced], dtype=np.int64))
        return ids.transpose(kept + reduced).reshape(-1, size).tolist()
    return None


def _iota(dims: str, permutation: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return (ids.transpose([int(p) for p in permutation.split(",")]) if permutation else ids).reshape(-1)


def axes_spanned(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which some replica group holds devices at different coordinates."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    spanned = set()
    for group in groups:
        coordinates = np.array(np.unravel_index(group, sizes)).reshape(len(sizes), -1)
        spanned |= {names[i] for i in range(len(names)) if len(set(coordinates[i].tolist())) > 1}
    return tuple(name for name in names if name in spanned)


def peak_memory_bytes(compiled: Any) -> int:
    """What the executable needs at once per device: arguments + outputs + temporaries, less what donation
    aliases (XLA memory analysis); or XLA's own peak where larger. XLA:CPU's peak_memory_in_bytes leaves the
    temporaries out, so it alone would miss most of a step's memory there."""
    stats = compiled.memory_analysis()
    if stats is None:
        return 0
    needed = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
              - stats.alias_size_in_bytes)
    return int(max(needed, getattr(stats, "peak_memory_in_bytes", 0)))


def dump(lowered: Any, compiled: Any, directory: Path, name: str) -> list[Path]:
    """Writes the step's StableHLO and optimised HLO text into `directory` (which exists)."""
    paths = [directory / f"{name}.stablehlo.mlir", directory / f"{name}.optimized.hlo.txt"]
    paths[0].write_text(lowered.as_text())
    paths[1].write_text(compiled.as_text())
    return paths

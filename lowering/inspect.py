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


def collectives(hlo_text: str) -> list[dict[str, Any]]:
    """[{kind, count, bytes}] for each collective kind in the HLO text (XLA's own, then xlatrain's custom
    calls as `xlatrain <op>`); async pairs counted once; bytes are the results'."""
    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    found = [(kind, result_shape(shape, kind, bool(start))) for shape, kind, start in _INSTRUCTION.findall(hlo_text)]
    found += [(f"xlatrain {op}", shape) for shape, op in _CUSTOM_COLLECTIVE.findall(hlo_text)]
    for kind, shape in found:
        counts[kind] += 1
        sizes[kind] += shape_bytes(shape)
    order = [k for k in COLLECTIVES if k in counts] + sorted(k for k in counts if k not in COLLECTIVES)
    return [{"kind": k, "count": counts[k], "bytes": sizes[k]} for k in order]


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

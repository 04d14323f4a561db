"""The kernels an optimised GPU module launches per step, by what they do, with the bytes they move and the matmul
FLOPs they compute: where a step's time goes that is not matmul or attention, read from the HLO alone (a GPU
compiled for on a host without one runs nothing, and XLA gives no cost analysis of it). The classes are those a
GPU trace's kernels are split into (xlatrain/observe/trace_kernels.py): matmul, attention, scan slices, copy or
transpose, reduction, elementwise, collective, other.

A kernel is a top-level instruction of the entry computation or of a loop's body that is not bookkeeping
(parameters, tuples, bitcasts); a loop's body counts once per trip of its known trip count. Its bytes are what
it reads and writes in memory: its operands and result, except that an in-place update of a slice (a layer
scan's saved activations) moves only the slice, and a slice reads only what it returns.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from xlatrain.lowering.hlo_graph import COMPUTATION, INSTRUCTION, instruction_parts
from xlatrain.lowering.inspect import COLLECTIVES, shape_bytes

NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier", "add-dependency", "copy-done", "send-done", "recv-done",
               "all-reduce-done", "all-gather-done", "collective-permute-done", "reduce-scatter-done",
               "all-to-all-done", "async-done", "async-update"}
"""Bookkeeping, or the second half of an asynchronous pair (the start is the kernel)."""

_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{|true_computation=|false_computation=|to_apply=)([^}]*?)(?:[,}]|$)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIMS = re.compile(r"\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass
class Line:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    text: str
    root: bool


@dataclass
class Kernel:
    name: str
    kind: str
    trips: int
    bytes: int
    flops: int
    op_name: str = ""
    """The traced operation it came from (jax's name stack, named scopes included)."""
    dots: list[tuple[list[int], list[int], str]] = field(default_factory=list)
    """Each dot it runs: its left and right operands' dimensions, and its line of HLO (the dimension numbers)."""


@dataclass
class KernelSplit:
    """Per class: kernels launched, bytes moved and matmul FLOPs per step."""

    kernels: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kernel: Kernel) -> None:
        self.kernels[kernel.kind] += kernel.trips
        self.bytes[kernel.kind] += kernel.trips * kernel.bytes
        self.flops[kernel.kind] += kernel.trips * kernel.flops

    def as_record(self) -> dict:
        """The classes that launch kernels, the most bytes first."""
        return {"kernels": sum(self.kernels.values()), "bytes": sum(self.bytes.values()),
                "matmul_flops": sum(self.flops.values()),
                "by_class": {kind: {"kernels": self.kernels[kind], "bytes": self.bytes[kind]}
                             for kind in sorted(self.kernels, key=self.bytes.__getitem__, reverse=True)}}


def kernel_split(hlo_text: str) -> dict:
    """{kernels, bytes, matmul_flops, by_class: {class: {kernels, bytes}}} per step of an optimised module."""
    computations, entry = parse_computations(hlo_text)
    split = KernelSplit()
    for kernel in kernels(computations, entry):
        split.add(kernel)
    return split.as_record()


def matmul_flops_in(hlo_text: str, scope: str) -> int:
    """The matmul FLOPs per step of an optimised module's kernels traced under jax.named_scope(`scope`), forward
    (`jvp(scope)`) and backward (`transpose(jvp(scope))`) alike."""
    computations, entry = parse_computations(hlo_text)
    inside = re.compile(rf"(^|[/(]){re.escape(scope)}\)*(/|$)")
    return sum(kernel.trips * kernel.flops for kernel in kernels(computations, entry) if inside.search(kernel.op_name))


def kernels(computations: dict[str, list[Line]], name: str, trips: int = 1) -> list[Kernel]:
    """The kernels of computation `name`, run `trips` times, and of the loops and branches it runs."""
    found = []
    lines = computations[name]
    shapes = {line.name: line.shape for line in lines}
    by_name = {line.name: line for line in lines}
    for line in lines:
        if line.opcode == "while":
            body = _BODY.search(line.text)
            count = _TRIPS.search(line.text)
            if body:
                found += kernels(computations, body.group(1), trips * (int(count.group(1)) if count else 1))
            continue
        if line.opcode in ("conditional", "call"):
            for called in _called(line.text):
                if called in computations:
                    found += kernels(computations, called, trips)
            continue
        if line.opcode in NOT_KERNELS:
            continue
        inner = _fused(computations, line)
        ran = inner or [line]
        seen = {**shapes, **{i.name: i.shape for i in ran}}
        dots = [i for i in ran if i.opcode == "dot"]
        found.append(Kernel(line.name, _kind(line, inner), trips, _bytes(line, shapes, inner),
                            sum(_dot_flops(i, seen) for i in dots), _op_name(line, by_name),
                            [(_dims(seen.get(d.operands[0], "")), _dims(seen.get(d.operands[1], "")), d.text)
                             for d in dots]))
    return found


def _op_name(line: Line, by_name: dict[str, Line]) -> str:
    """The operation `line` was traced from; where XLA left it none (XNNPACK's dot fusions on CPU), that of its
    nearest operands that have one, as a dot's inputs come from the same scope as the dot."""
    pending, seen = [line], set()
    while pending:
        current = pending.pop(0)
        found = _OP_NAME.search(current.text)
        if found:
            return found.group(1)
        fresh = [by_name[o] for o in current.operands if o in by_name and o not in seen]
        seen.update(o.name for o in fresh)
        pending += fresh
    return ""


def parse_computations(hlo_text: str) -> tuple[dict[str, list[Line]], str]:
    """{computation name: its instructions}, and the entry computation's name."""
    computations: dict[str, list[Line]] = {}
    entry, current = "", None
    for text in hlo_text.splitlines():
        header = COMPUTATION.match(text)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
            continue
        named = INSTRUCTION.match(text)
        if named and current is not None:
            shape, opcode, operands, _ = instruction_parts(text[named.end():])
            current.append(Line(named.group(2), shape, opcode, operands, text, named.group(1) is not None))
    return computations, entry


def _called(text: str) -> list[str]:
    names = []
    for group in _BRANCHES.findall(text):
        names += _OPERAND.findall(group)
    return names


def _fused(computations: dict[str, list[Line]], line: Line) -> list[Line] | None:
    """The instructions a fusion runs, with those of the computations they call in turn (None: not a fusion)."""
    if line.opcode != "fusion":
        return None
    inner, pending = [], _CALLS.findall(line.text)
    while pending:
        for called in computations.get(pending.pop(), []):
            inner.append(called)
            pending += _CALLS.findall(called.text) if called.opcode == "fusion" else []
    return inner


def _root(line: Line, inner: list[Line] | None) -> Line:
    """What a fusion computes, past the copies and bitcasts that only place its result."""
    if not inner:
        return line
    by_name = {i.name: i for i in inner}
    root = next((i for i in inner if i.root), line)
    while root.opcode in ("copy", "bitcast", "reshape") and root.operands and root.operands[0] in by_name:
        root = by_name[root.operands[0]]
    return root


def _kind(line: Line, inner: list[Line] | None) -> str:
    opcodes = {i.opcode for i in inner} if inner is not None else {line.opcode}
    targets = {target for i in inner or [line] for target in _TARGET.findall(i.text)}
    root = _root(line, inner)
    if any("fmha" in target or "flash" in target for target in targets):
        return "attention"
    if "dot" in opcodes or "convolution" in opcodes or any("gemm" in t or "matmul" in t for t in targets):
        return "matmul"
    if line.opcode in COLLECTIVES or line.opcode.removesuffix("-start") in COLLECTIVES or any(
            t.startswith("xlatrain_") for t in targets):
        return "collective"
    if root.opcode in ("dynamic-update-slice", "dynamic-slice"):
        return "scan slices"
    if "reduce" in opcodes or "reduce-window" in opcodes:
        return "reduction"
    if opcodes <= {"copy", "transpose", "bitcast", "parameter", "reshape", "broadcast"} and opcodes & {"copy",
                                                                                                     "transpose"}:
        return "copy or transpose"
    if line.opcode in ("custom-call", "sort", "scatter", "gather", "rng-bit-generator"):
        return "other"
    return "elementwise"


def _bytes(line: Line, shapes: dict[str, str], inner: list[Line] | None) -> int:
    """What the kernel reads and writes; an in-place slice update moves its update, a slice what it returns."""
    root = _root(line, inner)
    operands = [shape_bytes(shapes.get(name, "")) for name in line.operands]
    if inner:
        operands = [_read(index, size, inner) for index, size in enumerate(operands)]
    written = shape_bytes(line.shape)
    if root.opcode == "dynamic-update-slice" and operands and operands[0] == written:
        return 2 * sum(operands[1:])
    return sum(operands) + written


def _read(index: int, size: int, inner: list[Line]) -> int:
    """The bytes a fusion reads of its operand `index`: the slices of it, where it only slices it."""
    parameter = next((i.name for i in inner if i.opcode == "parameter" and f"parameter({index})" in i.text), None)
    users = [i for i in inner if parameter in i.operands]
    if users and all(u.opcode == "dynamic-slice" and u.operands[0] == parameter for u in users):
        return sum(shape_bytes(u.shape) for u in users)
    return size


def _dot_flops(dot: Line, shapes: dict[str, str]) -> int:
    """2 x the result's elements x the contracted elements of the left operand."""
    result = _dims(dot.shape)
    lhs = _dims(shapes.get(dot.operands[0], "")) if dot.operands else []
    contracting = _CONTRACTING.search(dot.text)
    contracted = [lhs[int(d)] for d in contracting.group(1).split(",") if d] if contracting and lhs else []
    return 2 * int(np.prod(result, dtype=np.int64)) * int(np.prod(contracted, dtype=np.int64))


def _dims(shape: str) -> list[int]:
    found = _DIMS.search(shape)
    return [int(d) for d in found.group(1).split(",") if d] if found else []

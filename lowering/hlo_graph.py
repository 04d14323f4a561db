"""The dataflow of an optimised HLO module, to check properties of what XLA will run.

`amp_order_problems` checks the AMP order of DESIGN.md on the compiled train step: the batch reaches
the parameter update, the finite check and the gradient norm *only* through cross-replica reductions
(so every replica decides on the same synchronised gradients); the loss scale is applied before those
reductions and divided out after them; the update depends on the finite check and on the norm (skip
and clip). Where the gradients are not synchronised (a pipeline over one data replica: each stage updates
from its own), the finite check still sees the batch only through reductions across the devices, and the
clip depends on one (the norm summed over the stages).

A collective whose every replica group holds one device reduces nothing: XLA:CPU keeps a sum over a one-device
mesh axis as such a collective, XLA:GPU drops it, so it counts as no reduction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from xlatrain.lowering.inspect import XLATRAIN_TARGET, replica_groups

REDUCTIONS = ("all-reduce", "all-reduce-start", "all-reduce-done", "reduce-scatter", "reduce-scatter-start",
              "reduce-scatter-done", "xlatrain_all_reduce", "xlatrain_reduce_scatter")
"""XLA's cross-replica reductions (XLA:GPU runs them as asynchronous -start/-done pairs), and xlatrain's
custom-call ones (named by their target, less the platform)."""

SINGLE_DEVICE = "no cross-replica reduction of the gradients (single device: nothing to order)"
ONE_DATA_REPLICA = "no cross-replica reduction of the gradients (one data replica: nothing to order)"
"""A model split over `tensor` alone: its devices reduce activations, never gradients across replicas."""

INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
"""An instruction's line up to its shape: (ROOT, its name)."""
COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
"""A computation's first line: (ENTRY, its name)."""
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")
_XLATRAIN_TARGET = re.compile(XLATRAIN_TARGET)


@dataclass
class Instruction:
    name: str
    opcode: str
    operands: list[str]
    called: list[str]
    op_name: str
    groups: list[list[int]] | None = None
    """For a collective: its replica groups (None: one group of every device)."""
    contains: set[str] = field(default_factory=set)
    """Opcodes and op_names of this instruction and of every computation it calls (fusions, loops)."""
    tuple_index: int | None = None
    """For a get-tuple-element: the element it reads."""


@dataclass
class HloGraph:
    entry: dict[str, Instruction]
    root: Instruction

    def parameter(self, op_name: str) -> list[str]:
        """Entry parameters whose metadata names `op_name` (e.g. "state.loss_scale.scale", "batch['inputs']")."""
        return [i.name for i in self.entry.values() if i.opcode == "parameter" and i.op_name == op_name]

    def in_scope(self, scope: str) -> list[str]:
        """Instructions computing (part of) something under `jax.named_scope(scope)`."""
        return [i.name for i in self.entry.values() if any(f"/{scope}/" in name for name in i.contains)]

    def reductions(self, counted: Callable[[list[list[int]] | None], bool] | None = None) -> set[str]:
        """The cross-device reductions (REDUCTIONS whose groups hold more than one device); `counted(groups)`:
        only those it accepts (the reductions over `data`, beside a tensor axis's)."""
        return {i.name for i in self.entry.values() if i.opcode in REDUCTIONS and _across_devices(i.groups)
                and (counted is None or counted(i.groups))}

    @cached_property
    def users(self) -> dict[str, list[str]]:
        """Each instruction's users (built once: every reachability question walks them)."""
        users: dict[str, list[str]] = {}
        for instruction in self.entry.values():
            for operand in instruction.operands:
                users.setdefault(operand, []).append(instruction.name)
        return users

    def reachable(self, sources: list[str] | set[str], blocked: set[str] = frozenset()) -> set[str]:
        """Instructions whose value depends on any of `sources`, not passing through the `blocked` ones."""
        seen, frontier = set(sources), list(sources)
        while frontier:
            for user in self.users.get(frontier.pop(), ()):
                if user not in seen and user not in blocked:
                    seen.add(user)
                    frontier.append(user)
        return seen


def parse_hlo(text: str) -> HloGraph:
    computations: dict[str, dict[str, Instruction]] = {}
    entry_name, current = None, None
    for line in text.splitlines():
        header = COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(2), {})
            entry_name = header.group(2) if header.group(1) else entry_name
            continue
        named = INSTRUCTION.match(line)
        if named and current is not None:
            instruction = _instruction(named.group(2), line[named.end():])
            current[instruction.name] = instruction
            if named.group(1):
                current["__root__"] = instruction
    if entry_name is None:
        raise ValueError("no ENTRY computation in the HLO text")

    def opcodes(computation: str, visiting: frozenset = frozenset()) -> set[str]:
        found: set[str] = set()
        for name, instruction in computations.get(computation, {}).items():
            if name != "__root__" and computation not in visiting:
                found |= {instruction.opcode, instruction.op_name}
                for called in instruction.called:
                    found |= opcodes(called, visiting | {computation})
        return found

    entry = computations[entry_name]
    root = entry.pop("__root__")
    for instruction in entry.values():
        called = (opcodes(c) for c in instruction.called)
        instruction.contains = {instruction.opcode, instruction.op_name}.union(*called)
        if instruction.opcode.endswith("-done"):  # an async collective's groups are on its start
            instruction.groups = entry[instruction.operands[0]].groups
    _split_combined_reductions(entry)
    return HloGraph(entry, root)


def _split_combined_reductions(entry: dict[str, Instruction]) -> None:
    """XLA combines reductions over the same devices into one with a tuple of operands (a tensor group's sum in
    the forward with the gradient norm's, say). Element k of its result depends on operand k alone: each element
    becomes a reduction of its own (`name#k`), read by the get-tuple-elements of that index, so that no
    dependency passes from one element to another."""
    users: dict[str, list[Instruction]] = {}
    for instruction in entry.values():
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction)
    for combined in [i for i in entry.values() if i.opcode in REDUCTIONS and len(i.operands) > 1]:
        done = [u for u in users.get(combined.name, ()) if u.opcode.endswith("-done")]
        result = done[0] if done else combined  # the instruction whose tuple the elements are read from
        readers = users.get(result.name, ())
        if not readers or any(r.opcode != "get-tuple-element" or r.tuple_index is None for r in readers):
            continue
        chain = [combined, *done]
        for k, operand in enumerate(combined.operands):
            previous = operand
            for part in chain:
                element = f"{part.name}#{k}"
                entry[element] = Instruction(element, part.opcode, [previous], part.called, part.op_name,
                                             part.groups, part.contains)
                previous = element
            for reader in readers:
                if reader.tuple_index == k:
                    reader.operands = [previous]
        for part in chain:
            del entry[part.name]


def instruction_parts(rest: str) -> tuple[str, str, list[str], str]:
    """(shape, opcode, operand names, attributes) of `rest`, an instruction's line after `INSTRUCTION`:
    `<shape> <opcode>(<operands>), attributes...`; tuple shapes hold parentheses too."""
    position = _matching(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:position], rest[position:].lstrip()
    open_paren = rest.index("(")
    close = _matching(rest, open_paren)
    return shape, rest[:open_paren].strip(), re.findall(r"%([\w.\-]+)", rest[open_paren:close]), rest[close:]


def _instruction(name: str, rest: str) -> Instruction:
    _, opcode, operands, attributes = instruction_parts(rest)
    target = _XLATRAIN_TARGET.search(attributes) if opcode == "custom-call" else None
    opcode = f"xlatrain_{target.group(1)}" if target else opcode
    op_name = _OP_NAME.search(attributes)
    label = op_name.group(1).replace("\\'", "'") if op_name else ""
    index = _TUPLE_INDEX.search(attributes) if opcode == "get-tuple-element" else None
    return Instruction(name, opcode, operands, _CALLED.findall(attributes), label, replica_groups(attributes),
                       tuple_index=int(index.group(1)) if index else None)


def _across_devices(groups: list[list[int]] | None) -> bool:
    """Whether a collective's replica groups hold more than one device (None: one group of every device)."""
    return groups is None or any(len(group) > 1 for group in groups)


def _matching(text: str, open_index: int) -> int:
    depth = 0
    for index in range(open_index, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return index
    raise ValueError(f"unbalanced parentheses in HLO: {text[:80]}")


def amp_order_problems(graph: HloGraph, param_outputs: list[int], batch_keys: list[str], *,
                       skips_nonfinite: bool, clips: bool, scales: bool = True, synchronised: bool = True,
                       counted: Callable[[list[list[int]] | None], bool] | None = None) -> list[str]:
    """What, if anything, in the compiled train step breaks the AMP order (empty: the order holds).

    `param_outputs` are the indices of the updated parameters in the step's output tuple; the step's
    phases are found by their `jax.named_scope` (lowering/step.py). `scales`: whether the step scales the
    loss (a dynamic loss scale); without it, there is no scale to apply before the sync or to undo after.
    `synchronised`: whether the gradients are summed across devices before the update (not in a pipeline
    over one data replica, where the finite check and the clip must still agree across the stages).
    `counted(groups)`: which reductions count (with a tensor axis, those over `data`: a tensor all-reduce in the
    forward is no gradient sync)."""
    outputs = [graph.root.operands[i] for i in param_outputs]
    batch = [p for key in batch_keys for p in graph.parameter(f"batch[{key!r}]")]
    scale = graph.parameter("state.loss_scale.scale")
    reductions = graph.reductions(counted)
    if not batch or (scales and not scale) or not outputs:
        return [f"cannot find the batch {batch_keys}, the loss scale or the parameter outputs in the HLO"]
    if not reductions:
        return [ONE_DATA_REPLICA if counted is not None and graph.reductions() else SINGLE_DEVICE]
    # (phase, its instructions, whether it must exist, whether the update must depend on it, how the batch
    # reaches it: only through cross-device reductions, through one at least, or any way)
    phases = [("the parameter update", outputs, True, False, "only through" if synchronised else "any way"),
              ("the finite check", graph.in_scope("finite_check"), True, skips_nonfinite, "only through"),
              ("the global-norm clip", graph.in_scope("clip"), clips, clips,
               "only through" if synchronised else "through")]
    from_batch = graph.reachable(batch)
    around_sync = graph.reachable(batch, blocked=reductions)
    after_sync = graph.reachable(reductions & from_batch)
    problems = []
    for what, nodes, exists, gates_update, from_the_batch in phases:
        if exists and not set(nodes) & from_batch:
            problems.append(f"{what} does not depend on the batch")
        elif from_the_batch == "only through" and set(nodes) & around_sync:
            problems.append(f"{what} depends on the batch without passing a cross-replica reduction")
        elif from_the_batch == "through" and exists and not set(nodes) & after_sync:
            problems.append(f"{what} does not depend on a cross-device reduction (each device would decide on "
                            "its own gradients)")
        if gates_update and not set(outputs) <= graph.reachable(nodes):
            problems.append(f"the update does not depend on {what}")
    if scales and not reductions & graph.reachable(scale):
        problems.append("the gradients are synchronised before the loss scale is applied")
    if scales and not set(outputs) <= graph.reachable(scale, blocked=reductions):
        problems.append("the update does not unscale the synchronised gradients")
    return problems

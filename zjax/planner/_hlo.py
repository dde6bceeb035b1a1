"""Count collective communication per device per step from HLO text.

Read the module right after SPMD partitioning (see :func:`partitioned_hlo`): later CPU passes upcast
bf16 collectives and never form reduce-scatters, so the numbers would not mean what they do on a GPU.

Volumes follow the ZeRO paper: an all-reduce moves 2x its size (reduce-scatter + all-gather), an
all-gather 1x its (full) result, a reduce-scatter 1x its (full) operand, an all-to-all and a
collective-permute 1x their size, a ragged all-to-all the smaller of its data operand and its result (what it can
send: the rows a rank holds, at most what a receiver's buffer takes; the rows that really cross depend on the
routing, and balanced routing sends (n-1)/n of them). ``wire`` is what a ring sends per device: x (n-1)/n of the above
(a permute sends all of it). An all-reduce whose every user is a ``dynamic-slice`` is counted as the
reduce-scatter the GPU compiler turns it into. Collectives inside ``while`` loops count once per trip.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from ..pipeline import ACTION_SCOPE
from ._groups import replica_groups as replica_groups
from ._groups import spanned_axes as spanned_axes

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5, "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


def _bytes(type_text: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _DTYPE_BYTES:  # sub-byte types pack: 2 x int4 per byte, rounded up per array
            total += math.ceil(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype])
    return int(total)


@dataclasses.dataclass
class _Instr:
    name: str
    opcode: str
    type_text: str
    rest: str


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(")[0]:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(_Instr(m.group(1), m.group(3), m.group(2), m.group(4)))
    return comps, entry


def _trip_count(instr: _Instr, comps: dict[str, list[_Instr]]) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.rest)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", instr.rest)
    if cond and cond.group(1) in comps:
        # the bound's constant: in the condition, or in the compare fusion XLA:GPU made of it (where a loop inside
        # the body kept XLA from recording the count: a layer scan around a chunked expert dispatch)
        names = [cond.group(1)]
        names += [c for i in comps[cond.group(1)] for c in re.findall(r"calls=%?([\w.\-]+)", i.rest) if c in comps]
        consts = [
            int(c) for n in names for i in comps[n] if i.opcode == "constant" for c in re.findall(r"^(-?\d+)\)", i.rest)
        ]
        if consts:
            return max(consts)
    return 1


def _callees(attrs: str) -> list[str]:
    names = re.findall(r"(?:to_apply|true_computation|false_computation)=%?([\w.\-]+)", attrs)
    branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if branches:
        names += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
    return names


def _volume(comps: dict[str, list[_Instr]], name: str, memo: dict[str, int]) -> int:
    """Bytes of the collectives ``name`` runs (loops' trips multiplied out, a conditional's largest branch)."""
    if name not in memo:
        memo[name], total = 0, 0  # HLO computations do not recurse
        for instr in comps.get(name, []):
            body = re.search(r"body=%?([\w.\-]+)", instr.rest) if instr.opcode == "while" else None
            parts = [_volume(comps, c, memo) for c in ([body.group(1)] if body else _callees(instr.rest)) if c in comps]
            if instr.opcode.removesuffix("-start") in KINDS:
                total += _bytes(instr.type_text)
            elif body and parts:
                total += _trip_count(instr, comps) * parts[0]
            elif parts and instr.opcode in ("call", "conditional"):  # a conditional runs one branch
                total += sum(parts) if instr.opcode == "call" else max(parts)
        memo[name] = total
    return memo[name]


_ACTION = re.compile(r'op_name="[^"]*' + ACTION_SCOPE + r"([FBW])\b")
"""A table schedule's action in an instruction's ``op_name`` (its group: the action's letter)."""


def _action(instrs: list[_Instr]) -> str | None:
    return next((m.group(1) for i in instrs if (m := _ACTION.search(i.rest))), None)


def _multiplicities(
    comps: dict[str, list[_Instr]], entry: str, share: float = 0.0
) -> tuple[dict[str, float], set[str]]:
    """Trips per step of every computation reachable from ``entry``, and those inside a ``while`` body. ``share``: a
    table schedule's tick loop runs each action's branch on that share of its trips (0: its costliest branch)."""
    mult: dict[str, float] = defaultdict(float)
    looped: set[str] = set()
    volumes: dict[str, int] = {}

    def visit(name: str, factor: float, in_loop: bool) -> None:
        mult[name] += factor
        if in_loop:
            looped.add(name)
        for instr in comps.get(name, []):
            if instr.opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", instr.rest)
                if body:
                    visit(body.group(1), factor * _trip_count(instr, comps), True)
            elif instr.opcode == "call":
                for callee in _callees(instr.rest):
                    if callee in comps and callee != name:
                        visit(callee, factor, in_loop)
            elif instr.opcode == "conditional":
                # one branch runs per execution: count the one that communicates most, not all of them
                branches = [c for c in _callees(instr.rest) if c in comps and c != name]
                acts = {c: _action(comps[c]) for c in branches}
                if share and len(set(acts.values()) - {None}) > 1:  # the tick loop's switch: every action runs
                    for c in (c for c, a in acts.items() if a):
                        visit(c, factor * share, in_loop)
                elif branches:
                    visit(max(branches, key=lambda c: _volume(comps, c, volumes)), factor, in_loop)

    visit(entry, 1, False)
    return mult, looped


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a partitioned HLO module."""

    name: str
    kind: str  # one of KINDS; an all-reduce feeding only dynamic-slices counts as a reduce-scatter
    bytes: int  # size of its result
    volume: int  # ZeRO-paper volume per execution
    wire: int  # ring bytes sent per device per execution
    trips: float  # executions per step (while-loop trips multiplied out; a table's actions on their share of ticks)
    in_loop: bool
    groups: list[list[int]]
    computation: str = ""  # the HLO computation it sits in (a while body, for loop collectives)
    # scheduled (async) collectives: compute instructions the scheduler put between its -start and -done;
    # None for a synchronous collective (XLA:CPU), which overlaps nothing
    overlap_ops: int | None = None
    dtype: str = ""  # the element type it moves (s8 for quantized collectives): its last array's
    dtypes: tuple[str, ...] = ()  # every element type it moves (a combined collective moves several)

    @property
    def overlapped(self) -> bool:
        return bool(self.overlap_ops)


def _num_devices(text: str) -> int:
    m = re.search(r"num_partitions=(\d+)", text)
    return int(m.group(1)) if m else 1


def collectives(hlo_text: str, share: float = 0.0) -> list[Collective]:
    """Every collective of an HLO module's text, with its bytes, trips per step and device groups (``share``: of a
    table schedule's ticks, those that run each action, ``M x chunks / ticks``; 0: its costliest action each tick)."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        raise ValueError("count_collectives: no ENTRY computation found in the HLO text.")
    mult, looped = _multiplicities(comps, entry, share)
    devices = _num_devices(hlo_text)
    out = []
    for comp, instrs in comps.items():
        factor = mult.get(comp, 0)
        if not factor:
            continue
        users: dict[str, list[str]] = defaultdict(list)
        between = _compute_between(instrs)
        for instr in instrs:
            for operand in re.findall(r"%([\w.\-]+)", instr.rest.split("), ")[0]):
                users[operand].append(instr.opcode)
        for instr in instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS or instr.opcode.endswith("-done"):
                continue
            operands_bytes, size = _async_sizes(instr) if instr.opcode.endswith("-start") else (None, None)
            size = _bytes(instr.type_text) if size is None else size
            groups = replica_groups(instr.rest, devices)
            n = max((len(g) for g in groups), default=1)
            if n == 1 and groups:  # every group one device (a shard_map's sum over axes of size 1): nothing moves
                continue
            if kind == "all-reduce" and users[instr.name] and all(u == "dynamic-slice" for u in users[instr.name]):
                kind = "reduce-scatter"  # what the GPU compiler makes of all-reduce + dynamic-slice
                vol = size
            elif kind == "all-reduce":
                vol = 2 * size
            elif kind == "reduce-scatter":
                operand = re.match(r"\s*([a-z0-9]+\[[0-9,]*\])", instr.rest)
                vol = operands_bytes if operands_bytes else _bytes(operand.group(1)) if operand else size * n
            elif kind == "ragged-all-to-all":
                operand = re.match(r"\s*([a-z0-9]+\[[0-9,]*\])", instr.rest)  # the data, when shapes are printed
                sent = operands_bytes if operands_bytes else _bytes(operand.group(1)) if operand else size
                vol = min(sent, size)
            else:
                vol = size
            ring = 1.0 if kind == "collective-permute" else (n - 1) / n if n > 1 else 0.0
            wire = round(vol * ring)
            arrays = _ARRAY.findall(instr.type_text)
            out.append(
                Collective(
                    instr.name, kind, size, vol, wire, factor, comp in looped, groups, comp, between.get(instr.name),
                    arrays[-1][0] if arrays else "", tuple(sorted({a[0] for a in arrays})),
                )
            )  # fmt: skip
    return out


# instructions that do work on the device (what a collective can hide behind)
_COMPUTE = (
    "fusion", "custom-call", "dot", "scaled-dot", "convolution", "while", "call", "conditional", "sort", "scatter",
    "gather",
)  # fmt: skip


def _compute_between(instrs: list[_Instr]) -> dict[str, int]:
    """For each async ``-start``: how many compute instructions come before its ``-done`` in schedule order."""
    starts: dict[str, int] = {}
    found: dict[str, int] = {}
    for i, instr in enumerate(instrs):
        if instr.opcode.endswith("-start"):
            starts[instr.name] = i
        elif instr.opcode.endswith("-done"):
            m = re.match(r"\s*%?([\w.\-]+)", instr.rest)
            if m and m.group(1) in starts:
                lo = starts[m.group(1)]
                found[m.group(1)] = sum(1 for x in instrs[lo + 1 : i] if x.opcode in _COMPUTE)
    return found


def _top_level(type_text: str) -> list[str]:
    """The elements of a tuple type ``(a, (b, c))`` at its top level (the type itself if not a tuple)."""
    text = type_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:-1])
    return [p.strip() for p in parts if p.strip()]


# async starts whose type is ``(operands, results, ...)``: XLA:GPU's all-gather and reduce-scatter
# ``((operands), (results))``, all-to-all ``((operand), result)``, collective-permute ``(operand, result)``
# (older versions add two u32[] contexts). An all-reduce-start's type is its result(s) alone.
_OPERANDS_THEN_RESULTS = (
    "all-gather-start", "reduce-scatter-start", "all-to-all-start", "collective-permute-start",
    "ragged-all-to-all-start",
)  # fmt: skip


def _async_sizes(instr: _Instr) -> tuple[int | None, int | None]:
    """``(operand bytes, result bytes)`` of an async ``-start`` whose type holds its operands and then its
    results; ``(None, None)`` for other shapes of type (the whole type is then the result)."""
    parts = _top_level(instr.type_text)
    if len(parts) >= 2 and instr.opcode == "ragged-all-to-all-start":  # ((data, output, 4 x offsets), result)
        return _bytes(_top_level(parts[0])[0]), _bytes(parts[1])
    if len(parts) >= 2 and instr.opcode in _OPERANDS_THEN_RESULTS:
        return _bytes(parts[0]), _bytes(parts[1])
    return None, None


@dataclasses.dataclass(frozen=True)
class Communication:
    """Collective bytes per device per step, by kind: ZeRO-paper volume and ring wire bytes.

    ``by_axes`` (when counted against a mesh) is the volume by the mesh axes a collective spans,
    e.g. ``{("dp",): ..., ("replica",): ...}``: what crosses the slow network under HSDP.
    """

    volume: dict[str, int]
    wire: dict[str, int]
    count: dict[str, int]
    by_axes: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)
    # of by_axes: the volume of collectives the scheduler overlapped with compute (async, compute between
    # -start and -done); the rest is exposed. Synchronous collectives (XLA:CPU) count as exposed.
    overlapped_by_axes: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)
    # of by_axes: the volume of all-to-alls (dense and ragged), which ZeRO never uses: an MoE's token dispatch
    # over ep, a reshard
    all_to_all_by_axes: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)

    @property
    def overlapped_volume(self) -> int:
        return sum(self.overlapped_by_axes.values())

    @property
    def exposed_volume(self) -> int:
        return self.total_volume - self.overlapped_volume

    @property
    def total_volume(self) -> int:
        return sum(self.volume.values())

    @property
    def total_wire(self) -> int:
        return sum(self.wire.values())

    def volume_across(self, axis: str) -> int:
        """Volume of the collectives whose groups span mesh ``axis``."""
        return sum(v for axes, v in self.by_axes.items() if axis in axes)


def count_collectives(hlo_text: str, mesh_shape: dict[str, int] | None = None, share: float = 0.0) -> Communication:
    """Collective bytes per device per step of an HLO module's text.

    Args:
      hlo_text: the module (see :func:`partitioned_hlo`).
      mesh_shape: the mesh's ``{axis: size}`` in order (``dict(mesh.shape)``); with it, volumes are
        also broken down by the axes each collective spans.
      share: a table schedule's ``M x chunks / ticks`` (:func:`collectives`).
    """
    volume: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    wire: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    count: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    by_axes: dict[tuple[str, ...], float] = defaultdict(float)
    overlapped: dict[tuple[str, ...], float] = defaultdict(float)
    all_to_all: dict[tuple[str, ...], float] = defaultdict(float)
    for c in collectives(hlo_text, share):
        volume[c.kind] += c.volume * c.trips
        wire[c.kind] += c.wire * c.trips
        count[c.kind] += c.trips
        axes = spanned_axes(c.groups, mesh_shape) if mesh_shape is not None else ()
        if mesh_shape is not None:
            by_axes[axes] += c.volume * c.trips
        if c.overlapped:
            overlapped[axes] += c.volume * c.trips
        if c.kind in ("all-to-all", "ragged-all-to-all"):
            all_to_all[axes] += c.volume * c.trips
    whole = lambda d: {k: round(v) for k, v in d.items()}  # noqa: E731 - a table's shares make fractions
    return Communication(*map(whole, (volume, wire, count, by_axes, overlapped, all_to_all)))

"""Count collective communication per device per step from HLO text.

Read the module right after SPMD partitioning (see :func:`partitioned_hlo`): later CPU passes upcast
bf16 collectives and never form reduce-scatters, so the numbers would not mean what they do on a GPU.

Volumes follow the ZeRO paper: an all-reduce moves 2x its size (reduce-scatter + all-gather), an
all-gather 1x its (full) result, a reduce-scatter 1x its (full) operand, an all-to-all and a
collective-permute 1x their size. ``wire`` is what a ring sends per device: x (n-1)/n of the above
(a permute sends all of it). An all-reduce whose every user is a ``dynamic-slice`` is counted as the
reduce-scatter the GPU compiler turns it into. Collectives inside ``while`` loops count once per trip.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections import defaultdict
from typing import Any

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


def _bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _DTYPE_BYTES:
            total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
    return total


def _group_size(attrs: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k.strip("'"): int(v) for k, v in re.findall(r"('[^']+'|\w+)=(\d+)", m.group(1))}
        axes = [a.strip().strip("'") for a in m.group(2).split(",") if a.strip()]
        return math.prod(sizes.get(a, 1) for a in axes)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    return 1


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
        consts = [
            int(c) for i in comps[cond.group(1)] if i.opcode == "constant" for c in re.findall(r"^(-?\d+)\)", i.rest)
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


def _multiplicities(comps: dict[str, list[_Instr]], entry: str) -> dict[str, int]:
    mult: dict[str, int] = defaultdict(int)

    def visit(name: str, factor: int) -> None:
        mult[name] += factor
        for instr in comps.get(name, []):
            if instr.opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", instr.rest)
                if body:
                    visit(body.group(1), factor * _trip_count(instr, comps))
            elif instr.opcode in ("call", "conditional"):
                for callee in _callees(instr.rest):
                    if callee in comps and callee != name:
                        visit(callee, factor)

    visit(entry, 1)
    return mult


@dataclasses.dataclass(frozen=True)
class Communication:
    """Collective bytes per device per step, by kind: ZeRO-paper volume and ring wire bytes."""

    volume: dict[str, int]
    wire: dict[str, int]
    count: dict[str, int]

    @property
    def total_volume(self) -> int:
        return sum(self.volume.values())

    @property
    def total_wire(self) -> int:
        return sum(self.wire.values())


def count_collectives(hlo_text: str) -> Communication:
    """Collective bytes per device per step of an HLO module's text."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        raise ValueError("count_collectives: no ENTRY computation found in the HLO text.")
    mult = _multiplicities(comps, entry)
    volume: dict[str, int] = dict.fromkeys(KINDS, 0)
    wire: dict[str, int] = dict.fromkeys(KINDS, 0)
    count: dict[str, int] = dict.fromkeys(KINDS, 0)
    for comp, instrs in comps.items():
        factor = mult.get(comp, 0)
        if not factor:
            continue
        users: dict[str, list[str]] = defaultdict(list)
        for instr in instrs:
            for operand in re.findall(r"%([\w.\-]+)", instr.rest.split("), ")[0]):
                users[operand].append(instr.opcode)
        for instr in instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in KINDS or instr.opcode.endswith("-done"):
                continue
            size = _bytes(instr.type_text)
            n = _group_size(instr.rest)
            if kind == "all-reduce" and users[instr.name] and all(u == "dynamic-slice" for u in users[instr.name]):
                kind = "reduce-scatter"  # what the GPU compiler makes of all-reduce + dynamic-slice
                vol = size
            elif kind == "all-reduce":
                vol = 2 * size
            elif kind == "reduce-scatter":
                operand = re.match(r"\s*([a-z0-9]+\[[0-9,]*\])", instr.rest)
                vol = _bytes(operand.group(1)) if operand else size * n
            else:
                vol = size
            ring = 1.0 if kind == "collective-permute" else (n - 1) / n if n > 1 else 0.0
            volume[kind] += vol * factor
            wire[kind] += round(vol * ring) * factor
            count[kind] += factor
    return Communication(volume, wire, count)


def partitioned_hlo(lowered: Any) -> tuple[Any, str]:
    """Compile ``lowered`` and return ``(compiled, HLO text right after SPMD partitioning)``."""
    with tempfile.TemporaryDirectory() as tmp:
        compiled = lowered.compile(compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        names = sorted(f for f in os.listdir(tmp) if "after_spmd-partitioning" in f)
        if not names:
            raise RuntimeError("partitioned_hlo: XLA wrote no module after SPMD partitioning.")
        with open(os.path.join(tmp, names[-1])) as f:
            return compiled, f.read()

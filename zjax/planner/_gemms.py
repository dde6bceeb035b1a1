"""The matrix products of a compiled step, counted per step by their operands' element types."""

from __future__ import annotations

import re
from collections import defaultdict

from ._hlo import _multiplicities, _parse


def _operand_names(rest: str) -> list[str]:
    """The ``%names`` an instruction reads (its argument list, before the attributes)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _element_type(type_text: str) -> str:
    return type_text.split("[", 1)[0].strip("( ")


def count_gemms(hlo_text: str) -> dict[str, int]:
    """The matrix products a compiled step runs, per step (loop bodies times their trip counts), by operand
    element types: ``{"bf16 x bf16": n, "f8e4m3fn x f8e5m2": m, ...}``. A product is a ``dot`` (alone or inside
    a fusion, e.g. XLA:GPU's Triton GEMM fusions) or a cuBLAS GEMM custom call; its operands' types are read
    where they are defined."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        return {}
    mult, _ = _multiplicities(comps, entry)
    types = {name: {i.name: _element_type(i.type_text) for i in instrs} for name, instrs in comps.items()}

    def products(comp: str) -> list[str]:
        found = []
        for instr in comps.get(comp, []):
            gemm = instr.opcode in ("dot", "scaled-dot") or (instr.opcode == "custom-call" and "$matmul" in instr.rest)
            if gemm:
                ops = [types[comp].get(n, "?") for n in _operand_names(instr.rest)[:2]]
                found.append(" x ".join(ops))
        return found

    counts: dict[str, float] = defaultdict(float)
    for comp, factor in mult.items():
        for kind in products(comp):
            counts[kind] += factor
        for instr in comps.get(comp, []):
            if instr.opcode == "fusion":
                callee = re.search(r"calls=%?([\w.\-]+)", instr.rest)
                for kind in products(callee.group(1)) if callee else []:
                    counts[kind] += factor
    return {k: round(v) for k, v in counts.items()}

"""A step's FLOPs from its compiled program, loops multiplied out, and the FLOPs of a table schedule's actions.

XLA's ``cost_analysis()`` counts a ``while`` body once, so it cannot compare a pipeline's engines (GPipe's scan
over iterations, the table engine's scan over ticks). Here the matrix products (``dot``, ``convolution``, cuBLAS
GEMMs) of every computation are counted with their executions per step: a loop body times its trips, and a
table schedule's tick loop per action: its ``lax.switch`` branches carry the name scope of their action (F, B or
W, :data:`zjax.pipeline.ACTION_SCOPE`), so each branch counts once per tick that runs it (``M x chunks`` each,
per stage). Inside an action, a branch in :data:`zjax.pipeline.ENDS_SCOPE` (the first stage's embedding, the last's
loss) counts on its share of the actions (``1 / (S x chunks)``: per device, averaged over the stages), the other
branch on the rest; any other conditional counts its costliest branch. Elementwise work is not counted.
"""

from __future__ import annotations

import re

from ..pipeline import ENDS_SCOPE
from ._hlo import _action, _callees, _Instr, _parse, _trip_count
from ._timeline import PRODUCTS, _dot_flops, _gemm_flops

_ENDS = re.compile(r'op_name="[^"]*' + ENDS_SCOPE + r"\b")


def step_flops(hlo_text: str, share: float = 0.0, ends: float = 0.0) -> tuple[float, dict[str, float]]:
    """``(FLOPs per step and device, FLOPs of one F, B and W action)`` of a module's text; ``share``: the fraction
    of a table schedule's ticks on which a stage runs each action kind (``M x chunks / ticks``; 0: no table);
    ``ends``: the fraction of the actions that run a branch in :data:`zjax.pipeline.ENDS_SCOPE` (``1 / (S x
    chunks)``; 0: its costliest branch)."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        raise ValueError("step_flops: no ENTRY computation found in the HLO text.")
    types = {name: {i.name: i.type_text for i in instrs} for name, instrs in comps.items()}
    memo: dict[str, float] = {}
    per_action: dict[str, float] = {}

    def flops(comp: str) -> float:  # one execution of ``comp``
        if comp in memo:
            return memo[comp]
        memo[comp] = 0.0  # a cycle (none in valid HLO) counts nothing
        memo[comp] = sum(_instr_flops(instr, comp) for instr in comps.get(comp, []))
        return memo[comp]

    def _instr_flops(instr: _Instr, comp: str) -> float:
        total = 0.0
        if instr.opcode in PRODUCTS:
            total += _dot_flops(instr, types[comp])
        elif instr.opcode == "custom-call" and "gemm" in instr.rest:
            total += _gemm_flops(instr, types[comp])
        body = re.search(r"body=%?([\w.\-]+)", instr.rest) if instr.opcode == "while" else None
        if body and body.group(1) in comps:
            return total + _trip_count(instr, comps) * flops(body.group(1))
        fused = re.findall(r"calls=%?([\w.\-]+)", instr.rest)
        callees = [c for c in (fused + _callees(instr.rest)) if c in comps and c != comp]
        if instr.opcode != "conditional":
            return total + sum(flops(c) for c in callees)
        labels = {c: _action(comps.get(c, [])) for c in callees}
        if share and len({a for a in labels.values() if a is not None}) > 1:  # the tick loop's switch
            per_action.update({a: flops(c) for c, a in labels.items() if a is not None})
            return total + share * sum(flops(c) for c, a in labels.items() if a is not None)
        marked = [c for c in callees if any(_ENDS.search(i.rest) for i in comps.get(c, []))]
        rest = [c for c in callees if c not in marked]
        if ends and marked and rest:  # inside an action: the first or the last stage's part, on its share
            return total + ends * max(map(flops, marked)) + (1 - ends) * max(map(flops, rest))
        return total + max((flops(c) for c in callees), default=0.0)

    return flops(entry), per_action

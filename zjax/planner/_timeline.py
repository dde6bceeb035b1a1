"""How long a step waits for its collectives: a roofline walk over the GPU compiler's schedule.

The planner's ``exposed`` counts a collective as hidden when any compute runs between its ``-start`` and its
``-done``; whether that compute outlasts the collective on its link is not in that count. Here every instruction
of the scheduled program gets a duration, in schedule order on one compute stream:

- compute: the roofline of its FLOPs (the dots in a fusion or a cuBLAS call, at the target's dense peak: the fp8
  one for a product of two fp8 operands) and the bytes it touches (its operands and result at the target's HBM
  bandwidth; an operand a fusion only slices counts its slices, a result it updates in place its update);
- a collective: its ring bytes per device (``Collective.wire``) over the link its groups span: NVLink inside a
  host, the network across hosts (:data:`LINKS`, published per-GPU figures, one direction). Collectives queue on
  one link in the order they start; a ``-done`` waits until its collective has crossed, a synchronous collective
  waits for all of it;
- a ``while`` loop: its body's duration times its trips (a collective the body starts for the next trip and
  waits for at the top of it, as XLA's pipeliner places them, has the rest of the trip to cross).

``wait`` is the time the compute stream stands still for collectives: what a step would add to its compute
if the estimates held. No latency term per collective (NCCL's microseconds per ring step), no contention
between compute and communication for HBM, no kernel launch gaps: a lower bound on the wait, with the
compute at peak (an upper bound on how fast the compute can hide it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from ._hlo import KINDS, _bytes, _callees, _Instr, _parse, _trip_count, collectives
from ._targets import GPUS_PER_HOST


@dataclasses.dataclass(frozen=True)
class Links:
    """Per-GPU bandwidth of one direction, bytes per second: ``intra`` inside a host (NVLink), ``inter`` across
    hosts (the GPU's network adapter)."""

    intra: float
    inter: float


LINKS: dict[str, Links] = {
    "h100": Links(450e9, 50e9),  # NVLink 4 (900 GB/s both ways), one 400 Gb/s adapter per GPU
    "h200": Links(450e9, 50e9),
    "b200": Links(900e9, 100e9),  # NVLink 5, 800 Gb/s
    "a100": Links(300e9, 25e9),  # NVLink 3, 200 Gb/s
}


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A step's estimated seconds: ``compute`` (every instruction's roofline), ``comm`` (every collective's time
    on its link) and ``wait`` (the compute stream standing still for collectives)."""

    compute: float
    comm: float
    wait: float
    links: Links | None = None  # the bandwidths it assumed

    @property
    def step(self) -> float:
        return self.compute + self.wait

    def to_dict(self) -> dict[str, Any]:
        links = None if self.links is None else {"intra": self.links.intra, "inter": self.links.inter}  # bytes/s
        return {
            "compute_s": self.compute,
            "comm_s": self.comm,
            "wait_s": self.wait,
            "step_s": self.step,
            "links": links,
        }


_FREE = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "partition-id", "replica-id", "after-all",
    "opt-barrier", "add-dependency", "copy-start", "copy-done", "domain",
}  # fmt: skip
_SLICES = {"dynamic-slice", "slice", "gather"}


def timeline(
    hlo_text: str,
    peak_flops: float,
    hbm_bytes_per_s: float,
    links: Links,
    gpus_per_host: int = GPUS_PER_HOST,
    fp8_flops: float | None = None,
) -> Timeline:
    """The estimate for a scheduled (compiled) HLO module's text; partition ``i`` sits on host
    ``i // gpus_per_host``. A product whose two operands are fp8 runs at ``fp8_flops`` (the target's fp8 peak;
    ``None``: at ``peak_flops`` like the others)."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        raise ValueError("timeline: no ENTRY computation found in the HLO text.")
    seconds = {}
    for c in collectives(hlo_text):
        across = any(len({d // gpus_per_host for d in g}) > 1 for g in c.groups)
        seconds[c.name] = c.wire / (links.inter if across else links.intra)
    walk = _Walk(comps, seconds, (peak_flops, fp8_flops or peak_flops), hbm_bytes_per_s)
    duration, wait, comm = walk.run(entry)
    return Timeline(duration - wait, comm, wait, links)


class _Walk:
    def __init__(
        self, comps: dict[str, list[_Instr]], seconds: dict[str, float], peaks: tuple[float, float], hbm: float
    ):  # fmt: skip
        self.comps, self.seconds, self.peaks, self.hbm = comps, seconds, peaks, hbm  # peaks: (others', fp8's)
        self.types = {name: {i.name: i.type_text for i in instrs} for name, instrs in comps.items()}
        self.memo: dict[str, tuple[float, float, float]] = {}
        self.compute_memo: dict[str, float] = {}

    def run(self, comp: str) -> tuple[float, float, float]:
        """``(duration, wait, comm)`` of one execution of ``comp``."""
        if comp in self.memo:
            return self.memo[comp]
        first = self._pass(comp, None)
        # a collective started late in one trip and waited for early in the next: crossed during the trip's end
        duration, wait, comm, _ = self._pass(comp, first)
        self.memo[comp] = (duration, wait, comm)
        return self.memo[comp]

    def _pass(self, comp: str, prior: Any) -> Any:
        t = wait = comm = link = 0.0
        ends: dict[str, float] = {}
        carried = _carried(self.comps.get(comp, []))
        for instr in self.comps.get(comp, []):
            op = instr.opcode
            kind = op.removesuffix("-start").removesuffix("-done")
            if kind in KINDS and instr.name in self.seconds or op.endswith("-done") and kind in KINDS:
                if op.endswith("-done"):
                    start = _first_operand(instr)
                    start = carried.get(start, start)  # a loop's carry: what the trip before started
                    end = ends.pop(start, None)
                    if end is None and prior is not None and start in prior[3]:
                        end = prior[3][start] - prior[0]  # started in the trip before, on the same clock
                    if end is not None and end > t:
                        wait, t = wait + end - t, end
                    continue
                cost = self.seconds.get(instr.name, 0.0)
                comm += cost
                begin = max(t, link)
                link = begin + cost
                if op.endswith("-start"):
                    ends[instr.name] = link
                else:  # synchronous: the stream waits for all of it
                    wait, t = wait + link - t, link
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", instr.rest)
                if body:
                    trips = _trip_count(instr, self.comps)
                    d, w, c = self.run(body.group(1))
                    t, wait, comm = t + trips * d, wait + trips * w, comm + trips * c
                continue
            if op in ("call", "conditional"):
                callees = _called(instr.rest, self.comps, comp)
                if callees:
                    d, w, c = max((self.run(c) for c in callees), key=lambda r: r[0])
                    t, wait, comm = t + d, wait + w, comm + c
                continue
            if op in _FREE or op.endswith("-done") or op.endswith("-start"):
                continue
            t += self._cost(comp, instr)
        return t, wait, comm, ends

    def _cost(self, comp: str, instr: _Instr) -> float:
        """Roofline seconds of one compute instruction."""
        if instr.opcode in ("dynamic-update-slice", "dynamic-slice"):  # in place: the slice, read and written
            moved = _operands(instr)[1:2] if instr.opcode == "dynamic-update-slice" else []
            size = sum(_bytes(self.types[comp].get(o, "")) for o in moved) or _bytes(instr.type_text)
            return 2.0 * size / self.hbm
        called = re.search(r"calls=%?([\w.\-]+)", instr.rest)
        compute = self._compute(called.group(1)) if called else 0.0
        if instr.opcode in PRODUCTS:
            compute += _dot_flops(instr, self.types[comp]) / self._peak(comp, instr)
        elif instr.opcode == "custom-call" and "__cudnn$fmha" in instr.rest:
            compute += _attention_flops(instr) / self.peaks[0]
        elif instr.opcode == "custom-call" and "gemm" in instr.rest:
            compute += _gemm_flops(instr, self.types[comp]) / self._peak(comp, instr)
        return max(compute, self._touched(comp, instr, called.group(1) if called else None) / self.hbm)

    def _peak(self, comp: str, instr: _Instr) -> float:
        """The FLOP/s of a product: the fp8 peak when both its operands are fp8."""
        operands = [self.types[comp].get(o, "") for o in _operands(instr)[:2]]
        return self.peaks[1] if len(operands) == 2 and all(t.startswith("f8") for t in operands) else self.peaks[0]

    def _compute(self, comp: str) -> float:
        """Seconds at peak of the products in a called computation (nested calls included)."""
        if comp not in self.compute_memo:
            total = 0.0
            for i in self.comps.get(comp, []):
                if i.opcode in PRODUCTS:
                    total += _dot_flops(i, self.types[comp]) / self._peak(comp, i)
                nested = re.search(r"calls=%?([\w.\-]+)", i.rest)
                if nested and nested.group(1) in self.comps:
                    total += self._compute(nested.group(1))
            self.compute_memo[comp] = total
        return self.compute_memo[comp]

    def _touched(self, comp: str, instr: _Instr, called: str | None) -> float:
        """Bytes an instruction reads and writes: a fusion's operands it only slices count their slices, a result
        it updates in place (``dynamic-update-slice``) its update."""
        operands = _operands(instr)
        sizes = [_bytes(self.types[comp].get(o, "")) for o in operands]
        out = _bytes(instr.type_text)
        body = self.comps.get(called or "", [])
        if body:
            params = {
                int(m.group(1)): i.name for i in body if i.opcode == "parameter" and (m := re.match(r"(\d+)\)", i.rest))
            }
            users: dict[str, list[_Instr]] = {}
            for i in body:
                for o in _operands(i):
                    users.setdefault(o, []).append(i)

            def readers(name: str) -> list[tuple[_Instr, str]]:  # (reader, what it reads); a bitcast moves no bytes
                return [
                    pair
                    for u in users.get(name, [])
                    for pair in (readers(u.name) if u.opcode == "bitcast" else [(u, name)])
                ]

            for k, name in params.items():
                pairs = readers(name)
                used = [u for u, _ in pairs]
                # every reader slices it (it is the slice's first operand, not an index)
                sliced = all(u.opcode in _SLICES and _operands(u)[:1] == [read] for u, read in pairs)
                if k < len(sizes) and used and sliced:
                    sizes[k] = sum(_bytes(u.type_text) for u in used)
            root = body[-1]
            if root.opcode == "dynamic-update-slice":
                update = _operands(root)[1:2]
                out = sum(_bytes(self.types[called or ""].get(u, "")) for u in update) or out
        return float(sum(sizes) + out)


def _operands(instr: _Instr) -> list[str]:
    """The operand names of an instruction (the text up to its closing parenthesis)."""
    depth, end = 1, len(instr.rest)
    for i, ch in enumerate(instr.rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", instr.rest[:end])


def _carried(body: list[_Instr]) -> dict[str, str]:
    """In a loop body: each element read from the loop's parameter (``get-tuple-element``), mapped to what the
    body's root tuple puts at that index for the next trip."""
    if not body or body[-1].opcode != "tuple":
        return {}
    params = {i.name for i in body if i.opcode == "parameter"}
    nxt = _operands(body[-1])
    out = {}
    for i in body:
        index = re.search(r"index=(\d+)", i.rest)
        if i.opcode == "get-tuple-element" and index and _first_operand(i) in params and int(index.group(1)) < len(nxt):
            out[i.name] = nxt[int(index.group(1))]
    return out


def _first_operand(instr: _Instr) -> str:
    names = _operands(instr)
    return names[0] if names else ""


def _called(attrs: str, comps: dict[str, list[_Instr]], here: str) -> list[str]:
    return [n for n in _callees(attrs) if n in comps and n != here]


def _dims(type_text: str) -> list[int]:
    m = re.search(r"\[([0-9,]*)\]", type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


PRODUCTS = ("dot", "convolution", "scaled-dot")
"""The opcodes of matrix products (``scaled-dot``: a block-scaled product, MXFP8's, its scales' operands after the
two values')."""


def _dot_flops(instr: _Instr, types: dict[str, str]) -> float:
    """2 x result elements x contracted elements (from the lhs operand's dims)."""
    lhs = _operands(instr)[:1]
    dims = _dims(types.get(lhs[0], "")) if lhs else []
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.rest)
    contracted = [int(d) for d in m.group(1).split(",") if d] if m else []
    k = math.prod(dims[d] for d in contracted if d < len(dims))
    return 2.0 * math.prod(_dims(instr.type_text)) * k


def _gemm_flops(instr: _Instr, types: dict[str, str]) -> float:
    """A cuBLAS call's FLOPs: its backend config's contracting dims on the lhs operand."""
    m = re.search(r"backend_config=(\{.*\})", instr.rest)
    try:
        config = json.loads(m.group(1)) if m else {}
    except json.JSONDecodeError:
        config = {}
    numbers = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    lhs = _operands(instr)[:1]
    dims = _dims(types.get(lhs[0], "")) if lhs else []
    k = math.prod(dims[int(d)] for d in numbers.get("lhs_contracting_dimensions", []) if int(d) < len(dims))
    out = _dims(_first_array(instr.type_text))
    return 2.0 * math.prod(out) * k


def _attention_flops(instr: _Instr) -> float:
    """cuDNN's fused attention: its two matmuls over the scores ``[B, N, T, S]`` (its config's intermediate shape)
    and the head dim, halved under a causal mask (skipped blocks); the backward pass's five 2.5 times that."""
    scores = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', instr.rest)
    if not scores:
        return 0.0
    elements = math.prod(int(d) for d in re.findall(r"\d+", scores.group(1)))
    head = _dims(_first_array(instr.type_text))[-1:] or [0]
    flops = 4.0 * elements * head[0]
    flops *= 0.5 if re.search(r'"mask_type":\s*"CAUSAL"', instr.rest) else 1.0
    return flops * (2.5 if "Backward" in instr.rest else 1.0)


def _first_array(type_text: str) -> str:
    m = re.search(r"[a-z][a-z0-9]*\[[0-9,]*\]", type_text)
    return m.group(0) if m else ""

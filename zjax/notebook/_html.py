"""HTML tables for Jupyter: a state's layout, a memory report, a planner estimate (``_repr_html_``)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from ..core._memory import CATEGORIES, LABELS, _fmt
from ._rows import layout_rows

_STYLE = (
    "<style>.zjax-t{border-collapse:collapse;font:12px monospace}.zjax-t td,.zjax-t th{padding:2px 8px;"
    "border-bottom:1px solid #ddd;text-align:left}.zjax-t td.n,.zjax-t th.n{text-align:right}"
    ".zjax-t caption{text-align:left;font-weight:bold;padding:4px 0}.zjax-t tr.sum td{font-weight:bold}</style>"
)


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    caption: str = "",
    numeric: Sequence[int] = (),
    bold_last: bool = False,
) -> str:
    """A small HTML table; columns in ``numeric`` are right-aligned. Cells are escaped."""

    def cell(tag: str, j: int, value: Any) -> str:
        cls = ' class="n"' if j in numeric else ""
        return f"<{tag}{cls}>{html.escape(str(value))}</{tag}>"

    head = "".join(cell("th", j, h) for j, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cls = ' class="sum"' if bold_last and r == len(rows) - 1 else ""
        body.append(f"<tr{cls}>" + "".join(cell("td", j, v) for j, v in enumerate(row)) + "</tr>")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f'{_STYLE}<table class="zjax-t">{cap}<tr>{head}</tr>{"".join(body)}</table>'


def _mesh_text(shape: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in shape.items() if v > 1) or "1 device"


def layout_html(layout: Any, state: Any = None) -> str:
    """Every parameter: shape, dtype, the spec of its params / master / moments / grads, bytes per device."""
    rows = layout_rows(layout, state)
    sized = state is not None
    headers = ["path", "shape", "dtype", "params", "master", "moments", "grads", "replicas"]
    if sized:
        headers += ["bytes/device", "unsharded"]
    body = []
    for r in rows:
        line = [r.path, "x".join(map(str, r.shape)) or "()", r.dtype, r.params, r.master, r.moments, r.grads,
                r.replication]  # fmt: skip
        if sized:
            line += [_fmt(r.total), _fmt(r.unsharded) if r.unsharded else ""]
        body.append(line)
    if sized:
        body.append(["total", "", "", "", "", "", "", "", _fmt(sum(r.total for r in rows)),
                     _fmt(sum(r.unsharded for r in rows))])  # fmt: skip
    caption = (
        f"ZeRO stage {layout.stage.level} on {_mesh_text(dict(layout.mesh.shape))}, {len(rows)} parameters"
        + (f", offload {layout.offload.name}" if layout.offload.enabled else "")
        + ("; bytes per device: params + master + moments + grads" if sized else "")
        + "; replicas = devices holding each byte of the master weights"
    )
    return table(headers, body, caption, numeric=(7, 8, 9), bold_last=sized)


def memory_report_html(report: Any) -> str:
    """ZeRO's formula beside the compiled program's numbers, per category and in total."""
    rows = []
    for key in CATEGORIES:
        compiled = report.compiled.get(key)
        rows.append([LABELS[key], _fmt(report.theory[key]), _fmt(compiled) if compiled is not None else "in temp"])
    rows += [
        ["model state", _fmt(report.state_theory), _fmt(report.state_compiled)],
        ["temporaries", "", _fmt(report.temp_bytes)],
        ["peak (arg + out - alias + temp)", "", _fmt(report.peak_bytes)],
    ]
    if report.offloaded_bytes:
        rows += [["in pinned host memory", "", _fmt(report.offloaded_bytes)],
                 ["device peak", "", _fmt(report.device_peak_bytes)]]  # fmt: skip
    caption = (
        f"memory per device: ZeRO stage {report.stage}, {report.precision}, {_mesh_text(report.mesh)}, "
        f"{report.num_params:,} params"
    )
    out = table(["category", "theory", "compiled"], rows, caption, numeric=(1, 2))
    if report.unsharded:
        items = "".join(f"<li>{html.escape(u.path)} {u.shape}: {html.escape(u.reason)}</li>" for u in report.unsharded)
        out += f"<div style='font:12px monospace'>replicated over dp:<ul>{items}</ul></div>"
    return out


def estimate_html(est: Any) -> str:
    """One row per planned configuration: theory, compiled memory and communication per device."""
    headers = ["stage", "remat", "accum", "offload", "theory", "state", "temp", "total", "comm", "x psi", "exposed"]
    rows = [
        [
            r.stage,
            r.remat,
            r.accum,
            r.offload,
            _fmt(r.theory["total"]),
            _fmt(r.compiled["state"]),
            _fmt(r.compiled["temp"]),
            _fmt(r.compiled["total"]),
            _fmt(r.comm.total_volume),
            f"{r.comm_psi:.2f}",
            _fmt(r.comm.exposed_volume) + (" *" if r.over_memory else ""),
        ]  # fmt: skip
        for r in est.rows
    ]
    compiler = f"XLA:GPU for {est.device_kind} (deviceless)" if est.backend == "gpu" else "XLA:CPU, simulated devices"
    caption = (
        f"{est.model}: {est.params:,} params on {_mesh_text(est.mesh)}, {est.precision}, global batch "
        f"{est.batch_size}; compiled by {compiler}; per device"
    )
    if any(r.over_memory for r in est.rows):
        caption += (
            "; * over the memory the scheduler plans against: it gives up overlap there, so a step that fits "
            "exposes less"
        )
    return table(headers, rows, caption, numeric=tuple(range(4, 11)))

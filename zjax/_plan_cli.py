"""``zjax plan``'s run: the planner on the command line (its arguments: :mod:`zjax._plan_args`; :mod:`zjax.cli`
dispatches)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from ._extras import MissingExtra, require
from ._jsonfile import write_json_atomic
from ._plan_args import parses_quantized
from ._quiet import filtered_stderr


def _plot(est, path: Path) -> None:
    import matplotlib  # checked before the compiles (run_plan)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"stage {r.stage}\n{r.remat}" + (f" x{r.accum}" if r.accum > 1 else "") for r in est.rows]
    parts = {
        "compute params": [r.theory["params"] for r in est.rows],
        "master + optimizer": [r.theory["optimizer"] for r in est.rows],
        "temporaries (compiled)": [r.compiled["temp"] for r in est.rows],
    }
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 4))
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        gb = [v / 1e9 for v in values]
        ax.bar(labels, gb, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, gb, strict=True)]
    ax.scatter(labels, [r.compiled["total"] / 1e9 for r in est.rows], color="black", zorder=3, label="compiled total")
    mesh = " ".join(f"{k}={v}" for k, v in est.mesh.items())
    ax.set_ylabel("GB per device")
    ax.set_title(f"{est.model} ({est.params / 1e9:.2f}B params), {mesh}, {est.precision}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_plan(args: argparse.Namespace) -> int:
    if args.timeline and args.target is None:
        print("zjax plan: --timeline walks a GPU's schedule: give --target too (e.g. h100)", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            require("matplotlib", "zjax plan --plot")  # before the compiles, not after them
        except MissingExtra as e:
            print(f"zjax plan: {e}", file=sys.stderr)
            return 2
    devices = math.prod(args.mesh.values())
    import jax

    jax.config.update("jax_platforms", "cpu")  # also what a deviceless GPU compile needs
    if args.target is None:
        from .sharding import simulate_cpu_devices

        simulate_cpu_devices(devices)
    with filtered_stderr():  # the backend starts: the CUDA plugin probes for a driver
        jax.devices()
    from . import planner
    from .planner._gpu import budget as make_budget
    from .remat import POLICIES

    try:
        _, cfg = planner.resolve_model(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"zjax plan: --model: {e}", file=sys.stderr)
        return 2
    given = (("capacity_factor", args.capacity_factor), ("dispatch_chunks", args.dispatch_chunks))
    moe = {name: value for name, value in given if value is not None}
    if moe and cfg.moe is None:
        flags = ", ".join("--" + name.replace("_", "-") for name in moe)
        print(f"zjax plan: {flags}: the model {args.model} has no experts", file=sys.stderr)
        return 2
    try:
        if cfg.moe is not None:
            dataclasses.replace(cfg.moe, **moe)  # the fields' own checks, before any compile
    except ValueError as e:
        print(f"zjax plan: {e}", file=sys.stderr)
        return 2
    remats = [r for r in args.remat.split(",") if r]
    bad = [r for r in remats if r not in POLICIES]
    if bad:
        print(f"zjax plan: unknown --remat {bad}; valid: {sorted(POLICIES)}", file=sys.stderr)
        return 2
    from .offload import Offload

    offloads = [o for o in args.offload.split(",") if o]
    if args.budget is not None and args.offload == "none":
        offloads = list(Offload.NAMES)  # offload is tried only when nothing fits on the device
    bad = [o for o in offloads if o not in Offload.NAMES]
    if bad or not offloads or (args.budget is None and len(offloads) > 1):
        print(f"zjax plan: --offload {args.offload}: one of {list(Offload.NAMES)} (a comma list with --budget)",
              file=sys.stderr)  # fmt: skip
        return 2
    pp = args.mesh.get("pp", 1)
    pipeline = None
    names = [n for n in args.schedule.split(",") if n]
    if args.pipeline_table is not None and args.budget is not None:
        print("zjax plan: --pipeline-table runs one schedule; --budget searches the named ones (--schedule)",
              file=sys.stderr)  # fmt: skip
        return 2
    if pp > 1 or args.microbatches is not None or args.pipeline_table is not None:
        from .pipeline import SCHEDULES, Pipeline, read_table

        if args.pipeline_table is not None:
            try:
                tab = read_table(args.pipeline_table)
                names = [tab]
                args.microbatches = args.microbatches or tab.microbatches
                args.repeats = tab.chunks if args.repeats == 1 else args.repeats
            except (OSError, ValueError) as e:
                print(f"zjax plan: --pipeline-table: {e}", file=sys.stderr)
                return 2
        elif not names or [n for n in names if n not in SCHEDULES] or (args.budget is None and len(names) > 1):
            print(f"zjax plan: --schedule {args.schedule}: one of {list(SCHEDULES)} (a comma list with --budget)",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            pipeline = Pipeline(
                args.microbatches or 2 * pp,
                repeats=args.repeats,
                zero3_gather=args.zero3_gather,
                recompute=args.recompute,
                schedule=names[0] if args.budget is None else "gpipe",  # --budget: fit tries each name
            )
        except ValueError as e:
            print(f"zjax plan: {e}", file=sys.stderr)
            return 2
    ranks = args.mesh.get("dp", 1) * args.mesh.get("replica", 1) * args.mesh.get("ep", 1)
    rows = ranks * (pipeline.microbatches if pipeline else 1)
    for name in ("ep", "cp"):
        sizes = getattr(args, name)
        if sizes is not None and (args.budget is None or not sizes or min(sizes) < 1):
            print(f"zjax plan: --{name} {sizes}: give positive {name} sizes with --budget (without it, put {name} "
                  "in --mesh)", file=sys.stderr)  # fmt: skip
            return 2
    if not args.accum or min(args.accum) < 1:
        print(f"zjax plan: --accum {args.accum}: give positive microbatch counts, e.g. 1,2,4", file=sys.stderr)
        return 2
    # default: one row per data-parallel rank in each microbatch, with a global batch that every --accum
    # value splits (their least common multiple), so that all of them are planned on the same batch
    batch = args.batch_size or rows * math.lcm(*args.accum)
    quantized = [None if q == "none" else q for q in args.quantize_comm.split(",") if q]
    bad = [q for q in quantized if q is not None and not parses_quantized(q)]
    if bad or not quantized:
        print(f"zjax plan: --quantize-comm {args.quantize_comm}: give none, weights, grads or weights+grads, a part "
              "int4 with ':int4' (weights+grads:int4) and its block with '@B' (weights:int4@64); a comma list "
              "compares them; with --budget, the values stage 3 may take", file=sys.stderr)  # fmt: skip
        return 2
    copies = [c for c in args.compute_copy.split(",") if c]
    if not copies or set(copies) - {"keep", "drop"} or (args.budget is not None and len(copies) > 1):
        print(f"zjax plan: --compute-copy {args.compute_copy}: keep or drop (keep,drop compares them without "
              "--budget)", file=sys.stderr)  # fmt: skip
        return 2
    hpzs = [h for h in args.hpz.split(",") if h]
    if not hpzs or set(hpzs) - {"no", "yes"} or (args.budget is not None and len(hpzs) > 1):
        print(f"zjax plan: --hpz {args.hpz}: no or yes (no,yes compares them without --budget)", file=sys.stderr)
        return 2
    from .train import OPTIMIZERS, Optim

    if args.optimizer not in OPTIMIZERS:
        print(f"zjax plan: --optimizer {args.optimizer}: one of {', '.join(OPTIMIZERS)}", file=sys.stderr)
        return 2
    optim = Optim(name=args.optimizer)
    tx = None if args.optimizer == "adamw" else (lambda params: optim.transformation(1000, params))
    try:
        if args.budget is None:
            if len(remats) > 1:
                raise ValueError(f"--remat {args.remat}: several policies are compared only with --budget.")
            estimates = [
                planner.estimate(
                    args.model,
                    mesh=args.mesh,
                    stages=stages,
                    remat=remats[0],
                    precision=args.precision,
                    matmul=args.matmul,
                    batch_size=batch,
                    seq_len=args.seq_len,
                    accum=accum,
                    pipeline=pipeline,
                    target=args.target,
                    offload=offloads[0],
                    quantized_comm=q,
                    reduce_dtype=args.reduce_dtype,
                    compute_copy=copy == "keep",
                    hpz=hpz == "yes",
                    tx=tx,
                    moe=moe,
                )  # fmt: skip
                for hpz in hpzs
                for copy in copies
                for q in quantized  # each after the first plans stage 3 only (the only rows it changes)
                for stages in [
                    args.stages
                    if (q, copy, hpz) == (quantized[0], copies[0], hpzs[0])
                    else [s for s in args.stages if s == 3]
                ]
                if stages
                for accum in args.accum  # every value is planned
            ]
            est = type(estimates[0])(**{**estimates[0].__dict__, "rows": tuple(r for e in estimates for r in e.rows)})
            est = dataclasses.replace(est, show_timeline=args.timeline)
            print(est)
            result = est.to_dict()
        else:
            limit = make_budget(args.budget, args.target)
            row, closest, tried, skipped = planner.fit(
                limit.usable, args.model, mesh=args.mesh, stages=args.stages, remats=remats, accums=args.accum,
                precision=args.precision, batch_size=batch, seq_len=args.seq_len, target=args.target,
                offloads=offloads, pipeline=pipeline, schedules=names if pipeline is not None else (),
                eps=args.ep or (), cps=args.cp or (), quantized=quantized, reduce_dtype=args.reduce_dtype,
                compute_copy=copies[0] == "keep", hpz=hpzs[0] == "yes", matmul=args.matmul, tx=tx,
                moe=moe,
            )  # fmt: skip
            est = type(tried[0])(**{**tried[0].__dict__, "rows": tuple(r for e in tried for r in e.rows)})
            est = dataclasses.replace(est, show_timeline=args.timeline)
            print(est)
            if skipped:
                print("\nnot planned (cannot run):")
                for line in planner.describe_skipped(skipped):
                    print(f"  {line}")
            print(f"\nbudget: {limit.describe()}")
            if row is not None:
                print(
                    f"fits: stage {row.stage}, remat {row.remat}, {row.accum} microbatch(es)"
                    + (f", schedule {row.schedule}" if row.schedule else "")
                    + (f", mesh {','.join(f'{k}={v}' for k, v in row.mesh.items() if v > 1)}" if args.ep else "")
                    + (f", offload {row.offload}" if row.offloaded else "")
                    + (f", wire {row.wire}" if "int" in row.wire else "")
                    + f": {row.compiled['total'] / 1e9:.3f} GB per device"
                    + (f" (+{row.offloaded / 1e9:.3f} GB in host memory)" if row.offloaded else "")
                )
            else:
                print(
                    f"nothing fits in {limit.usable / 1e9:.3f} GB per device; closest: stage {closest.stage}, "
                    f"remat {closest.remat}, {closest.accum} microbatch(es) at {closest.compiled['total'] / 1e9:.3f} GB"
                )
            result = est.to_dict() | {
                "budget": limit.usable,
                "budget_detail": limit.describe(),
                "fits": row.to_dict() if row is not None else None,
                "closest": closest.to_dict(),
                "skipped": [dataclasses.asdict(c) | {"reason": reason} for c, reason in skipped],
            }
    except (ValueError, ImportError) as e:
        print(f"zjax plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        _plot(est, args.plot)
        print(f"wrote {args.plot}")
    return 0 if args.budget is None or result.get("fits") is not None else 1

"""Pipeline schedules on 8 simulated CPU devices: bubble, permutes per iteration, bytes per device, compile time.

    python benchmarks/pipeline.py [--json runs/pipeline.json] [--gpu-target h100] [--schedules-only]

First, one row per schedule (GPipe, circular, 1F1B, interleaved 1F1B, zero-bubble, ZB-V) at M = 8 and 32
microbatches of two 128-token sequences (the example's small preset, dp=2 x pp=4, ZeRO-3, bf16): the
bubble of the table the step runs (in ticks, and in time: each tick as long as its longest action, by the
actions' FLOPs), compiled temporaries and peak per device, dp and pp bytes per step, FLOPs per step (loops
multiplied out), the step time on this CPU (orders of magnitude only: 8 simulated devices on a few cores) and, with
``--gpu-target``, the temporaries XLA:GPU compiles for that GPU.

Compiles the train step of a small decoder (8 layers) for GPipe and the circular schedule on
dp=2 x pp=4 (ZeRO-1, ZeRO-2 and ZeRO-3, gathering once per step or per use) and on dp=8 without a
pipeline, and reads the compiled program: ``memory_analysis()`` for argument, temp and peak bytes, the
partitioned HLO for the collective-permutes inside the loop and the bytes all-gathered and reduced over
dp per step. A weight-heavy variant (short sequences) and the model's remat policy ("full" vs "none")
show where each gathering mode pays.
CPU numbers: they show structure and memory, not speed.

With ``--gpu-target`` the same comparison runs on the GPU compiler (deviceless XLA:GPU, through the
planner) for a larger decoder (16 layers, width 512): per device state, temporaries and peak, and the bytes
gathered and reduced over dp per step with the share the scheduler left exposed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import zjax

zjax.simulate_cpu_devices(8)

from zjax.models import Decoder, DecoderConfig, lm_loss  # noqa: E402
from zjax.planner._compile import partitioned_hlo  # noqa: E402
from zjax.planner._flops import step_flops  # noqa: E402
from zjax.planner._hlo import collectives, spanned_axes  # noqa: E402

CFG = DecoderConfig(vocab=256, embed=128, layers=8, heads=4, head_dim=32, mlp=512, max_len=64)
ROWS = 64
GPU_CFG = DecoderConfig(vocab=256, embed=512, layers=16, heads=8, head_dim=64, mlp=2048, max_len=64)


def measure(
    mesh_kw: dict[str, int],
    stage: int,
    pipeline: zjax.Pipeline | None,
    rows: int = ROWS,
    seq: int = CFG.max_len,
    remat: str = CFG.remat,
) -> dict:
    model = Decoder(dataclasses.replace(CFG, remat=remat))
    plan = zjax.Plan(zjax.make_mesh(**mesh_kw), stage=stage, precision="bf16", pipeline=pipeline)
    state = plan.abstract_state(
        lambda r: model.init(r, jnp.zeros((1, CFG.max_len), jnp.int32))["params"], optax.adamw(1e-3), jax.random.key(0)
    )
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    batch = jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32)
    lowered = step.lower(state, batch)
    start = time.perf_counter()
    compiled, hlo = partitioned_hlo(lowered)
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    report = step.memory_report(state, batch, compiled=compiled)
    ops = collectives(hlo)
    pipeline = plan.pipeline  # its gathering mode settled for the stage
    permutes = [c for c in ops if c.kind == "collective-permute" and c.in_loop]
    stages = mesh_kw.get("pp", 1)
    shape = dict(plan.mesh.shape)

    def dp_bytes(kinds: tuple[str, ...]) -> int:  # per device per step, loop trips multiplied out
        return sum(c.volume * c.trips for c in ops if c.kind in kinds and "dp" in spanned_axes(c.groups, shape))

    return {
        "mesh": mesh_kw,
        "batch": [rows, seq],
        "zero_stage": stage,
        "schedule": "none"
        if pipeline is None
        else ("gpipe" if pipeline.repeats == 1 else f"circular R={pipeline.repeats}") + f" M={pipeline.microbatches}",
        "zero3_gather": pipeline.zero3_gather if pipeline is not None else None,
        "remat": remat,
        "bubble": 0.0 if pipeline is None else round(pipeline.bubble(stages), 4),
        "iterations": None if pipeline is None else pipeline.iterations(stages),
        "loop_permutes_fwd_plus_bwd": len(permutes),
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "peak_bytes": report.peak_bytes,
        "dp_gather_bytes": dp_bytes(("all-gather",)),
        "dp_reduce_bytes": dp_bytes(("all-reduce", "reduce-scatter")),
        # weights (and their gradients) exchanged over pp, outside the loop's stage-to-stage permutes: the
        # circular schedule's view of naturally ordered layers as [R, S, Lps]
        "pp_exchange_bytes": sum(
            c.volume * c.trips for c in ops if c.kind != "collective-permute" and "pp" in spanned_axes(c.groups, shape)
        ),
        "compile_seconds": round(seconds, 2),
    }


def measure_gpu(
    target: str, stage: int, pipeline: zjax.Pipeline, rows: int = 32, seq: int = 8, cfg: DecoderConfig = GPU_CFG
) -> dict:
    """One row on the GPU compiler: the planner's deviceless XLA:GPU compile of the train step."""
    (row,) = zjax.planner.estimate(
        cfg,
        mesh={"dp": 2, "pp": 4},
        stages=(stage,),
        batch_size=rows,
        seq_len=seq,
        pipeline=pipeline,
        target=target,
    ).rows
    dp = row.comm.by_axes.get(("dp",), 0)
    mode = pipeline.for_stage(zjax.Stage.from_value(stage)).zero3_gather
    return {
        "target": target,
        "layers": cfg.layers,
        "batch": [rows, seq],
        "zero_stage": stage,
        "zero3_gather": mode,
        "schedule": ("gpipe" if pipeline.repeats == 1 else f"circular R={pipeline.repeats}")
        + f" M={pipeline.microbatches}",
        "state_bytes": row.compiled["state"],
        "temp_bytes": row.compiled["temp"],
        "peak_bytes": row.compiled["total"],
        "dp_bytes": dp,
        "dp_exposed_bytes": dp - row.comm.overlapped_by_axes.get(("dp",), 0),
    }


def gpu_table(target: str) -> list[dict]:
    out = []
    deep = dataclasses.replace(GPU_CFG, layers=32)  # eight repeats of one layer per stage
    head = f"decoder width {GPU_CFG.embed}, {GPU_CFG.num_params:,} params at 16 layers, dp=2 x pp=4, bf16 + AdamW"
    print(f"\nXLA:GPU for {target} (deviceless): {head}")
    print(
        f"{'layers':>6} {'schedule':<18}{'zero':>8}{'state MiB':>11}{'temp MiB':>10}{'peak MiB':>10}{'dp MiB':>9}"
        f"{'exposed':>9}"
    )
    for cfg, m, r in ((GPU_CFG, 4, 1), (GPU_CFG, 8, 4), (deep, 8, 8)):
        for stage, gather in ((1, None), (3, "step"), (3, None)):
            row = measure_gpu(target, stage, zjax.Pipeline(m, repeats=r, zero3_gather=gather), cfg=cfg)
            out.append(row)
            print(
                f"{cfg.layers:>6} {row['schedule']:<18}{row['zero_stage']:>3}/{row['zero3_gather']:<5}"
                f"{row['state_bytes'] / 2**20:>10.1f}{row['temp_bytes'] / 2**20:>10.1f}"
                f"{row['peak_bytes'] / 2**20:>10.1f}"
                f"{row['dp_bytes'] / 2**20:>9.1f}{row['dp_exposed_bytes'] / 2**20:>9.1f}"
            )
    return out


SCHEDULES = (("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zb-v", 2))
SMALL_8 = DecoderConfig(max_len=128, layers=8)  # the small preset, deepened (as the example does) for 2 chunks/stage


def schedule_row(name: str, repeats: int, m_: int, target: str | None) -> dict:
    """One schedule on the example's small preset: compiled bytes, bubble, traffic, CPU step time, GPU temps."""
    import numpy as np

    cfg = SMALL_8
    model = Decoder(cfg)
    schedule = zjax.Pipeline(m_, repeats=repeats, schedule=name)
    plan = zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3, pipeline=schedule)
    init_fn = lambda r: model.init(r, jnp.zeros((1, 128), jnp.int32))["params"]  # noqa: E731
    state = plan.init(init_fn, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    rows = 2 * 2 * m_  # two sequences per microbatch and dp rank
    tokens = np.random.RandomState(0).randint(0, cfg.vocab, (rows, 129)).astype(np.int32)
    batch = plan.shard_batch(tokens)
    compiled, hlo = partitioned_hlo(step.lower(state, batch))
    report = step.memory_report(state, batch, compiled=compiled)
    shape = dict(plan.mesh.shape)
    table = schedule.table(4)
    share = m_ * repeats / table.ticks if schedule.tabled else 0.0
    ops = collectives(hlo, share)  # each action of the tick loop on its share of the ticks

    def axis_bytes(axis: str) -> int:
        return round(sum(c.volume * c.trips for c in ops if axis in spanned_axes(c.groups, shape)))

    flops, actions = step_flops(hlo, share, 1 / (4 * repeats))  # the tick loop's actions weighed by their ticks
    in_time = table.bubble_time(actions) if actions else table.idle() / table.ticks  # GPipe: iterations alike
    times = []
    for _ in range(3):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    row = {
        "schedule": name,
        "repeats": repeats,
        "microbatches": m_,
        "bubble": round(schedule.bubble(4), 4),
        "ticks": schedule.table(4).ticks,
        "in_flight_max": int(max(schedule.table(4).in_flight())),
        "bubble_time": round(float(max(in_time)), 4),
        "flops_per_step": flops,
        "action_flops": actions,
        "temp_bytes": report.temp_bytes,
        "peak_bytes": report.peak_bytes,
        "dp_bytes": axis_bytes("dp"),
        "pp_bytes": axis_bytes("pp"),
        "cpu_step_seconds": round(sorted(times)[1], 3),
        "loss": float(metrics["loss"]),
    }
    if target is not None:
        (gpu,) = zjax.planner.estimate(
            cfg, mesh={"dp": 2, "pp": 4}, stages=(3,), batch_size=rows, seq_len=128, pipeline=schedule, target=target
        ).rows
        row |= {"gpu_target": target, "gpu_temp_bytes": gpu.compiled["temp"], "gpu_peak_bytes": gpu.compiled["total"]}
    return row


def schedules_table(target: str | None) -> list[dict]:
    out = []
    print(f"schedules: small preset at 8 layers ({SMALL_8.num_params:,} params), dp=2 x pp=4, ZeRO-3, bf16, "
          "2 x 128 tokens per microbatch")  # fmt: skip
    head = f"{'schedule':<22}{'M':>4}{'bubble':>8}{'ticks':>6}{'in flight':>10}{'temp MiB':>10}{'peak MiB':>10}"
    head += f"{'dp MiB':>8}{'pp MiB':>8}{'GFLOP':>7}{'time bubble':>12}{'CPU s':>7}"
    head += f"{'GPU temp MiB':>14}" if target else ""
    print(head)
    for name, repeats in SCHEDULES:
        for m_ in (8, 32):
            r = schedule_row(name, repeats, m_, target)
            out.append(r)
            label = name + (f" R={repeats}" if repeats > 1 else "")
            print(
                f"{label:<22}{m_:>4}{r['bubble']:>8.1%}{r['ticks']:>6}{r['in_flight_max']:>10}"
                f"{r['temp_bytes'] / 2**20:>10.2f}{r['peak_bytes'] / 2**20:>10.2f}{r['dp_bytes'] / 2**20:>8.2f}"
                f"{r['pp_bytes'] / 2**20:>8.2f}{r['flops_per_step'] / 1e9:>7.2f}{r['bubble_time']:>12.1%}"
                f"{r['cpu_step_seconds']:>7.2f}" + (f"{r['gpu_temp_bytes'] / 2**20:>14.2f}" if target else "")
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--gpu-target", default=None, help="also compile for this GPU target (e.g. h100)")
    parser.add_argument("--schedules-only", action="store_true", help="only the table per schedule")
    args = parser.parse_args()
    schedule_rows = schedules_table(args.gpu_target)
    if args.schedules_only:
        if args.json is not None:
            zjax.write_json_atomic(args.json, {"schedules": schedule_rows})
            print(f"written to {args.json}")
        return
    rows = [measure({"dp": 8}, 1, None), measure({"dp": 8}, 3, None)]
    for stage, gather in ((1, None), (2, None), (3, "step"), (3, None)):  # None: the plan's default for the stage
        for m, r in ((4, 1), (8, 1), (32, 1), (4, 2), (8, 2)):
            rows.append(measure({"dp": 2, "pp": 4}, stage, zjax.Pipeline(m, repeats=r, zero3_gather=gather)))
    # weights outweigh activations (short sequences): where gathering per use pays off
    for stage, gather in ((1, None), (2, None), (3, "step"), (3, None)):
        for m, r in ((4, 1), (8, 2)):
            rows.append(measure({"dp": 2, "pp": 4}, stage, zjax.Pipeline(m, repeats=r, zero3_gather=gather), 32, 8))
    # the model's remat policy applies to each stage's layer scan, as without a pipeline
    for remat in ("none", "full"):
        rows.append(measure({"dp": 8}, 3, None, remat=remat))
        rows.append(measure({"dp": 2, "pp": 4}, 3, zjax.Pipeline(4), remat=remat))
    print(f"decoder {CFG.layers} layers, {CFG.num_params:,} params, bf16 + AdamW")
    head = f"{'batch':<7}{'mesh':<12}{'zero':>7}{'remat':>6}  {'schedule':<18}{'bubble':>7}{'permutes':>9}"
    head += f"{'args KiB':>10}{'temp KiB':>10}{'peak KiB':>10}{'AG dp KiB':>10}{'RED dp KiB':>11}{'pp xchg KiB':>12}"
    print(head + f"{'compile':>9}")
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        zero = f"{r['zero_stage']}" + (f"/{r['zero3_gather']}" if r["zero3_gather"] else "")
        print(
            f"{'x'.join(map(str, r['batch'])):<7}{mesh:<12}{zero:>7}{r['remat']:>6}  {r['schedule']:<18}"
            f"{r['bubble']:>7.3f}"
            f"{r['loop_permutes_fwd_plus_bwd']:>9}"
            f"{r['argument_bytes'] / 1024:>10.1f}{r['temp_bytes'] / 1024:>10.1f}{r['peak_bytes'] / 1024:>10.1f}"
            f"{r['dp_gather_bytes'] / 1024:>10.1f}{r['dp_reduce_bytes'] / 1024:>11.1f}"
            f"{r['pp_exchange_bytes'] / 1024:>12.1f}{r['compile_seconds']:>8.1f}s"
        )
    gpu_rows = gpu_table(args.gpu_target) if args.gpu_target else []
    if args.json is not None:
        zjax.write_json_atomic(
            args.json,
            {"schedules": schedule_rows, "model": CFG.__dict__, "rows": rows, "gpu_model": GPU_CFG.__dict__,
             "gpu_rows": gpu_rows},
        )  # fmt: skip
        print(f"written to {args.json}")


if __name__ == "__main__":
    main()

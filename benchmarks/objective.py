"""One objective on every path: the loss and gradients of one step, by each way zjax can reduce them.

    python benchmarks/objective.py [--json runs/objective.json]

The example's ``small`` decoder on 8 simulated CPU devices, one batch of 32 rows whose rows score different numbers
of tokens (a ``loss_mask``) and half of which hold two packed documents. Each setting's gradients come from
``step.grads`` (what the step would apply); they are compared with ``jax.grad`` of ``lm_loss``'s mean over the
whole batch in one plain ``jax.jit`` on one device (fp32). Before the one-objective change these settings
disagreed whenever ranks or microbatches held different numbers of tokens (``docs/concepts/objective.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zjax

jax.config.update("jax_platforms", "cpu")
zjax.simulate_cpu_devices(8)

from zjax.models import PRESETS, Decoder, lm_loss  # noqa: E402

CFG = dataclasses.replace(PRESETS["small"], max_len=32)
ROWS = 32
SETTINGS = {  # name -> (mesh, plan options, accumulation)
    "bf16, stage 2": ({"dp": 8}, {"stage": 2, "precision": "bf16"}, 1),
    "bf16, stage 2, reduce_dtype=float32": ({"dp": 8}, {"stage": 2, "precision": "bf16", "reduce_dtype": "float32"}, 1),
    "bf16, stage 3, quantized_comm=grads": ({"dp": 8}, {"stage": 3, "precision": "bf16", "quantized_comm": "grads"}, 1),
    "fp32, stage 0": ({"dp": 8}, {"stage": 0, "precision": "fp32"}, 1),
    "fp32, stage 0, accum_steps=2": ({"dp": 8}, {"stage": 0, "precision": "fp32"}, 2),
    "fp32, stage 3": ({"dp": 8}, {"stage": 3, "precision": "fp32"}, 1),
    "fp32, stage 3, dp=2 x cp=4": ({"dp": 2, "cp": 4}, {"stage": 3, "precision": "fp32"}, 1),
}
LADDER = (1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 6e-2, 1e-1, 1.0, float("inf"))


def batch() -> dict[str, np.ndarray]:
    """Uneven masks (row i scores 1 + 5i mod S+1 targets) and packed rows (every other row two documents)."""
    rs = np.random.RandomState(0)
    width = CFG.max_len + 1
    tokens = rs.randint(0, CFG.vocab, (ROWS, width)).astype(np.int32)
    scored = 1 + (5 * np.arange(ROWS)[:, None]) % width
    mask = (np.arange(width)[None] < scored).astype(np.float32)
    cut = np.where(np.arange(ROWS) % 2 == 0, 4 + np.arange(ROWS) % (width - 8), width)[:, None]
    at = np.arange(width)[None]
    return {"tokens": tokens, "loss_mask": mask, "segment_ids": (1 + (at >= cut)).astype(np.int32),
            "positions": np.where(at >= cut, at - cut, at).astype(np.int32)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    model, data = Decoder(CFG), batch()
    init = lambda rng: model.init(rng, jnp.zeros((1, CFG.max_len), jnp.int32))["params"]  # noqa: E731
    one = jax.devices()[0]
    loss, want = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(model, p, b).mean))(
        jax.device_put(jax.jit(init)(jax.random.key(0)), one), jax.device_put(data, one)
    )
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])  # noqa: E731
    want = flat(want)
    rows = [{"setting": "one device (jax.grad)", "loss": float(loss), "count": None, "relative": 0.0}]
    for name, (mesh, options, accum) in SETTINGS.items():
        plan = zjax.Plan(zjax.make_mesh(**mesh), **options)
        state = plan.init(init, optax.sgd(1.0), jax.random.key(0))
        grads, metrics = plan.train_step(lambda p, b: lm_loss(model, p, b), accum).grads(state, plan.shard_batch(data))
        relative = float(np.linalg.norm(flat(grads) - want) / np.linalg.norm(want))
        rows.append({"setting": name, "loss": float(metrics["loss"]), "count": float(metrics["count"]),
                     "relative": relative})  # fmt: skip
    print(f"small decoder, {ROWS} rows x {CFG.max_len} tokens, uneven masks and packed rows; 8 simulated devices")
    print(f"{'setting':40s} {'loss':>7s} {'tokens':>6s}  gradient vs one device")
    for r in rows:
        bound = next(b for b in LADDER if r["relative"] < b) if r["relative"] else None
        count = "" if r["count"] is None else f"{r['count']:.0f}"
        print(f"{r['setting']:40s} {r['loss']:7.4f} {count:>6s}  {'(reference)' if bound is None else f'< {bound:g}'}")
    if args.json:
        zjax.write_json_atomic(args.json, {"config": dataclasses.asdict(CFG), "rows": rows})


if __name__ == "__main__":
    main()

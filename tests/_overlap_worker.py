"""A step whose collectives overlap, run many times on 8 simulated CPU devices (tests/test_cpu_simulation.py).

``python -m tests._overlap_worker STEPS``: the tiny decoder at ZeRO stage 3 in bf16 with packed rows, so each
device runs the layer scan's weight all-gathers beside the gradient all-reduces outside the loop, with steps
dispatched ahead of the host. With XLA:CPU's default pool (8 threads for 8 devices on a 2-core machine) this
deadlocked in rendezvous in 3 of 3 runs within 40 steps; it prints ``finished`` when all steps ran.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zjax
from zjax.models import PRESETS, Decoder, lm_loss

jax.config.update("jax_platforms", "cpu")
zjax.simulate_cpu_devices(8)

steps, seq, rows = int(sys.argv[1]), 64, 16
model = Decoder(PRESETS["tiny"])
plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16", clip_norm=1.0)
state = plan.init(
    lambda r: model.init(r, jnp.zeros((1, seq), jnp.int32))["params"], optax.adamw(1e-3), jax.random.key(0)
)
step = plan.train_step(lambda p, b: lm_loss(model, p, b))
rs = np.random.RandomState(0)
segments = np.where(np.arange(seq + 1) < seq // 2, 1, 2).astype(np.int32)  # two documents per row
positions = np.concatenate([np.arange(seq // 2), np.arange(seq + 1 - seq // 2)]).astype(np.int32)
batch = {
    "tokens": rs.randint(0, model.cfg.vocab, (rows, seq + 1)).astype(np.int32),
    "segment_ids": np.tile(segments, (rows, 1)),
    "positions": np.tile(positions, (rows, 1)),
}
losses = []
for i in range(steps):
    state, metrics = step(state, plan.shard_batch(batch))  # dispatched ahead: the host syncs every 10 steps
    losses.append(metrics["loss"])
    if i % 10 == 9:
        jax.block_until_ready(metrics["loss"])
print("finished", steps, float(losses[-1]), flush=True)

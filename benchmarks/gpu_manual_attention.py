"""One GPU: stage-3 steps whose gradients zjax reduces itself (qgZ, ``reduce_dtype``: a region manual over the data
axes) run cuDNN's fused attention and train like the bf16 step. Prints and writes the losses of three steps and
the count of cuDNN attention calls in each compiled program.

    python benchmarks/gpu_manual_attention.py [--json runs/gpu_manual_attention_h200.json]

``gpu_overlap=False``: jax 0.11 has no longer two of zjax's XLA:GPU options (``zjax.core._overlap``).
"""

import argparse
import json
from pathlib import Path

import jax
import optax

import zjax
from zjax.models import Decoder, DecoderConfig, lm_loss

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--json", type=Path, default=None)
args = parser.parse_args()
cfg = DecoderConfig(vocab=512, embed=256, layers=2, heads=4, head_dim=64, mlp=512, max_len=128)
model = Decoder(cfg)
tokens = jax.random.randint(jax.random.key(1), (4, cfg.max_len + 1), 0, cfg.vocab)
out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
for name, kw in (("bf16", {}), ("qgz", {"quantized_comm": "grads"}), ("fp32_reduce", {"reduce_dtype": "float32"})):
    plan = zjax.Plan(zjax.make_mesh(dp=1), stage=3, gpu_overlap=False, **kw)
    state = plan.init(lambda r: model.init(r, tokens[:1, :-1])["params"], optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    batch = plan.shard_batch(tokens)
    text = step.lower(state, batch).compile().as_text()
    losses = []
    for _ in range(3):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    out[name] = {"losses": losses, "cudnn_fmha": text.count("__cudnn$fmha")}
print(json.dumps(out, indent=1))
if args.json is not None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")

"""The one-device objective, and one step of any plan measured against it.

The reference is ``jax.grad`` of :func:`zjax.models.lm_loss`'s mean over the whole batch, in one plain ``jax.jit``
on one device: no mesh, no plan, no zjax step. A plan's step is run once with SGD at learning rate 1 written as
``trace(decay=0)`` then ``scale(-1)``: its optimizer state then holds the very gradient the step applied, in fp32
(reading it back as the difference of the weights would lose digits where weights are much larger than their
gradients, as an embedding's are). The batches have uneven loss masks (each
row scores a different number of tokens) and packed rows (two documents in some rows), what real data has.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zjax
from zjax.models import Decoder, DecoderConfig, lm_loss

from ._models import TINY


def uneven_batch(rows: int, cfg: DecoderConfig = TINY, seed: int = 0, packed: bool = True) -> dict[str, np.ndarray]:
    """Tokens ``[rows, S+1]`` whose rows score 1 to S+1 tokens (``loss_mask``), and with ``packed`` every other row
    two documents (``segment_ids`` 1 then 2, ``positions`` restarting at the cut)."""
    rs = np.random.RandomState(seed)
    width = cfg.max_len + 1
    tokens = rs.randint(0, cfg.vocab, (rows, width)).astype(np.int32)
    mask = np.zeros((rows, width), np.float32)
    for i in range(rows):
        mask[i, : 1 + (7 * i + seed) % width] = 1.0
    batch = {"tokens": tokens, "loss_mask": mask}
    if packed:
        segments = np.ones((rows, width), np.int32)
        positions = np.tile(np.arange(width, dtype=np.int32), (rows, 1))
        for i in range(0, rows, 2):
            cut = 3 + (i + seed) % (width - 5)
            segments[i, cut:] = 2
            positions[i, cut:] = np.arange(width - cut)
        batch |= {"segment_ids": segments, "positions": positions}
    return batch


def init_fn(cfg: DecoderConfig = TINY):
    model = Decoder(cfg)
    return lambda rng: model.init(rng, jnp.zeros((1, cfg.max_len), jnp.int32))["params"]


@functools.cache
def initial(cfg: DecoderConfig, seed: int = 0) -> Any:
    """The model's initial parameters (one device, on the host): every case starts from them (``plan.init``'s
    ``params``, which places them without compiling the model's initialization again)."""
    return nn.unbox(jax.device_get(jax.jit(init_fn(cfg))(jax.random.key(seed))))


def reference(cfg: DecoderConfig, batch: dict[str, np.ndarray], seed: int = 0) -> tuple[float, Any]:
    """``(loss, grads)`` of the whole batch's mean token loss on one device, in float64 on the host."""
    model = Decoder(cfg)
    device = jax.devices()[0]
    params = jax.device_put(initial(cfg, seed), device)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(model, p, b).mean))(
        params, jax.device_put(batch, device)
    )
    return float(loss), _host(grads)


SGD = optax.chain(optax.trace(decay=0.0), optax.scale(-1.0))
"""SGD at learning rate 1 whose state is the last gradient it applied."""


def applied(plan: zjax.Plan, cfg: DecoderConfig, batch: Any, accum: int = 1, seed: int = 0) -> tuple[Any, dict]:
    """The gradient one SGD step (learning rate 1) of ``plan`` applied, in float64 on the host, and its metrics."""
    model = Decoder(cfg)
    state = plan.init(init_fn(cfg), SGD, jax.random.key(seed), params=initial(cfg, seed))
    weights = lambda s: s.master_params if plan.keeps_master else s.params  # noqa: E731 - the fp32 weights
    before = _host(weights(state))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b), accum_steps=accum)
    state, metrics = step(state, plan.shard_batch(batch))
    grads, after = _host(state.opt_state.inner[0].trace), _host(weights(state))
    for b, a, g in zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(grads), strict=True):
        # the weights moved by that gradient, to the rounding of the fp32 subtraction
        assert np.all(np.abs((b - a) - g) <= 2.0**-23 * (np.abs(b) + np.abs(a)) + 1e-30)
    return grads, jax.device_get(metrics)


def relative(got: Any, want: Any) -> float:
    """The larger of the whole tree's and the worst leaf's relative norm difference."""
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    whole = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in pairs)) / np.sqrt(sum(np.sum(b**2) for _, b in pairs))
    worst = max(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30) for a, b in pairs)
    return float(max(whole, worst))


def _host(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float64), tree)

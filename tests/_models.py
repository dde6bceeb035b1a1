"""Small models and a training loop shared by the tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zjax
from zjax.models import Decoder, DecoderConfig, lm_loss

MP_CONFIGS = {"stage0": (8, 0), "stage1": (8, 1), "stage2": (8, 2), "stage3": (8, 3), "hsdp3": ((2, 4), 3)}
"""Configurations trained by 2 processes x 4 devices and by 1 x 8 (tests/test_multiprocess.py): name -> (dp, stage)."""
MP_STEPS, MP_ROWS = 4, 256
MP_TX = optax.adamw(1e-3)

TINY = DecoderConfig(vocab=64, embed=64, layers=2, heads=4, head_dim=16, mlp=128, max_len=16)


def _logical(init, names):
    return nn.with_logical_partitioning(init, names)


class LinenMLP(nn.Module):
    hidden: int = 128
    out: int = 32

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(
            self.hidden,
            kernel_init=_logical(nn.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=_logical(nn.initializers.zeros, ("mlp",)),
        )(x)
        x = nn.gelu(x)
        return nn.Dense(self.out, kernel_init=_logical(nn.initializers.lecun_normal(), ("mlp", "embed")))(x)


class NnxMLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(din, hidden, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(hidden, dout, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def regression_batch(n: int = 32, din: int = 32, dout: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    x = rs.randn(n, din).astype(np.float32)
    w = (rs.randn(din, dout) / np.sqrt(din)).astype(np.float32)
    return {"x": x, "y": np.tanh(x @ w).astype(np.float32)}


def mse(pred, y):
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def linen_mlp_task(din: int = 32):
    model = LinenMLP()
    x0 = jnp.zeros((1, din))

    def init_fn(rng):
        return model.init(rng, x0)["params"]

    def loss_fn(params, batch):
        dtype = jax.tree.leaves(params)[0].dtype
        return mse(model.apply({"params": params}, batch["x"].astype(dtype)), batch["y"])

    return init_fn, loss_fn


def nnx_mlp_task(din: int = 32):
    # zjax places parameters itself: annotated nnx variables must not shard eagerly on their own.
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: NnxMLP(din, 128, 32, nnx.Rngs(0))))

    def init_fn(rng):
        return nnx.split(NnxMLP(din, 128, 32, nnx.Rngs(rng)), nnx.Param)[1]

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        dtype = jax.tree.leaves(params)[0].dtype
        return mse(model(batch["x"].astype(dtype)), batch["y"])

    return init_fn, loss_fn


def decoder_task(cfg: DecoderConfig = TINY):
    model = Decoder(cfg)
    dummy = jnp.zeros((1, cfg.max_len), jnp.int32)
    return (lambda r: model.init(r, dummy)["params"]), (lambda p, b: lm_loss(model, p, b))


def token_batch(n: int = 16, cfg: DecoderConfig = TINY, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, cfg.vocab, size=(n, cfg.max_len + 1)).astype(np.int32)


def train(task, batches, *, stage, mesh=None, precision="fp32", tx=None, accum=1, seed=0, **plan_kw):
    """Run len(batches) steps; returns (losses, final state, plan)."""
    init_fn, loss_fn = task
    mesh = zjax.make_mesh(dp=-1) if mesh is None else mesh
    plan = zjax.Plan(mesh, stage=stage, precision=precision, **plan_kw)
    state = plan.init(init_fn, optax.adam(1e-2) if tx is None else tx, jax.random.key(seed))
    step = plan.train_step(loss_fn, accum_steps=accum)
    losses = []
    for batch in batches:
        state, metrics = step(state, plan.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    return losses, state, plan


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float64), tree)


def rel_norm_diff(a, b) -> float:
    la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
    num = np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(la, lb, strict=True)))
    den = np.sqrt(sum(np.sum(y**2) for y in lb))
    return float(num / den)


class LinenCNN(nn.Module):
    """Conv + BatchNorm + Dropout: a linen model with a mutable collection (batch_stats) and dropout.

    The convolution has no bias, as in real CNNs: BatchNorm subtracts the batch mean, so a bias before it has a
    gradient that is zero in exact arithmetic and only rounding noise in fp32, which Adam divides by its own
    tiny second moment into a full-size step whose sign the CPU's reduction order (AVX2, AVX-512, NEON) decides.
    """

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
        return nn.Dense(8)(x.mean(axis=(1, 2)))


def cnn_task():
    """init_fn -> zjax.Variables (params + batch_stats); loss_fn(params, batch, model_state, rng)."""
    model = LinenCNN()

    def init_fn(rng):
        return zjax.Variables.linen(model.init(rng, jnp.zeros((1, 8, 8, 3)), train=False))

    def loss_fn(params, batch, model_state, rng):
        logits, updates = model.apply(
            {"params": params, **model_state}, batch["x"], rngs={"dropout": rng}, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"]).mean()
        return loss, updates

    return init_fn, loss_fn


def image_batch(n: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {"x": rs.randn(n, 8, 8, 3).astype(np.float32), "y": rs.randint(0, 8, (n,)).astype(np.int32)}


class NnxNormDrop(nnx.Module):
    """Linear + BatchNorm + Dropout in nnx: BatchNorm statistics and the dropout RNG are not nnx.Param."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(32, 64, use_bias=False, rngs=rngs)  # no bias before BatchNorm (see LinenCNN)
        self.norm = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(nnx.relu(self.norm(self.up(x)))))


def nnx_norm_drop_task():
    """The docs' nnx recipe (docs/howto/flax_models.md) for a module with model state."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: NnxNormDrop(nnx.Rngs(0))))

    def init_fn(rng):
        return zjax.Variables.nnx(NnxNormDrop(nnx.Rngs(rng)))

    def loss_fn(params, batch, model_state):
        model = nnx.merge(graphdef, params, model_state)
        loss = mse(model(batch["x"]), batch["y"])
        return loss, nnx.state(model, nnx.Not(nnx.Param))

    return init_fn, loss_fn

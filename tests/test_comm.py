"""Quantized weight gathers (qwZ): int8 blocks on the wire, straight-through gradients, the step's bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from zjax import comm
from zjax.models import Decoder, DecoderConfig, lm_loss
from zjax.planner._hlo import collectives, partitioned_hlo
from zjax.sharding._annotations import Leaf
from zjax.stages._layout import Placement


@pytest.mark.parametrize("block", [4, 64, 256])
def test_a_block_round_trips_within_half_a_step(block):
    rs = np.random.RandomState(block)
    x = jnp.asarray(rs.randn(6, 512) * rs.lognormal(size=(6, 1)), jnp.float32)
    q, scale = comm.quantize(x, block)
    assert q.dtype == jnp.int8 and scale.shape == (6, 512 // block)
    back = comm.dequantize(q, scale, jnp.float32)
    amax = np.abs(np.asarray(x).reshape(6, -1, block)).max(-1)
    err = np.abs(np.asarray(back - x)).reshape(6, -1, block).max(-1)
    assert np.all(err <= amax / 254 * (1 + 1e-6))  # half of one step amax / 127
    on_grid = comm.dequantize(q, scale, jnp.float32)  # values on the grid come back (up to the scale's rounding)
    np.testing.assert_allclose(comm.dequantize(*comm.quantize(on_grid, block), jnp.float32), on_grid, rtol=1e-6)
    # a block that does not divide the dim takes the whole dim; zeros stay zeros
    q, scale = comm.quantize(jnp.zeros((3, 10)), 4)
    assert scale.shape == (3, 1) and not np.any(np.asarray(q))


def test_gathered_is_int8_per_shard_and_its_gradient_goes_straight_through():
    """On dp=8, a weight split over dp on dim 1: the gathered value is each shard quantized on its own and put
    together, and the gradient of sum(gathered * c) is c, reduce-scattered once (not 8c)."""
    mesh = zjax.make_mesh(dp=8)
    rs = np.random.RandomState(0)
    w = rs.randn(16, 64).astype(np.float32)
    c = rs.randn(16, 64).astype(np.float32)
    placement = Placement(Leaf("w", (16, 64), jnp.float32, None), P(), P(None, "dp"), None)

    def f(w, c):
        with comm.use([placement], block=4):
            return jnp.sum(comm.gathered(w, ("w",)) * c)

    shards = [comm.dequantize(*comm.quantize(jnp.asarray(s), 4), jnp.float32) for s in np.split(w, 8, axis=1)]
    expected = float(np.sum(np.concatenate([np.asarray(s) for s in shards], axis=1) * c))
    with jax.set_mesh(mesh):
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "dp")))
        value, grad = jax.jit(jax.value_and_grad(f))(ws, c)
        lowered = jax.jit(jax.value_and_grad(f)).lower(ws, c)
    np.testing.assert_allclose(float(value), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), c, rtol=1e-6)
    _, hlo = partitioned_hlo(lowered)
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert gathers and all("s8[16,64]" in g or "f32[16,16]" in g for g in gathers)  # the int8 values and their scales


CFG = DecoderConfig(vocab=256, embed=128, layers=2, heads=4, head_dim=32, mlp=512, max_len=32)


def step_of(quantized: str | None, precision: str = "bf16"):
    model = Decoder(CFG)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision=precision, quantized_comm=quantized)
    state = plan.init(
        lambda r: model.init(r, jnp.zeros((1, 32), jnp.int32))["params"], optax.adamw(1e-3), jax.random.key(0)
    )
    return plan, state, plan.train_step(lambda p, b: lm_loss(model, p, b))


def test_the_step_gathers_int8_for_half_the_bytes_and_trains_like_bf16():
    tokens = np.random.RandomState(0).randint(0, CFG.vocab, (16, 33)).astype(np.int32)
    runs = {}
    for quantized in (None, "weights"):
        plan, state, step = step_of(quantized)
        batch = plan.shard_batch(tokens)
        _, hlo = partitioned_hlo(step.lower(state, batch))
        ops = collectives(hlo)
        gathered = sum(c.volume * c.trips for c in ops if c.kind == "all-gather")
        reduced = sum(c.volume * c.trips for c in ops if c.kind == "reduce-scatter")
        dtypes = {line.split("=")[1].split("[")[0].strip() for line in hlo.splitlines() if " all-gather(" in line}
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[quantized] = (gathered, reduced, dtypes, losses)
    plain, quant = runs[None], runs["weights"]
    assert "s8" in quant[2] and "s8" not in plain[2]
    assert quant[0] <= 0.55 * plain[0]  # int8 values + fp32 scales per 256 elements against bf16
    assert quant[1] == plain[1]  # gradients reduce as before, in bf16
    # weights within amax/254 per block: the loss moves by far less than training does
    np.testing.assert_allclose(quant[3], plain[3], rtol=2e-3)
    assert quant[3][-1] < quant[3][0]


def test_quantized_comm_needs_stage_3_without_a_pipeline():
    with pytest.raises(ValueError, match=r"quantized_comm='weights' quantizes ZeRO-3's weight gathers: .*stage 1"):
        zjax.Plan(zjax.make_mesh(dp=8), stage=1, quantized_comm="weights")
    with pytest.raises(ValueError, match=r"quantized_comm='grads'; use one of \('weights',\)"):
        zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm="grads")
    with pytest.raises(ValueError, match=r"a pipeline"):
        zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3, quantized_comm="weights", pipeline=zjax.Pipeline(4))

"""A tied embedding's gradient crosses the data axes once, as ZeRO counts it (2 psi at stages 0-2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from zjax.models import Decoder, DecoderConfig, lm_loss
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives

TIED = DecoderConfig(vocab=4096, embed=256, layers=2, heads=4, head_dim=64, mlp=512, max_len=32, tie_embeddings=True)


def compiled(stage: int, cfg: DecoderConfig = TIED):
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=stage)
    init_fn = lambda r: model.init(r, jnp.zeros((1, 32), jnp.int32))["params"]  # noqa: E731
    state = plan.abstract_state(init_fn, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    return partitioned_hlo(step.lower(state, jax.ShapeDtypeStruct((8, 33), jnp.int32)))


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_the_tables_gradient_crosses_dp_once(stage):
    """Used by the lookup and by the head, the table's gradient has two contributions; reduced one by one (what
    GSPMD does with a parameter used twice) the table crosses dp twice: 2.43 psi for Llama-3.2-1B at stage 0,
    2.89 psi for this model (measured before the per-rank copies)."""
    if stage == 0:  # one all-reduce of the whole table, in the compute dtype
        table_bytes = TIED.vocab * TIED.embed * 2  # bf16
        reductions = [c for c in collectives(compiled(stage)[1]) if c.kind in ("all-reduce", "reduce-scatter")]
        assert [c.bytes for c in reductions if c.bytes >= table_bytes] == [table_bytes]
    est = zjax.planner.estimate(TIED, mesh={"dp": 8}, stages=(stage,), batch_size=8, seq_len=32)
    assert est.rows[0].comm_psi == pytest.approx(2.0, abs=0.01)


@pytest.mark.slow  # the fast test above holds the table's gradient to one reduction; this one its numbers
def test_the_per_rank_tied_loss_equals_the_plain_one():
    """fp32: the per-rank copies change where the gradient is summed, not the loss or the gradient."""
    model = Decoder(TIED)
    tokens = np.random.RandomState(0).randint(0, TIED.vocab, (16, 33)).astype(np.int32)
    params = model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))["params"]
    plain = jax.jit(jax.value_and_grad(lambda p, t: lm_loss(model, p, t).mean))(params, tokens)
    mesh = zjax.make_mesh(dp=8)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(tokens, NamedSharding(mesh, P("dp")))
        ranked = jax.jit(jax.value_and_grad(lambda p, t: lm_loss(model, p, t).mean))(params, sharded)
    np.testing.assert_allclose(ranked[0], plain[0], rtol=1e-6)
    for got, want in zip(jax.tree.leaves(ranked[1]), jax.tree.leaves(plain[1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

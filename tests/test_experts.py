"""Mixture of experts: the ep axis, dropless grouped experts, the router, capacity, and MoE decoders on every mesh."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax import experts
from zjax.experts import _dispatch
from zjax.models import Decoder, DecoderConfig, MoE, MoELayer, lm_loss

E, D, F, K = 8, 16, 32, 2
TINY = DecoderConfig(
    vocab=128, embed=32, layers=2, heads=2, head_dim=16, mlp=64, max_len=16, moe=MoE(experts=8, z_loss_weight=1e-3)
)


def _inputs(b=8, s=6, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (b, s, D))
    gates, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (b, s, E))), K)
    w = [jax.random.normal(k, shape) * 0.2 for k, shape in zip(ks[2:], [(E, D, F), (E, D, F), (E, F, D)], strict=True)]
    return x, ids, gates, w


def _dense_reference(x, ids, gates, wg, wu, wd):
    """Every expert on every token, then the chosen ones weighted: what the grouped path must equal."""
    y = jnp.einsum(
        "bsef,efd->bsed", jax.nn.silu(jnp.einsum("bsd,edf->bsef", x, wg)) * jnp.einsum("bsd,edf->bsef", x, wu), wd
    )
    return jnp.einsum("bsed,bske->bsd", y, jax.nn.one_hot(ids, wg.shape[0]) * gates[..., None])


def _loss(x, gates, wg, wu, wd, ids):
    out, _ = experts.expert_mlp(x, ids, gates, wg, wu, wd)
    return jnp.sum(out * out)


MESHES = [
    # (no dp=8 or dp=2 x ep=4: the dp x ep x tp mesh below and the ragged exchange's ep=4 test cover them)
    pytest.param({"dp": 1, "ep": 8}, marks=pytest.mark.slow),
    {"dp": 2, "ep": 2, "tp": 2},
    pytest.param({"dp": 2, "ep": 2, "cp": 2}, marks=pytest.mark.slow),
]


def test_grouped_experts_equal_every_expert_on_every_token():
    x, ids, gates, w = _inputs()
    out, dropped = experts.expert_mlp(x, ids, gates, *w)
    np.testing.assert_allclose(out, _dense_reference(x, ids, gates, *w), rtol=1e-5, atol=1e-5)
    assert float(dropped) == 0.0


@pytest.mark.parametrize("mesh_axes", MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_every_mesh_gives_the_same_outputs_and_gradients(mesh_axes):
    """Experts split over ep (rows sent by all-to-all), their hidden dim over tp, tokens over dp and cp."""
    x, ids, gates, w = _inputs()
    grad = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3, 4))
    want = grad(x, gates, *w, ids)
    mesh = zjax.make_mesh(**mesh_axes)
    with jax.set_mesh(mesh), nn.logical_axis_rules(zjax.Rules().activations_for(mesh)):
        got = jax.jit(grad)(x, gates, *w, ids)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_capacity_drops_the_later_rows_of_a_full_expert_and_counts_them():
    """8 tokens, top-1 of 2 experts, factor 1: capacity ceil(1 x 8 x 1 / 2) = 4 rows per expert. Expert 0 is
    chosen by tokens 0-5: tokens 4 and 5 are dropped (zero output), tokens 0-3 and 6-7 computed."""
    x, _, _, (wg, wu, wd) = _inputs(b=1, s=8)
    wg, wu, wd = wg[:2], wu[:2], wd[:2]
    ids = jnp.array([[[0], [0], [0], [0], [0], [0], [1], [1]]])
    gates = jnp.ones((1, 8, 1))
    assert experts.capacity(8, 1, 2, 1.0) == 4
    out, dropped = experts.expert_mlp(x, ids, gates, wg, wu, wd, capacity_factor=1.0)
    assert float(dropped) == 2.0
    want = _dense_reference(x, ids, gates, wg, wu, wd)
    np.testing.assert_allclose(out[0, [0, 1, 2, 3, 6, 7]], want[0, [0, 1, 2, 3, 6, 7]], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(out[0, 4:6]).max()) == 0.0


def test_dropped_rows_are_summed_over_the_devices():
    """Capacity is per device's tokens (GShard's groups): on dp=8 each device holds one row of 6 tokens."""
    x, ids, gates, w = _inputs()
    per_row = sum(
        float(experts.expert_mlp(x[i : i + 1], ids[i : i + 1], gates[i : i + 1], *w, capacity_factor=0.5)[1])
        for i in range(8)
    )
    mesh = zjax.make_mesh(dp=2, ep=4)
    with jax.set_mesh(mesh), nn.logical_axis_rules(zjax.Rules().activations_for(mesh)):
        _, dropped = jax.jit(lambda *a: experts.expert_mlp(*a, capacity_factor=0.5))(x, ids, gates, *w)
    assert per_row > 0 and float(dropped) == per_row


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` built from a dense all-to-all (XLA:CPU has no ragged one): each rank's
    slice for rank r, padded to the operand's length, travels with its size and offset.

    What the real collective requires is checked, and a violation poisons the output (NaN; the smallest int for
    ids; a traced program cannot raise): each sender's slices lie inside its operand; each receiver expects
    (``recv_sizes``) exactly the sizes its senders send; the slices land inside the output without overlapping."""
    n, ep = operand.shape[0], send_sizes.shape[0]
    i = jnp.arange(n)
    taken = jnp.take(operand, jnp.clip(input_offsets[:, None] + i, 0, n - 1), axis=0)
    inside = (i < send_sizes[:, None]).reshape(ep, n, *([1] * (operand.ndim - 1)))
    chunks = jnp.where(inside, taken, 0)  # [ep, n, ...]
    swap = lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)  # noqa: E731
    chunks, sizes, offsets = swap(chunks), swap(send_sizes), swap(output_offsets)
    for j in range(ep):
        at = jnp.where(i < sizes[j], offsets[j] + i, output.shape[0])  # past the end: dropped
        output = output.at[at].set(chunks[j].astype(output.dtype), mode="drop")
    ends = offsets + sizes
    overlap = (offsets[:, None] < ends[None, :]) & (offsets[None, :] < ends[:, None]) & (sizes[:, None] > 0)
    overlap &= (sizes[None, :] > 0) & ~jnp.eye(ep, dtype=bool)
    valid = (
        jnp.all(input_offsets + send_sizes <= n)
        & jnp.all((input_offsets >= 0) & (send_sizes >= 0))
        & jnp.all(sizes == recv_sizes)
        & jnp.all((offsets >= 0) & (ends <= output.shape[0]))
        & ~jnp.any(overlap)
    )
    poison = jnp.nan if jnp.issubdtype(output.dtype, jnp.floating) else jnp.iinfo(output.dtype).min
    return jnp.where(valid, output, poison).astype(output.dtype)


def test_the_ragged_exchange_sends_every_row_to_its_expert_and_back(monkeypatch):
    """The offsets of the GPU path (only the rows cross ep), run here through an emulated ragged all-to-all."""
    monkeypatch.setattr(_dispatch.jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    x, ids, gates, w = _inputs()
    want = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3, 4))(x, gates, *w, ids)
    ragged = lambda x, g, a, b, c, i: jnp.sum(experts.expert_mlp(x, i, g, a, b, c, exchange="ragged")[0] ** 2)  # noqa: E731
    mesh = zjax.make_mesh(dp=2, ep=4)
    with jax.set_mesh(mesh), nn.logical_axis_rules(zjax.Rules().activations_for(mesh)):
        got = jax.jit(jax.value_and_grad(ragged, argnums=(0, 1, 2, 3, 4)))(x, gates, *w, ids)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _worst_case_ids(b: int, s: int) -> jax.Array:
    """Every token of every device picks expert 0 and one other: rank 0 of ep=8 (one expert per rank) receives
    every device's whole slice, the exchange's bound (rows_per_rank) exactly."""
    other = 1 + jnp.arange(b * s).reshape(b, s) % (E - 1)
    return jnp.stack([jnp.zeros_like(other), other], axis=-1)


@pytest.mark.parametrize("exchange", ["padded", pytest.param("ragged", marks=pytest.mark.slow)])
def test_receive_buffers_are_the_routing_bound_and_hold_the_worst_case(exchange, monkeypatch):
    """dp=1 x ep=8, one 6-token row per device, top-2 of 8 experts: a token reaches one rank at most once, so each
    rank's slice of a buffer is 6 rows, not the 12 a device sends (ep x 6 rows per receive buffer, half the
    worst case of every row to one rank). Under the most skewed routing it allows the outputs, gradients and
    dropped counts equal one device's; with a capacity factor the bound is the experts' capacity (3 rows); in two
    chunks of 3 tokens, dropless, each chunk's slice is 3 rows."""
    monkeypatch.setattr(_dispatch.jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    x, _, gates, w = _inputs()
    ids = _worst_case_ids(8, 6)
    assert experts.rows_per_rank(6, K, E, 8, None) == 6 and experts.rows_per_rank(6, K, E, 8, 2.0) == 3
    assert experts.rows_per_rank(6, K, E, 2, None) == 12  # four experts per rank: a token's two can share one
    mesh = zjax.make_mesh(dp=1, ep=8)
    for factor, chunks in ((None, 1), (2.0, 1), (None, 2)):

        def loss(x, g, a, b, c, ids, factor=factor, chunks=chunks):
            out, dropped = experts.expert_mlp(
                x, ids, g, a, b, c, capacity_factor=factor, exchange=exchange, chunks=chunks
            )
            return jnp.sum(out**2), dropped

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
        # capacity is per device's tokens: the reference runs each device's row alone and adds them up
        one = jax.jit(grad)
        rows = [one(x[i : i + 1], gates[i : i + 1], *w, ids[i : i + 1]) for i in range(8)]
        with jax.set_mesh(mesh), nn.logical_axis_rules(zjax.Rules().activations_for(mesh)):
            lowered = jax.jit(grad).lower(x, gates, *w, ids)
            (value, dropped), grads = lowered.compile()(x, gates, *w, ids)
        assert float(dropped) == sum(float(r[0][1]) for r in rows) == (0.0 if factor is None else 8 * 3.0)
        np.testing.assert_allclose(value, sum(float(r[0][0]) for r in rows), rtol=1e-5)
        np.testing.assert_allclose(grads[0], np.concatenate([r[1][0] for r in rows]), rtol=1e-5, atol=1e-5)
        for j in range(2, 5):  # the expert weights' gradients: every device's summed
            np.testing.assert_allclose(grads[j], sum(r[1][j] for r in rows), rtol=1e-4, atol=1e-5)
        if exchange == "padded":  # the dense all-to-all's buffers: ep x the bound, rows of D values
            per_rank = experts.rows_per_rank(6 // chunks, K, E, 8, factor)
            swaps = [line for line in lowered.as_text().splitlines() if "all_to_all" in line and f"x{D}xf32>" in line]
            assert swaps and all(f"tensor<{8 * per_rank}x{D}xf32>" in line for line in swaps), swaps
    with pytest.raises(ValueError, match=r"chunks=4 does not divide the 6 tokens each device routes"):
        experts.expert_mlp(x[:1], ids[:1], gates[:1], *w, chunks=4)


def _train(cfg, stage, steps=2, offload="none", pipeline=None, **mesh_axes):
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(**mesh_axes), stage=stage, precision="fp32", offload=offload, pipeline=pipeline)
    init = lambda r: model.init(r, jnp.zeros((1, cfg.max_len), jnp.int32))["params"]  # noqa: E731
    state = plan.init(init, optax.adamw(1e-2), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    tokens = np.random.RandomState(0).randint(0, cfg.vocab, (16, cfg.max_len + 1)).astype(np.int32)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, plan.shard_batch(tokens))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.opt_state.master), metrics


@functools.cache
def _reference():
    return _train(TINY, 0, dp=8)


def _refused(cfg, stage, pipeline=None, batch=None, **mesh_axes):
    """Trace (not run) a step of ``cfg`` on the mesh: a refused configuration raises while the step is traced."""
    model = Decoder(cfg)
    plan = zjax.Plan(zjax.make_mesh(**mesh_axes), stage=stage, precision="fp32", pipeline=pipeline)
    init = lambda r: model.init(r, jnp.zeros((1, cfg.max_len), jnp.int32))["params"]  # noqa: E731
    state = plan.abstract_state(init, optax.adamw(1e-2), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    step.lower(state, plan.shard_batch(np.zeros((16, cfg.max_len + 1), np.int32) if batch is None else batch))


def _same_training(stage, mesh_axes, offload="none", pipeline=None):
    want, want_params, _ = _reference()
    got, got_params, metrics = _train(TINY, stage, offload=offload, pipeline=pipeline, **mesh_axes)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    return got, metrics


@pytest.mark.slow  # the fast pipeline test below trains ep against dp=8 too, with the routers' metrics
def test_a_moe_decoder_trains_the_same_on_ep_as_on_dp_and_reports_its_routers():
    """ZeRO-3 with the experts over ep=4: the losses and the fp32 master weights of dp=8 (fp32); the step's
    metrics carry the routers' losses and the tokens each expert was chosen for."""
    losses, metrics = _same_training(3, {"dp": 2, "ep": 4})
    aux = metrics["aux"]
    tokens = np.asarray(aux["expert_tokens"])
    assert tokens.shape == (TINY.layers, 8)
    assert (tokens.sum(axis=1) == 16 * TINY.max_len * 2).all()  # every token chose top_k = 2 experts in every layer
    assert float(aux["load_balance"]) >= 1.0  # E x sum f P >= 1 for top-2 (2 when balanced)
    extra = TINY.moe.load_balance_weight * float(aux["load_balance"]) + 1e-3 * float(aux["z_loss"])
    last = float(aux["ce"]) + extra  # the metrics are the last step's
    assert losses[-1] == pytest.approx(last, rel=1e-6) and float(aux["dropped"]) == 0.0


# each mesh once, every stage once (and stage 3 on dp=2 x ep=4, above)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh_axes", "stage"),
    [
        ({"dp": 4, "ep": 2}, 0), ({"dp": 2, "ep": 4}, 1), ({"dp": 2, "ep": 2, "cp": 2}, 2),
        ({"dp": 2, "ep": 2, "tp": 2}, 3),
    ],
)  # fmt: skip
def test_every_stage_and_ep_trains_the_same(stage, mesh_axes):
    _same_training(stage, mesh_axes)


@pytest.mark.parametrize(
    ("stage", "mesh_axes", "gather"),
    # tests/test_pipeline_objective.py runs dp=2 x ep=2 x pp=2 and dp=4 x pp=2 at stage 3 against one device
    [pytest.param(3, {"dp": 4, "pp": 2}, "layer", marks=pytest.mark.slow),
     pytest.param(2, {"dp": 2, "pp": 2, "tp": 2}, "layer", marks=pytest.mark.slow),
     pytest.param(1, {"ep": 2, "pp": 2, "tp": 2}, "step", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_moe_decoder_trains_the_same_in_a_pipeline(stage, mesh_axes, gather):
    """GPipe over pp=2 with 4 microbatches: the stages carry the routers' sums (token counts, probabilities,
    z) out of the pipeline, so the load-balancing loss is the whole batch's, as without a pipeline; with ep the
    experts enter each stage split over ep and rows cross it inside the stage: losses, fp32 master weights and
    the router metrics equal dp=8's."""
    _, _, want = _reference()
    pipe = zjax.Pipeline(microbatches=4, zero3_gather=gather)
    _, metrics = _same_training(stage, mesh_axes, pipeline=pipe)
    for key in ("load_balance", "z_loss", "ce", "expert_tokens", "dropped"):
        np.testing.assert_allclose(metrics["aux"][key], want["aux"][key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_ep_composes_with_hsdp_and_offload():
    """Experts over ep inside an HSDP shard group (replica=2 x dp=2 x ep=2), and with the optimizer state in host
    memory (ZeRO-Offload): the numbers of dp=8."""
    _same_training(3, {"dp": (2, 2), "ep": 2})
    _same_training(3, {"dp": 2, "ep": 4}, offload="optimizer")


def test_gradients_reach_the_router_through_the_gates_and_through_the_auxiliary_losses():
    """The router's gradient has two sources: the gates that weight the experts' outputs (the cross-entropy) and
    the load-balancing and z-losses. Cutting either changes it (a stop_gradient in either path fails this test)."""
    x = jax.random.normal(jax.random.key(1), (4, 6, TINY.embed))

    def router_grad(moe: MoE, what: str):
        layer = MoELayer(moe, TINY.embed, TINY.mlp)
        params = layer.init(jax.random.key(0), x)["params"]

        def loss(p):
            out, stats = layer.apply({"params": p}, x)
            main = jnp.sum(out**2) if what in ("all", "main") else 0.0
            return main + (moe.loss(stats) if what in ("all", "aux") else 0.0)

        return np.asarray(nn.unbox(jax.jit(jax.grad(loss))(params))["router"])

    moe = MoE(experts=8, load_balance_weight=0.1, z_loss_weight=0.1)
    main, aux, both = (router_grad(moe, w) for w in ("main", "aux", "all"))
    assert np.abs(main).max() > 1e-4 and np.abs(aux).max() > 1e-4
    np.testing.assert_allclose(both, main + aux, rtol=1e-4, atol=1e-7)


def _hf_balance(logits: np.ndarray, mask: np.ndarray, top_k: int) -> float:
    """Hugging Face's ``load_balancing_loss_func`` (Mixtral, Qwen-MoE) with an attention mask, in NumPy: every
    layer's router logits ``[layers, batch, seq, E]`` concatenated, ``f`` per (choice, expert) and ``P`` per
    expert over the unmasked tokens of all layers, ``E x sum f P``."""
    e = logits.shape[-1]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).reshape(-1, e)
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]
    picks = np.eye(e)[chosen]  # [tokens, k, E]
    m = np.broadcast_to(mask[None], logits.shape[:3]).reshape(-1).astype(np.float64)
    f = np.einsum("t,tke->ke", m, picks) / m.sum()
    p = np.einsum("t,te->e", m, probs) / m.sum()
    return float(e * np.sum(f * p[None]))


@pytest.mark.parametrize("balance_loss", ["pooled", "per-layer"])
def test_the_load_balancing_loss_is_hugging_faces_or_per_layer_and_leaves_padding_out(balance_loss):
    """Two layers' routers on uneven masks: ``pooled`` equals Hugging Face's formula (the layers' f and P
    averaged first), ``per-layer`` the mean of each layer's own formula; the masked tokens count in neither."""
    moe = MoE(experts=E, top_k=K, balance_loss=balance_loss)
    layer = MoELayer(moe, D, F)
    xs = jax.random.normal(jax.random.key(3), (2, 4, 6, D))  # two layers' inputs
    mask = (np.arange(6)[None] < np.array([6, 2, 5, 1])[:, None]).astype(np.float32)
    logits, stats = [], []
    for i in range(2):
        params = layer.init(jax.random.key(10 + i), xs[i])["params"]
        _, st = layer.apply({"params": params}, xs[i], jnp.asarray(mask))
        logits.append(np.asarray(xs[i] @ nn.unbox(params)["router"], np.float64))
        stats.append(st)
    balance, _ = moe.aux_losses(jax.tree.map(lambda *a: jnp.stack(a), *stats))
    logits = np.stack(logits)
    if balance_loss == "pooled":
        want = _hf_balance(logits, mask, K)
    else:
        want = np.mean([_hf_balance(logits[i : i + 1], mask, K) for i in range(2)])
    assert float(balance) == pytest.approx(want, rel=1e-5)
    assert float(balance) != pytest.approx(_hf_balance(logits, np.ones_like(mask), K), rel=1e-3)  # mask matters
    other = (
        _hf_balance(logits, mask, K)
        if balance_loss == "per-layer"
        else np.mean([_hf_balance(logits[i : i + 1], mask, K) for i in range(2)])
    )
    assert float(balance) != pytest.approx(other, rel=1e-3)  # the two formulas differ on two layers


def test_lm_loss_routes_padding_but_leaves_it_out_of_the_routers_statistics():
    """``loss_mask`` reaches the routers: the load-balancing loss and the token counts do not change with what
    the padded positions hold, and they differ from the unmasked batch's."""
    model = Decoder(TINY)
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, TINY.vocab)
    mask = (jnp.arange(17)[None] < jnp.array([17, 9, 12, 4])[:, None]).astype(jnp.int32)
    params = model.init(jax.random.key(1), tokens[:, :-1])["params"]
    loss = jax.jit(lambda b: lm_loss(model, params, b))
    _, masked = loss({"tokens": tokens, "loss_mask": mask})
    noise = jax.random.randint(jax.random.key(2), tokens.shape, 0, TINY.vocab)
    _, repadded = loss({"tokens": jnp.where(mask > 0, tokens, noise), "loss_mask": mask})
    _, whole = loss({"tokens": tokens})
    np.testing.assert_allclose(masked["load_balance"], repadded["load_balance"], rtol=1e-6)
    np.testing.assert_array_equal(masked["expert_tokens"], repadded["expert_tokens"])
    counted = int(jnp.sum(mask[:, :-1])) * TINY.moe.top_k
    assert (np.asarray(masked["expert_tokens"]).sum(axis=1) == counted).all()
    assert float(masked["load_balance"]) != pytest.approx(float(whole["load_balance"]), rel=1e-4)


@pytest.mark.slow  # the GPU target's test checks the same formula
def test_the_memory_formula_counts_experts_over_dp_and_dense_parameters_over_dp_x_ep():
    """ZeRO-3 with ep=4, dp=2: every parameter's state over 8 devices (experts: ep x dp, the rest: dp x ep)."""
    model = Decoder(TINY)
    for stage in (3,):
        plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=stage)
        init = lambda r: model.init(r, jnp.zeros((1, 16), jnp.int32))["params"]  # noqa: E731
        state = plan.abstract_state(init, optax.adamw(1e-3), jax.random.key(0))
        step = plan.train_step(lambda p, b: lm_loss(model, p, b))
        report = step.memory_report(state, jax.ShapeDtypeStruct((16, 17), jnp.int32))
        assert report.state_compiled == pytest.approx(report.state_theory, rel=0.01)
        groups = report.state_by_group  # bf16 + fp32 master + Adam: 14 bytes a parameter over its N
        assert groups["experts"] == pytest.approx(TINY.num_expert_params / 4 * 14 / 2, rel=1e-3)  # ep=4, then dp=2
        assert groups["dense"] == pytest.approx((TINY.num_params - TINY.num_expert_params) * 14 / 8, rel=1e-3)
        assert groups["experts"] + groups["dense"] == pytest.approx(report.state_theory, abs=2)
        w_gate = state.layout.params.placements[
            [p.leaf.path for p in state.layout.params.placements].index("layers/moe/w_gate")
        ]
        assert "ep" in str(w_gate.compute) and "dp" in str(w_gate.sharded) and "ep" in str(w_gate.sharded)


def test_bad_configurations_say_what_works():
    with pytest.raises(ValueError, match="top_k=9 is larger than experts=8"):
        MoE(experts=8, top_k=9)
    x, ids, gates, w = _inputs()
    mesh = zjax.make_mesh(dp=1, ep=8)
    six = [a[:6] for a in w]
    rules = nn.logical_axis_rules(zjax.Rules().activations_for(mesh))
    with jax.set_mesh(mesh), rules, pytest.raises(ValueError, match=r"6 experts cannot be split over ep=8; use an"):
        jax.jit(experts.expert_mlp)(x, jnp.minimum(ids, 5), gates, *six)
    dense = dataclasses.replace(TINY, moe=None)
    with pytest.raises(ValueError, match=r"the mesh has ep=4 but the model has no experts"):
        _refused(dense, 0, dp=2, ep=4)
    pooled = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, balance_loss="pooled"))
    with pytest.raises(ValueError, match="balance_loss='pooled'. under the table schedule '1f1b'.*'per-layer'"):
        _refused(pooled, 0, dp=4, pp=2, pipeline=zjax.Pipeline(microbatches=4, schedule="1f1b"))
    # the table schedules run the layers' stack without the model's own call: its refusals hold there too
    mtp = dataclasses.replace(TINY, mtp_layers=1)
    with pytest.raises(ValueError, match="mtp_layers=1 of a mixture of experts under the table schedule '1f1b'"):
        _refused(mtp, 0, dp=4, pp=2, pipeline=zjax.Pipeline(microbatches=4, schedule="1f1b"))
    edges = dataclasses.replace(TINY, layers=4, matmul="fp8-current", bf16_edge_layers=1)
    with pytest.raises(ValueError, match="bf16_edge_layers=1 under pipeline parallelism is not supported yet"):
        _refused(edges, 0, dp=4, pp=2, pipeline=zjax.Pipeline(microbatches=4, schedule="zero-bubble"))
    with pytest.raises(ValueError, match="ep=2 under pipeline parallelism needs Pipeline.zero3_gather='step'"):
        _refused(TINY, 3, dp=2, ep=2, pp=2, pipeline=zjax.Pipeline(microbatches=4))


def dispatch_formula(cfg: DecoderConfig, tokens_per_device: int) -> int:
    """The ragged all-to-alls' bytes per device per step (the planner's count: each way, the rows a rank can
    send): per layer, every token's top_k rows (bf16) out and back in the forward, the recompute and the backward,
    and their int32 expert ids in the forward and the recompute."""
    rows = tokens_per_device * cfg.moe.top_k
    return cfg.layers * (6 * rows * cfg.embed * 2 + 2 * rows * 4)


@pytest.mark.slow  # a full GPU compile of the MoE step; the fast suite checks the kernel choice and the counter
def test_on_the_gpu_target_rows_cross_ep_by_ragged_all_to_alls_as_the_formula_counts():
    """Deviceless XLA:GPU for 8 H100s, ZeRO-3, dp=2 x ep=4: the dispatch is ragged (only the rows cross), its bytes
    are the formula's, the state per device is the ZeRO formula's per group, and the experts' ZeRO traffic (over dp
    alone) is ZeRO-3's 3 psi of a device's experts (gather, gather again in the recompute, reduce-scatter)."""
    est = zjax.planner.estimate(TINY, mesh={"dp": 2, "ep": 4}, stages=(3,), batch_size=8, seq_len=16, target="h100")
    row = est.rows[0]
    assert row.comm.count["ragged-all-to-all"] > 0 and row.comm.volume["all-to-all"] < row.comm.total_volume / 100
    assert row.comm.volume["ragged-all-to-all"] == dispatch_formula(TINY, 8 * 16 // 8)
    assert row.compiled["state"] == pytest.approx(row.theory["params"] + row.theory["optimizer"], rel=0.01)
    assert row.comm.by_axes[("dp",)] == 3 * TINY.num_expert_params // 4 * 2  # bf16, the ep=4 experts of a device


@pytest.mark.slow  # one example run; the Decoder trains on ep as on dp=8 in the fast pipeline test above
def test_the_example_trains_moe_small_on_ep(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def run(mesh: str) -> dict:
        out = tmp_path / f"{mesh}.json"
        cmd = [sys.executable, str(root / "examples" / "train_lm.py"), "--preset", "moe-small", "--mesh", mesh]
        cmd += ["--precision", "fp32", "--steps", "3", "--no-progress", "--metrics-json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(out.read_text())

    ep = run("dp=2,ep=4")
    assert ep["mesh"]["ep"] == 4 and ep["active_params"] < ep["num_params"] / 3
    assert all(np.isfinite(ep["losses"])) and ep["losses"][-1] < ep["losses"][0]


def test_on_the_gpu_target_the_grouped_matmul_is_tokamaxs_kernel_not_a_dense_dot():
    """XLA:GPU (jax 0.10.2) lowers jax.lax.ragged_dot to one dense matmul over every expert: 64 experts cost 64x
    the temporaries. The GPU default is tokamax's Triton grouped matmul instead."""
    from jax.sharding import SingleDeviceSharding

    from zjax.core._overlap import DEVICELESS
    from zjax.planner._gpu import cudnn_for_target, gpu_devices

    on = SingleDeviceSharding(gpu_devices("h100", 1)[0])
    rows = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16, sharding=on)
    ids = jax.ShapeDtypeStruct((4096,), jnp.int32, sharding=on)
    w_in = jax.ShapeDtypeStruct((64, 512, 256), jnp.bfloat16, sharding=on)
    w_out = jax.ShapeDtypeStruct((64, 256, 512), jnp.bfloat16, sharding=on)
    temps, texts = {}, {}
    for grouped in ("xla", "tokamax"):
        fn = lambda r, i, a, b, c, g=grouped: experts.grouped_swiglu(r, i, 64, a, b, c, g)  # noqa: E731
        with cudnn_for_target("h100"):
            compiled = jax.jit(fn).lower(rows, ids, w_in, w_in, w_out).compile(compiler_options=DEVICELESS)
        temps[grouped], texts[grouped] = compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()
    assert "xla.gpu.triton" in texts["tokamax"] and "xla.gpu.triton" not in texts["xla"]
    assert temps["xla"] >= 4096 * 64 * 512 * 2  # the rows spread over every expert's columns
    assert temps["tokamax"] < temps["xla"] / 20


@pytest.mark.slow  # checkpoints move between meshes in test_checkpoint's fast tests; this adds the experts' ep
def test_a_run_saved_at_ep4_restores_at_ep1_and_the_reverse(tmp_path):
    """The experts' state over ep x dp: a checkpoint written at dp=2 x ep=4 restores on dp=8 and back, bitwise,
    each leaf in its new layout (experts whole over dp=8's ranks' ZeRO shards, then split over ep again)."""
    model = Decoder(TINY)
    init = lambda r: model.init(r, jnp.zeros((1, 16), jnp.int32))["params"]  # noqa: E731
    tx = optax.adamw(1e-2)
    plans = {
        name: zjax.Plan(zjax.make_mesh(**axes), stage=3)
        for name, axes in (("ep", {"dp": 2, "ep": 4}), ("dp", {"dp": 8}))
    }
    state = plans["ep"].init(init, tx, jax.random.key(0))
    tokens = np.random.RandomState(0).randint(0, TINY.vocab, (16, 17)).astype(np.int32)
    state, _ = plans["ep"].train_step(lambda p, b: lm_loss(model, p, b))(state, plans["ep"].shard_batch(tokens))
    want = jax.device_get(state.opt_state.master)
    with zjax.Checkpointer(tmp_path / "ep") as ckpt:
        ckpt.save(state, plans["ep"], {"data_position": 1})
    with zjax.Checkpointer(tmp_path / "ep") as ckpt:
        on_dp, _ = ckpt.restore(plans["dp"], init, tx, jax.random.key(0))
    w_gate = nn.unbox(on_dp.opt_state.master)["layers"]["moe"]["w_gate"]
    assert "ep" not in str(w_gate.sharding.spec)
    with zjax.Checkpointer(tmp_path / "dp") as ckpt:
        ckpt.save(on_dp, plans["dp"], {"data_position": 1})
    with zjax.Checkpointer(tmp_path / "dp") as ckpt:
        back, _ = ckpt.restore(plans["ep"], init, tx, jax.random.key(0))
    assert "ep" in str(nn.unbox(back.opt_state.master)["layers"]["moe"]["w_gate"].sharding.spec)
    for got in (on_dp, back):
        for a, b in zip(jax.tree.leaves(jax.device_get(got.opt_state.master)), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_nested_checkpointing_carries_the_routers_statistics():
    """remat="nested" (a scan of scans) returns each layer's router statistics in layer order, as "full" does."""
    cfg = dataclasses.replace(TINY, layers=4)
    tokens = np.random.RandomState(1).randint(0, cfg.vocab, (4, 17)).astype(np.int32)
    params = Decoder(cfg).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    out = {}
    for remat in ("full", "nested"):
        model = Decoder(dataclasses.replace(cfg, remat=remat))
        mean = lambda p, t, m=model: (lambda out: (out[0].mean, out[1]))(lm_loss(m, p, t))  # noqa: E731
        out[remat] = jax.jit(jax.value_and_grad(mean, has_aux=True))(params, tokens)
    for a, b in zip(jax.tree.leaves(out["nested"]), jax.tree.leaves(out["full"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert out["nested"][0][1]["expert_tokens"].shape == (4, 8)


def test_the_budget_search_takes_ep_out_of_dp_where_the_experts_divide():
    from zjax.planner._fit import _ep_reason, with_ep

    assert with_ep({"dp": 8}, 4) == {"dp": 2, "ep": 4} and with_ep({"dp": 2, "ep": 4}, 8) == {"dp": 1, "ep": 8}
    assert with_ep({"dp": 8}, 0) == {"dp": 8}
    assert _ep_reason(4, {"dp": 8}, TINY) is None
    assert _ep_reason(3, {"dp": 8}, TINY) == "ep=3 does not divide the 8 data-parallel ranks (dp x ep)"
    six = dataclasses.replace(TINY, moe=MoE(experts=6))
    assert _ep_reason(4, {"dp": 8}, six) == "ep=4 does not divide the model's 6 experts"
    assert _ep_reason(2, {"dp": 8}, dataclasses.replace(TINY, moe=None)) == "ep=2 needs a mixture-of-experts model"


@pytest.mark.slow
def test_the_budget_search_picks_the_largest_ep_that_fits_at_the_lowest_stage():
    """Stage 0 on dp=8 holds every expert on every device; on ep=8 each device holds one: the search finds a stage-0
    plan by taking ep out of dp before it tries a higher stage."""
    budget = zjax.planner.estimate(TINY, mesh={"dp": 1, "ep": 8}, stages=(0,), batch_size=8, seq_len=16).rows[0]
    found = zjax.planner.fit(
        budget.compiled["total"], TINY, mesh={"dp": 8}, stages=(0, 3), remats=("full",), accums=(1,),
        batch_size=8, seq_len=16, offloads=("none",), eps=(1, 2, 8),
    )  # fmt: skip
    assert found.row is not None and found.row.stage == 0 and found.row.mesh["ep"] == 8


@pytest.mark.slow  # three compiles; the fast receive-buffer test checks the exchange's buffer shapes
def test_the_planner_sizes_the_exchange_by_the_capacity_factor():
    """XLA:CPU's padded exchange moves each rank's whole buffers: dp=2 x ep=4, 16 tokens of top-2 per device, two
    experts per rank. Dropless, a rank's slice holds 32 rows (a token's two experts can share a rank); with
    capacity factor 2 each expert takes 8 rows of a device, so a slice holds 16, and with factor 1, 8: the
    dispatch's all-to-all bytes (rows and their ids) go as the slice (beside a fixed 1 KB of other all-to-alls)."""
    plan = functools.partial(zjax.planner.estimate, TINY, mesh={"dp": 2, "ep": 4}, stages=(0,), batch_size=8)
    slices = [experts.rows_per_rank(16, 2, 8, 4, f) for f in (None, 2.0, 1.0)]
    assert slices == [32, 16, 8]
    ests = [plan(seq_len=16, moe={"capacity_factor": f}) for f in (None, 2.0, 1.0)]
    v32, v16, v8 = (e.rows[0].comm.volume["all-to-all"] for e in ests)
    assert v32 - v16 == 2 * (v16 - v8) > 0 and v8 - (v16 - v8) < v8 / 8  # linear in the slice, little besides
    # rows of a search over ep show their own meshes
    other = dataclasses.replace(ests[0].rows[0], mesh={**ests[0].rows[0].mesh, "dp": 8, "ep": 1})
    text = str(dataclasses.replace(ests[0], rows=(ests[0].rows[0], other)))
    assert " acc mesh " in text and " acc mesh " not in str(ests[0]) and " dp=2,ep=4 " in text and " dp=8 " in text
    with pytest.raises(ValueError, match="capacity_factor.: 1.0} but model 'custom' has no experts"):
        zjax.planner.estimate(dataclasses.replace(TINY, moe=None), mesh={"dp": 8}, moe={"capacity_factor": 1.0})

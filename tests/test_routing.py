"""DeepSeek-V3's routing: sigmoid scores, group-limited top-k, the routed scaling factor, shared experts without a
gate, the per-sequence balance loss, and auxiliary-loss-free balancing by selection biases kept as model state."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax.models import ROUTER_STATE, Decoder, DecoderConfig, MoE, MoELayer, lm_loss

from ._objective import relative, uneven_batch

E, D, F, S = 8, 16, 24, 12
DEEPSEEK = MoE(
    experts=E, top_k=2, scoring="sigmoid", groups=4, top_groups=2, routed_scale=2.5, shared_mlp=20,
    shared_gate=False, bias_update_rate=0.01, load_balance_weight=0.0,
)  # fmt: skip


def _silu(x):
    return x / (1 + np.exp(-x))


def _deepseek_reference(h, p, bias, moe):
    """DeepSeek-V3's MoE in NumPy (float64): sigmoid scores, the bias added for the choice, groups scored by
    their two best biased scores, the ``top_groups`` best kept (the others at -inf, as DeepSeek's reference code
    masks them), top-k among those, gates the unbiased scores normalized and scaled, the shared expert added."""
    x = h.reshape(-1, h.shape[-1]).astype(np.float64)
    scores = 1 / (1 + np.exp(-(x @ p["router"])))
    choice = scores + bias
    per = E // moe.groups
    grouped = choice.reshape(-1, moe.groups, per)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    keep = np.argsort(-group_score, axis=-1)[:, : moe.top_groups]
    masked = np.full_like(grouped, -np.inf)
    for t in range(x.shape[0]):
        masked[t, keep[t]] = grouped[t, keep[t]]
    ids = np.argsort(-masked.reshape(-1, E), axis=-1)[:, : moe.top_k]
    gates = np.take_along_axis(scores, ids, -1)
    gates = gates / gates.sum(-1, keepdims=True) * moe.routed_scale
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, g in zip(ids[t], gates[t], strict=True):
            out[t] += g * ((_silu(x[t] @ p["w_gate"][j]) * (x[t] @ p["w_up"][j])) @ p["w_down"][j])
    out += (_silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    return out.reshape(h.shape), ids


def test_deepseek_routing_equals_a_numpy_reference_and_keeps_each_token_within_its_groups():
    layer = MoELayer(DEEPSEEK, D, F)
    h = jax.random.normal(jax.random.key(0), (3, S, D))
    variables = layer.init(jax.random.key(1), h)
    assert jax.tree.map(jnp.shape, variables[ROUTER_STATE]) == {"bias": (E,), "load": (E,)}
    bias = np.asarray(jax.random.normal(jax.random.key(2), (E,))) * 0.05
    variables = {"params": variables["params"], ROUTER_STATE: {"bias": jnp.asarray(bias)}}
    out, stats = jax.jit(layer.apply)(variables, h)
    params = {k: np.asarray(v, np.float64) for k, v in nn.unbox(variables["params"]).items()}
    want, ids = _deepseek_reference(np.asarray(h), params, bias, DEEPSEEK)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
    assert (np.asarray(stats["tokens"]) == np.bincount(ids.ravel(), minlength=E)).all()
    assert max(len(set(row // (E // DEEPSEEK.groups))) for row in ids) <= DEEPSEEK.top_groups
    # the groups bind: some token's plain top-2 of the biased scores spans groups outside its best two
    free = MoELayer(dataclasses.replace(DEEPSEEK, groups=1, top_groups=None), D, F)
    _, free_stats = jax.jit(free.apply)(variables, h)
    assert not np.array_equal(np.asarray(free_stats["tokens"]), np.asarray(stats["tokens"]))


def test_deepseek_v2_ranks_groups_by_their_best_score():
    """``group_score="max"`` (DeepSeek-V2's group_limited_greedy): softmax scores, each token's two groups with the
    best single score kept, its top-2 among them; the choices are NumPy's, and differ from ranking by two best."""
    v2 = MoE(experts=E, top_k=2, groups=4, top_groups=2, group_score="max", normalize_top_k=False, routed_scale=1.5)
    h = jax.random.normal(jax.random.key(3), (4, S, D))
    variables = MoELayer(v2, D, F).init(jax.random.key(4), h)
    _, stats = jax.jit(MoELayer(v2, D, F).apply)(variables, h)
    x = np.asarray(h, np.float64).reshape(-1, D)
    logits = x @ np.asarray(nn.unbox(variables["params"])["router"], np.float64)
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    grouped = (scores / scores.sum(-1, keepdims=True)).reshape(-1, 4, E // 4)
    keep = np.argsort(-grouped.max(-1), axis=-1)[:, :2]
    masked = np.zeros_like(grouped)  # DeepSeek-V2 masks the other groups with 0 (softmax scores are positive)
    np.put_along_axis(masked, keep[..., None], np.take_along_axis(grouped, keep[..., None], 1), 1)
    ids = np.argsort(-masked.reshape(-1, E), axis=-1)[:, :2]
    assert (np.asarray(stats["tokens"]) == np.bincount(ids.ravel(), minlength=E)).all()
    top2 = MoELayer(dataclasses.replace(v2, group_score="top2"), D, F)
    assert not np.array_equal(np.asarray(jax.jit(top2.apply)(variables, h)[1]["tokens"]), np.asarray(stats["tokens"]))


def test_the_per_sequence_balance_loss_averages_each_rows_own_loss():
    moe = MoE(experts=E, top_k=2, scoring="sigmoid", balance_loss="per-sequence")
    layer = MoELayer(moe, D, F)
    h = jax.random.normal(jax.random.key(3), (2, 4, S, D))  # two layers' inputs
    mask = (np.arange(S)[None] < np.array([S, 5, 0, 9])[:, None]).astype(np.float32)  # row 2: no token counts
    want = []
    stats = []
    for i in range(2):
        params = layer.init(jax.random.key(i), h[i])["params"]
        _, st = layer.apply({"params": params}, h[i], jnp.asarray(mask))
        stats.append(st)
        scores = 1 / (1 + np.exp(-np.asarray(h[i] @ nn.unbox(params)["router"], np.float64)))
        probs = scores / scores.sum(-1, keepdims=True)
        picks = np.eye(E)[np.argsort(-scores, -1)[..., :2]].sum(-2)  # [rows, seq, E]
        for b in range(4):
            n = mask[b].sum()
            if n:
                f = (mask[b][:, None] * picks[b]).sum(0) / n
                p = (mask[b][:, None] * probs[b]).sum(0) / n
                want.append(E * np.sum(f * p))
    balance, _ = moe.aux_losses(jax.tree.map(lambda *a: jnp.stack(a), *stats))
    assert float(balance) == pytest.approx(np.mean(want), rel=1e-5)


# -- auxiliary-loss-free balancing ----------------------------------------------------------------------------


def _skewed_routing(rate: float, steps: int = 200, tokens: int = 4096) -> np.ndarray:
    """A synthetic routing task: each step's token states are ``N(0, I) + u`` and the router's columns for experts
    0 and 1 lean along ``u``, so those two take most rows. Each step routes fresh tokens and moves the biases by
    the step's loads (:func:`zjax.models.moved_bias`). Returns each step's busiest load over the mean load."""
    moe = MoE(experts=E, top_k=2, scoring="sigmoid", bias_update_rate=rate, load_balance_weight=0.0)
    layer = MoELayer(moe, 32, 16)
    u = np.array(jax.random.normal(jax.random.key(5), (32,)))
    u /= np.linalg.norm(u)
    params = nn.unbox(layer.init(jax.random.key(0), jnp.zeros((1, 1, 32)))["params"])
    params["router"] = params["router"].at[:, :2].add(2.0 * jnp.asarray(u)[:, None])

    def one(bias, key):
        h = jax.random.normal(key, (1, tokens, 32)) + jnp.asarray(u)
        _, stats = layer.apply({"params": params, ROUTER_STATE: {"bias": bias}}, h)
        return zjax.models.moved_bias(moe, bias, stats["tokens"]), stats["tokens"].max() / stats["tokens"].mean()

    run = jax.jit(lambda key: jax.lax.scan(one, jnp.zeros(E), jax.random.split(key, steps))[1])
    return np.asarray(run(jax.random.key(1)))


def test_selection_biases_even_out_a_skewed_router_without_an_auxiliary_loss():
    """DeepSeek-V3's loss-free balancing on a router that sends most rows to two of eight experts: with the biases
    moved by rate x sign(mean load - load) after each step, within 200 steps the busiest expert carries less than
    1.2x the mean load (no auxiliary loss), and keeps there; with the update off (rate 0) it stays above 2x."""
    on, off = _skewed_routing(0.003), _skewed_routing(0.0)
    assert on[0] > 2.5 and off[0] > 2.5  # the skew
    assert on[-50:].max() < 1.2, on[-50:]
    assert off.min() > 2, off.min()


SKEWED = DecoderConfig(
    vocab=64, embed=32, layers=2, heads=2, head_dim=16, mlp=64, max_len=16,
    moe=MoE(experts=E, top_k=2, scoring="sigmoid", load_balance_weight=0.0, bias_update_rate=0.01),
)  # fmt: skip


def _variables(cfg):
    model = Decoder(cfg)
    return model, zjax.Variables.linen(model.init(jax.random.key(0), jnp.zeros((1, cfg.max_len), jnp.int32)))


def _trained(steps, accum=1):
    """``steps`` stage-1 steps on dp=2 x ep=4 (``accum`` microbatches each): the state, its plan, the init's
    variables, and the biases that :func:`zjax.models.moved_bias` makes of the steps' reported loads."""
    model, variables = _variables(SKEWED)
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=1, precision="fp32")
    state = plan.init(lambda r: variables, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(zjax.models.train_functions(model, SKEWED.max_len)[1], accum_steps=accum)
    data = np.random.RandomState(0).randint(0, SKEWED.vocab, (steps, 16, SKEWED.max_len + 1)).astype(np.int32)
    want = jnp.zeros((SKEWED.layers, E))
    for tokens in data:
        state, metrics = step(state, plan.shard_batch(tokens))
        assert float(np.sum(metrics["aux"]["expert_tokens"])) == SKEWED.layers * 16 * SKEWED.max_len * 2 / accum
        want = zjax.models.moved_bias(SKEWED.moe, want, metrics["aux"]["expert_tokens"])
    return state, plan, variables, want


def _biases(state):
    return jax.device_get(state.model_state)[ROUTER_STATE]["layers"]["moe"]["bias"]


@pytest.mark.slow  # the accumulated test below checks a step's move bitwise against one device's, loads reset
def test_a_train_step_moves_the_biases_by_its_whole_batchs_loads():
    """The biases are model state: each stage-1 step on dp=2 x ep=4 moves every layer's by the loads of the whole
    global batch (the step's ``expert_tokens``, every data rank's rows), and the loads counted start again."""
    state, _, _, want = _trained(2)
    np.testing.assert_array_equal(_biases(state), want)
    assert np.abs(want).max() > 0
    assert not np.any(jax.device_get(state.model_state)[ROUTER_STATE]["layers"]["moe"]["load"])


BIASED_PATHS = {  # mesh, plan, microbatches accumulated, remat
    "dp2-ep4-accum4": (dict(dp=2, ep=4), dict(stage=1), 4, "full"),
    # the biases travel with their layers' weights to the stage that runs them (numbered layers), kept whole where
    # ZeRO-3 gathers each layer's weights over dp
    "dp4-pp2-1f1b-stage3": (dict(dp=4, pp=2), dict(stage=3, pipeline=zjax.Pipeline(4, schedule="1f1b")), 1, "full"),
    "dp2-ep2-pp2-gpipe-accum2": (dict(dp=2, ep=2, pp=2), dict(stage=1, pipeline=zjax.Pipeline(2)), 2, "full"),
    "dp8-nested-remat": (dict(dp=8), dict(stage=2), 1, "nested"),
}


@pytest.mark.parametrize(
    "path", [p if p == "dp2-ep4-accum4" else pytest.param(p, marks=pytest.mark.slow) for p in BIASED_PATHS]
)
def test_accumulated_microbatches_route_with_the_steps_biases_and_move_them_once(path):
    """With biases moved (not zero), a step of accumulated microbatches (or a pipeline's) routes every microbatch
    with the step's biases: its gradients are ``jax.grad`` of the whole batch's loss on one device, and the biases
    move once, by the whole batch's loads, bitwise as one device moves them (moving them after each microbatch
    would route the later ones differently, and move them once per microbatch)."""
    mesh, plan_kw, accum, remat = BIASED_PATHS[path]
    model, variables = _variables(SKEWED)
    runs = Decoder(dataclasses.replace(SKEWED, remat=remat))
    bias = jnp.asarray(np.random.RandomState(1).normal(0, 0.05, (SKEWED.layers, E)), jnp.float32)
    routers = {"layers": {"moe": {"bias": bias, "load": jnp.zeros_like(bias)}}}
    variables = zjax.Variables(variables.params, {ROUTER_STATE: routers})
    batch = uneven_batch(32, SKEWED)

    def one_device(p, b, ms):
        (out, _), new = lm_loss(model, p, b, ms)
        return out.mean, new

    grads, new = jax.jit(jax.grad(one_device, has_aux=True))(
        *jax.device_put((nn.unbox(variables.params), batch, variables.model_state), jax.devices()[0])
    )
    want = jax.device_get(zjax.models.with_moved_biases(SKEWED, new))[ROUTER_STATE]["layers"]["moe"]["bias"]
    plan = zjax.Plan(zjax.make_mesh(**mesh), precision="fp32", **plan_kw)
    loss_fn = zjax.models.train_functions(runs, SKEWED.max_len)[1]
    state = plan.init(lambda r: variables, optax.sgd(0.1), jax.random.key(0))
    step = plan.train_step(loss_fn, accum_steps=accum)
    got, _ = step.grads(state, plan.shard_batch(batch))
    assert relative(*(jax.tree.map(np.asarray, jax.device_get(g)) for g in (got, grads))) < 3e-5
    state, _ = step(state, plan.shard_batch(batch))
    np.testing.assert_array_equal(_biases(state), want)
    assert not np.any(jax.device_get(state.model_state)[ROUTER_STATE]["layers"]["moe"]["load"])  # counted anew


@pytest.mark.slow  # a checkpoint round trip; the fast test above checks the biases the steps make
def test_the_biases_restore_bitwise_on_another_mesh_and_stage(tmp_path):
    state, plan, variables, _ = _trained(2)
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan, {"data_position": 2})
    other = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="fp32")
    with zjax.Checkpointer(tmp_path) as ckpt:
        back, _ = ckpt.restore(other, lambda r: variables, optax.adamw(1e-3), jax.random.key(0))
    np.testing.assert_array_equal(_biases(back), _biases(state))


def test_bad_routing_configurations_say_what_works():
    for bad, match in [
        (dict(groups=3), "dividing experts=8"),
        (dict(groups=4, top_groups=5), "top_groups=5 must be in 1..groups=4"),
        (dict(groups=4, top_groups=1, top_k=3), "top_k=3 experts cannot come from top_groups=1 groups of 2"),
        (dict(scoring="tanh"), "scoring='tanh'; use one of"),
        (dict(routed_scale=0.0), "routed_scale=0.0 must be > 0"),
        (dict(bias_update_rate=-1.0), "bias_update_rate=-1.0 must be >= 0"),
        (dict(balance_loss="mean"), "balance_loss='mean'; use one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            MoE(experts=8, **bad)
    model, variables = _variables(SKEWED)
    tokens = jnp.zeros((2, 17), jnp.int32)
    with pytest.raises(ValueError, match="selection biases .* model state"):
        lm_loss(model, variables.params, tokens)


@pytest.mark.slow  # a planner compile; zjax train's DeepSeek-shaped run (slow too) uses the same functions
def test_the_planner_and_the_step_take_a_model_whose_routers_keep_biases():
    """``zjax.models.train_functions`` gives the state-threading ``(init_fn, loss_fn)`` the planner compiles (a
    DeepSeek-V3 config's routers keep selection biases): its state holds the biases beside the parameters."""
    cfg = DecoderConfig(vocab=64, embed=D, layers=2, heads=2, head_dim=8, mlp=F, max_len=S, moe=DEEPSEEK)
    init_fn, loss_fn = zjax.models.train_functions(Decoder(cfg), S)
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="fp32")
    state = plan.abstract_state(init_fn, optax.sgd(0.1), jax.random.key(0))
    assert state.model_state[ROUTER_STATE]["layers"]["moe"]["bias"].shape == (2, E)
    est = zjax.planner.estimate(cfg, mesh={"dp": 2, "ep": 4}, stages=(3,), batch_size=8, precision="fp32")
    assert est.rows[0].compiled["state"] > 0 and est.rows[0].comm.all_to_all_by_axes

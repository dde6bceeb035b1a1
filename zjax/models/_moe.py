"""The mixture-of-experts feed-forward layer of the decoder: a top-k router in fp32, SwiGLU experts through
:func:`zjax.experts.expert_mlp` (dropless grouped matmuls, experts split over ``ep``), optional shared experts,
the load-balancing and router z-losses.

One configuration (:class:`MoE`) covers Mixtral (top-2 of 8, the chosen probabilities renormalized), Qwen2-MoE
(60 experts, top-4 without renormalizing, a shared expert behind a sigmoid gate) and Qwen3-MoE (128 experts,
top-8, renormalized, no shared expert).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..experts import EXCHANGES, GROUPED, expert_mlp, experts_held
from ..sharding import DP, EP
from ._biases import ROUTER_STATE
from ._params import param

F32 = jnp.float32

BALANCE_LOSSES = {
    "per-layer": "the mean over layers of each layer's E x sum_e f_le P_le",
    "pooled": "E x sum_e mean_l(f_le) x mean_l(P_le): the routers pooled first (Hugging Face's Mixtral, Qwen-MoE)",
    "per-sequence": "the mean over layers and rows of E x sum_e f_lbe P_lbe (DeepSeek-V3's sequence-wise loss x top_k)",
}
"""How :class:`MoE`'s load-balancing loss combines the layers and rows (``MoE(balance_loss=...)``)."""

SCORINGS = {
    "softmax": "softmax(logits): Mixtral, Qwen-MoE, DeepSeek-V2",
    "sigmoid": "sigmoid(logits), each expert on its own: DeepSeek-V3",
}
"""The router's scores (``MoE(scoring=...)``); the top-k choice and the gates read them."""

GROUP_SCORES = {
    "top2": "the sum of the group's two best scores: DeepSeek-V3 (noaux_tc)",
    "max": "the group's best score: DeepSeek-V2 (group_limited_greedy)",
}
"""How group-limited routing ranks the groups (``MoE(group_score=...)``)."""


@dataclasses.dataclass(frozen=True)
class MoE:
    """A mixture-of-experts feed-forward layer in every decoder layer (``DecoderConfig(moe=MoE(...))``).

    Each token's router scores are ``softmax(h @ router)`` or, with ``scoring="sigmoid"``, ``sigmoid(h @ router)``
    (fp32, :data:`SCORINGS`); the token goes to its ``top_k`` highest-scoring experts, their outputs weighted by
    those scores, renormalized to sum to 1 when ``normalize_top_k`` (Mixtral, Qwen3-MoE, DeepSeek-V3; for softmax
    the same as a softmax over the top-k logits) and as they are otherwise (Qwen2-MoE), then times
    ``routed_scale`` (DeepSeek's ``routed_scaling_factor``). With ``groups > 1`` the experts form ``groups``
    equal groups (consecutive experts: on an ``ep`` mesh a group lies on one rank when ``groups`` is a multiple
    of ``ep``) and a token chooses among its ``top_groups`` best groups, ranked by ``group_score``
    (:data:`GROUP_SCORES`: the sum of a group's two best scores, DeepSeek-V3's, or its best, DeepSeek-V2's); a
    token's rows reach at most ``top_groups`` groups. ``bias_update_rate`` (``None``: no bias) adds a
    per-expert bias to the scores for the choice only (DeepSeek-V3's auxiliary-loss-free balancing): model state
    in the :data:`ROUTER_STATE` collection, moved once per train step by ``rate x sign(mean load - load)`` over
    the tokens the whole step routed (0: kept as loaded). ``mlp`` is each expert's hidden size (default: the
    decoder's ``mlp``); ``shared_mlp > 0`` adds a shared SwiGLU expert of that size that every token passes
    through, scaled by ``sigmoid(h @ shared_gate)`` (Qwen2-MoE) or, ``shared_gate=False``, added as it is
    (DeepSeek). ``capacity_factor`` (default ``None``: dropless) caps each expert
    at :func:`zjax.experts.capacity` rows of each device's tokens. The loss adds
    ``load_balance_weight x`` the load-balancing loss (Switch Transformer's ``E x sum_e f_e P_e`` with ``f_e``
    the fraction of tokens that chose expert ``e`` and ``P_e`` its mean probability; ``top_k`` when perfectly
    balanced; ``P`` from the normalized scores ``s / sum(s)`` under sigmoid scoring), the layers combined as
    ``balance_loss`` says (:data:`BALANCE_LOSSES`: ``"per-layer"``, the mean of each layer's loss, ``"pooled"``,
    each expert's ``f`` and ``P`` averaged over layers first, as Hugging Face's Mixtral computes it, or
    ``"per-sequence"``, each row's own loss averaged, DeepSeek-V3's complementary loss times ``top_k``), and
    ``z_loss_weight x`` the router z-loss (``mean(logsumexp(logits)^2)``,
    ST-MoE) averaged over layers. The routers count the tokens whose ``loss_mask`` is nonzero (padding is not
    routed traffic; :func:`zjax.models.lm_loss`). ``exchange`` picks how rows cross
    ``ep`` and ``grouped`` the grouped matmul (:func:`zjax.experts.expert_mlp`; both by platform by default);
    ``dispatch_chunks`` routes each device's tokens in that many chunks, one after another (its ``chunks``: the
    exchange's buffers that much smaller, one more exchange in the backward pass).
    """

    experts: int = 8
    top_k: int = 2
    mlp: int | None = None
    normalize_top_k: bool = True
    shared_mlp: int = 0
    capacity_factor: float | None = None
    load_balance_weight: float = 0.01
    z_loss_weight: float = 0.0
    balance_loss: str = "per-layer"
    scoring: str = "softmax"
    routed_scale: float = 1.0
    groups: int = 1
    top_groups: int | None = None
    group_score: str = "top2"
    shared_gate: bool = True
    bias_update_rate: float | None = None
    exchange: str | None = None
    grouped: str | None = None
    dispatch_chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoE: {name}={value!r} must be a positive int.")
        if self.top_k > self.experts:
            raise ValueError(
                f"MoE: top_k={self.top_k} is larger than experts={self.experts}; each token chooses top_k of the "
                f"experts: use top_k <= {self.experts}."
            )
        if self.mlp is not None and (not isinstance(self.mlp, int) or self.mlp < 1):
            raise ValueError(f"MoE: mlp={self.mlp!r} must be a positive int or None (the decoder's mlp).")
        if not isinstance(self.shared_mlp, int) or self.shared_mlp < 0:
            raise ValueError(f"MoE: shared_mlp={self.shared_mlp!r} must be an int >= 0 (0: no shared expert).")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor={self.capacity_factor} must be > 0, or None (dropless).")
        for name in ("load_balance_weight", "z_loss_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"MoE: {name}={getattr(self, name)} must be >= 0.")
        if self.balance_loss not in BALANCE_LOSSES:
            raise ValueError(
                f"MoE: balance_loss={self.balance_loss!r}; use one of {list(BALANCE_LOSSES)} (how the layers' "
                "load-balancing losses combine)."
            )
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoE: scoring={self.scoring!r}; use one of {list(SCORINGS)}.")
        if not self.routed_scale > 0:
            raise ValueError(f"MoE: routed_scale={self.routed_scale} must be > 0 (it multiplies the gates).")
        if not isinstance(self.groups, int) or self.groups < 1 or self.experts % self.groups:
            raise ValueError(
                f"MoE: groups={self.groups!r} must be a positive int dividing experts={self.experts} (the experts "
                "form equal groups of consecutive experts)."
            )
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"MoE: group_score={self.group_score!r}; use one of {list(GROUP_SCORES)}.")
        top_groups = self.routed_groups
        if not 1 <= top_groups <= self.groups:
            raise ValueError(f"MoE: top_groups={self.top_groups} must be in 1..groups={self.groups}, or None (all).")
        if self.top_k > top_groups * (self.experts // self.groups):
            raise ValueError(
                f"MoE: top_k={self.top_k} experts cannot come from top_groups={top_groups} groups of "
                f"{self.experts // self.groups}; raise top_groups or lower top_k."
            )
        if self.bias_update_rate is not None and not self.bias_update_rate >= 0:
            raise ValueError(
                f"MoE: bias_update_rate={self.bias_update_rate} must be >= 0 (0: a bias kept as loaded), or None "
                "(no selection bias)."
            )
        if not isinstance(self.dispatch_chunks, int) or self.dispatch_chunks < 1:
            raise ValueError(f"MoE: dispatch_chunks={self.dispatch_chunks!r} must be a positive int (1: no chunks).")
        if self.exchange is not None and self.exchange not in EXCHANGES:
            raise ValueError(f"MoE: exchange={self.exchange!r}; use one of {list(EXCHANGES)} or None (by platform).")
        if self.grouped is not None and self.grouped not in GROUPED:
            raise ValueError(f"MoE: grouped={self.grouped!r}; use one of {list(GROUPED)} or None (by platform).")

    @property
    def routed_groups(self) -> int:
        """The groups a token's experts come from (``top_groups``, all ``groups`` by default)."""
        return self.groups if self.top_groups is None else self.top_groups

    def expert_mlp(self, dense_mlp: int) -> int:
        return dense_mlp if self.mlp is None else self.mlp

    def params_per_layer(self, embed: int, dense_mlp: int) -> tuple[int, int]:
        """``(expert, dense)`` parameters of one layer's MoE: the experts' matrices, and the router and shared
        expert (held like any dense parameter)."""
        experts = self.experts * 3 * embed * self.expert_mlp(dense_mlp)
        shared = (3 * embed * self.shared_mlp + embed * self.shared_gate) if self.shared_mlp else 0
        return experts, embed * self.experts + shared

    def active_per_layer(self, embed: int, dense_mlp: int) -> int:
        """Matmul parameters one token passes through in one layer: ``top_k`` experts, the router, the shared
        expert."""
        return self.top_k * 3 * embed * self.expert_mlp(dense_mlp) + self.params_per_layer(embed, dense_mlp)[1]

    def aux_losses(self, stats: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """``(load_balance, z_loss)``, scalars, from the routers' sums (:class:`MoELayer`'s ``stats``, stacked per
        layer) over the ``N_l`` tokens each layer counted: the load-balancing loss as :attr:`balance_loss` combines
        the layers (:data:`BALANCE_LOSSES`, with ``f_le = tokens_le / N_l`` and ``P_le = probs_le / N_l``; per
        sequence, the rows' sums of ``f_lbe P_lbe`` over the rows that counted a token) and
        the mean over layers of ``z_l / N_l``. Computed from sums, they are the same however the tokens were split
        on the way (microbatches of a pipeline, data-parallel ranks); a layer that counted no token adds 0."""
        if self.balance_loss == "pooled":
            count = stats["count"]
            total = jnp.maximum(jnp.sum(count), 1.0)
            share, prob = jnp.sum(stats["tokens"], axis=0) / total, jnp.sum(stats["probs"], axis=0) / total
            z = jnp.mean(stats["z"] / jnp.where(count > 0, count, 1.0))
            return self.experts * jnp.sum(share * prob), z
        balance, z = self._per_layer(stats)
        return jnp.mean(balance), jnp.mean(z)

    def _per_layer(self, stats: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """``(load_balance, z_loss)`` of each layer (``[layers]``): the losses are their means, but ``"pooled"``'s."""
        count = stats["count"]
        safe = jnp.where(count > 0, count, 1.0)
        if self.balance_loss == "per-sequence":
            rows = stats["rows"]
            balance = self.experts * stats["row_balance"] / jnp.where(rows > 0, rows, 1.0)
        else:
            balance = self.experts * jnp.sum(stats["tokens"] * stats["probs"], axis=-1) / (safe * safe)
        return balance, stats["z"] / safe

    def loss(self, stats: dict[str, jax.Array]) -> jax.Array:
        """The weighted auxiliary losses of ``stats`` (per layer, stacked)."""
        balance, z = self.aux_losses(stats)
        return self.load_balance_weight * balance + self.z_loss_weight * z

    def layers_loss(self, stats: dict[str, jax.Array], layers: int) -> jax.Array:
        """:meth:`loss`'s part from the layers of ``stats`` (some of a model's ``layers``: a pipeline stage's), so
        that the parts of all stages add up to :meth:`loss`; not for ``balance_loss="pooled"``, whose layers
        meet before its product."""
        balance, z = self._per_layer(stats)
        return jnp.sum(self.load_balance_weight * balance + self.z_loss_weight * z) / layers


def _swiglu(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


class MoELayer(nn.Module):
    """``MoELayer(moe, embed, dense_mlp)(h [batch, seq, embed], mask) -> (out, stats)``; ``stats`` holds the
    layer's router sums over the tokens ``mask [batch, seq]`` counts (all by default; fp32): ``tokens``
    (``[experts]``: rows each expert was chosen for), ``probs`` (``[experts]``: the router probabilities), ``z``
    (``logsumexp(logits)^2``), ``count`` (tokens) and ``dropped`` (rows past capacity, every token's);
    :meth:`MoE.aux_losses` makes the losses of them. Every token is routed: the mask weighs the statistics."""

    moe: MoE
    embed: int
    dense_mlp: int

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
        m, e = self.moe, self.embed
        f = m.expert_mlp(self.dense_mlp)
        router = param(self, "router", (e, m.experts), ("embed", None))
        logits = h.astype(F32) @ router.astype(F32)  # [batch, seq, experts]
        if m.scoring == "sigmoid":
            scores = jax.nn.sigmoid(logits)
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # the balance loss's P
        else:
            scores = probs = jax.nn.softmax(logits, axis=-1)
        choice = scores
        if m.bias_update_rate is not None:  # selection only: the gates read the scores
            bias = self.variable(ROUTER_STATE, "bias", jnp.zeros, (m.experts,), F32).value
            if self.is_initializing():  # counted by lm_loss, read by with_moved_biases: not by the layer
                self.variable(ROUTER_STATE, "load", jnp.zeros, (m.experts,), F32)
            choice = choice + jax.lax.stop_gradient(bias.astype(F32))
        if m.groups > 1:
            choice = _within_top_groups(choice, m.groups, m.routed_groups, m.group_score)
        top, ids = jax.lax.top_k(choice, m.top_k)
        if choice is not scores:  # the gates read the unbiased scores
            top = jnp.take_along_axis(scores, ids, axis=-1)
        if m.normalize_top_k:
            top = top / (jnp.sum(top, axis=-1, keepdims=True) + (1e-20 if m.scoring == "sigmoid" else 0.0))
        gates = top * m.routed_scale if m.routed_scale != 1.0 else top
        held = experts_held(m.experts)  # in a pipeline's stage over ep: its rank's experts
        w_gate = param(self, "w_gate", (held, e, f), ("expert", "embed", "mlp"))
        w_up = param(self, "w_up", (held, e, f), ("expert", "embed", "mlp"))
        w_down = param(self, "w_down", (held, f, e), ("expert", "mlp", "embed"))
        out, dropped = expert_mlp(
            h, ids, gates, w_gate, w_up, w_down, capacity_factor=m.capacity_factor,
            exchange=m.exchange, grouped=m.grouped, chunks=m.dispatch_chunks,  # type: ignore[arg-type]  # validated
        )  # fmt: skip
        if m.shared_mlp:
            s = m.shared_mlp
            shared = _swiglu(
                h,
                param(self, "shared_gate", (e, s), ("embed", "mlp")),
                param(self, "shared_up", (e, s), ("embed", "mlp")),
                param(self, "shared_down", (s, e), ("mlp", "embed")),
            )
            if m.shared_gate:
                gate = param(self, "shared_router", (e, 1), ("embed", None)).astype(F32)
                shared = jax.nn.sigmoid(h.astype(F32) @ gate) * shared.astype(F32)
            out = out + shared.astype(out.dtype)
        # sums over the tokens (MoE.aux_losses turns them into the losses), so that parts of a batch add up
        return out, _router_sums(m, ids, probs, logits, mask, dropped)


def _router_sums(m: MoE, ids, probs, logits, mask, dropped) -> dict[str, jax.Array]:
    """:class:`MoELayer`'s statistics: sums over the tokens ``mask`` counts (all without one); the per-row terms of
    the per-sequence loss only when it is the loss (they are ``[batch, experts]`` arrays the others never read)."""
    picks = jax.nn.one_hot(ids, m.experts, dtype=F32)  # [batch, seq, top_k, experts]
    if mask is None:
        stats = {
            "tokens": jnp.sum(picks, axis=(0, 1, 2)),
            "probs": jnp.sum(probs, axis=(0, 1)),
            "z": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
            "count": jnp.asarray(ids.shape[0] * ids.shape[1], F32),
        }
    else:
        w = mask.astype(F32)
        stats = {
            "tokens": jnp.einsum("bs,bske->e", w, picks),
            "probs": jnp.einsum("bs,bse->e", w, probs),
            "z": jnp.sum(w * jax.nn.logsumexp(logits, axis=-1) ** 2),
            "count": jnp.sum(w),
        }
    if m.balance_loss == "per-sequence":
        w = jnp.ones(ids.shape[:2], F32) if mask is None else mask.astype(F32)
        row_tokens = jnp.einsum("bs,bske->be", w, picks)
        row_count = jnp.sum(w, axis=1)
        row_f_p = jnp.sum(row_tokens * jnp.einsum("bs,bse->be", w, probs), axis=-1)
        stats["row_balance"] = jnp.sum(row_f_p / jnp.where(row_count > 0, row_count, 1.0) ** 2)
        stats["rows"] = jnp.sum((row_count > 0).astype(F32))
    return {**stats, "dropped": dropped}


def _within_top_groups(choice: jax.Array, groups: int, top_groups: int, group_score: str) -> jax.Array:
    """``choice [..., experts]`` with the experts outside each token's ``top_groups`` best groups at ``-inf``;
    a group's score is the sum of its two best choices (``"top2"``; its best alone for groups of one expert) or
    its best (``"max"``)."""
    per = choice.shape[-1] // groups
    grouped = choice.reshape(*choice.shape[:-1], groups, per)
    best_of = 1 if group_score == "max" else min(2, per)
    score = jnp.sum(jax.lax.top_k(grouped, best_of)[0], axis=-1)  # [..., groups]
    _, best = jax.lax.top_k(score, top_groups)
    keep = jnp.any(best[..., :, None] == jnp.arange(groups), axis=-2)  # [..., groups]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


EXPERT_KEYS = ("['w_gate']", "['w_up']", "['w_down']")


def expert_splits(layers: Any) -> Any:
    """A pipeline's ``split_over`` for stacked layers ``[L, ...]``: ``{1: ep}`` for the experts' weights (their
    experts split over ``ep``, each rank's stage holding its own), ``None`` for the rest."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: {1: EP} if jax.tree_util.keystr(path[-1:]) in EXPERT_KEYS else None, layers
    )


def check_experts_in_pipeline(moe: MoE, schedule: Any) -> None:
    """A mixture of experts runs under every schedule.

    Its load-balancing loss multiplies each expert's token share by its mean probability, so the gradient of a
    microbatch's router needs the routing of every row the loss pools. GPipe's backward starts after the last
    forward: it pools the whole batch (the stages carry the routers' sums). A table schedule runs some backward
    passes first: there each microbatch's losses are its own (each data-parallel rank's microbatch, as
    Megatron-LM computes them), weighted by its share of the scored tokens, as gradient accumulation weighs them;
    ``balance_loss="pooled"``, whose layers meet before its product, then has no per-stage part.
    """
    if schedule is None:
        return
    if schedule.tabled and moe.balance_loss == "pooled":
        raise ValueError(
            f"Decoder: MoE(balance_loss='pooled') under the table schedule {schedule.name!r}: the pooled loss "
            "multiplies the token shares and probabilities summed over every layer, which no stage holds while "
            "its microbatch's backward pass runs. Use balance_loss='per-layer' (Megatron-LM's, per microbatch "
            "there) or 'per-sequence', or schedule='gpipe'."
        )
    sizes = jax.sharding.get_abstract_mesh().shape
    if int(sizes.get(EP, 1)) > 1 and int(sizes.get(DP, 1)) > 1 and schedule.zero3_gather == "layer":
        # measured, jax 0.10.2: experts split over a manual ep and a GSPMD dp inside the stage abort XLA's SPMD
        # partitioner (a failed check in spmd_partitioner_util.cc, the process killed)
        raise ValueError(
            f"Decoder: a mixture-of-experts model with {EP}={sizes[EP]} under pipeline parallelism needs "
            f"Pipeline(zero3_gather='step') (the stage's weights gathered over {DP} once per step); "
            "zero3_gather='layer' (the default at stages 2 and 3) keeps them split over dp inside the stage, "
            "which XLA's partitioner cannot combine with the experts' ep split."
        )

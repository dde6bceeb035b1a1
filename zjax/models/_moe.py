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

from ..experts import EXCHANGES, GROUPED, expert_mlp
from ..experts._dispatch import experts_held
from ._params import param

F32 = jnp.float32

BALANCE_LOSSES = {
    "per-layer": "the mean over layers of each layer's E x sum_e f_le P_le",
    "pooled": "E x sum_e mean_l(f_le) x mean_l(P_le): the routers pooled first (Hugging Face's Mixtral, Qwen-MoE)",
}
"""How :class:`MoE`'s load-balancing loss combines the layers (``MoE(balance_loss=...)``)."""


@dataclasses.dataclass(frozen=True)
class MoE:
    """A mixture-of-experts feed-forward layer in every decoder layer (``DecoderConfig(moe=MoE(...))``).

    Each token's router probabilities are ``softmax(h @ router)`` (fp32); the token goes to its ``top_k``
    most probable experts, their outputs weighted by those probabilities, renormalized to sum to 1 when
    ``normalize_top_k`` (Mixtral, Qwen3-MoE; the same as a softmax over the top-k logits) and as they are
    otherwise (Qwen2-MoE). ``mlp`` is each expert's hidden size (default: the decoder's ``mlp``);
    ``shared_mlp > 0`` adds a shared SwiGLU expert of that size that every token passes through, scaled by
    ``sigmoid(h @ shared_gate)`` (Qwen2-MoE). ``capacity_factor`` (default ``None``: dropless) caps each expert
    at :func:`zjax.experts.capacity` rows of each device's tokens. The loss adds
    ``load_balance_weight x`` the load-balancing loss (Switch Transformer's ``E x sum_e f_e P_e`` with ``f_e``
    the fraction of tokens that chose expert ``e`` and ``P_e`` its mean probability; ``top_k`` when perfectly
    balanced), the layers combined as ``balance_loss`` says (:data:`BALANCE_LOSSES`: ``"per-layer"``, the mean
    of each layer's loss, or ``"pooled"``, each expert's ``f`` and ``P`` averaged over layers first, as Hugging
    Face's Mixtral computes it), and ``z_loss_weight x`` the router z-loss (``mean(logsumexp(logits)^2)``,
    ST-MoE) averaged over layers. The routers count the tokens whose ``loss_mask`` is nonzero (padding is not
    routed traffic; :func:`zjax.models.lm_loss`). ``exchange`` picks how rows cross
    ``ep`` and ``grouped`` the grouped matmul (:func:`zjax.experts.expert_mlp`; both by platform by default).
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
    exchange: str | None = None
    grouped: str | None = None

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
        if self.exchange is not None and self.exchange not in EXCHANGES:
            raise ValueError(f"MoE: exchange={self.exchange!r}; use one of {list(EXCHANGES)} or None (by platform).")
        if self.grouped is not None and self.grouped not in GROUPED:
            raise ValueError(f"MoE: grouped={self.grouped!r}; use one of {list(GROUPED)} or None (by platform).")

    def expert_mlp(self, dense_mlp: int) -> int:
        return dense_mlp if self.mlp is None else self.mlp

    def params_per_layer(self, embed: int, dense_mlp: int) -> tuple[int, int]:
        """``(expert, dense)`` parameters of one layer's MoE: the experts' matrices, and the router and shared
        expert (held like any dense parameter)."""
        experts = self.experts * 3 * embed * self.expert_mlp(dense_mlp)
        shared = (3 * embed * self.shared_mlp + embed) if self.shared_mlp else 0
        return experts, embed * self.experts + shared

    def active_per_layer(self, embed: int, dense_mlp: int) -> int:
        """Matmul parameters one token passes through in one layer: ``top_k`` experts, the router, the shared
        expert."""
        return self.top_k * 3 * embed * self.expert_mlp(dense_mlp) + self.params_per_layer(embed, dense_mlp)[1]

    def aux_losses(self, stats: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """``(load_balance, z_loss)``, scalars, from the routers' sums (:class:`MoELayer`'s ``stats``, stacked per
        layer) over the ``N_l`` tokens each layer counted: the load-balancing loss as :attr:`balance_loss` combines
        the layers (:data:`BALANCE_LOSSES`, with ``f_le = tokens_le / N_l`` and ``P_le = probs_le / N_l``) and
        the mean over layers of ``z_l / N_l``. Computed from sums, they are the same however the tokens were split
        on the way (microbatches of a pipeline, data-parallel ranks); a layer that counted no token adds 0."""
        count = stats["count"]
        safe = jnp.where(count > 0, count, 1.0)
        if self.balance_loss == "pooled":
            total = jnp.maximum(jnp.sum(count), 1.0)
            share, prob = jnp.sum(stats["tokens"], axis=0) / total, jnp.sum(stats["probs"], axis=0) / total
            balance = self.experts * jnp.sum(share * prob)
        else:
            balance = jnp.mean(self.experts * jnp.sum(stats["tokens"] * stats["probs"], axis=-1) / (safe * safe))
        return balance, jnp.mean(stats["z"] / safe)

    def loss(self, stats: dict[str, jax.Array]) -> jax.Array:
        """The weighted auxiliary losses of ``stats`` (per layer, stacked)."""
        balance, z = self.aux_losses(stats)
        return self.load_balance_weight * balance + self.z_loss_weight * z


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
        probs = jax.nn.softmax(logits, axis=-1)
        top, ids = jax.lax.top_k(probs, m.top_k)
        gates = top / jnp.sum(top, axis=-1, keepdims=True) if m.normalize_top_k else top
        held = experts_held(m.experts)  # in a pipeline's stage over ep: its rank's experts
        w_gate = param(self, "w_gate", (held, e, f), ("expert", "embed", "mlp"))
        w_up = param(self, "w_up", (held, e, f), ("expert", "embed", "mlp"))
        w_down = param(self, "w_down", (held, f, e), ("expert", "mlp", "embed"))
        out, dropped = expert_mlp(
            h, ids, gates, w_gate, w_up, w_down, capacity_factor=m.capacity_factor,
            exchange=m.exchange, grouped=m.grouped,  # type: ignore[arg-type]  # validated in MoE
        )  # fmt: skip
        if m.shared_mlp:
            s = m.shared_mlp
            shared = _swiglu(
                h,
                param(self, "shared_gate", (e, s), ("embed", "mlp")),
                param(self, "shared_up", (e, s), ("embed", "mlp")),
                param(self, "shared_down", (s, e), ("mlp", "embed")),
            )
            weight = jax.nn.sigmoid(h.astype(F32) @ param(self, "shared_router", (e, 1), ("embed", None)).astype(F32))
            out = out + (weight * shared.astype(F32)).astype(out.dtype)
        # sums over the tokens (MoE.aux_losses turns them into the losses), so that parts of a batch add up
        w = jnp.ones(ids.shape[:2], F32) if mask is None else mask.astype(F32)
        stats = {
            "tokens": jnp.einsum("bs,bske->e", w, jax.nn.one_hot(ids, m.experts, dtype=F32)),
            "probs": jnp.einsum("bs,bse->e", w, probs),
            "z": jnp.sum(w * jax.nn.logsumexp(logits, axis=-1) ** 2),
            "count": jnp.sum(w),
            "dropped": dropped,
        }
        return out, stats

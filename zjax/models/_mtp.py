"""Multi-token prediction (DeepSeek-V3's MTP): modules after the decoder that each predict one token further ahead.

Module ``k`` (1-based) takes the previous module's hidden states (the decoder's last layer's for ``k = 1``, before
its final norm) and the embeddings of the tokens ``k`` places after each input, RMS-normalises both, projects
their concatenation ``[embedding; hidden]`` from ``2 x embed`` to ``embed``, runs one decoder layer, and its
normalised output through the shared head predicts the token ``k + 1`` places after each input (the embedding
table and the head are the decoder's). :func:`zjax.models.lm_loss` adds ``mtp_weight / mtp_layers`` times the
modules' cross-entropy sums to the next-token loss's sum, all divided by the next-token targets' count (so that the
objective is a sum over tokens however the batch is split). A mixture of experts' MTP layer routes without
selection biases and adds no balance loss.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._block import Block, _constrain
from ._config import DecoderConfig
from ._layers import RMSNorm
from ._params import param


class MTP(nn.Module):
    """``MTP(cfg)(hidden, embedded, positions, segment_ids) -> (next hidden, normed hidden for the head)``."""

    cfg: DecoderConfig
    load_balanced: bool = False

    @nn.compact
    def __call__(
        self,
        hidden: jax.Array,
        embedded: jax.Array,
        positions: jax.Array | None,
        segment_ids: jax.Array | None,
        dropout_keys: jax.Array | None = None,
        layer: jax.Array | int = 0,
    ) -> tuple[jax.Array, jax.Array]:
        c = self.cfg
        e = RMSNorm(c.embed, c.norm_eps, name="embed_norm")(embedded)
        h = RMSNorm(c.embed, c.norm_eps, name="hidden_norm")(hidden)
        w = param(self, "w_proj", (2 * c.embed, c.embed), (None, "embed"))
        x = _constrain(jnp.concatenate([e, h], axis=-1) @ w.astype(e.dtype))
        block = Block(c.mtp_layer, self.load_balanced, name="layer")
        x, _ = block(x, positions, segment_ids, None, dropout_keys, layer)
        return x, RMSNorm(c.embed, c.norm_eps, name="norm")(x)


def mtp_rows(
    tokens: jax.Array, segment_ids: jax.Array | None, loss_mask: jax.Array | None, depth: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(inputs, targets, weights)``, each ``[depth, B, S]``, of the multi-token prediction modules from the batch's
    ``[B, S+1]`` rows: module ``k`` (1-based) reads the token ``k`` places after each input and predicts the one
    ``k + 1`` places after it; a target past the row, outside the input's document or masked weighs 0."""
    s = tokens.shape[1] - 1
    inputs, targets, weights = [], [], []
    for k in range(1, depth + 1):
        shifted = lambda x, by: jnp.pad(x[:, by:], ((0, 0), (0, max(by - 1, 0))))[:, :s]  # noqa: E731
        inputs.append(shifted(tokens, k))
        target = jnp.pad(tokens[:, k + 1 :], ((0, 0), (0, k)))[:, :s]
        weight = jnp.broadcast_to((jnp.arange(s) + k + 1 <= s).astype(jnp.float32), target.shape)
        if loss_mask is not None:
            weight = weight * jnp.pad(loss_mask[:, k + 1 :].astype(jnp.float32), ((0, 0), (0, k)))[:, :s]
        if segment_ids is not None:  # documents are contiguous: the same document at i and i + k + 1
            later = jnp.pad(segment_ids[:, k + 1 :], ((0, 0), (0, k)))[:, :s]
            weight = weight * (later == segment_ids[:, :s]).astype(jnp.float32)
        targets.append(target)
        weights.append(weight)
    return jnp.stack(inputs), jnp.stack(targets), jnp.stack(weights)

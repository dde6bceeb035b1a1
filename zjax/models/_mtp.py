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
    ) -> tuple[jax.Array, jax.Array]:
        c = self.cfg
        e = RMSNorm(c.embed, c.norm_eps, name="embed_norm")(embedded)
        h = RMSNorm(c.embed, c.norm_eps, name="hidden_norm")(hidden)
        w = param(self, "w_proj", (2 * c.embed, c.embed), (None, "embed"))
        x = _constrain(jnp.concatenate([e, h], axis=-1) @ w.astype(e.dtype))
        x, _ = Block(c.mtp_layer, self.load_balanced, name="layer")(x, positions, segment_ids)
        return x, RMSNorm(c.embed, c.norm_eps, name="norm")(x)

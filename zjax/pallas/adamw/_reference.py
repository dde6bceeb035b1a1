"""The fused mixed-precision AdamW update in plain jnp: the definition of correct and the CPU path.

With ``t`` the step count after this update, ``g`` the unscaled fp32 gradient and ``p`` the fp32 master:

    m' = b1 m + (1 - b1) g                  v' = b2 v + (1 - b2) g^2
    u  = (m' / (1 - b1^t)) / (sqrt(v' / (1 - b2^t)) + eps) + wd p
    p' = p - lr u                           compute copy = p'.astype(compute_dtype)

(``optax.adamw`` with ``eps_root=0``: decoupled weight decay, Loshchilov & Hutter 2019.) When ``apply`` is
0 (non-finite gradients under loss scaling) every output equals its input.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Scalars(NamedTuple):
    """Per-step scalars, fp32: learning rate, betas, eps, weight decay, bias corrections, 1/loss scale, apply."""

    lr: jax.Array
    b1: jax.Array
    b2: jax.Array
    eps: jax.Array
    wd: jax.Array
    bc1: jax.Array  # 1 - b1^t
    bc2: jax.Array  # 1 - b2^t
    inv_scale: jax.Array
    apply: jax.Array  # 1.0 to update, 0.0 to keep everything as it is

    def as_array(self, size: int = 16) -> jax.Array:
        """Packed into one fp32 vector (padded to ``size``, a power of two for Triton)."""
        vec = jnp.stack([jnp.asarray(x, jnp.float32) for x in self])
        return jnp.pad(vec, (0, size - vec.shape[0]))


def adamw_math(s, g, p, m, v):
    """The elementwise update on fp32 values; ``s`` indexes like :class:`Scalars` (fields or vector)."""
    lr, b1, b2, eps, wd, bc1, bc2, inv_scale, apply = (s[i] for i in range(9))
    g = g * inv_scale
    m_new = b1 * m + (1.0 - b1) * g
    v_new = b2 * v + (1.0 - b2) * (g * g)
    update = (m_new / bc1) / (jnp.sqrt(v_new / bc2) + eps) + wd * p
    p_new = p - lr * update
    keep = apply == 0.0
    return jnp.where(keep, p, p_new), jnp.where(keep, m, m_new), jnp.where(keep, v, v_new)


def adamw_reference(scalars: Scalars, grad, master, m, v, compute_dtype):
    """``(new_master, new_m, new_v, new_compute)`` for one array (any shape)."""
    p, m_new, v_new = adamw_math(tuple(scalars), grad.astype(jnp.float32), master, m, v)
    return p, m_new, v_new, p.astype(compute_dtype)

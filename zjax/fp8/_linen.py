"""How a linen module's product takes a recipe of :data:`zjax.fp8.MATMULS`: the Decoder's projections and a user's own
layers call :func:`linen_matmul`, which keeps what a recipe needs (delayed scaling's amax history) as the module's
variable and checks what it needs of the shapes (MXFP8's blocks) where the parameter's path is known."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._delayed import COLLECTION, HISTORY, matmul_delayed
from ._matmul import F32, MATMULS, matmul
from ._mx import check_blocks, matmul_mx


def linen_matmul(
    module: Any, name: str, x: jax.Array, w: jax.Array, recipe: str = "fp8-current", contract: int = 1,
    history: int = HISTORY,
) -> jax.Array:  # fmt: skip
    """``x @ w`` (contracting ``x``'s last ``contract`` dims with ``w``'s first) by a recipe of
    :data:`zjax.fp8.MATMULS`, inside a linen module's ``@nn.compact`` method: how a user's own layers opt in.
    ``"fp8-delayed"`` keeps the amax history as the module's variable ``name`` in :data:`COLLECTION`
    (initialise the model with :meth:`zjax.Variables.linen` and give the train step a
    ``loss_fn(params, batch, model_state)``).

    Example:
      >>> kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 512))
      >>> y = zjax.fp8.linen_matmul(self, "kernel", x, kernel, "fp8-delayed")
    """
    if recipe == "fp8-current":
        return matmul(x, w, contract)
    if recipe == "mxfp8":  # the blocked dims checked here, where the parameter's path is known
        check_blocks(f"zjax.fp8 ({'/'.join(module.path)}/{name})", x, w, contract)
        return matmul_mx(x, w, contract)
    if recipe == "fp8-delayed":
        hist = module.variable(COLLECTION, name, lambda: jnp.zeros((3, history), F32))
        return matmul_delayed(x, w, hist.value, contract)
    if recipe == "default":
        return jnp.tensordot(x, w.astype(x.dtype), axes=contract)
    raise ValueError(f"zjax.fp8.linen_matmul: recipe {recipe!r}; use one of {list(MATMULS)}.")

"""How the decoder's modules make and read a parameter: fp32, with logical axis names, through qwZ's gather."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from .. import comm


def param(
    module: nn.Module,
    name: str,
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    init=None,
    gather=True,
):
    """The parameter ``name`` of ``module`` (fp32 when made; the step passes it in the compute dtype), read
    through :func:`zjax.comm.gathered` (int8 over the ZeRO axes under ``Plan(quantized_comm="weights")``);
    ``gather=False``: as it lies, for a reader that gathers it itself (:func:`zjax.comm.lookup`)."""
    init = nn.initializers.lecun_normal() if init is None else init
    if comm.reads_shards() and module.has_variable("params", name):
        # a step manual over the data axes passes this rank's shard: gathered below (flax would refuse its shape)
        value = nn.unbox(module.get_variable("params", name))
    else:
        value = module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)
    return comm.gathered(value, (*module.path, name)) if gather else value

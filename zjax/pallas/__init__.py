"""Pallas GPU kernels, each with a pure-jnp reference that is also the CPU path."""

from .adamw import FusedAdamW as FusedAdamW
from .adamw import FusedAdamWConfig as FusedAdamWConfig
from .adamw import fused_adamw as fused_adamw
from .quantize import QuantizeConfig as QuantizeConfig
from .quantize import quantize_blocks as quantize_blocks

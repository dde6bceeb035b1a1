"""Fused mixed-precision AdamW: reference (jnp), Pallas kernel, config and API."""

from ._api import IMPLEMENTATIONS as IMPLEMENTATIONS
from ._api import FusedAdamW as FusedAdamW
from ._api import FusedAdamWState as FusedAdamWState
from ._api import fused_adamw as fused_adamw
from ._config import FusedAdamWConfig as FusedAdamWConfig
from ._kernel import adamw_kernel as adamw_kernel
from ._reference import Scalars as Scalars
from ._reference import adamw_reference as adamw_reference

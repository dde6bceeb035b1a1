"""Mixture-of-experts building blocks: token dispatch over the ``ep`` mesh axis and grouped expert matmuls."""

from ._dispatch import EXCHANGES as EXCHANGES
from ._dispatch import GROUPED as GROUPED
from ._dispatch import capacity as capacity
from ._dispatch import default_grouped as default_grouped
from ._dispatch import expert_mlp as expert_mlp
from ._dispatch import experts_held as experts_held
from ._dispatch import grouped_swiglu as grouped_swiglu
from ._dispatch import local_experts as local_experts
from ._dispatch import rows_per_rank as rows_per_rank

"""FP8 matrix products (current and delayed scaling, MXFP8) for a model's projections."""

from ._delayed import COLLECTION as COLLECTION
from ._delayed import HISTORY as HISTORY
from ._delayed import advance as advance
from ._delayed import amax_seen as amax_seen
from ._delayed import finite as finite
from ._delayed import histories as histories
from ._delayed import matmul_delayed as matmul_delayed
from ._delayed import saturated as saturated
from ._delayed import with_histories as with_histories
from ._linen import linen_matmul as linen_matmul
from ._matmul import MATMULS as MATMULS
from ._matmul import matmul as matmul
from ._matmul import quantize as quantize
from ._mx import BLOCK as BLOCK
from ._mx import check_device as check_device
from ._mx import matmul_mx as matmul_mx
from ._mx import quantize_blocks as quantize_blocks

# the rest: the train step's side of delayed scaling (histories ... saturated, zjax.core) and check_device (the
# planner's and zjax train's check of a recipe against the GPU it would run on)
__all__ = [
    "BLOCK", "COLLECTION", "HISTORY", "MATMULS", "linen_matmul", "matmul", "matmul_delayed", "matmul_mx", "quantize",
    "quantize_blocks",
]  # fmt: skip

"""FP8 matrix products (current and delayed scaling) for a model's projections."""

from ._delayed import COLLECTION as COLLECTION
from ._delayed import HISTORY as HISTORY
from ._delayed import advance as advance
from ._delayed import amax_seen as amax_seen
from ._delayed import finite as finite
from ._delayed import histories as histories
from ._delayed import linen_matmul as linen_matmul
from ._delayed import matmul_delayed as matmul_delayed
from ._delayed import saturated as saturated
from ._delayed import with_histories as with_histories
from ._matmul import MATMULS as MATMULS
from ._matmul import matmul as matmul
from ._matmul import quantize as quantize

# the rest (histories ... saturated) is the train step's side of delayed scaling (zjax.core)
__all__ = ["COLLECTION", "HISTORY", "MATMULS", "linen_matmul", "matmul", "matmul_delayed", "quantize"]

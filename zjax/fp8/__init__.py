"""FP8 matrix products (current scaling) for a model's projections."""

from ._matmul import MATMULS as MATMULS
from ._matmul import matmul as matmul
from ._matmul import quantize as quantize

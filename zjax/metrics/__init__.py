"""Run-time metrics: writers (JSON lines, TensorBoard, W&B) and model FLOPs / MFU."""

from ._flops import flops_per_token as flops_per_token
from ._flops import matmul_params as matmul_params
from ._flops import mfu as mfu
from ._writer import MetricsWriter as MetricsWriter

"""Fewer bytes on the wire: ZeRO-3 weight gathers as int8 blocks (ZeRO++'s qwZ).

plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm="weights")
"""

from ._gather import QUANTIZED_COMM as QUANTIZED_COMM
from ._gather import gathered as gathered
from ._gather import use as use
from ._quantize import DEFAULT_BLOCK as DEFAULT_BLOCK
from ._quantize import dequantize as dequantize
from ._quantize import quantize as quantize

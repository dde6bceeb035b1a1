"""Fewer bytes on the wire: ZeRO-3 weight gathers (qwZ) and gradient reductions (qgZ) as int8 or int4 blocks (ZeRO++).

plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm="weights+grads")  # int8 both ways
plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, quantized_comm="weights+grads:int4")  # ZeRO++'s int4 gradients
"""

from ._gather import GATHERED as GATHERED
from ._gather import QUANTIZED_COMM as QUANTIZED_COMM
from ._gather import gather_unread as gather_unread
from ._gather import gathered as gathered
from ._gather import gathered_tree as gathered_tree
from ._gather import manual as manual
from ._gather import manual_spec as manual_spec
from ._gather import passthrough as passthrough
from ._gather import reads as reads
from ._gather import reads_shards as reads_shards
from ._gather import shard_reads as shard_reads
from ._gather import use as use
from ._lookup import lookup as lookup
from ._quantize import DEFAULT_BLOCK as DEFAULT_BLOCK
from ._quantize import FLOAT8 as FLOAT8
from ._quantize import Wire as Wire
from ._quantize import dequantize as dequantize
from ._quantize import parse as parse
from ._quantize import quantize as quantize
from ._reduce import Reduction as Reduction
from ._reduce import reduce as reduce
from ._scan import layer_scan as layer_scan
from ._scan import quantized_reductions as quantized_reductions

"""Named activation-checkpointing policies and scan-over-layers helpers."""

from ._partition import gather_checkpoint as gather_checkpoint
from ._partition import partition_checkpoint as partition_checkpoint
from ._policy import DECODER_NAMES as DECODER_NAMES
from ._policy import POLICIES as POLICIES
from ._policy import RematPolicy as RematPolicy
from ._scan import LAYERS as LAYERS
from ._scan import STACKED as STACKED
from ._scan import linen_scan as linen_scan
from ._scan import nested_scan as nested_scan
from ._scan import nnx_scan as nnx_scan
from ._scan import nnx_stack as nnx_stack

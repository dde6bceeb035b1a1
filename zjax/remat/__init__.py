"""Named activation-checkpointing policies."""

from ._policy import DECODER_NAMES as DECODER_NAMES
from ._policy import POLICIES as POLICIES
from ._policy import RematPolicy as RematPolicy

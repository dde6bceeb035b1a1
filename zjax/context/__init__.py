"""Long context: attention that never holds ``[S, S]``, and sequences split over the ``cp`` mesh axis."""

from ._attention import CONTEXT_MODES as CONTEXT_MODES
from ._attention import attention as attention
from ._attention import attention_implementation as attention_implementation
from ._blocked import Blocks as Blocks
from ._sequence import balanced_order as balanced_order
from ._sequence import check_length as check_length
from ._sequence import check_sequence as check_sequence
from ._sequence import context_size as context_size
from ._sequence import load_balance as load_balance

"""Reference models used by the example, the tests and the planner presets."""

from ._decoder import PRESETS as PRESETS
from ._decoder import Decoder as Decoder
from ._decoder import DecoderConfig as DecoderConfig
from ._decoder import lm_loss as lm_loss

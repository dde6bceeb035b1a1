"""The Llama-family decoder (Llama-2/3/3.1, Mistral, Qwen2, Mixtral and Qwen-MoE by configuration), its loss and
its presets."""

from ._biases import ROUTER_STATE as ROUTER_STATE
from ._biases import moved_bias as moved_bias
from ._biases import with_moved_biases as with_moved_biases
from ._config import DecoderConfig as DecoderConfig
from ._config import RopeScaling as RopeScaling
from ._config import YarnScaling as YarnScaling
from ._decoder import Decoder as Decoder
from ._hf_config import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES
from ._hf_config import config_from_hf as config_from_hf
from ._hf_config import config_to_hf as config_to_hf
from ._hf_config import from_hf_config as from_hf_config
from ._layers import dropout_keys as dropout_keys
from ._loss import lm_loss as lm_loss
from ._mla import MLA as MLA
from ._moe import BALANCE_LOSSES as BALANCE_LOSSES
from ._moe import GROUP_SCORES as GROUP_SCORES
from ._moe import SCORINGS as SCORINGS
from ._moe import MoE as MoE
from ._moe import MoELayer as MoELayer
from ._presets import PRESETS as PRESETS
from ._train import train_functions as train_functions

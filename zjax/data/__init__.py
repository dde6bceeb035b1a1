"""Training data on grain: local files, Hugging Face tokenizers (or bytes), packed rows, per-process reads.

Example:
  >>> tok = zjax.data.load_tokenizer("ckpt_dir")                  # or None: bytes
  >>> train, held_out = zjax.data.train_eval_split(zjax.data.tokenize("corpus/", tok), 0.01)
  >>> data = zjax.data.LMData(train, seq_len=2048, batch_size=256, eos_id=tok.eos_id, seed=0)
  >>> batch = plan.shard_batch(data.batch(step, plan.mesh))      # this process's rows only
"""

from ._dataset import LMData as LMData
from ._dataset import PackedRows as PackedRows
from ._dataset import tokenize as tokenize
from ._dataset import train_eval_split as train_eval_split
from ._sources import read_documents as read_documents
from ._sources import read_tokens as read_tokens
from ._tokenize import ByteTokenizer as ByteTokenizer
from ._tokenize import HFTokenizer as HFTokenizer
from ._tokenize import Tokenizer as Tokenizer
from ._tokenize import load_tokenizer as load_tokenizer

"""Hugging Face checkpoints: ``load`` into a plan's sharded layout and ``save`` from one (safetensors).

Needs the ``hf`` extra (``pip install 'zjax[hf]'``: safetensors), imported only when these run.

Example:
  >>> model = zjax.models.from_hf_config("ckpt_dir")
  >>> state = zjax.hf.load("ckpt_dir", plan, model, optax.adamw(1e-5))
  >>> zjax.hf.save("out_dir", model, state)
"""

from ._load import load as load
from ._save import save as save

"""The training loop as a library piece: a user's own model, loss and data, zjax's step loop around them.

Example (8 simulated CPU devices)::

    config = zjax.train.LoopConfig(steps=100, eval_every=20, checkpoint_dir="runs/ckpt", resume=True)
    with zjax.train.runtime(config):                       # before anything starts a JAX backend
        plan = zjax.Plan(zjax.make_mesh(dp=-1), stage=3)
        state, start = zjax.train.init_or_restore(plan, init_fn, tx, jax.random.key(0), config)
        step = plan.train_step(loss_fn, accum_steps=2)
        result = zjax.train.fit(plan, step, state, batches, config, start=start,
                                eval_step=plan.eval_step(loss_fn), eval_data=held_out)

A script's flags and a TOML run file: ``zjax.train.add_arguments(parser)``, then
``args, config = zjax.train.parse_args(parser)`` (``--config run.toml``; explicit flags win).

The trainer behind ``zjax train``: :class:`RunConfig` (a run's sections: model, data, plan, pipeline, optim, loop,
output) and :func:`run_lm`, which trains a decoder language model from one; :class:`Optim` builds the optimizer
and learning-rate schedule of its ``[optim]`` section.
"""

from .._argparse import ArgumentParser as ArgumentParser
from ._command import add_train_arguments as add_train_arguments
from ._command import one_line_errors as one_line_errors
from ._command import run_command as run_command
from ._config import LoopConfig as LoopConfig
from ._config import add_arguments as add_arguments
from ._files import load_config as load_config
from ._files import parse_args as parse_args
from ._lm import run_lm as run_lm
from ._loop import FitResult as FitResult
from ._loop import fit as fit
from ._loop import init_or_restore as init_or_restore
from ._optim import OPTIMIZERS as OPTIMIZERS
from ._optim import SCHEDULES as SCHEDULES
from ._optim import Optim as Optim
from ._optim import whole_matrices as whole_matrices
from ._run import RunConfig as RunConfig
from ._runtime import runtime as runtime

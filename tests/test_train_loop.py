"""zjax.train.fit: a user's own flax model, loss and data; evaluation and checkpoint cadences, resume, preemption."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
import zjax.train

ROOT = Path(__file__).resolve().parents[1]


class Regressor(nn.Module):
    """The user's model: nothing zjax-specific in it."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.tanh(nn.Dense(32)(x)))


MODEL = Regressor()
TX = optax.adam(1e-2)


def init_fn(rng):
    return MODEL.init(rng, jnp.zeros((1, 8)))["params"]


def loss_fn(params, batch):  # the user's loss: a Huber loss on the regression targets
    return jnp.mean(optax.huber_loss(MODEL.apply({"params": params}, batch["x"]), batch["y"]))


def batches(seed=0):
    """The user's data: a plain generator of numpy batches (16 rows, the global batch)."""
    rs = np.random.RandomState(seed)
    w = rs.randn(8, 4).astype(np.float32)
    while True:
        x = rs.randn(16, 8).astype(np.float32)
        yield {"x": x, "y": np.sin(x @ w)}


HELD = [b for _, b in zip(range(3), batches(seed=1), strict=False)]  # held-out: a list, re-read each time


def setup(stage=2):
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=stage, precision="fp32")
    return plan, plan.train_step(loss_fn, accum_steps=2)


def by_hand(steps):
    """The same training written as a plain loop: the numbers fit must reproduce."""
    plan, step = setup()
    state, losses = plan.init(init_fn, TX, jax.random.key(0)), []
    for _, b in zip(range(steps), batches(), strict=False):
        state, m = step(state, plan.shard_batch(b))
        losses.append(float(m["loss"]))
    return losses


def test_a_user_model_loss_and_iterator_train_through_fit(tmp_path):
    plan, step = setup()
    config = zjax.train.LoopConfig(steps=7, log_every=2, eval_every=3, progress=False, log_dir=tmp_path)
    state = plan.init(init_fn, TX, jax.random.key(0))
    result = zjax.train.fit(plan, step, state, batches(), config, eval_step=plan.eval_step(loss_fn), eval_data=HELD)
    assert result.losses == by_hand(7)  # accumulation (2 microbatches) happens inside the plan's step
    assert result.losses[-1] < result.losses[0] and int(result.state.step) == 7
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6, 7]  # every 2 steps, the evaluations at 3 and 6, the end
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6, 7]  # and at the end
    assert records[-1]["loss"] == result.losses[-1] and result.eval_loss == records[-1]["eval_loss"]
    plain = plan.eval_step(loss_fn)
    assert result.eval_loss == pytest.approx(np.mean([float(plain(result.state, plan.shard_batch(b))) for b in HELD]))
    assert {"grad_norm", "loss_scale", "skipped", "step_time"} <= set(records[0])
    assert "tokens_per_second" not in records[0]  # no tokens_per_step given: no made-up rate


def test_checkpoint_cadence_and_resume_equal_a_straight_run(tmp_path):
    plan, step = setup()
    ckpt = tmp_path / "ckpt"
    first = zjax.train.LoopConfig(steps=7, save_every=2, stop_at=5, checkpoint_dir=ckpt, progress=False)
    state, start = zjax.train.init_or_restore(plan, init_fn, TX, jax.random.key(0), first)
    assert start == 0
    one = zjax.train.fit(plan, step, state, batches(), first)
    with zjax.Checkpointer(ckpt) as c:
        assert c.steps() == [2, 4, 5]  # every 2 steps, and the step it stopped at
        assert c.metadata(5)["user"] == {"data_position": 5}
    resume = zjax.train.LoopConfig(steps=7, save_every=2, checkpoint_dir=ckpt, resume=True, progress=False)
    state, start = zjax.train.init_or_restore(plan, init_fn, TX, jax.random.key(0), resume)
    assert start == 5
    two = zjax.train.fit(plan, step, state, batches(), resume, start=start)  # skips the 5 batches it saw
    assert one.losses + two.losses == by_hand(7)
    assert (two.start, two.end, two.preempted) == (5, 7, False)
    with zjax.Checkpointer(ckpt) as c:
        assert c.steps()[-1] == 7
    state, start = zjax.train.init_or_restore(plan, init_fn, TX, jax.random.key(0), resume)
    seven = [b for _, b in zip(range(7), batches(), strict=False)]
    done = zjax.train.fit(plan, step, state, seven, resume, start=start)
    assert (done.start, done.end, done.losses, done.memory) == (7, 7, [], None)  # a finished run: nothing to do


def test_data_forms_and_their_errors():
    plan, step = setup()
    state = plan.init(init_fn, TX, jax.random.key(0))
    listed = [b for _, b in zip(range(3), batches(), strict=False)]
    config = zjax.train.LoopConfig(steps=3, progress=False)
    by_step = zjax.train.fit(plan, step, state, lambda i: listed[i], config).losses
    state = plan.init(init_fn, TX, jax.random.key(0))
    assert zjax.train.fit(plan, step, state, listed, config).losses == by_step == by_hand(3)
    with pytest.raises(ValueError, match="data ran out at step 3"):
        fresh = plan.init(init_fn, TX, jax.random.key(0))
        zjax.train.fit(plan, step, fresh, listed, zjax.train.LoopConfig(steps=4, progress=False))
    with pytest.raises(TypeError, match="data of type int gives no batches"):
        zjax.train.fit(plan, step, state, 3, config)
    with pytest.raises(ValueError, match="eval_every=2 needs eval_step and eval_data"):
        zjax.train.fit(plan, step, state, listed, zjax.train.LoopConfig(steps=3, eval_every=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": -1}, "steps=-1 must be an int >= 0"),
        ({"log_every": 0}, "log_every=0 must be an int >= 1"),
        ({"resume": True}, "resume=True needs checkpoint_dir"),
        ({"preemptible": True}, "preemptible=True needs checkpoint_dir"),
        ({"cpu_devices": 8, "processes": 3}, "cpu_devices=8 must divide among processes=3"),
    ],
)
def test_loop_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zjax.train.LoopConfig(**kwargs)


@pytest.mark.slow  # jax.distributed with gloo in a fresh process
def test_sigterm_saves_and_returns_cleanly(tmp_path):
    """A SIGTERM during step 3 (sent by the data function, so the moment is fixed): every process agrees on a
    step, saves it, and fit returns with preempted; the script exits 0 and a resumed run continues there."""
    script = tmp_path / "user.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import jax, numpy as np
        import zjax, zjax.train
        from tests.test_train_loop import TX, batches, init_fn, loss_fn

        config = zjax.train.LoopConfig(steps=50, checkpoint_dir={str(tmp_path / "ckpt")!r}, preemptible=True,
                                       save_every=1000, progress=False)
        with zjax.train.runtime(config, []):
            plan = zjax.Plan(zjax.make_mesh(dp=8), stage=2, precision="fp32")
            state, start = zjax.train.init_or_restore(plan, init_fn, TX, jax.random.key(0), config)
            data = [b for _, b in zip(range(50), batches())]

            def fetch(i):
                if i == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                return data[i]

            result = zjax.train.fit(plan, plan.train_step(loss_fn), state, fetch, config)
            print("RESULT", result.preempted, result.end, len(result.losses), flush=True)
        """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][0]
    _, preempted, end, count = line.split()
    assert preempted == "True" and 3 <= int(end) < 50 and int(count) == int(end)
    assert f"preempted: saved step {end}, exiting" in proc.stdout
    with zjax.Checkpointer(tmp_path / "ckpt") as c:
        assert c.steps() == [int(end)] and c.metadata(int(end))["user"] == {"data_position": int(end)}

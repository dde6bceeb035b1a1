"""examples/train_lm.py on zjax.train trains to the losses it printed before the loop moved into the library, and a
user's own script written against zjax.train (below: the same model, data and optimizer) trains to the same ones.

The recorded numbers and the commands that produced them are in train_loop_baseline.json (8 simulated CPU devices,
AMD EPYC; equal bit for bit there when the loop moved). XLA:CPU's fp32 sums differ between AVX2, AVX-512 and ARM,
so a run is compared with the recording within 1% (what a changed data order, schedule or accumulation moves far
more) and the example with the library script exactly.
"""

import dataclasses
import json
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
import zjax.train
from zjax.models import PRESETS, Decoder, lm_loss

ROOT = Path(__file__).resolve().parents[1]
BASELINE = json.loads((ROOT / "tests" / "train_loop_baseline.json").read_text())["runs"]
DOCS = ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "typing.py", "inspect.py", "json/decoder.py",
        "collections/__init__.py")  # fmt: skip


def recorded(got: list[float], name: str, key: str = "losses") -> None:
    np.testing.assert_allclose(got, BASELINE[name][key], rtol=1e-2, err_msg=BASELINE[name]["command"])


def run_example(tmp_path: Path, name: str, ckpt: Path | None = None) -> dict:
    """The recorded command ``name``, run now; its --metrics-json."""
    out = tmp_path / f"{name}.json"
    command = BASELINE[name]["command"].replace("CKPT", str(ckpt or tmp_path / "ckpt"))
    argv = [sys.executable, *shlex.split(command)[1:], "--metrics-json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def user_script(*, steps: int, stage: int, accum: int, eval_every: int, log_every: int) -> zjax.train.FitResult:
    """A user's script on zjax.train: a decoder on a few standard-library files, its own loop settings."""
    tok = zjax.data.load_tokenizer(None)  # bytes
    cfg = dataclasses.replace(PRESETS["tiny"], max_len=32, remat="full", vocab=-(-tok.vocab_size // 128) * 128)
    model = Decoder(cfg)
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = [np.concatenate([tok.encode((root / d).read_text(encoding="utf-8")), [tok.eos_id]]) for d in DOCS]
    train, held = zjax.data.train_eval_split(np.concatenate(docs).astype(np.int32), 0.05)
    data = zjax.data.LMData(train, 32, 16, eos_id=tok.eos_id, seed=0)
    held_out = zjax.data.LMData(held, 32, 16, eos_id=tok.eos_id, shuffle=False)

    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=stage, precision="bf16", clip_norm=1.0)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, steps // 10), max(2, steps))
    # weight decay on the matrices of the layers only, not on norms, the embedding or the head (zjax train's default)
    decays = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "layers" in jax.tree_util.keystr(path) and "norm" not in jax.tree_util.keystr(path), p
    )
    tx = optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=decays)
    state = plan.init(lambda r: model.init(r, jnp.zeros((1, 32), jnp.int32))["params"], tx, jax.random.key(0))
    loss_fn = lambda params, batch: lm_loss(model, params, batch)  # noqa: E731
    config = zjax.train.LoopConfig(steps=steps, eval_every=eval_every, log_every=log_every, progress=False)
    step = plan.train_step(loss_fn, accum_steps=accum)
    return zjax.train.fit(plan, step, state, data, config, eval_step=plan.eval_step(loss_fn), eval_data=held_out)


@pytest.mark.slow  # the example in a subprocess and a user script (33 s); zjax.train's own tests stay fast
def test_example_and_a_user_script_train_to_the_recorded_losses(tmp_path):
    """Stage 2, 2 accumulation microbatches, evaluation every 2 steps."""
    want = BASELINE["stage2_accum2_eval"]
    example = run_example(tmp_path, "stage2_accum2_eval")
    mine = user_script(steps=6, stage=2, accum=2, eval_every=2, log_every=2)
    assert mine.losses == example["losses"] and mine.eval_loss == example["eval_loss"]
    recorded(example["losses"], "stage2_accum2_eval")
    np.testing.assert_allclose(example["eval_loss"], want["eval_loss"], rtol=1e-2)


@pytest.mark.slow  # 30 steps of the small preset (~30 s on 2 cores)
def test_the_main_command_trains_to_the_recorded_losses(tmp_path):
    recorded(run_example(tmp_path, "default_30_steps")["losses"], "default_30_steps")


# the recorded stopped and resumed runs (stage3_fp32_stop_at_3, stage3_fp32_resumed) are commands of
# tests/test_example.py's resume test, which holds them to these recordings too
@pytest.mark.slow  # a run of the script
def test_a_tensor_parallel_fp16_run_trains_to_the_recorded_losses(tmp_path):
    recorded(run_example(tmp_path, "stage1_tp2_fp16_accum2")["losses"], "stage1_tp2_fp16_accum2")

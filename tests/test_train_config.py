"""Run files: TOML values under explicit flags, and errors that name the key, the file and the valid keys."""

import argparse
from pathlib import Path

import pytest

import zjax.train

ROOT = Path(__file__).resolve().parents[1]


def parser():
    p = zjax.train.add_arguments(argparse.ArgumentParser(prog="run"))
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mesh", type=lambda s: dict(x.split("=") for x in s.split(",")), default={"dp": "-1"})
    return p


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_file_values_under_explicit_flags(tmp_path):
    path = write(
        tmp_path,
        '[plan]\nstage = 1\nmesh = "dp=4,tp=2"\n[loop]\nsteps = 20\neval-every = 5\ncheckpoint_dir = "ck"\nlr = 1\n'
        "progress = false\n",
    )
    args, config = zjax.train.parse_args(parser(), ["--config", str(path), "--steps", "7"])
    assert config.steps == 7  # the flag wins
    assert config.eval_every == 5 and config.checkpoint_dir == Path("ck") and config.progress is False
    assert args.stage == 1 and args.lr == 1.0 and isinstance(args.lr, float)
    assert args.mesh == {"dp": "4", "tp": "2"}  # a string goes through the flag's type, as if typed
    _, plain = zjax.train.parse_args(parser(), ["--steps", "7"])
    assert plain == zjax.train.LoopConfig(steps=7)


def test_unknown_key_names_it_the_file_and_the_valid_keys(tmp_path, capsys):
    path = write(tmp_path, "[loop]\nstepz = 3\n")
    with pytest.raises(ValueError, match=r"run.toml: unknown key \[loop\] 'stepz'; valid keys: .*eval_every.*steps"):
        zjax.train.load_config(path, ["steps", "eval_every"])
    with pytest.raises(SystemExit) as e:
        zjax.train.parse_args(parser(), ["--config", str(path)])
    assert e.value.code == 2 and "unknown key [loop] 'stepz'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stage = 5\n", "stage = 5 is not one of"),
        ("resume = 1\n", "resume = 1 must be true or false"),
        ("steps = 3\n[loop]\nsteps = 4\n", "key 'steps' appears twice"),
        ("steps = \n", "not valid TOML"),
        ("resume = true\n", "resume=True needs checkpoint_dir"),
        ('profile_steps = "5"\n', "--profile-steps: expected A:B"),
    ],
)
def test_bad_files_exit_naming_the_problem(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as e:
        zjax.train.parse_args(parser(), ["--config", str(write(tmp_path, text))])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_examples_config_file_parses_with_the_examples_flags():
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_lm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    path = ROOT / "examples" / "configs" / "small.toml"
    args, config = zjax.train.parse_args(train_lm.build_parser(), ["--config", str(path), "--stage", "2"])
    assert args.stage == 2 and args.mesh == {"dp": 8} and args.preset == "small"
    assert config == zjax.train.LoopConfig(steps=100, eval_every=50, eval_batches=4, save_every=50)

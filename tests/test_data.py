"""Data on grain (packing, per-step batches, tokenizers, sources), metrics writers and MFU."""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zjax
from zjax.data import ByteTokenizer, LMData, PackedRows, load_tokenizer, tokenize, train_eval_split
from zjax.models import DecoderConfig, lm_loss


def test_packed_rows_mark_documents():
    eos = 99
    stream = np.array([5, 6, eos, 7, 8, 9, eos, 1, 2, 3, 4, eos, 9], np.int32)
    rows = PackedRows(stream, 4, eos)
    assert len(rows) == 3
    r0, r1, r2 = rows[0], rows[1], rows[2]
    np.testing.assert_array_equal(r0["tokens"], [5, 6, eos, 7, 8])
    np.testing.assert_array_equal(r0["segment_ids"], [1, 1, 1, 2, 2])
    np.testing.assert_array_equal(r0["positions"], [0, 1, 2, 0, 1])
    # row 1 starts inside the document "7 8 9 eos": its positions continue from there
    np.testing.assert_array_equal(r1["tokens"], [8, 9, eos, 1, 2])
    np.testing.assert_array_equal(r1["positions"], [1, 2, 3, 0, 1])
    np.testing.assert_array_equal(r1["segment_ids"], [1, 1, 1, 2, 2])
    np.testing.assert_array_equal(r2["positions"], [1, 2, 3, 4, 0])
    with pytest.raises(ValueError, match="make no row"):
        PackedRows(stream[:3], 4, eos)


def test_batches_are_a_function_of_the_step():
    stream = np.arange(10_000, dtype=np.int32)  # every row starts with its own token
    a = LMData(stream, 16, 8, seed=3)
    b = LMData(stream, 16, 8, seed=3)
    c = LMData(stream, 16, 8, seed=4)
    # step 7 read directly equals step 7 reached by reading 0..6 first (resume needs only the step)
    for s in range(7):
        a.batch(s)
    np.testing.assert_array_equal(a.batch(7)["tokens"], b.batch(7)["tokens"])
    assert not np.array_equal(a.batch(7)["tokens"], c.batch(7)["tokens"])
    # within an epoch every row is read once
    epoch = np.concatenate([a.batch(s)["tokens"][:, 0] for s in range(a.num_rows // 8)])
    assert len(set(epoch.tolist())) == len(epoch)
    # on a mesh in one process, this process holds the whole batch
    mesh = zjax.make_mesh(dp=4, tp=2)
    np.testing.assert_array_equal(a.batch(3, mesh)["tokens"], a.batch(3)["tokens"])
    assert set(a.batch(3)) == {"tokens"}  # no end-of-document id: one stream, nothing packed
    with pytest.raises(ValueError, match="does not split over the data axes"):
        LMData(stream, 16, 6).batch(0, mesh)


@pytest.mark.slow  # compiles the loss three times; test_hf checks packing at the model level in the fast suite
def test_packed_batch_loss_equals_documents_apart():
    tok = ByteTokenizer()
    docs = ["first document, a short one", "the second is a little longer than that"]
    stream = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs]).astype(np.int32)
    data = LMData(stream, len(stream) - 1, 1, eos_id=tok.eos_id, shuffle=False)
    packed = data.batch(0)
    cfg = DecoderConfig(vocab=257, embed=32, layers=2, heads=4, head_dim=8, mlp=64, max_len=128, kv_heads=2)
    model = zjax.models.Decoder(cfg)
    import flax.linen as nn

    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    loss = jax.jit(lambda b: lm_loss(model, params, b).mean)
    got = float(loss(jax.tree.map(jnp.asarray, packed)))
    # each document on its own row, with its end-of-document token as the last target
    apart = [np.append(tok.encode(d), tok.eos_id)[None].astype(np.int32) for d in docs]
    counts = [x.shape[1] - 1 for x in apart]
    want = sum(n * float(loss(jnp.asarray(x))) for n, x in zip(counts, apart, strict=True)) / sum(counts)
    assert got == pytest.approx(want, rel=1e-5)


def test_sources_and_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 5 and tok.eos_id == 1
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text(
        json.dumps({"text": "hello world"}) + "\n\n" + json.dumps({"text": "world again x"}) + "\n"
    )
    (tmp_path / "corpus" / "b.txt").write_text("again hello")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = {"id": [7, 8, 9], "text": ["hello", "world hello", "x again"]}
    pq.write_table(pa.table(rows), tmp_path / "corpus" / "c.parquet", row_group_size=2)  # two row groups
    want = [2, 3, 1, 3, 4, 0, 1, 4, 2, 1] + [2, 1, 3, 2, 1, 0, 4, 1]  # a.jsonl, b.txt, then c.parquet's rows
    np.testing.assert_array_equal(tokenize(tmp_path / "corpus", tok), want)
    with pytest.raises(ValueError, match=r"c.parquet has no 'body' column \(columns: \['id', 'text'\]\)"):
        tokenize(tmp_path / "corpus" / "c.parquet", tok, text_key="body")
    np.save(tmp_path / "tokens.npy", np.arange(20, dtype=np.int32))
    np.testing.assert_array_equal(tokenize(tmp_path / "tokens.npy", tok), np.arange(20))
    train, held = train_eval_split(np.arange(100), 0.1)
    assert len(train) == 90 and held[0] == 90
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no 'text' field"):
        tokenize(tmp_path / "bad.jsonl", tok)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path / "corpus")


def test_flops_per_token_hand_count():
    cfg = zjax.models.PRESETS["llama3-8b"]
    s = 8192
    # by hand: per layer q (4096 x 4096), k and v (4096 x 1024 each), o (4096 x 4096), MLP 3 x 4096 x 14336;
    # the head 4096 x 128256; 6 FLOPs per matmul parameter per token, attention 12 * layers * 4096 * seq
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    hand = 6 * (32 * per_layer + 4096 * 128256) + 12 * 32 * 4096 * s
    assert zjax.metrics.flops_per_token(cfg, s) == pytest.approx(hand, rel=0.01)
    assert zjax.metrics.mfu(1000.0, cfg, s, "cpu", 8) is None  # no peak for a CPU: no made-up number
    h100 = zjax.metrics.mfu(1000.0, cfg, s, "NVIDIA H100 80GB HBM3", 1)
    assert h100 == pytest.approx(1000.0 * hand / 989.4e12, rel=0.01)
    # fp8 projections (q, k, v, o and the MLP's three) at the H100's fp8 peak (1,979 dense TFLOP/s), the head and
    # attention's scores at the bf16 peak; against the bf16 peak alone, as fp8 figures are usually published
    fp8 = dataclasses.replace(cfg, matmul="fp8-current")
    seconds = 6 * 32 * per_layer / 1978.9e12 + (hand - 6 * 32 * per_layer) / 989.4e12
    got = zjax.metrics.mfu(1000.0, fp8, s, "NVIDIA H100 80GB HBM3", 1)
    assert got == pytest.approx(1000.0 * seconds, rel=0.01) and got < h100
    assert zjax.metrics.mfu(1000.0, fp8, s, "NVIDIA H100 80GB HBM3", 1, bf16_peak=True) == pytest.approx(h100)
    assert zjax.metrics.mfu(1000.0, fp8, s, "NVIDIA A100-SXM4-80GB", 1) is None  # no fp8 tensor cores: no fp8 peak


def test_metrics_writer(tmp_path):
    with zjax.metrics.MetricsWriter(tmp_path, tensorboard=True) as w:
        w.write(1, {"loss": jnp.float32(2.5), "mfu": None, "bad": float("nan")})
        # readable while training: flushed after each record
        first = json.loads((tmp_path / "metrics.jsonl").read_text())
        assert first == {"step": 1, "loss": 2.5, "mfu": None, "bad": None}
        w.write(2, {"loss": 2.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_metrics_writer_drives_a_wandb_run(tmp_path, monkeypatch):
    """The W&B glue (the package itself is an optional extra, not installed in CI): one run in the log
    directory, the numeric metrics of each record at its step, finished on close."""
    import types

    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with zjax.metrics.MetricsWriter(tmp_path, wandb={"project": "p", "name": "r"}) as w:
        w.write(3, {"loss": jnp.float32(2.5), "mfu": None, "note": "x"})
    assert calls == [
        ("init", {"dir": str(tmp_path), "project": "p", "name": "r"}),
        ("log", {"loss": 2.5}, 3),
        ("finish",),
    ]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: the error says what to install
    with pytest.raises(ImportError, match=r'pip install "zjax\[wandb\]"'):
        zjax.metrics.MetricsWriter(tmp_path, wandb={"project": "p"})

"""DeepSeek-V3 and Qwen3-MoE against transformers' own PyTorch implementations (a reference zjax did not write):
tiny random models made and saved by transformers, loaded sharded at stage 3 in fp32; the loss and one SGD step's
updates equal transformers' (1e-4), and a save writes the files back bit for bit.

transformers has these models only in PyTorch: they need the ``reference`` extra (``pip install -e ".[reference]"``,
with a CPU build of torch), which CI installs for its slow step (``.ci/run``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

import zjax
from zjax.models import Decoder, from_hf_config, train_functions

from ._hf_models import read_checkpoint

torch = pytest.importorskip("torch", reason='transformers\' PyTorch models: pip install -e ".[reference]"')
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers' models in PyTorch, then two meshes' compiles each

LR = 0.5
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
    rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts_per_tok=2, attn_implementation="eager",
)  # fmt: skip
MODELS = {
    # MLA with query and key-value latents, YaRN, the first layer dense, a shared expert, sigmoid routing limited
    # to 2 of 4 groups with the selection bias, normalised and scaled gates
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # softmax routing over 8 experts, top-2 normalised, q/k norms; the load-balancing loss in the objective
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_experts=8,
        norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01,
    ),
}  # fmt: skip
MESHES = [{"dp": 2, "ep": 4}, {"dp": 2, "ep": 2, "tp": 2}]


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request, tmp_path_factory):
    """A tiny random model saved by transformers (fp32), with its loss and one SGD step's weights on a batch."""
    torch.manual_seed(0)
    config = MODELS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2 if "norm" not in name else 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the selection bias moves which experts a token reaches
                b.copy_(torch.randn(b.shape) * 0.5)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory, safe_serialization=True)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (8, 17)).astype(np.int32)
    # the inputs zjax's loss feeds the model (every token but the last; the load-balancing term pools over them)
    out = model(input_ids=torch.from_numpy(tokens[:, :-1].astype(np.int64)))
    targets = torch.from_numpy(tokens[:, 1:].astype(np.int64))
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
    aux = getattr(out, "aux_loss", None)  # Qwen3-MoE's load-balancing loss (output_router_logits)
    total = ce if aux is None else ce + config.router_aux_loss_coef * aux
    total.backward()
    stepped = {  # an expert no token reached has no gradient
        n: (p if p.grad is None else p - LR * p.grad).detach().numpy() for n, p in model.named_parameters()
    }
    return directory, tokens, ce.item(), total.item(), stepped


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_the_loss_and_an_sgd_step_are_transformers(reference, mesh, tmp_path):
    directory, tokens, ce, total, stepped = reference
    model = _as_transformers(from_hf_config(directory))
    plan = zjax.Plan(zjax.make_mesh(**mesh), stage=3, precision="fp32")
    state = zjax.hf.load(directory, plan, model, optax.sgd(LR))
    step = plan.train_step(train_functions(model, tokens.shape[1] - 1)[1])
    state, metrics = step(state, plan.shard_batch(tokens))
    assert abs(float(metrics["aux"]["ce"]) - ce) <= 1e-4 * ce, (float(metrics["aux"]["ce"]), ce)
    assert abs(float(metrics["loss"]) - total) <= 1e-4 * total, (float(metrics["loss"]), total)
    got = read_checkpoint(str(zjax.hf.save(tmp_path / "stepped", model, state, dtype="float32")))
    before = read_checkpoint(str(directory))
    assert set(got) >= set(stepped)
    for name, want in stepped.items():
        update, want_update = got[name] - before[name], want - before[name]
        scale = max(float(np.abs(want_update).max()), 1e-30)
        assert float(np.abs(update - want_update).max()) <= 1e-4 * scale, name


def _as_transformers(model: Decoder) -> Decoder:
    """``model`` with transformers' objective: its DeepSeek-V3 has no sequence-wise balance loss (DeepSeek's own
    code and zjax add it, ``aux_loss_alpha``), so its weight is 0 here; Qwen3-MoE's pooled loss is kept."""
    if model.cfg.moe is None or model.cfg.moe.balance_loss != "per-sequence":
        return model
    return Decoder(dataclasses.replace(model.cfg, moe=dataclasses.replace(model.cfg.moe, load_balance_weight=0.0)))


def test_a_save_writes_transformers_files_back_bitwise(reference, tmp_path):
    directory = reference[0]
    model = from_hf_config(directory)
    plan = zjax.Plan(zjax.make_mesh(dp=2, ep=4), stage=3, precision="fp32")
    state = zjax.hf.load(directory, plan, model, optax.sgd(0.0))
    out = zjax.hf.save(tmp_path / "out", model, state, dtype="float32")  # as transformers saved them
    want, got = read_checkpoint(str(directory)), read_checkpoint(str(out))
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[n], x) and got[n].dtype == x.dtype for n, x in want.items())

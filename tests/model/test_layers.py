"""``--layers N`` (patchdsl/model/layers.py, ``load_model(layers=N)``): one layer of each layer type kept,
the config made to agree with the kept layers, and only the kept layers ever built."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from patchdsl.model import load_model
from patchdsl.model.layers import choose

L, F, D, M = "linear_attention", "full_attention", "dense", "moe"


@pytest.mark.parametrize("kinds,n,kept", [
    ([L, L, L, F] * 8, 2, [0, 3]),                  # Qwen3.5: the first two layers are linear attention
    ([L, L, L, F] * 8, 4, [0, 1, 2, 3]),            # N covers the types: the first N
    ([L, L, L, F] * 8, 3, [0, 1, 3]),
    ([D] * 3 + [M] * 58, 2, [0, 3]),                # DeepSeek-V3: first_k_dense_replace = 3
    (["sliding", "full"] * 18, 2, [0, 1]),          # gpt-oss
    ([F] * 28, 2, [0, 1]),
    (["a"] * 4 + ["b", "c"], 3, [0, 4, 5]),
    (["a"] * 4 + ["b", "c"], 2, [0, 4, 5]),         # more types than N: one of each (the output says so)
    ([F, F], 5, [0, 1]),
])
def test_choose_keeps_a_layer_of_each_type(kinds, n, kept):
    got = choose(kinds, n)
    assert got == kept
    assert {kinds[i] for i in got} == set(kinds)


def _config_file(tmp_path, model_type: str, **over):
    d = AutoConfig.for_model(model_type, **over).to_dict()
    d.pop("torch_dtype", None)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    return p


def _rebuilt_layers(cfg):
    """The decoder layers transformers builds from the cut config (meta): the model's own code must agree with
    the layers kept (a dense layer where the config says dense, linear attention where layer_types says so)."""
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    return [[(n, type(c).__name__) for n, c in lay.named_modules()] for lay in m.model.layers]


def _layers(model):
    return [[(n, type(c).__name__) for n, c in lay.named_modules()] for lay in model.model.layers]


SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             vocab_size=128, max_position_embeddings=64)


@pytest.mark.parametrize("model_type,over,kept", [
    ("qwen3_5_text", dict(num_hidden_layers=8, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=8), (0, 3)),
    ("qwen3_moe", dict(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       decoder_sparse_step=2, mlp_only_layers=[]), (0, 1)),
    ("qwen3_moe", dict(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       decoder_sparse_step=1, mlp_only_layers=[0, 1]), (0, 2)),
    ("gpt_oss", dict(num_hidden_layers=6, num_local_experts=4, num_experts_per_tok=2, sliding_window=8), (0, 1)),
])
def test_kept_layers_agree_with_the_config_and_run(tmp_path, model_type, over, kept):
    path = _config_file(tmp_path, model_type, **{**SMALL, **over})
    lm = load_model(path, layers=2, dtype="fp32", log=None, attn_implementation="eager")
    model = lm.model
    assert lm.layers.kept == kept and lm.layers.of == over["num_hidden_layers"]
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    assert _layers(model) == _rebuilt_layers(model.config)
    for new, lay in enumerate(model.model.layers):      # renumbered: caches and per-layer lookups index by it
        for m in lay.modules():
            if isinstance(getattr(m, "layer_idx", None), int):
                assert m.layer_idx == new
    ids = torch.randint(0, 128, (1, 6))
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)      # the cache built from the cut config
    assert torch.isfinite(out.logits).all()
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_qwen3_5_keeps_both_attention_kinds_and_says_which(tmp_path):
    path = _config_file(tmp_path, "qwen3_5_text", **{**SMALL, "num_hidden_layers": 8})
    lines = []
    lm = load_model(path, layers=2, meta=True, log=lines.append)
    assert list(lm.model.config.layer_types) == [L, F]
    assert {type(lay.linear_attn).__name__ if hasattr(lay, "linear_attn") else type(lay.self_attn).__name__
            for lay in lm.model.model.layers} == {"Qwen3_5GatedDeltaNet", "Qwen3_5Attention"}
    assert "kept decoder layers 0, 3 of 8" in lines[0]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_a_model_far_too_big_is_built_only_where_kept(tmp_path):
    """DeepSeek-V3's default config (256 routed experts a layer, three dense layers first) at 200 layers: the
    whole model has ~5B parameters (20 GB in fp32); with layers=2 one dense and one MoE layer exist, nothing
    else is ever allocated, and the first_k_dense_replace of the cut config agrees."""
    over = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_hidden_layers=200,
                vocab_size=1024, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    path = _config_file(tmp_path, "deepseek_v3", **over)
    whole = sum(p.numel() for p in load_model(path, meta=True, log=None).model.parameters())
    assert whole > 4e9
    before = _rss_mb()
    lm = load_model(path, layers=2, dtype="fp32", log=None, attn_implementation="eager")
    grown = _rss_mb() - before
    model = lm.model
    n = sum(p.numel() for p in model.parameters())
    assert lm.layers.kept == (0, 3) and model.config.first_k_dense_replace == 1
    assert _layers(model) == _rebuilt_layers(model.config)
    assert n < whole / 50 and grown < 4 * n * 4 / 2 ** 20 + 1024, (n, whole, grown)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    # transformers' own initialisation: random projections, unit norms, the rotary table computed
    assert 0.01 < model.model.layers[1].mlp.experts.gate_up_proj.std().item() < 0.04
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    inv = model.model.rotary_emb.inv_freq
    assert inv[0].item() == 1.0 and torch.isfinite(inv).all() and (inv > 0).all()
    ids = torch.randint(0, 1024, (1, 6))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_a_model_cut_at_load_is_cut_further_by_verify_naming_the_original_layers(tmp_path):
    from patchdsl.model.layers import keep

    path = _config_file(tmp_path, "qwen3_moe", **{**SMALL, "num_hidden_layers": 6, "num_experts": 4,
                                                  "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                                  "decoder_sparse_step": 1, "mlp_only_layers": [0, 1, 2]})
    lm = load_model(path, layers=3, meta=True, log=None)
    assert lm.layers.kept == (0, 1, 3)
    assert keep(lm.model, 5) is lm.layers                 # no further cut: the load's record
    again = keep(lm.model, 1)                             # fewer: one of each type, named in the original model
    assert again.kept == (0, 3) and again.of == 6 and len(lm.model.model.layers) == 2
    assert _layers(lm.model) == _rebuilt_layers(lm.model.config)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma3_text", "qwen3_5_text", "qwen2_5_vl"])
def test_the_kept_part_is_initialised_as_a_whole_build_is(tmp_path, model_type):
    """to_empty + transformers' initialize_weights fills every buffer as building the model whole does (rotary
    tables per layer type, a router's correction bias, a vision tower's), and every parameter (no uninitialised
    memory): compared buffer by buffer with the whole model's, the kept layers with the layers they were."""
    from patchdsl.model.modules import decoder_layers
    from patchdsl.model.tiny import quiet, tiny_family_config

    with quiet():
        cfg = tiny_family_config(model_type)
    d = cfg.to_dict()
    d.pop("torch_dtype", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d, default=str))
    with quiet():
        whole = load_model(path, dtype="fp32", log=None).model
        lm = load_model(path, dtype="fp32", layers=1, log=None)
    layers_path, _ = decoder_layers(whole)
    prefix = layers_path + "."

    def original(name: str) -> str:
        if not name.startswith(prefix):
            return name
        i, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{lm.layers.kept[int(i)]}.{rest}"

    wb = dict(whole.named_buffers())
    cut = dict(lm.model.named_buffers())
    assert cut
    for name, b in cut.items():
        assert torch.equal(b, wb[original(name)]), name
    for name, p in lm.model.named_parameters():
        assert torch.isfinite(p).all() and p.shape == whole.get_parameter(original(name)).shape, name

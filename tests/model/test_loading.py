"""Model loading: shipped configs on meta, tiny CPU builds, local dirs, config paths, saved weights, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from patchdsl.model import (
    CONFIGS_DIR,
    ModelLoadError,
    load_model,
    parse_dtype,
    shipped_models,
    tiny_config,
)

# id: (class, model_type, layers, hidden, intermediate, heads, kv heads, head_dim, vocab, tied, parameters)
SHIPPED = {
    "Qwen/Qwen3-0.6B": ("Qwen3ForCausalLM", "qwen3", 28, 1024, 3072, 16, 8, 128, 151936, True, 596_049_920),
    "meta-llama/Llama-3.2-1B": ("LlamaForCausalLM", "llama", 16, 2048, 8192, 32, 8, 64, 128256, True, 1_235_814_400),
    "mistralai/Mistral-7B-v0.3": ("MistralForCausalLM", "mistral", 32, 4096, 14336, 32, 8, 128, 32768, False,
                                  7_248_023_552),
    "google/gemma-3-1b-pt": ("Gemma3ForCausalLM", "gemma3_text", 26, 1152, 6912, 4, 1, 256, 262144, True,
                             999_885_952),
    "microsoft/Phi-3-mini-4k-instruct": ("Phi3ForCausalLM", "phi3", 32, 3072, 8192, 32, 32, 96, 32064, False,
                                         3_821_079_552),
    "Qwen/Qwen2.5-0.5B": ("Qwen2ForCausalLM", "qwen2", 24, 896, 4864, 14, 2, 64, 151936, True, 494_032_768),
    "meta-llama/Llama-3.1-8B": ("LlamaForCausalLM", "llama", 32, 4096, 14336, 32, 8, 128, 128256, False,
                                8_030_261_248),
    "Qwen/Qwen3-8B": ("Qwen3ForCausalLM", "qwen3", 36, 4096, 12288, 32, 8, 128, 151936, False, 8_190_735_360),
    # mixture of experts (issue 24): 128 experts, top 8, moe_intermediate 768
    "Qwen/Qwen3-30B-A3B": ("Qwen3MoeForCausalLM", "qwen3_moe", 48, 2048, 6144, 32, 4, 128, 151936, False,
                           30_532_122_624),
}

# vision-language models (issue 25; built as their ...ForConditionalGeneration): id: (class, model_type,
# text layers, text hidden, text vocab, tied, parameters, M-RoPE sections or None)
SHIPPED_VLM = {
    "Qwen/Qwen2.5-VL-7B-Instruct": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", 28, 3584, 152064, False,
                                    8_292_166_656, [16, 24, 24]),
    "Qwen/Qwen3-VL-8B-Instruct": ("Qwen3VLForConditionalGeneration", "qwen3_vl", 36, 4096, 151936, False,
                                  8_767_123_696, [24, 20, 20]),
    "google/gemma-3-4b-it": ("Gemma3ForConditionalGeneration", "gemma3", 34, 2560, 262208, True, 4_300_079_472, None),
}


def _quiet(_msg: str) -> None:
    pass


class Log(list):
    def __call__(self, msg: str) -> None:
        self.append(msg)


def _attn(model):
    return model.model.layers[0].self_attn


def _q_out(attn) -> int:
    if hasattr(attn, "q_proj"):
        return attn.q_proj.out_features
    return attn.o_proj.in_features          # Phi-3: fused qkv_proj


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_shipped_ids_and_files():
    assert sorted(shipped_models()) == sorted([*SHIPPED, *SHIPPED_VLM])
    for hub_id in SHIPPED:
        path = CONFIGS_DIR / (hub_id.replace("/", "__") + ".json")
        d = json.loads(path.read_text())
        for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps", "torch_dtype"):
            assert key in d, (hub_id, key)
        assert d["architectures"] == [SHIPPED[hub_id][0]]
        assert "auto_map" not in d          # never remote code


@pytest.mark.parametrize("hub_id", sorted(SHIPPED))
def test_shipped_meta_build(hub_id):
    cls, mtype, layers, hidden, inter, heads, kv, head_dim, vocab, tied, n_params = SHIPPED[hub_id]
    log = Log()
    lm = load_model(hub_id, meta=True, log=log)
    m, c = lm.model, lm.config
    assert type(m).__name__ == cls and c.model_type == mtype
    assert lm.has_weights is False and c is m.config
    assert all(p.device.type == "meta" for p in m.parameters())
    assert next(m.parameters()).dtype == torch.bfloat16        # the checkpoint dtype
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (layers, hidden, inter)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (heads, kv, vocab)
    assert len(m.model.layers) == layers
    assert m.model.embed_tokens.weight.shape == (vocab, hidden)
    assert _q_out(_attn(m)) == heads * head_dim
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
    assert sum(p.numel() for p in m.parameters()) == n_params
    assert len(log) == 1 and "meta device" in log[0] and hub_id in log[0]
    assert lm.source == log[0]


@pytest.mark.parametrize("hub_id", sorted(SHIPPED_VLM))
def test_shipped_vision_language_meta_build(hub_id):
    """A vision-language config builds its ...ForConditionalGeneration (the image-text-to-text class where
    the model type has no causal LM), the multimodal RoPE sections as the checkpoint's config gives them."""
    cls, mtype, layers, hidden, vocab, tied, n_params, mrope = SHIPPED_VLM[hub_id]
    lm = load_model(hub_id, meta=True, log=_quiet)
    m, t = lm.model, lm.config.get_text_config()
    assert type(m).__name__ == cls and lm.config.model_type == mtype
    assert (t.num_hidden_layers, t.hidden_size, t.vocab_size) == (layers, hidden, vocab)
    assert len(m.model.language_model.layers) == layers and m.lm_head.weight.shape == (vocab, hidden)
    assert (m.lm_head.weight is m.model.language_model.embed_tokens.weight) == tied
    assert sum(p.numel() for p in m.parameters()) == n_params
    rope = t.rope_parameters
    assert (rope.get("mrope_section") if mrope else None) == mrope
    tiny = load_model(hub_id, tiny=True, log=_quiet)
    tt = tiny.config.get_text_config()
    assert type(tiny.model) is type(m) and tt.hidden_size <= 160 and tt.vocab_size == 512
    if mrope:      # the sections shrink with head_dim (they must sum to half of it)
        hd = getattr(tt, "head_dim", None) or tt.hidden_size // tt.num_attention_heads
        assert sum(tt.rope_parameters["mrope_section"]) == hd // 2
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    out = tiny.model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)


def test_shipped_details():
    q3 = load_model("Qwen/Qwen3-0.6B", meta=True, log=_quiet).config
    assert q3.max_position_embeddings == 40960 and q3.rms_norm_eps == 1e-6 and q3.head_dim == 128
    assert q3.rope_parameters["rope_theta"] == 1_000_000 and not q3.attention_bias
    llama = load_model("meta-llama/Llama-3.2-1B", meta=True, log=_quiet).config
    rp = llama.rope_parameters
    assert rp["rope_type"] == "llama3" and rp["factor"] == 32.0 and rp["rope_theta"] == 500000.0
    g = load_model("google/gemma-3-1b-pt", meta=True, log=_quiet)
    gc = g.config
    assert gc.sliding_window == 512 and gc.query_pre_attn_scalar == 256
    assert gc.layer_types.count("full_attention") == 4 and gc.layer_types[5] == "full_attention"
    assert hasattr(_attn(g.model), "q_norm") and gc.hidden_activation == "gelu_pytorch_tanh"
    phi = load_model("microsoft/Phi-3-mini-4k-instruct", meta=True, log=_quiet)
    assert phi.config.sliding_window == 2047 and phi.config.max_position_embeddings == 4096
    assert hasattr(phi.model.model.layers[0].mlp, "gate_up_proj")
    q25 = load_model("Qwen/Qwen2.5-0.5B", meta=True, log=_quiet)
    assert _attn(q25.model).q_proj.bias is not None          # Qwen2 has q/k/v biases
    mis = load_model("mistralai/Mistral-7B-v0.3", meta=True, log=_quiet).config
    assert mis.rope_parameters["rope_theta"] == 1_000_000.0 and mis.sliding_window is None


@pytest.mark.parametrize("hub_id", sorted(SHIPPED))
def test_tiny_forward_backward(hub_id):
    log = Log()
    lm = load_model(hub_id, tiny=True, log=log)
    full = load_model(hub_id, meta=True, log=_quiet)
    m, c, fc = lm.model, lm.config, full.config
    assert type(m) is type(full.model) and lm.has_weights is False
    assert len(log) == 1 and "tiny" in log[0] and "random weights (seed 0)" in log[0]
    assert c.hidden_size <= 160 and c.num_hidden_layers == 2 and c.vocab_size == 512
    assert 16 <= _q_out(_attn(m)) // c.num_attention_heads <= 32
    assert next(m.parameters()).dtype == torch.float32
    # structure kept: GQA kind, decoupled head_dim, tied embeddings, q/k norms, fused MLP, biases
    full_ratio = fc.num_attention_heads // fc.num_key_value_heads
    tiny_ratio = c.num_attention_heads // c.num_key_value_heads
    assert (full_ratio == 1) == (tiny_ratio == 1) and (fc.num_key_value_heads == 1) == (c.num_key_value_heads == 1)
    assert (_q_out(_attn(full.model)) == fc.hidden_size) == (_q_out(_attn(m)) == c.hidden_size)
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == (full.model.lm_head.weight is
                                                                 full.model.model.embed_tokens.weight)
    assert sorted(n for n, _ in _attn(m).named_children()) == sorted(n for n, _ in _attn(full.model).named_children())
    assert sorted(n for n, _ in m.model.layers[0].mlp.named_children()) == \
        sorted(n for n, _ in full.model.model.layers[0].mlp.named_children())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(c, k, None)
        assert all(0 <= i < 512 for i in (v if isinstance(v, list) else [v]) if i is not None)
    ids = torch.randint(0, c.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = m(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, 512) and torch.isfinite(out.loss)
    out.loss.backward()
    assert m.model.embed_tokens.weight.grad is not None


def test_tiny_gemma3_keeps_sliding_and_full_layers():
    c = load_model("google/gemma-3-1b-pt", tiny=True, log=_quiet).config
    assert c.layer_types == ["sliding_attention", "full_attention"]
    assert c.sliding_window < 16                    # exercised by 16-token CPU workloads
    assert c.query_pre_attn_scalar == c.head_dim    # ratio kept (256/256)
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000


def test_tiny_gemma4_renumbers_its_per_layer_overrides():
    """Gemma 4's per_layer_config (its full-attention layers' wider heads, keyed "05", "11", ...) follows the
    kept layers, its head sizes shrunk with the rest; the per-layer input embeddings shrink with the
    vocabulary (issue 38: verify exited 3 on `per_layer_config` keys out of range; the tiny model held 135M
    parameters)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from patchdsl.model.tiny import meta_params, tiny_family_config

    if "gemma4_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no Gemma 4")
    cfg = tiny_family_config("gemma4_text")
    d = cfg.to_dict()
    assert d["layer_types"] == ["sliding_attention", "full_attention"]
    assert d["per_layer_config"] == {"1": {"head_dim": 64}}
    assert meta_params(cfg) < 2_000_000


def test_default_configs_with_special_floats_and_implied_head_sizes_load(tmp_path):
    """transformers' default configs as `save_pretrained` writes them: Falcon-H1's time_step_limit (0, inf) is
    written {"__float__": "Infinity"} by transformers 5.2x (read back as a float, as transformers does);
    Nemotron's leaves num_key_value_heads None, Hunyuan's and Ministral's head_dim (the modelling code reads
    them as they are: heads, and hidden / heads).  Issue 38: exit 3 and "cannot build"."""
    import math

    from transformers import AutoConfig

    for model_type in ("falcon_h1", "nemotron", "hunyuan_v1_dense", "ministral"):
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        c = load_model(str(tmp_path / model_type), meta=True, log=_quiet).config
        assert c.num_key_value_heads and vars(c).get("head_dim", 1), model_type
    assert math.isinf(load_model(str(tmp_path / "falcon_h1"), meta=True, log=_quiet).config.time_step_limit[1])
    bad = json.loads((tmp_path / "falcon_h1" / "config.json").read_text())
    bad["rms_norm_eps"] = {"__float__": "NaN"}      # decoded, then refused by the config check
    (tmp_path / "falcon_h1" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "falcon_h1"), meta=True, log=_quiet)


# hybrid families with a Mamba-2 mixer: (model_type, the config key of the mixer's width or None: expand x hidden)
MAMBA = [("bamba", None), ("falcon_h1", "mamba_d_ssm"), ("granitemoehybrid", None)]


@pytest.mark.parametrize("model_type, width_key", MAMBA)
def test_tiny_config_shrinks_the_mamba_mixer(model_type, width_key):
    """The state-space mixer is shrunk with the rest (defaults: 128 heads, state 256, chunks of 256, whose
    reference scan needed 17 GB at batch 2 in transformers 5.17), within the family's own checks, and
    a batch-2 training step runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        full = AutoConfig.for_model(model_type)
    except (KeyError, ValueError):
        pytest.skip(f"{model_type} is not in this transformers")
    t = tiny_config(full)
    width = getattr(t, width_key) if width_key else t.mamba_expand * t.hidden_size
    assert t.mamba_n_heads * t.mamba_d_head == width and t.mamba_n_heads % t.mamba_n_groups == 0
    assert t.mamba_n_heads <= 8 and t.mamba_d_state <= 16 and t.mamba_chunk_size <= 16
    assert (full.mamba_n_heads, full.mamba_d_state) != (t.mamba_n_heads, t.mamba_d_state)   # it was big
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(t)
    assert sum(p.numel() for p in m.parameters()) < 2_000_000
    ids = torch.randint(0, t.vocab_size, (2, 8))
    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_tiny_config_partial_rotary_and_longrope():
    from transformers import Phi3Config

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0] * 48, "long_factor": [2.0] * 48, "original_max_position_embeddings": 4096}
    cfg = Phi3Config(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
                     num_hidden_layers=32, vocab_size=200064, max_position_embeddings=131072,
                     original_max_position_embeddings=4096, rope_parameters=rope, pad_token_id=199999)
    t = tiny_config(cfg)
    hd = t.hidden_size // t.num_attention_heads
    rp = t.rope_parameters
    assert rp["partial_rotary_factor"] == 0.75 and rp["rope_type"] == "longrope"
    assert len(rp["short_factor"]) == len(rp["long_factor"]) == int(hd * 0.75) // 2
    assert t.pad_token_id < 512
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(t)
    ids = torch.randint(0, 512, (1, 12))
    assert torch.isfinite(m(input_ids=ids).logits).all()


def test_seeded_random_weights_are_reproducible():
    a = load_model("Qwen/Qwen3-0.6B", tiny=True, log=_quiet).model.state_dict()
    b = load_model("Qwen/Qwen3-0.6B", tiny=True, log=_quiet).model.state_dict()
    c = load_model("Qwen/Qwen3-0.6B", tiny=True, seed=1, log=_quiet).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_dtypes():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("fp32") is torch.float32
    assert parse_dtype(torch.float16) is torch.float16 and parse_dtype(None) is None
    lm = load_model("meta-llama/Llama-3.2-1B", tiny=True, dtype="bf16", log=_quiet)
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    lm = load_model("meta-llama/Llama-3.2-1B", meta=True, dtype=torch.float32, log=_quiet)
    assert next(lm.model.parameters()).dtype == torch.float32
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model("meta-llama/Llama-3.2-1B", meta=True, dtype="fp8", log=_quiet)


def _write_tiny_config(directory: Path, hub_id: str = "Qwen/Qwen3-0.6B") -> Path:
    cfg = tiny_config(load_model(hub_id, meta=True, log=_quiet).config)
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(directory)
    return directory / "config.json"


def test_local_dir_without_weights(tmp_path):
    _write_tiny_config(tmp_path / "m")
    log = Log()
    lm = load_model(str(tmp_path / "m"), log=log)
    assert lm.has_weights is False and type(lm.model).__name__ == "Qwen3ForCausalLM"
    assert len(log) == 1 and log[0].startswith(f"no weights for {tmp_path / 'm'} here")
    assert "random weights (seed 0)" in log[0] and "\n" not in log[0]
    assert lm.config.hidden_size == 64 and next(lm.model.parameters()).device.type == "cpu"


def test_config_json_path(tmp_path):
    cfg_path = _write_tiny_config(tmp_path / "m", "google/gemma-3-1b-pt")
    log = Log()
    lm = load_model(cfg_path, log=log)
    assert type(lm.model).__name__ == "Gemma3ForCausalLM" and lm.has_weights is False
    assert len(log) == 1 and str(cfg_path) in log[0]
    # any file name works for a bare config
    other = tmp_path / "gemma-arch.json"
    other.write_text(cfg_path.read_text())
    assert load_model(str(other), meta=True, log=_quiet).config.num_hidden_layers == 2


def test_dir_with_saved_weights_loads_them(tmp_path):
    src = load_model("microsoft/Phi-3-mini-4k-instruct", tiny=True, seed=123, log=_quiet).model
    src.save_pretrained(tmp_path / "saved")
    log = Log()
    lm = load_model(str(tmp_path / "saved"), log=log)
    assert lm.has_weights is True and len(log) == 1 and "pretrained weights" in log[0]
    got, want = lm.model.state_dict(), src.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the config.json inside that directory finds the same weights
    lm2 = load_model(str(tmp_path / "saved" / "config.json"), log=_quiet)
    assert lm2.has_weights and torch.equal(lm2.model.lm_head.weight, src.lm_head.weight)
    # weights=False / meta=True ignore them
    assert load_model(str(tmp_path / "saved"), weights=False, log=_quiet).has_weights is False
    assert load_model(str(tmp_path / "saved"), meta=True, log=_quiet).has_weights is False


def _fake_cache(root: Path, hub_id: str) -> Path:
    repo = root / ("models--" + hub_id.replace("/", "--"))
    rev = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    return snap


def test_hf_cache_config_and_weights(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    # a config-only cache entry for an id that is not shipped
    snap = _fake_cache(tmp_path, "someorg/cached-only")
    _write_tiny_config(snap, "meta-llama/Llama-3.2-1B")
    log = Log()
    lm = load_model("someorg/cached-only", log=log)
    assert not lm.has_weights and "cached config.json" in log[0] and len(log) == 1
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    # cached weights are loaded without the network
    snap = _fake_cache(tmp_path, "someorg/cached-weights")
    src = load_model("Qwen/Qwen2.5-0.5B", tiny=True, seed=7, log=_quiet).model
    src.save_pretrained(snap)
    log = Log()
    lm = load_model("someorg/cached-weights", log=log)
    assert lm.has_weights and "local Hugging Face cache" in log[0]
    assert torch.equal(lm.model.model.embed_tokens.weight, src.model.embed_tokens.weight)


def test_unknown_id_is_a_helpful_error():
    with pytest.raises(ModelLoadError) as e:
        load_model("nobody/no-such-model", log=_quiet)
    msg = str(e.value)
    assert "nobody/no-such-model" in msg and "config.json" in msg and "HF_HUB_OFFLINE" in msg
    for hub_id in SHIPPED:
        assert hub_id in msg
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model("./not/here/config.json", log=_quiet)


def test_directory_without_config_is_an_error(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="without a config.json"):
        load_model(str(tmp_path), log=_quiet)
    # a folder that merely shares a Hub id's name (e.g. an output dir) does not shadow it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert load_model("Qwen/Qwen3-0.6B", meta=True, log=_quiet).config.hidden_size == 1024


def _no_network(monkeypatch):
    import huggingface_hub

    from patchdsl.model import loading

    def boom(*a, **k):
        raise AssertionError("the network was tried although HF_HUB_OFFLINE=1")

    monkeypatch.setattr(loading, "_hub_reachable", boom)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", boom)


def test_offline_prefers_cached_config_and_never_tries_the_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    _no_network(monkeypatch)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    snap = _fake_cache(tmp_path, "Qwen/Qwen3-0.6B")          # a (tiny) cached config, no weights
    _write_tiny_config(snap, "Qwen/Qwen3-0.6B")
    log = Log()
    lm = load_model("Qwen/Qwen3-0.6B", log=log)              # weights requested, none to be had
    assert not lm.has_weights and lm.config.hidden_size == 64
    assert log == ["no weights for Qwen/Qwen3-0.6B here: built the architecture from its cached config.json "
                   "with random weights (seed 0)"]
    lm = load_model("qwen/qwen3-0.6b", meta=True, log=log)   # not cached under that spelling: shipped
    assert lm.config.hidden_size == 1024 and "shipped config" in log[-1]


@pytest.mark.slow
def test_offline_full_size_random_build(monkeypatch):
    _no_network(monkeypatch)
    log = Log()
    lm = load_model("Qwen/Qwen3-0.6B", log=log)
    assert log == ["no weights for Qwen/Qwen3-0.6B here: built the architecture from its shipped config "
                   "with random weights (seed 0)"]
    assert not lm.has_weights and next(lm.model.parameters()).dtype == torch.bfloat16
    assert sum(p.numel() for p in lm.model.parameters()) == SHIPPED["Qwen/Qwen3-0.6B"][-1]
    assert lm.model.model.layers[0].self_attn.q_proj.weight.std() > 0

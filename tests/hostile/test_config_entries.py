"""One check of a model's config, whatever the entry that reads it (issue 38).

A hostile config was an internal error (exit 3) or worse by some entries: values transformers' strict
validation refuses (``StrictDataclassFieldValidationError``) escaped, and a folder with weights skipped
patchdsl's checks entirely (a 2**20 hidden size then tried to allocate 4 TB).  Every entry now makes
its config by ``patchdsl.model.hf.config_from_dict`` and checks the size of a model before building
it (``check_fits``).  The table: hostile configs x every entry that reads a config (a config.json path
on the meta device, tiny and full size; a model folder; a folder with weights; a Hub id in the local
cache, with and without weights; ``config_from_dict`` as the examples call it; the command line).

Also here: a mixture-of-experts model whose widths transformers' grouped_mm cannot take (bf16 / fp16 on
any device: strides of 16 bytes) is built with transformers' eager experts, so verify runs it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from patchdsl.cli import main
from patchdsl.model import ModelLoadError, config_from_dict, load_model

from .test_hostile_inputs import no_hang, one_line

HUB_ID = "hostile-org/tiny-llama"
BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
            max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=10000.0)
TB4 = dict(hidden_size=2 ** 20, num_attention_heads=1024, num_key_value_heads=1024, vocab_size=2 ** 20)
FULL = "full"        # entries that build at full size (allocate): only they refuse a model too large to hold

# (name, changes to BASE, the error's pattern, which entries refuse it: None = all)
HOSTILE = [
    ("ok", {}, None, ()),
    ("strict: hidden_act an int", {"hidden_act": 5}, r"field 'hidden_act': .*expected str, got int", None),
    ("strict: a bool as a string", {"tie_word_embeddings": "yes"}, r"field 'tie_word_embeddings'", None),
    ("strict: a token id as a string", {"pad_token_id": "x"}, r"field 'pad_token_id'", None),
    ("a size as a string", {"hidden_size": "32"}, r'"hidden_size" must be a positive integer', None),
    ("a RoPE base NaN", {"rope_theta": math.nan, "rope_parameters": {"rope_type": "default", "rope_theta": math.nan}},
     r"rope_theta", None),
    ("an unknown model_type", {"model_type": "no-such-model"}, r'model_type "no-such-model" is not known', None),
    # refused before anything is allocated, with the numbers: by the weights (a weights folder) or by the
    # whole build / run (model/memory.py's one check)
    ("4 TB of weights", TB4, r"weights alone take [\d,.]+ GiB in \w+, more than the [\d,.]+ GiB free"
                             r"|estimated ~[\d,.]+ GiB, [\d,.]+ GiB available on this machine: not started, it would not fit",
     FULL),
]


def _write(folder: Path, d: dict, weights: Path | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d, allow_nan=True))
    if weights is not None:
        shutil.copyfile(weights, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def saved_weights(tmp_path_factory):
    """The weights of BASE, saved once (a hostile config is refused before they are read)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"})).save_pretrained(d)
    return d / "model.safetensors"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local Hugging Face cache, offline."""
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def _cached(hub: Path, d: dict, weights: Path | None) -> str:
    repo = hub / ("models--" + HUB_ID.replace("/", "--"))
    rev = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    _write(repo / "snapshots" / rev, d, weights)
    return HUB_ID


# entry -> (kind, how it reads a config written as asked)
ENTRIES = {
    "config.json, meta": ("meta", lambda t, d, w, hub: load_model(_write(t / "m", d, None) / "config.json", meta=True)),
    "config.json, tiny": ("tiny", lambda t, d, w, hub: load_model(_write(t / "m", d, None) / "config.json", tiny=True)),
    "config.json, full": (FULL, lambda t, d, w, hub: load_model(_write(t / "m", d, None) / "config.json")),
    "model folder, meta": ("meta", lambda t, d, w, hub: load_model(_write(t / "m", d, None), meta=True)),
    "folder with weights": (FULL, lambda t, d, w, hub: load_model(_write(t / "m", d, w))),
    "cached Hub id, meta": ("meta", lambda t, d, w, hub: load_model(_cached(hub, d, None), meta=True)),
    "cached Hub id with weights": (FULL, lambda t, d, w, hub: load_model(_cached(hub, d, w))),
    "config_from_dict": ("dict", lambda t, d, w, hub: config_from_dict(d)),
}
CASES = [(h[0], e) for h in HOSTILE for e in ENTRIES]


@pytest.mark.parametrize("hostile, entry", CASES, ids=[f"{h}-{e}" for h, e in CASES])
def test_every_entry_checks_the_config_the_same_way(hostile, entry, saved_weights, hub_cache, tmp_path):
    _, changes, pattern, refused_by = next(h for h in HOSTILE if h[0] == hostile)
    kind, read = ENTRIES[entry]
    d = {**BASE, **changes}
    refused = refused_by is None or kind in refused_by
    with no_hang():
        if not refused:
            got = read(tmp_path, d, saved_weights, hub_cache)
            if entry.endswith("with weights"):
                assert got.has_weights, got.source
            return
        with pytest.raises(ModelLoadError) as e:
            read(tmp_path, d, saved_weights, hub_cache)
    msg = str(e.value)
    assert re.search(pattern, msg), msg
    assert "\n" not in msg and len(msg) < 600, msg


CLI_CASES = [
    (["plan", "llama", "--model", "{cfg}"], "strict: hidden_act an int"),
    (["apply", "llama", "--model", "{folder}", "--full"], "strict: a token id as a string"),
    (["apply", "llama", "--model", "{folder}", "--full"], "4 TB of weights"),
    (["verify", "llama", "--model", "{cfg}", "--full"], "4 TB of weights"),
]


@pytest.mark.parametrize("argv, hostile", CLI_CASES, ids=[f"{a[0]}-{h}" for a, h in CLI_CASES])
def test_the_command_line_says_what_is_wrong_with_exit_2(argv, hostile, saved_weights, tmp_path):
    _, changes, pattern, _ = next(h for h in HOSTILE if h[0] == hostile)
    folder = _write(tmp_path / "m", {**BASE, **changes}, saved_weights)
    with no_hang():
        r = CliRunner().invoke(main, [a.format(cfg=folder / "config.json", folder=folder) for a in argv])
    out = (r.stderr if r.stderr_bytes is not None else "") + r.output
    assert r.exit_code == 2, (r.exit_code, out[-1500:])
    one_line(out)
    assert re.search(pattern, out), out[-1500:]


# ---------------------------------------------------------------- MoE widths grouped_mm cannot take
ODD_MOE = dict(model_type="qwen3_moe", hidden_size=40, intermediate_size=48, moe_intermediate_size=20,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=10, vocab_size=64,
               max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_an_moe_with_widths_grouped_mm_cannot_take_runs_with_eager_experts(dtype, tmp_path):
    cfg = _write(tmp_path / "moe", ODD_MOE, None) / "config.json"
    log: list[str] = []
    m = load_model(cfg, dtype=dtype, log=log.append).model        # full size (no shrinking), random weights
    assert "eager loop" in log[0] and "moe_intermediate_size 20" in log[0], log
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 6))
    out = m(input_ids=ids, labels=ids)          # the unpatched model: grouped_mm raised here
    out.loss.backward()
    assert torch.isfinite(out.loss) and m.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def test_an_moe_whose_widths_grouped_mm_takes_keeps_its_implementation(tmp_path):
    cfg = _write(tmp_path / "moe", {**ODD_MOE, "hidden_size": 64, "moe_intermediate_size": 32, "head_dim": 16},
                 None) / "config.json"
    log: list[str] = []
    m = load_model(cfg, meta=True, log=log.append).model
    assert "eager" not in log[0] and m.config._experts_implementation != "eager", log

"""No data becomes code: transformers is never asked to run a model's own code (issue 38).

A model folder may ship Python files that its ``config.json`` names in ``auto_map``; transformers
imports them when asked with ``trust_remote_code`` (or when a person answers ``y`` to its "run the
custom code?" prompt).  patchdsl never asks: every config and model is made in
``patchdsl/model/hf.py`` (``trust_remote_code=False``, the config object made from a dict patchdsl
read and checked itself).  Two tests: one reads the code of patchdsl and its tools and fails on any
call of transformers' Auto classes / ``from_pretrained`` / ``from_config`` / ``for_model`` outside
that module; one feeds every command that loads a model a folder whose ``auto_map`` file would write
a marker file if imported, with ``y`` on stdin (the prompt must not appear; the marker must not).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchdsl.cli import main
from patchdsl.model import load_model

from .test_hostile_inputs import no_hang, one_line

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (ROOT / "patchdsl", ROOT / "tools" / "patchdsl_tools")
THE_PLACE = ROOT / "patchdsl" / "model" / "hf.py"
# what asks transformers for a class or a model by a config's say-so (and so may reach remote code)
AUTO = re.compile(r"^Auto[A-Z]\w*$")
CALLS = {"from_pretrained", "from_config", "for_model", "CONFIG_MAPPING", "get_class_from_dynamic_module",
         "dynamic_module_utils", "resolve_trust_remote_code"}


def transformers_entries(path: Path) -> list[str]:
    """``file:line name`` of every use of an Auto class or a loading entry of transformers in ``path``."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            names = [a.name for a in node.names] + (node.module or "").split(".")
        elif isinstance(node, ast.Import):
            names = [p for a in node.names if a.name.startswith("transformers") for p in a.name.split(".")]
        for n in names:
            if AUTO.match(n) or n in CALLS:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append(f"{where}:{node.lineno} {n}")
    return found


def test_the_scan_finds_what_it_looks_for(tmp_path):
    # the scan itself can fail: each form it must catch, in a file of its own
    forms = ["from transformers import AutoConfig", "import transformers.dynamic_module_utils",
             "m = x.from_pretrained('p')", "m = cls.from_config(c)", "c = transformers.AutoModelForCausalLM",
             "from transformers.models.auto.configuration_auto import CONFIG_MAPPING"]
    for i, src in enumerate(forms):
        p = tmp_path / f"probe_{i}.py"
        p.write_text(src + "\n")
        assert transformers_entries(p), src
    p = tmp_path / "clean.py"
    p.write_text("def spec_from_config(c):\n    return 'pass attn_implementation= to from_pretrained'\n")
    assert not transformers_entries(p)


def test_only_model_hf_asks_transformers_for_configs_and_models():
    offenders = [e for d in SCANNED for p in sorted(d.rglob("*.py")) if p != THE_PLACE
                 for e in transformers_entries(p)]
    assert not offenders, ("transformers' Auto classes / from_pretrained / from_config / for_model are called "
                           "only in patchdsl/model/hf.py (never remote code, one check of every config); "
                           "go through it instead:\n  " + "\n  ".join(offenders))
    assert transformers_entries(THE_PLACE), "patchdsl/model/hf.py no longer calls transformers: update this test"


# ---------------------------------------------------------------- behaviour: a folder with code
EVIL = ("from pathlib import Path\nPath({marker!r}).write_text('imported')\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel\n")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny llama's saved weights and config dict (saved once)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _code_folder(weights: Path, tmp: Path, model_type: str) -> tuple[Path, Path]:
    d = tmp / f"m_{model_type}"
    d.mkdir()
    for f in ("model.safetensors", "config.json"):
        (d / f).write_bytes((weights / f).read_bytes())
    marker = tmp / f"MARKER_{model_type}"
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig",
                                                "AutoModelForCausalLM": "evil.EvilModel"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return d, marker


# every command that loads a model, with the folder; --full: the weights are loaded (from_pretrained)
COMMANDS = [
    ["plan", "llama", "--model", "{m}"],
    ["inspect", "--model", "{m}"],
    ["suggest", "--model", "{m}"],
    ["translate", "--liger", "true", "--model", "{m}"],
    ["apply", "llama", "--model", "{m}", "--full", "--steps", "1", "--seq", "4"],
    ["verify", "llama", "--model", "{m}", "--full", "--seq", "4"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[a[0] for a in COMMANDS])
def test_a_folder_whose_auto_map_names_its_own_code_is_refused_and_the_code_never_runs(argv, weights, tmp_path):
    d, marker = _code_folder(weights, tmp_path, "evilmodel")
    with no_hang():
        # "y" answers transformers' prompt, should it appear: the code would then run
        r = CliRunner().invoke(main, [a.format(m=d) for a in argv], input="y\ny\n")
    out = (r.stderr if r.stderr_bytes is not None else "") + r.output
    assert not marker.exists(), f"the model folder's code was imported: {out[-1500:]}"
    assert "custom code" not in out and "[y/N]" not in out, out[-1500:]
    assert r.exit_code == 2, (r.exit_code, out[-1500:])
    one_line(out)
    assert re.search(r"model_type \"evilmodel\" is not known to transformers.*auto_map.*never runs", out), out[-800:]


def test_a_known_model_type_with_auto_map_loads_with_transformers_own_class(weights, tmp_path):
    d, marker = _code_folder(weights, tmp_path, "llama")
    log: list[str] = []
    lm = load_model(str(d), log=log.append)
    assert lm.has_weights and type(lm.model).__name__ == "LlamaForCausalLM"
    assert type(lm.model).__module__.startswith("transformers."), type(lm.model).__module__
    assert not marker.exists()
    assert len(log) == 1 and "auto_map" in log[0] and "never runs it" in log[0], log
    assert "auto_map" not in lm.config.to_dict()

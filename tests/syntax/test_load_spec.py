"""load_spec: a path, a shipped name, or text; includes; cycles."""

from pathlib import Path

import pytest

import patchdsl
from patchdsl import SpecError


@pytest.mark.parametrize("arg,n_rules", [
    ("qwen3", 4), ("specs/qwen3.kpatch", 4), ("gemma3.kpatch", 4), (Path("specs/llama.kpatch"), 4),
    ("*.mlp: SwiGLU -> fused_swiglu", 1),
])
def test_forms(arg, n_rules, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert len(patchdsl.load_spec(arg).rules) == n_rules


@pytest.mark.parametrize("arg", ["nope.kpatch", "x/nope.kpatch", Path("nope.kpatch")])
def test_missing_file(arg):
    with pytest.raises(SpecError, match="not found"):
        patchdsl.load_spec(arg)


def test_include_expands_in_place_and_keeps_locations(tmp_path):
    (tmp_path / "base.kpatch").write_text("dtype bf16\n*.mlp: SwiGLU -> fused_swiglu\n")
    (tmp_path / "top.kpatch").write_text('include "base.kpatch"\nmodel.norm: RMSNorm -> fused_rmsnorm\n')
    spec = patchdsl.load_spec(tmp_path / "top.kpatch")
    assert [r.op.name for r in spec.rules] == ["fused_swiglu", "fused_rmsnorm"]
    assert spec.rules[0].span.file.endswith("base.kpatch") and spec.rules[0].span.line == 2
    assert spec.rules[1].span.file.endswith("top.kpatch") and spec.dtypes == ("bf16",)


def test_include_shipped_by_name(tmp_path):
    (tmp_path / "mine.kpatch").write_text('include "qwen3"\nmodel.layers.{0..3}.mlp: SwiGLU -> fused_swiglu(in_place=false)\n')
    spec = patchdsl.load_spec(tmp_path / "mine.kpatch")
    assert len(spec.rules) == 5


def test_include_cycle_is_an_error(tmp_path):
    (tmp_path / "a.kpatch").write_text('include "b.kpatch"\n')
    (tmp_path / "b.kpatch").write_text('include "a.kpatch"\n')
    with pytest.raises(SpecError, match="include cycle"):
        patchdsl.load_spec(tmp_path / "a.kpatch")


@pytest.mark.parametrize("arg,fragments", [
    ("qwen4", ["spec 'qwen4' not found", "did you mean 'qwen3'?", "shipped specs: ", "gemma3, ", "llama, mistral, "]),
    ("lama", ["did you mean 'llama'?"]),
    ("qwen4.kpatch", ["spec 'qwen4.kpatch' not found", "did you mean 'qwen3'?"]),
    ("specs/nope.kpatch", ["not found", "shipped specs:"]),
])
def test_misspelt_names_are_not_spec_text(arg, fragments):
    with pytest.raises(SpecError) as ei:
        patchdsl.load_spec(arg)
    text = ei.value.render()
    for f in fragments:
        assert f in text, text
    assert "unexpected" not in text      # not parsed as spec text


def test_shipped_spec_by_short_path_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = patchdsl.load_spec("specs/qwen3.kpatch")
    assert spec.path == "specs/qwen3.kpatch" and spec.rules[0].span.short.startswith("specs/qwen3.kpatch:")


# (files to write, the top file, include_dirs, expected error fragment or None)
INCLUDE_RULES = [
    ({"a/top.kpatch": 'include "sub/b.kpatch"', "a/sub/b.kpatch": "*.mlp: SwiGLU -> fused_swiglu"},
     "a/top.kpatch", [], None),                                        # a subfolder of the spec's folder
    ({"a/top.kpatch": 'include "b"', "a/b.kpatch": "*.mlp: SwiGLU -> fused_swiglu"},
     "a/top.kpatch", [], None),                                        # .kpatch may be left out
    ({"a/top.kpatch": 'include "sub/b.kpatch"', "a/sub/b.kpatch": 'include "../c.kpatch"',
      "a/c.kpatch": "*.mlp: SwiGLU -> fused_swiglu"}, "a/top.kpatch", [], None),   # still inside a/
    ({"a/top.kpatch": 'include "../b.kpatch"', "b.kpatch": "*.mlp: SwiGLU -> fused_swiglu"},
     "a/top.kpatch", [], "outside the folders includes may read"),
    ({"a/top.kpatch": 'include "../b.kpatch"', "b.kpatch": "*.mlp: SwiGLU -> fused_swiglu"},
     "a/top.kpatch", ["."], None),                                      # allowed explicitly
    ({"a/top.kpatch": 'include "llama"'}, "a/top.kpatch", [], None),   # shipped specs are always allowed
    ({"a/top.kpatch": 'include "b.json"'}, "a/top.kpatch", [], r"only \*\.kpatch files can be included"),
]


@pytest.mark.parametrize("files,top,dirs,error", INCLUDE_RULES)
def test_include_rule(tmp_path, files, top, dirs, error):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    dirs = [tmp_path / d for d in dirs]
    if error is None:
        assert patchdsl.load_spec(tmp_path / top, include_dirs=dirs).rules
    else:
        with pytest.raises(SpecError, match=error):
            patchdsl.load_spec(tmp_path / top, include_dirs=dirs)


def test_spec_text_has_no_folder_of_its_own(tmp_path, monkeypatch):
    """Text (not a file) may include shipped specs and include_dirs, not the working directory."""
    (tmp_path / "b.kpatch").write_text("*.mlp: SwiGLU -> fused_swiglu\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match="not found"):
        patchdsl.load_spec('include "b.kpatch"\n')
    assert patchdsl.load_spec('include "b.kpatch"\n', include_dirs=[tmp_path]).rules
    assert len(patchdsl.load_spec('include "qwen3"\n').rules) == 4

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
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
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

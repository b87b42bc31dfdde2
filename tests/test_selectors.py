"""Selector semantics, as a table: (selector, path, matches?)."""

import pytest

from patchdsl.syntax import SpecError
from patchdsl.syntax.selectors import compile_selector

CASES = [
    # '*' is any run of characters, dots included; anchored at both ends
    ("*.mlp", "model.layers.0.mlp", True),
    ("*.mlp", "model.layers.27.mlp", True),
    ("*.mlp", "model.layers.0.mlp.gate_proj", False),
    ("*.mlp", "mlp", False),
    ("mlp", "model.layers.0.mlp", False),
    ("*mlp", "mlp", True),
    ("model.*", "model.layers.0.mlp", True),
    ("*norm", "model.layers.3.input_layernorm", True),
    ("*", "lm_head", True),
    # '**' as a component: zero or more whole components
    ("model.**.mlp", "model.mlp", True),
    ("model.**.mlp", "model.layers.3.mlp", True),
    ("model.**.mlp", "model.layers.3.xmlp", False),
    ("**.mlp", "model.layers.1.mlp", True),
    ("**.mlp", "mlp", True),
    ("model.**", "model.norm", True),
    ("model.**", "lm_head", False),
    # '?' is one character, not a dot
    ("model.layers.?.mlp", "model.layers.7.mlp", True),
    ("model.layers.?.mlp", "model.layers.12.mlp", False),
    ("model.layers.??.mlp", "model.layers.12.mlp", True),
    ("model?norm", "model.norm", False),
    # alternation
    ("*.self_attn.{q_norm,k_norm}", "model.layers.0.self_attn.q_norm", True),
    ("*.self_attn.{q_norm,k_norm}", "model.layers.0.self_attn.k_norm", True),
    ("*.self_attn.{q_norm,k_norm}", "model.layers.0.self_attn.v_norm", False),
    ("*.{input,post_attention}_layernorm", "model.layers.4.post_attention_layernorm", True),
    ("{model.norm,lm_head}", "lm_head", True),
    ("*.{mlp,self_attn.*_proj}", "model.layers.0.self_attn.q_proj", True),
    # integer ranges
    ("model.layers.{0..11}.mlp", "model.layers.0.mlp", True),
    ("model.layers.{0..11}.mlp", "model.layers.11.mlp", True),
    ("model.layers.{0..11}.mlp", "model.layers.12.mlp", False),
    ("model.layers.{0..11}.mlp", "model.layers.1.mlp", True),
    ("model.layers.{10..11}.mlp", "model.layers.1.mlp", False),
    ("model.layers.{0..11}.mlp", "model.layers.011.mlp", False),
    ("model.layers.{3..3}.mlp", "model.layers.3.mlp", True),
    # literal dots and underscores
    ("model.norm", "model.norm", True),
    ("model.norm", "modelxnorm", False),
    ("lm_head", "lm_head", True),
]


@pytest.mark.parametrize("selector,path,expected", CASES)
def test_selector_table(selector, path, expected):
    assert bool(compile_selector(selector).match(path)) is expected


BAD = [
    ("model.layers.{3..1}.mlp", "empty range"),
    ("model.layers.{0..}.mlp", "bad range"),
    ("*.{q_norm,}", "empty alternative"),
    ("*.{q_norm", "'{'"),
    ("model..mlp", "empty path component"),
    ("model.x**.mlp", "'**' must be a whole path component"),
]


@pytest.mark.parametrize("selector,message", BAD)
def test_bad_selectors_are_located_errors(selector, message):
    from patchdsl import parse_spec

    with pytest.raises(SpecError) as ei:
        parse_spec(f"{selector}: RMSNorm -> fused_rmsnorm\n", "bad.kpatch")
    e = ei.value
    assert message in e.message
    assert e.span is not None and e.span.file == "bad.kpatch" and e.span.line == 1
    assert "^" in e.render()


def test_exclusion_and_several_selectors():
    from patchdsl import parse_spec
    from patchdsl.select import path_matches

    rule = parse_spec("model.layers.{0..3}.mlp, model.layers.9.mlp, !model.layers.2.mlp: SwiGLU -> fused_swiglu").rules[0]
    got = [i for i in range(12) if path_matches(rule, f"model.layers.{i}.mlp")]
    assert got == [0, 1, 3, 9]


def test_only_exclusions_is_an_error():
    from patchdsl import parse_spec

    with pytest.raises(SpecError, match="at least one selector that is not an exclusion"):
        parse_spec("!model.norm: RMSNorm -> fused_rmsnorm")

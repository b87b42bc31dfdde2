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
    ("model.layers.{-2..1}.mlp", "model.layers.-1.mlp", True),
    ("model.layers.{-2..1}.mlp", "model.layers.-3.mlp", False),
    ("model.layers.{-2..1}.mlp", "model.layers.1.mlp", True),
    ("model.layers.{95..105}.mlp", "model.layers.100.mlp", True),
    ("model.layers.{95..105}.mlp", "model.layers.94.mlp", False),
    ("model.layers.{95..105}.mlp", "model.layers.106.mlp", False),
    ("layer{0..3}x", "layer3x", True),
    ("layer{0..3}x", "layer13x", False),
    ("model.layers.{0..11}1.mlp", "model.layers.111.mlp", True),     # 11 then a literal 1
    ("model.layers.{0..100000}.{0..100000}.mlp", "model.layers.100000.7.mlp", True),
    ("model.layers.{0..100000}.{0..100000}.mlp", "model.layers.100001.7.mlp", False),
    # nested alternation (from Python; the spec lexer keeps braces one level deep)
    ("{a,{b,c}}.x", "c.x", True),
    ("{a,{b,c}}.x", "d.x", False),
    # '**' in the middle
    ("model.**.q_norm", "model.layers.0.self_attn.q_norm", True),
    ("model.**.q_norm", "model.q_norm", True),
    ("model.**.q_norm", "modelq_norm", False),
    # '*' and '?' runs: no backtracking blow-up (linear in the path)
    ("*?" * 13 + "*", "model.layers.0.input_layernorm", True),
    ("*?" * 20 + "x", "model.layers.0.self_attn.q_proj" * 3, False),
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
    ("model.layers.{0..1000000}.mlp", "is too large"),
    ("model.layers.{0..12345678901234567890}.mlp", "range bound has 20 digits"),
    ("model.layers.{0.." + "9" * 5000 + "}.mlp", "range bound has 5000 digits"),
    ("*.{" + ",".join(f"a{i}" for i in range(300)) + "}", "too many alternatives"),
    ("a" * 1001, "selector is too long"),
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


@pytest.mark.parametrize("selector,message", [
    ("{" * 9 + "a" + "}" * 9, "braces nest too deep"),
    ("{" + "{a,b}," * 200 + "c}", "too many alternatives"),
])
def test_limits_of_compiled_selectors(selector, message):
    with pytest.raises(SpecError, match=message):
        compile_selector(selector)


@pytest.mark.parametrize("lo,hi", [(0, 0), (0, 9), (0, 11), (3, 3), (7, 123), (-15, -3), (-9, 20), (95, 1005),
                                   (1000, 1999), (0, 100000), (99, 100)])
def test_ranges_match_exactly_their_integers(lo, hi):
    m = compile_selector(f"x.{{{lo}..{hi}}}")
    probe = set(range(lo - 30, lo + 30)) | set(range(hi - 30, hi + 30)) | {(lo + hi) // 2}
    for n in probe:
        assert m.match(f"x.{n}") is (lo <= n <= hi), n
    assert not m.match(f"x.0{abs(hi)}")          # no leading zeros
    assert not m.match("x.") and not m.match("x.-")


def test_class_patterns_glob():
    from patchdsl.syntax.selectors import class_glob

    assert class_glob("*RMSNorm").match("Qwen3RMSNorm")
    assert class_glob("Qwen?MLP").match("Qwen3MLP")
    assert not class_glob("Qwen?MLP").match("Qwen33MLP")
    assert not class_glob("*?*?*?*?*?*?*?*?*?*?*?*?*?*?*?*?*?*?*?*?*?x").match("A" * 60)


def test_exclusion_and_several_selectors():
    from patchdsl import parse_spec
    from patchdsl.planning.select import path_matches

    rule = parse_spec("model.layers.{0..3}.mlp, model.layers.9.mlp, !model.layers.2.mlp: SwiGLU -> fused_swiglu").rules[0]
    got = [i for i in range(12) if path_matches(rule, f"model.layers.{i}.mlp")]
    assert got == [0, 1, 3, 9]


def test_only_exclusions_is_an_error():
    from patchdsl import parse_spec

    with pytest.raises(SpecError, match="at least one selector that is not an exclusion"):
        parse_spec("!model.norm: RMSNorm -> fused_rmsnorm")


# A rule's selectors and brace members each patch something, or the rule is an error at that
# selector (issue 22: a misspelt selector in a list, or a brace member that fits nothing, used to
# vanish from the totals); `optional` lists them as unmatched instead.
# (rule, None = plans with these patched leaf totals and unmatched count | error regex)
DEAD_MEMBERS = [
    ("*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm",
     ({"input_layernorm": 2, "post_attention_layernorm": 2, "norm": 1}, 0)),
    ("*.input_layernorm, *.post_atention_layernorm, model.norm: RMSNorm -> fused_rmsnorm",
     r"(?s)'\*\.post_atention_layernorm' in .* matched 0 modules.*did you mean 'post_attention_layernorm'"),
    ("optional *.input_layernorm, *.post_atention_layernorm: RMSNorm -> fused_rmsnorm",
     ({"input_layernorm": 2}, 1)),
    ("*.self_attn.{q_norm,k_norm}: RMSNorm -> fused_rmsnorm", ({"q_norm": 2, "k_norm": 2}, 0)),
    ("*.self_attn.{q_norm,k_norm,v_norm}: RMSNorm -> fused_rmsnorm",
     r"'\*\.self_attn\.v_norm' \(a member of '\*\.self_attn\.\{q_norm,k_norm,v_norm\}'\) matched 0 modules"),
    ("optional *.self_attn.{q_norm,k_norm,v_norm}: RMSNorm -> fused_rmsnorm", ({"q_norm": 2, "k_norm": 2}, 1)),
    # a member that matches modules of another kind is dropped as surely: an error too
    ("model.layers.*.{input_layernorm,mlp}: RMSNorm -> fused_rmsnorm",
     r"'model\.layers\.\*\.mlp' .* matched 2 module\(s\) \(Qwen3MLP\) but none is RMSNorm"),
    ("*.mlp, *.self_attn: SwiGLU -> fused_swiglu", r"'\*\.self_attn' in .* but none is SwiGLU"),
    # nested braces, and a range that stays whole (layers 0 and 1 exist; the range is one member)
    ("model.layers.{0..5}.{input_layernorm,post_attention_layernorm}: RMSNorm -> fused_rmsnorm",
     ({"input_layernorm": 2, "post_attention_layernorm": 2}, 0)),
    ("model.layers.{0,7}.mlp: SwiGLU -> fused_swiglu", r"'model\.layers\.7\.mlp' .* matched 0 modules"),
    # exclusions are not members
    ("*.mlp, !model.layers.0.mlp: SwiGLU -> fused_swiglu", ({"mlp": 1}, 0)),
]


@pytest.mark.parametrize("rule, expected", DEAD_MEMBERS, ids=[r for r, _ in DEAD_MEMBERS])
def test_every_selector_and_brace_member_patches_something(rule, expected):
    from patchdsl.planning.planner import plan

    from ..families import tiny_model

    model = tiny_model("qwen3")
    if isinstance(expected, str):
        with pytest.raises(SpecError, match=expected):
            plan(rule + "\n", model)
        return
    totals, n_unmatched = expected
    p = plan(rule + "\n", model)
    assert {n: a for n, a, _ in p.totals} == totals
    assert len(p.unmatched_optional) == n_unmatched


def test_brace_members_expands_alternations_not_ranges():
    from patchdsl.planning.select import MAX_MEMBERS, brace_members

    assert brace_members("*.{a,b}.{c,d}") == ["*.a.c", "*.a.d", "*.b.c", "*.b.d"]
    assert brace_members("a.{b,{c,d}x}") == ["a.b", "a.cx", "a.dx"]
    assert brace_members("l.{0..11}.mlp") == ["l.{0..11}.mlp"]
    assert brace_members("*.mlp") == ["*.mlp"]
    wide = "x.{" + ",".join(f"m{i}" for i in range(MAX_MEMBERS + 1)) + "}"
    assert brace_members(wide) == [wide]          # too many to check one by one: the whole selector

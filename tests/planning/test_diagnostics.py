"""Every diagnostic: message text, file:line:col, the caret line, exit code 2, no traceback."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from patchdsl.cli import main

# (spec text, message fragment, line, col, hint fragment or None)
CHECK_ERRORS = [
    ("*.mlp SwiGLU -> fused_swiglu\n", "unexpected 'SwiGLU'", 1, 7, "expected ',' or ':'"),
    ("*.mlp: SwiGLU ->\n", "unexpected end of line", 1, 17, "expected a name"),
    ("*.mlp: SwiGLU -> fused_swiglu(\n", "unexpected end of line", 1, 31, "expected"),
    ("*.mlp: SwiGLU -> fused_swiglu(in_place=)\n", "unexpected ')'", 1, 40, "a number"),
    ("\n\n*.mlp: Swi@GLU -> fused_swiglu\n", "unexpected character '@'", 3, 11, None),
    ("dtype bf17\n", "unknown dtype 'bf17'", 1, 7, "did you mean 'bf16'?"),
    ("*.norm: RMSNorm -> fused_rmsnrm\n", "unknown op 'fused_rmsnrm'", 1, 20, "did you mean 'fused_rmsnorm'?"),
    ("*.norm: RMSNorm -> fused_rmsnorm(esp=1e-6)\n", "unknown flag 'esp' for fused_rmsnorm", 1, 34, "did you mean 'eps'?"),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=\"small\")\n", "flag 'eps' expects a number or auto, got 'small'", 1, 34, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=true)\n", "flag 'eps' expects a number or auto, got true", 1, 34, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(casting=bert)\n", "flag 'casting' expects 'llama' or 'gemma' or auto", 1, 34, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=1, eps=2)\n", "flag 'eps' given twice", 1, 41, None),
    ("*.norm: RMSnorm -> fused_rmsnorm\n", "unknown kind 'RMSnorm'", 1, 9, "did you mean 'RMSNorm'?"),
    ("*.mlp: SwiGLU -> fused_rmsnorm\n", "fused_rmsnorm replaces RMSNorm modules, not SwiGLU", 1, 8, None),
    ("*: Linear|*Norm -> fused_rmsnorm\n", "fused_rmsnorm replaces RMSNorm modules, not Linear", 1, 4, None),
    ("model.layers.{5..2}.mlp: SwiGLU -> fused_rmsnorm\n", "empty range {5..2}", 1, 14, None),
    ("default fused_rmsnrm(eps=1e-6)\n", "unknown op 'fused_rmsnrm'", 1, 9, "did you mean"),
    ("dtype bf16\ndtype fp32\n", "'dtype' given twice", 2, 1, None),
    ("include \"no/such/file.kpatch\"\n", "included file 'no/such/file.kpatch' not found", 1, 9, None),
    ("include \"/etc/shadow\"\n", "included file '/etc/shadow' is outside the folders includes may read", 1, 9,
     "--include-dir"),
    ("include \"notes.txt\"\n", "included file 'notes.txt' is not a spec: only *.kpatch files can be included",
     1, 9, None),
    # numbers: finite, in range, 64-bit
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=1e309)\n", "number 1e309 is out of range", 1, 38, "finite"),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=-1e309)\n", "number -1e309 is out of range", 1, 38, None),
    ("lm_head: Linear -> fused_linear_cross_entropy(z_loss=1e309)\n", "number 1e309 is out of range", 1, 54, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=nan)\n", "flag 'eps' expects a number or auto, got 'nan'", 1, 34, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=inf)\n", "flag 'eps' expects a number or auto, got 'inf'", 1, 34, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=1e-999)\n", "number 1e-999 is too small: it rounds to 0", 1, 38, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(eps=-0.5)\n", "flag 'eps' must be >= 0.0", 1, 34, None),
    ("*.norm: RMSNorm -> fused_rmsnorm(block=9223372036854775808)\n", "integer 9223372036854775808 is out of range",
     1, 40, "64 bits"),
    ("*.norm: RMSNorm -> fused_rmsnorm(block=" + "9" * 5000 + ")\n",
     "integer 999999999999999999999999... (5000 characters) is out of range", 1, 40, None),
    ("model.layers.{0.." + "9" * 5000 + "}.mlp: SwiGLU -> fused_swiglu\n", "range bound has 5000 digits", 1, 14, None),
]


@pytest.mark.parametrize("text,msg,line,col,hint", CHECK_ERRORS)
def test_check_errors(tmp_path, text, msg, line, col, hint):
    spec = tmp_path / "bad.kpatch"
    spec.write_text(text)
    r = CliRunner().invoke(main, ["check", str(spec)])
    assert r.exit_code == 2, r.output
    out = r.output
    assert f"{spec}:{line}:{col}: error: {msg}" in out, out
    src = text.split("\n")[line - 1]
    caret_line = out.split("\n")[2]
    if len(src) <= 120:
        assert f"{line} | {src}" in out
        assert caret_line.index("^") == len(f"  {line} | ") + col - 1, out
    else:    # a long line is shown as a window around the caret
        shown = out.split("\n")[1]
        assert len(shown) < 140 and shown[caret_line.index("^")] == src[col - 1], out
    if hint:
        assert hint in out
    assert "Traceback" not in out


def test_check_ok(tmp_path):
    spec = tmp_path / "ok.kpatch"
    spec.write_text("dtype bf16\n*.input_layernorm: RMSNorm -> fused_rmsnorm(eps=1e-6)  # trailing comment\n")
    r = CliRunner().invoke(main, ["check", str(spec)])
    assert r.exit_code == 0 and "ok" in r.output


def test_missing_spec_file_exit_2():
    r = CliRunner().invoke(main, ["check", "/no/such.kpatch"])
    assert r.exit_code == 2 and "not found" in r.output and "Traceback" not in r.output


def test_real_process_exit_code_and_no_traceback(tmp_path):
    spec = tmp_path / "bad.kpatch"
    spec.write_text("*.mlp: SwiGLU -> fused_swiglu(in_place=maybe\n")
    p = subprocess.run([sys.executable, "-m", "patchdsl.cli", "check", str(spec)], capture_output=True, text=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr + p.stdout
    assert f"{spec}:1:" in p.stderr


def test_every_error_in_one_run(tmp_path):
    """Four mistakes, four located errors, in file order, in one run."""
    spec = tmp_path / "four.kpatch"
    spec.write_text("dtype bf17\n"
                    "*.mlp SwiGLU -> fused_swiglu\n"
                    "*.norm: RMSNorm -> fused_rmsnrm\n"
                    "*.q_norm: RMSNorm -> fused_rmsnorm(esp=1, eps=1e309)\n")
    r = CliRunner().invoke(main, ["check", str(spec)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    want = [(1, 7, "unknown dtype 'bf17'"), (2, 7, "unexpected 'SwiGLU'"), (3, 20, "unknown op 'fused_rmsnrm'"),
            (4, 36, "unknown flag 'esp'"), (4, 47, "number 1e309 is out of range")]
    positions = [r.output.index(f"{spec}:{ln}:{col}: error: {msg}") for ln, col, msg in want]
    assert positions == sorted(positions), r.output
    assert r.output.rstrip().endswith("5 errors")


def test_errors_are_capped(tmp_path):
    from patchdsl.syntax.errors import MAX_ERRORS

    spec = tmp_path / "many.kpatch"
    spec.write_text("".join(f"*.n{i}: RMSNorm -> nope{i}\n" for i in range(MAX_ERRORS + 10)))
    r = CliRunner().invoke(main, ["check", str(spec)])
    assert r.exit_code == 2
    assert r.output.count(": error: ") == MAX_ERRORS
    assert f"{MAX_ERRORS + 10} errors (the first {MAX_ERRORS} shown)" in r.output


def test_spec_error_api_single_and_several():
    from patchdsl import SpecError, parse_spec

    with pytest.raises(SpecError) as one:
        parse_spec("dtype bf17\n", "a.kpatch")
    e = one.value
    assert e.errors == (e,) and e.count == 1 and e.span.line == 1 and "bf17" in e.message
    with pytest.raises(SpecError) as two:
        parse_spec("dtype bf17\n*.mlp SwiGLU -> fused_swiglu\n", "a.kpatch")
    e = two.value
    assert [x.span.line for x in e.errors] == [1, 2] and e.count == 2
    assert e.message == e.errors[0].message and e.span == e.errors[0].span
    assert str(e) == e.render()


@pytest.mark.parametrize("args,fragments", [
    (["check", "qwen4"], ["spec 'qwen4' not found", "did you mean 'qwen3'?", "shipped specs: ", "gemma3, ", "llama, "]),
    (["plan", "nosuchspec", "-m", "Qwen/Qwen3-0.6B"], ["spec 'nosuchspec' not found", "shipped specs: ", "gemma3"]),
    (["check", "/no/such/dir/x.kpatch"], ["not found"]),
])
def test_missing_specs_list_the_shipped_ones(args, fragments):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "Traceback" not in r.output
    for f in fragments:
        assert f in r.output, r.output


def test_shipped_spec_locations_are_short():
    r = CliRunner().invoke(main, ["check", "qwen3", "--json"])
    assert r.exit_code == 0
    import json

    rules = json.loads(r.output)["rules"]
    assert rules and all(x["rule"].startswith("specs/qwen3.kpatch:") for x in rules)


def test_include_dir_option(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "base.kpatch").write_text("*.mlp: SwiGLU -> fused_swiglu\n")
    (tmp_path / "proj").mkdir()
    top = tmp_path / "proj" / "top.kpatch"
    top.write_text('include "base.kpatch"\n')
    r = CliRunner().invoke(main, ["check", str(top)])
    assert r.exit_code == 2 and f"{top}:1:9: error: included file 'base.kpatch' not found" in r.output
    r = CliRunner().invoke(main, ["check", str(top), "--include-dir", str(tmp_path / "lib")])
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def qwen3_index():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from patchdsl.model.index import build_index

    cfg = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return build_index(model)


# (spec, line:col of the error, message fragment, hint fragment)
PLAN_ERRORS = [
    ("*: Linear -> fused_linear_cross_entropy", (1, 1),
     "fused_linear_cross_entropy fits only the causal LM's lm_head; '*' selects 14 other module(s)",
     "'lm_head: Linear -> fused_linear_cross_entropy'"),
    ("*.q_proj: Linear -> fused_cross_entropy", (1, 1),
     "fused_cross_entropy fits only the causal LM's lm_head; '*.q_proj' selects 2 module(s)", None),
    ("*.mlp: LlamaMLP -> fused_swiglu", (1, 8), "none is LlamaMLP", "did you mean 'Qwen3MLP'?"),
    ("*: LlamaRMSNorm -> fused_rmsnorm", (1, 4), "none is LlamaRMSNorm", "did you mean 'Qwen3RMSNorm'?"),
    ("mlp: SwiGLU -> fused_swiglu", (1, 1), "'mlp' matched 0 modules", "'*.mlp' matches 2"),
]


@pytest.mark.parametrize("text,pos,msg,hint", PLAN_ERRORS)
def test_plan_hints(qwen3_index, text, pos, msg, hint):
    from patchdsl import SpecError, parse_spec
    from patchdsl.planning.planner import plan

    with pytest.raises(SpecError) as ei:
        plan(parse_spec(text + "\n", "h.kpatch"), qwen3_index, target="interpreter")
    e = ei.value
    assert (e.span.line, e.span.col) == pos and msg in e.message, e.render()
    if hint:
        assert hint in (e.hint or ""), e.render()
    assert "q_proj and" not in e.render()    # not a conflict between two Linear modules


def test_plan_reports_every_rule_error(qwen3_index):
    from patchdsl import SpecError, parse_spec
    from patchdsl.planning.planner import plan

    text = ("mlp: SwiGLU -> fused_swiglu\n*.mlp: LlamaMLP -> fused_swiglu\n"
            "*.self_attn: Attention -> fused_rope\n*.self_attn: Attention -> fused_qk_norm_rope\n")
    with pytest.raises(SpecError) as ei:
        plan(parse_spec(text, "h.kpatch"), qwen3_index, target="interpreter")
    assert [x.span.line for x in ei.value.errors] == [1, 2, 4]


def test_shipped_rule_locations_in_a_plan(qwen3_index):
    from patchdsl import load_spec
    from patchdsl.planning.planner import plan

    p = plan(load_spec("qwen3"), qwen3_index, target="interpreter")
    assert p.spec == "specs/qwen3.kpatch"
    assert all(r.startswith("specs/qwen3.kpatch:") for s in p.sites for r in s.rules)

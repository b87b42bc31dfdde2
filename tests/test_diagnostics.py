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
    assert f"{line} | {src}" in out
    caret_line = out.split("\n")[2]
    assert caret_line.index("^") == len(f"  {line} | ") + col - 1, out
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

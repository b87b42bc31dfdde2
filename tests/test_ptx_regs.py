"""bench/ptx_regs.py: fused_qk_norm_rope's kernels compiled for sm_90 on the CPU, registers and what fits
per SM read from ptxas (the numbers behind the qk sweep's programs-per-SM choices in bench/NOTES.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mod():
    spec = importlib.util.spec_from_file_location("ptx_regs_mod", ROOT / "bench" / "ptx_regs.py")
    mod = importlib.util.module_from_spec(spec)
    interp = os.environ.get("TRITON_INTERPRET")
    try:
        spec.loader.exec_module(mod)          # sets TRITON_INTERPRET=0 for a fresh process; undo it here
    finally:
        if interp is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = interp
    return mod


# (registers per thread, warps) -> programs that fit in 64K registers (8-register allocation units,
# at most 2048 threads)
@pytest.mark.parametrize("regs,warps,fit", [(115, 2, 8), (158, 4, 3), (254, 4, 2), (48, 4, 10), (96, 8, 2),
                                            (128, 16, 1), (255, 16, 0), (16, 1, 64), (24, 4, 16)])
def test_fits_per_sm(regs, warps, fit):
    assert _mod().fits_per_sm(regs, warps) == fit


def _run(*args):
    if not os.path.exists(_mod().ptxas_path()):
        pytest.skip("the triton wheel ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "ptx_regs.py"), *args], capture_output=True, text=True,
                          cwd=str(ROOT), env=env, timeout=300)


def test_registers_of_the_shipped_and_a_block_backward():
    """The shipped CUDA backward is the block layout (H200 sweep); the per-token one it replaced is a variant."""
    r = _run("--json", "--variants", json.dumps({"per_token": {"bwd_layout": "per_token", "bwd_warps": 2},
                                                 "shipped": {}}))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {(x["variant"], x["kernel"]): x for x in json.loads(r.stdout)}
    assert set(rows) == {("per_token", "fwd"), ("per_token", "bwd"), ("shipped", "fwd"), ("shipped", "bwd")}
    tok, blk = rows[("per_token", "bwd")], rows[("shipped", "bwd")]
    for x in rows.values():
        assert 16 <= x["regs"] <= 255 and x["spill_bytes"] == 0 and x["fit_per_sm"] >= 1
    # the same forward in both; the block backward holds all 24 heads' tiles: more registers, more warps
    assert rows[("per_token", "fwd")]["regs"] == rows[("shipped", "fwd")]["regs"]
    assert tok["warps"] == 2 and blk["warps"] == 4 and blk["regs"] > tok["regs"]
    assert blk["fit_per_sm"] < tok["fit_per_sm"]
    # vectorised global loads (the divisibility hints reach the compiler)
    assert any(k.startswith("ld.global.v") for k in blk["loads"])


def test_an_unknown_variant_parameter_fails():
    r = _run("--variants", json.dumps({"bad": {"bwd_layout": "rows"}}))
    assert r.returncode != 0 and "bwd_layout" in r.stderr

"""bench/kern_sweep.py (issue 15 item 4) at tiny shapes on the CPU: it runs end to end, checks every
variant against float64, writes its JSON and table, picks winners only among correct variants, and
fails (exit 1) when a variant computes the wrong thing.  The times mean nothing here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real sweep)")

ROOT = Path(__file__).resolve().parents[1]


def _sweep():
    spec = importlib.util.spec_from_file_location("kern_sweep", ROOT / "bench" / "kern_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kern_sweep"] = mod           # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_tiny_sweep_runs_checks_and_reports(tmp_path, capsys):
    ks = _sweep()
    rc = ks.main(["--device", "cpu", "--tiny", "--quiet", "--out", str(tmp_path),
                  "--only", "atomic,atomic_prefetch,fwd_r8_w4,flat_1024_w4,flat_2048_w8_evict"])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads((tmp_path / "kern_sweep.json").read_text())
    assert doc["complete"] and doc["target"] == "interpreter"
    by_op = {d["op"]: d for d in doc["ops"]}
    assert set(by_op) == {"rmsnorm", "geglu", "swiglu"}
    rms = {r["variant"]: r for r in by_op["rmsnorm"]["rows"]}
    # default always runs; --only picks the rest; the best fwd and bwd are combined into one more
    assert {"default", "atomic", "atomic_prefetch", "fwd_r8_w4"} <= set(rms)
    assert rms["atomic"]["over"] == {"dw_reduce": "atomic"}
    # at the tiny size the planner already gives the forward 8 rows / 4 warps: not measured twice
    assert rms["fwd_r8_w4"]["status"] == "same kernel as default"
    overs = [json.dumps(r["over"], sort_keys=True) for r in rms.values() if r["status"] == "ok"]
    assert len(set(overs)) == len(overs), "no kernel is measured twice"
    if "combo" in rms:          # the best forward launch with the best backward scheme, when that is new
        assert rms["combo"]["what"].startswith("fwd of ") and rms["combo"]["correct"]
    for d in doc["ops"]:
        assert d["floors"]["rw32_err"] < 1e-2     # the floor kernel computes what it claims
        for r in d["rows"]:
            assert r["status"] in ("ok", "same kernel as default"), (d["op"], r)
            if r["status"] == "ok":
                assert r["correct"] and r["fwd_bwd_ms"] > 0, (d["op"], r)
                assert d["op"] != "rmsnorm" or set(r["errs"]) == {"out:y", "grad:x", "grad:w"}
        assert d["winner"]["variant"] in {r["variant"] for r in d["rows"]}
    assert {r["variant"] for r in by_op["geglu"]["rows"]} == {"default", "flat_1024_w4", "flat_2048_w8_evict"}
    text = (tmp_path / "kern_sweep.txt").read_text()
    for op in ("rmsnorm", "geglu", "swiglu"):
        assert f"WINNER {op}:" in text
    assert text.strip() in out


def test_a_wrong_variant_fails_the_run_and_never_wins(tmp_path, capsys, monkeypatch):
    ks = _sweep()
    # eps 0.5 instead of the module's 1e-6: a kernel that runs fine and computes another function
    # eps 0.01: off by less than the bf16 bar, but clearly worse than the shipped kernel (how a race
    # that drops one program's dW share looks at real sizes)
    monkeypatch.setitem(ks.VARIANTS, "rmsnorm", [ks.RMS[0], ks.Variant("broken", {"eps": 0.5}, "wrong eps", "both"),
                                                 ks.Variant("subtle", {"eps": 0.01}, "slightly wrong eps", "both")])
    rc = ks.main(["--device", "cpu", "--tiny", "--quiet", "--no-floors", "--ops", "rmsnorm", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    doc = json.loads((tmp_path / "kern_sweep.json").read_text())
    (d,) = doc["ops"]
    rows = {r["variant"]: r for r in d["rows"]}
    assert rows["subtle"]["err"] <= rows["subtle"]["tol"] and rows["subtle"]["worse_than_default"]
    assert d["bad"] == ["broken", "subtle"] and d["winner"]["variant"] == "default"
    assert "WRONG NUMBERS: broken, subtle" in out and "(worse than default: " in out


def test_tiny_qk_norm_rope_sweep(tmp_path, capsys):
    """fused_qk_norm_rope's block layouts: checked against float64 (outputs, dq, dk, both norm-weight
    grads), the best forward and backward combined, the winner among correct variants."""
    ks = _sweep()
    rc = ks.main(["--device", "cpu", "--tiny", "--quiet", "--no-floors", "--ops", "qk_norm_rope", "--out", str(tmp_path),
                  "--only", "bwd_t2_w4_p2,fwd_t2_w4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    (d,) = json.loads((tmp_path / "kern_sweep.json").read_text())["ops"]
    rows = {r["variant"]: r for r in d["rows"]}
    assert {"default", "bwd_t2_w4_p2", "fwd_t2_w4"} <= set(rows) <= {"default", "bwd_t2_w4_p2", "fwd_t2_w4", "combo"}
    assert rows["bwd_t2_w4_p2"]["over"] == {"bwd_layout": "block", "bwd_tokens": 2, "bwd_warps": 4,
                                            "bwd_programs_per_sm": 2}
    if "combo" in rows:     # (which forward and backward are fastest on the interpreter is noise)
        assert rows["combo"]["over"] == {**rows["bwd_t2_w4_p2"]["over"], **rows["fwd_t2_w4"]["over"]}
    for r in rows.values():
        assert r["status"] == "ok" and r["correct"], r
        assert set(r["errs"]) == {"out:q", "out:k", "grad:q", "grad:k", "grad:q_weight", "grad:k_weight"}
    assert "WINNER qk_norm_rope:" in out


def test_unknown_op_is_an_error(capsys):
    ks = _sweep()
    with pytest.raises(SystemExit):
        ks.main(["--device", "cpu", "--tiny", "--ops", "rmsnorm,nope"])
    assert "unknown op(s) nope" in capsys.readouterr().err


def test_every_variant_renders_for_the_gpu_at_the_issue_shapes():
    """What the GPU run will build: each variant's module at the issue's shape for target cuda is
    valid Python, and differs from the shipped kernel's source unless it says it is the same."""
    from patchdsl.bench import runner
    from patchdsl.bench.cases import families
    from patchdsl.codegen import KernelKey, render
    from patchdsl.ops.registry import get_op

    ks = _sweep()
    fams = families()
    for op, variants in ks.VARIANTS.items():
        fam = fams[ks.FAMILY.get(op, op)]
        key, _ = runner.plan_key(fam, get_op(fam.op), ks.SHAPES[op], "bf16", "cuda")
        auto = key.param_dict
        default_src = render(key)
        seen = {}
        for v in variants:
            params = v.params(auto, ks.SHAPES[op])
            src = render(KernelKey.make(key.op, key.template, key.name, params))
            compile(src, f"<{op}:{v.name}>", "exec")
            assert (src == default_src) == (params == auto), (op, v.name)
            if params == auto and v.name != "default":
                continue     # what the planner now picks itself: the sweep reports "same kernel as default"
            assert src not in seen, f"{op}: {v.name} renders the same kernel as {seen.get(src)}"
            seen[src] = v.name

"""``patchdsl bench specialise`` on the CPU: tiny shapes, the Triton interpreter, one call per variant.

Checked: the JSON rows and their fields, that every generic variant really is different generated
source (text compared) with the loops / masks its description claims, at the tiny shapes and at the
real GPU shapes (rendering only), that its numbers match float64 and the auto kernel, that a wrong
variant is flagged and fails the CLI, flags that give the auto kernel again, and the time budget.
Times are never checked.
"""

from __future__ import annotations

import json

import pytest
import torch

from patchdsl_tools.bench import specialise as sp
from patchdsl_tools.bench.cases import families
from patchdsl.codegen import render

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness test (the GPU runs bench/gpu_all.sh)")

FAMILIES = families()
ROW_FIELDS = {"op", "op_name", "shape", "label", "dtype", "variant", "flags", "kernel", "rule", "status",
              "source_features", "source", "time_ms", "timing_method", "err", "errs", "err_vs_auto", "tol",
              "correct", "source_differs"}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One CLI run over every op at its tiny shape (bf16), shared by the tests below."""
    from patchdsl_tools.bench.cli import run

    tmp = tmp_path_factory.mktemp("spec")
    out = tmp / "specialise.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = run(["specialise", "--json", str(out), "--device", "cpu", "--quiet"])
    return rc, json.loads(out.read_text()), buf.getvalue(), tmp


def test_cli_writes_complete_json_and_table_last(cli_run):
    rc, doc, printed, tmp = cli_run
    assert rc == 0, printed
    assert doc["kind"] == sp.KIND and doc["complete"] is True and doc["options"]["tiny"] is True
    assert {r["op"] for r in doc["results"]} == set(FAMILIES)
    lines = printed.strip().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("specialised vs generic"))
    assert "CPU interpreter: times mean nothing" in lines[start]
    assert lines[start + 1].split()[:8] == ["op", "shape", "variant", "flags", "source", "ms", "ratio", "err"]
    assert len(lines) - start - 2 == len(doc["results"])        # the table is the last thing printed
    assert (tmp / "specialise.txt").read_text().strip() == "\n".join(lines[start:])


@pytest.mark.parametrize("fam", [f for f in FAMILIES if f in sp.GENERIC])
def test_rows_per_op(cli_run, fam):
    _, doc, _, _ = cli_run
    rows = [r for r in doc["results"] if r["op"] == fam]
    assert [r["variant"] for r in rows] == ["auto"] + [v.name for v in sp.GENERIC[fam]]
    auto = rows[0]
    timed = [r for r in rows if r["status"] == "ok"]
    assert auto["status"] == "ok" and len(timed) >= 2, [(r["variant"], r["status"], r.get("error")) for r in rows]
    for r in timed:
        missing = ROW_FIELDS - set(r)
        assert not missing, missing
        assert r["correct"] is True and 0 < r["err"] <= r["tol"], (r["variant"], r["errs"])
        assert r["err_vs_auto"] <= r["tol"]
        assert r["time_ms"] > 0 and r["timing_method"].startswith("cpu_once")
        assert r["kernel"].startswith(FAMILIES[fam].op) and r["rule"].endswith(
            "" if r["variant"] == "auto" else ")")
        if r["variant"] == "auto":
            assert r["flags"] == {} and r["source_differs"] is None and r["err_vs_auto"] == 0.0
        else:
            assert r["flags"] and r["source_differs"] is True
            assert r["source"]["sha256"] != auto["source"]["sha256"]
            assert r["source_features"] != auto["source_features"]
            assert r["ratio"] == pytest.approx(r["time_ms"] / auto["time_ms"])
    for r in rows:
        if r["status"] != "ok":          # only ever: flags that plan the auto kernel again at this tiny shape
            assert r["status"] == "same kernel" and r["params"] == auto["params"]


def _variants(name: str, shape: dict, target: str):
    fam = FAMILIES[name]
    key, _ = sp.plan_variant(fam, shape, "bf16", target, None)
    out = [("auto", key, render(key))]
    for v in sp.GENERIC[name]:
        k, rule = sp.plan_variant(fam, shape, "bf16", target, v.flags(key.param_dict))
        for flag, value in v.flags(key.param_dict).items():
            assert f"{flag}={value}" in rule
        out.append((v.name, k, render(k)))
    return out


@pytest.mark.parametrize("name,shape", [(n, s) for n in FAMILIES for s in sp.SHAPES.get(n, [])],
                         ids=lambda x: x if isinstance(x, str) else x.get("label", ""))
def test_generic_variants_differ_in_source_at_gpu_shapes(name, shape):
    """Rendering only (no GPU needed): the cuda kernels the GPU run compares really differ."""
    vs = _variants(name, shape, "cuda")
    auto_name, auto_key, auto_src = vs[0]
    facts = sp.source_facts(auto_src)
    for vname, key, src in vs[1:]:
        assert src != auto_src and key != auto_key, vname
        f = sp.source_facts(src)
        g, p = key.param_dict, auto_key.param_dict
        if "q_loop" in p:                                        # heads looped where auto has one tile
            assert g["q_loop"] and not p["q_loop"] and f["loops"] > facts["loops"]
        elif g["n_tiles"] > p["n_tiles"]:                        # the row in more (smaller) tiles
            assert not g["single_pass"] and f["loops"] > 0 and "for start in range" in src
        else:                                                    # same tiles, no persistent grid
            assert p["programs_per_sm"] > 0 and g["programs_per_sm"] == 0 and f["loops"] < facts["loops"]
        assert sp.describe(key.param_dict, f) != sp.describe(auto_key.param_dict, facts)


def test_rmsnorm_qwen3_shape_one_pass_vs_looped_masked():
    (_, k0, s0), (_, k1, s1) = _variants("rmsnorm", {"tokens": 16384, "hidden": 1024}, "cuda")
    main0 = "\n".join(sp.kernel_bodies(s0)[n] for n in ("rmsnorm_fwd_h1024", "rmsnorm_bwd_h1024"))
    main1 = "\n".join(sp.kernel_bodies(s1)[n] for n in ("rmsnorm_fwd_h1024", "rmsnorm_bwd_h1024"))
    assert "for start in range" not in main0 and "mask=" not in main0
    assert "for start in range" in main1 and "mask=" in main1
    assert sp.describe(k0.param_dict, sp.source_facts(s0)) == "one-pass, 4 rows/program, no mask"
    assert sp.describe(k1.param_dict, sp.source_facts(s1)) == "looped 4 tiles of 256, masked"
    assert k1.param_dict["BLOCK"] == 256 and not k1.param_dict["single_pass"]


def test_rope_generic_loops_heads():
    vs = _variants("rope", FAMILIES["rope"].issue[0], "cuda")
    assert "for h0 in range" not in vs[0][2] and "for h0 in range" in vs[1][2]
    assert vs[1][1].param_dict["q_loop"] and not vs[0][1].param_dict["q_loop"]


def test_kernel_bodies_and_facts():
    src = ("import triton\n\n@triton.jit\ndef a_fwd(X):\n    for start in range(0, 4, 2):\n"
           "        tl.load(X, mask=m)\n\n    return 1\n\n\n@triton.jit\ndef dw_sum(X):\n"
           "    tl.store(X, 1, mask=m)\n\n\ndef host():\n    for i in range(3):\n        pass\n")
    b = sp.kernel_bodies(src)
    assert set(b) == {"a_fwd", "dw_sum"} and "return 1" in b["a_fwd"] and "host" not in b["dw_sum"]
    f = sp.source_facts(src)
    assert f["kernels"] == ["a_fwd"] and f["loops"] == 1 and f["masked_accesses"] == 1


def test_wrong_variant_is_flagged_and_fails_the_cli(tmp_path, monkeypatch, capsys):
    real = sp.build_call

    def build(fam, key, params, ref_shapes):
        call = real(fam, key, params, ref_shapes)
        if key.param_dict.get("single_pass"):     # the auto kernel at the tiny shape; generic ones loop
            return call
        return lambda *a: tuple(o * 1.05 for o in call(*a))

    monkeypatch.setattr(sp, "build_call", build)
    from patchdsl_tools.bench.cli import run

    rc = run(["specialise", "--json", str(tmp_path / "s.json"), "--device", "cpu", "--ops", "rmsnorm", "--quiet"])
    assert rc == 1
    doc = json.loads((tmp_path / "s.json").read_text())
    auto, gen = doc["results"]
    assert auto["correct"] is True and gen["correct"] is False
    assert gen["err"] > 0.04 and gen["err_vs_auto"] > 0.04
    assert " BAD" in capsys.readouterr().out


def test_same_kernel_and_budget(tmp_path, monkeypatch):
    # programs_per_sm=0 is what auto picks for cross entropy: the variant gives the auto kernel again
    monkeypatch.setitem(sp.GENERIC, "cross_entropy",
                        (sp.Variant("row_per_program", lambda p: {"programs_per_sm": 0}, "one program per row"),))
    o = sp.Options(device="cpu", dtype="bf16", ops=("cross_entropy",), tiny=True, quiet=True,
                   json_path=str(tmp_path / "a.json"))
    doc = sp.run_specialise(o)
    same = [r for r in doc["results"] if r["variant"] == "row_per_program"]
    assert same and same[0]["status"] == "same kernel"
    assert "time_ms" not in same[0] and not sp.wrong(doc)
    doc = sp.run_specialise(sp.Options(device="cpu", ops=("rmsnorm", "swiglu"), tiny=True, quiet=True, budget_s=0.0))
    assert [r["status"] for r in doc["results"]] == ["skipped", "skipped"] and doc["complete"]


def test_unknown_op_is_a_usage_error(tmp_path, capsys):
    from patchdsl_tools.bench.cli import run

    assert run(["specialise", "--json", str(tmp_path / "x.json"), "--device", "cpu", "--ops", "nope"]) == 2
    assert "unknown op" in capsys.readouterr().err


def test_tune_candidates_are_rows_of_their_own(tmp_path):
    """--tune adds the TUNE launch candidates, marked as such and kept out of the generic verdict."""
    o = sp.Options(device="cpu", dtype="bf16", ops=("qk_norm_rope",), tiny=True, quiet=True, tune=True,
                   json_path=str(tmp_path / "t.json"))
    doc = sp.run_specialise(o)
    tuned = [r for r in doc["results"] if r.get("tune")]
    assert {r["variant"] for r in tuned} == {v.name for v in sp.TUNE["qk_norm_rope"]}
    # on the interpreter's tiny heads some candidates give the auto kernel again (not timed)
    assert all(r["status"] == "ok" and r["correct"] or r["status"] == "same kernel" for r in tuned), tuned
    assert any(r["status"] == "ok" for r in tuned)
    assert all(r["params"][k] == v for r in tuned for k, v in r["flags"].items() if k in r["params"])
    assert not sp.wrong(doc)

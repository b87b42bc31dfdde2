"""The benchmark harness on the CPU: tiny shapes, the Triton interpreter, perf_counter timing.

What is checked is the harness's logic and its JSON, never a time: every registered op runs
through plan -> generated module -> entry point; its result is compared with float64; a wrong
kernel is flagged (and fails the CLI); an op missing from the registry gives a "not implemented"
row; an unavailable peer gives an "unavailable" row; one failing unit never stops the run; the
e2e run trains the same weights unpatched and patched and the losses agree.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from patchdsl_tools.bench import cases, report, runner
from patchdsl_tools.bench.cases import bind, families
from patchdsl.ops.registry import get_op

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU harness test (the GPU runs bench/gpu_all.sh)")

FAMILIES = families()
UNIT_FIELDS = {"op", "op_name", "group", "label", "shape", "impl", "dtype", "status", "bytes", "rotations",
               "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_spread", "timing_method", "err_out", "err_grads", "err_max",
               "tol", "correct", "eager_fwd_ms", "eager_fwd_bwd_ms", "host_fwd_us", "host_fwd_bwd_us", "gbps",
               "pct_copy", "floor_ms", "host_sync", "unit_s"}


def _opts(tmp_path, **kw):
    base = dict(device="cpu", dtype="bf16", groups=("tiny",), impls=("patchdsl", "hf"), target_ms=1.0,
                json_path=str(tmp_path / "ops.json"), quiet=True)
    base.update(kw)
    return runner.Options(**base)


@pytest.fixture(scope="module")
def ops_doc(tmp_path_factory):
    """One tiny run over every family (patchdsl + HF), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("bench")
    opts = runner.Options(device="cpu", dtype="bf16", groups=("tiny",), impls=("patchdsl", "hf"), target_ms=1.0,
                          json_path=str(tmp / "ops.json"), quiet=True)
    doc = runner.run_ops(opts)
    return doc, tmp / "ops.json"


# ----------------------------------------------------------------------------- the full tiny run
def test_json_written_and_complete(ops_doc):
    doc, path = ops_doc
    on_disk = json.loads(path.read_text())
    assert on_disk["kind"] == "patchdsl-bench-ops" and on_disk["complete"] is True
    assert {"date", "torch", "triton", "transformers", "patchdsl", "device"} <= set(on_disk["env"])
    assert on_disk["ceilings"]["copy"]["gbps"] > 0 and on_disk["ceilings"]["matmul_bf16"]["tflops"] > 0
    # patchdsl, plus hf where it is a peer (a family benchmarking another mode of an op has none)
    assert len(on_disk["results"]) == sum((1 + ("hf" in f.peers)) * len(f.tiny) for f in FAMILIES.values())


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_every_family_runs(ops_doc, fam):
    doc, _ = ops_doc
    rows = [r for r in doc["results"] if r["op"] == fam]
    assert rows
    for r in rows:
        if r["impl"] == "patchdsl" and get_op(FAMILIES[fam].op) is None:
            assert r["status"] == "not implemented" and FAMILIES[fam].op in r["error"]
            continue
        assert r["status"] == "ok", (r["impl"], r.get("error"), r.get("traceback"))
        missing = UNIT_FIELDS - set(r)
        assert not missing, missing
        assert r["correct"] is True, (r["impl"], r["err_out"], r["err_grads"])
        assert 0 < r["err_max"] <= r["tol"]             # bf16 against float64: never exactly 0
        assert set(r["err_grads"]) == set(FAMILIES[fam].act_grad) | set(FAMILIES[fam].param_grad)
        for m in ("fwd", "bwd", "fwd_bwd"):
            assert r[f"{m}_ms"] >= 0 and r["bytes"][m] > 0
            assert r[f"{m}_ms"] == 0 or r["gbps"][m] > 0     # a derived bwd of a trivial scaling can be 0
        assert r["rotations"] == 2 and r["timing_method"] and r["host_sync"] is None
        if r["impl"] == "patchdsl":
            assert r["kernel"].startswith(FAMILIES[fam].op) and r["entry"] and r["site"]


def test_comparisons_pair_patchdsl_with_hf(ops_doc):
    doc, _ = ops_doc
    ok = {(r["op"], r["label"]) for r in doc["results"] if r["impl"] == "patchdsl" and r["status"] == "ok"}
    got = {(c["op"], c["label"]) for c in doc["comparisons"] if c["peer"] == "hf"}
    assert got == ok
    for c in doc["comparisons"]:
        assert c["ratio_fwd_bwd"] > 0


def test_summaries_and_plot(ops_doc, tmp_path):
    doc, path = ops_doc
    text = report.ops_summary(doc)
    for fam in FAMILIES:
        assert fam in text
    assert not re.search(r"\d BAD", text)
    t = report.targets_summary(doc, None)
    assert "RMSNorm 16384x1024" in t          # tiny shapes do not answer the targets
    assert "PASS" not in t.split("per-call")[0]
    pytest.importorskip("matplotlib")
    from patchdsl_tools.bench.plot import plot

    png = plot(doc, None, tmp_path / "x.png")
    assert png and (tmp_path / "x.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- failure handling
def test_wrong_kernel_is_flagged_and_fails_the_cli(tmp_path, monkeypatch, capsys):
    real = runner.build_patchdsl

    def wrong(fam, params, shape, dtype, target, ref_shapes):
        call, info = real(fam, params, shape, dtype, target, ref_shapes)
        return (lambda *a: tuple(o * 1.05 for o in cases.as_tuple(call(*a)))), info

    monkeypatch.setattr(runner, "build_patchdsl", wrong)
    doc = runner.run_ops(_opts(tmp_path, ops=("rmsnorm",), impls=("patchdsl",)))
    for r in doc["results"]:
        assert r["status"] == "ok" and r["correct"] is False and r["err_out"] > 0.04
    assert re.search(r"\d BAD", report.ops_summary(doc))
    from patchdsl_tools.bench.cli import run

    assert run(["summary", str(tmp_path / "ops.json")]) == 1
    assert re.search(r"\d BAD", capsys.readouterr().out)


def test_unregistered_op_and_unavailable_peer_and_errors_do_not_stop_the_run(tmp_path, monkeypatch):
    fams = families()
    fams["rmsnorm"].op = "fused_not_there"

    def boom(params, shape):
        raise ZeroDivisionError("planted")

    fams["swiglu"].hf = boom
    monkeypatch.setattr(runner, "families", lambda: fams)
    doc = runner.run_ops(_opts(tmp_path, ops=("rmsnorm", "swiglu"), impls=("patchdsl", "hf", "cce", "liger")))
    st = {(r["op"], r["label"], r["impl"]): r for r in doc["results"]}
    assert all(r["status"] == "not implemented" for k, r in st.items() if k[0] == "rmsnorm" and k[2] == "patchdsl")
    assert all(r["status"] == "ok" for k, r in st.items() if k[0] == "rmsnorm" and k[2] == "hf")
    bad = st[("swiglu", "6x96", "hf")]
    assert bad["status"] == "error" and "planted" in bad["error"] and "traceback" in bad
    assert st[("swiglu", "6x96", "patchdsl")]["status"] == ("ok" if get_op("fused_swiglu") else "not implemented")
    assert not any(k[2] == "cce" for k in st)             # cce is a peer of linear CE only
    try:
        import liger_kernel  # noqa: F401
    except Exception:
        assert all(r["status"] == "unavailable" for k, r in st.items() if k[2] == "liger")
    assert doc["complete"] is True


def test_budget_skips_remaining_units(tmp_path):
    doc = runner.run_ops(_opts(tmp_path, ops=("swiglu",), budget_s=0.0))
    assert doc["results"] and all(r["status"] == "skipped" for r in doc["results"])


def test_not_replayable_backward_is_derived(tmp_path, monkeypatch):
    """A backward that refuses a second run (buffers consumed) gets bwd = (fwd+bwd) - fwd, marked derived."""
    fams = families()
    fam = fams["swiglu"]
    orig = fam.hf

    def once(params, shape):
        f = orig(params, shape)

        class Once(torch.autograd.Function):
            @staticmethod
            def forward(ctx, g, u):
                ctx.save_for_backward(g, u)
                ctx.used = False
                return f(g, u)

            @staticmethod
            def backward(ctx, dy):
                if ctx.used:
                    raise RuntimeError("backward called twice")
                ctx.used = True
                g, u = ctx.saved_tensors
                s = torch.sigmoid(g.float())
                return ((dy.float() * u.float() * s * (1 + g.float() * (1 - s))).to(g.dtype),
                        (dy.float() * g.float() * s).to(u.dtype))

        return Once.apply

    fam.hf = once
    monkeypatch.setattr(runner, "families", lambda: fams)
    doc = runner.run_ops(_opts(tmp_path, ops=("swiglu",), impls=("hf",)))
    (r,) = doc["results"]
    assert r["status"] == "ok" and r["correct"] and "twice" in r["bwd_derived"]
    assert math.isclose(r["bwd_ms"], max(0.0, r["fwd_bwd_ms"] - r["fwd_ms"]), rel_tol=1e-9, abs_tol=1e-12)


# ----------------------------------------------------------------------------- pieces
def _f_xw(x, w): ...
def _f_kw(hidden_states, weight, *, eps=1e-6): ...
def _f_bias(h, w, b, labels, num_items_in_batch=None): ...
def _f_odd(a, b, c): ...


@pytest.mark.parametrize("fn,syn,order,expect", [
    (_f_xw, {"x": ("x",), "w": ("w",)}, ("x", "w"), [("x", "x"), ("w", "w")]),
    (_f_kw, {"x": ("hidden_states",), "w": ("weight",)}, ("x", "w"), [("hidden_states", "x"), ("weight", "w")]),
    (_f_bias, {"h": ("h",), "w": ("w",), "bias": ("b",), "y": ("labels",)}, ("h", "w", "y"),
     [("h", "h"), ("w", "w"), ("b", "bias"), ("labels", "y")]),
    (_f_odd, {"q": ("q",)}, ("q", "k", "cos"), [("a", "q"), ("b", "k"), ("c", "cos")]),
])
def test_bind_matches_parameters_by_name_then_position(fn, syn, order, expect):
    assert bind(fn, syn, order).bound == expect


def test_bind_refuses_what_it_cannot_fill():
    with pytest.raises(TypeError, match="cannot bind"):
        bind(_f_odd, {"q": ("q",)}, ("q",))


def test_rel_err_flags_nan_and_shape():
    a = torch.randn(10, 7)
    assert runner.rel_err(a, a) == 0.0
    assert math.isinf(runner.rel_err(a[:5], a))
    b = a.clone()
    b[3, 3] = float("nan")
    assert math.isinf(runner.rel_err(b, a))
    assert 0.09 < runner.rel_err(a * 1.1, a) < 0.11


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_float64_reference_matches_the_hf_function(fam):
    """Each family's reference (hand-written or chunked) agrees with its HF peer run in float64."""
    f = FAMILIES[fam]
    shape = f.tiny[0]
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    params = f.make_params(shape, "fp32", "cpu", g(1))
    act = f.make_act(shape, "fp32", "cpu", g(2))
    dys = f.make_dys(shape, "fp32", "cpu", g(3))
    outs, grads = f.reference(params, act, dys)
    p64 = {k: (torch.nn.Parameter(v.detach().double()) if isinstance(v, torch.nn.Parameter) else
               (v.double() if v.is_floating_point() else v)) for k, v in params.items()}
    a64 = {k: (v.detach().double().requires_grad_(k in f.act_grad) if v.is_floating_point() else v)
           for k, v in act.items()}
    hf = f.hf(p64, shape)
    o = cases.as_tuple(hf(*[a64[n] for n in f.act_names]))
    for x, r in zip(o, outs):
        assert runner.rel_err(x, r) < 1e-6
    leaves = [a64[n] for n in f.act_grad] + [p64[n] for n in f.param_grad]
    pairs = [(x, d) for x, d in zip(o, dys) if x.requires_grad]
    gr = torch.autograd.grad([p[0] for p in pairs], leaves, [None if d is None else d.double() for _, d in pairs])
    for n, x in zip(list(f.act_grad) + list(f.param_grad), gr):
        assert runner.rel_err(x, grads[n]) < 1e-6, n


def test_byte_counts_at_the_issue_shapes():
    f = FAMILIES
    assert f["rmsnorm"].nbytes(f["rmsnorm"].issue[0], 2)["fwd_bwd"] == 5 * 16384 * 1024 * 2 + 3 * 1024 * 2
    assert f["swiglu"].nbytes(f["swiglu"].issue[0], 2)["fwd_bwd"] == 8 * 16384 * 3072 * 2
    assert f["cross_entropy"].nbytes(f["cross_entropy"].issue[0], 2)["fwd_bwd"] == 2 * 8192 * 151936 * 2 + 8 * 8192
    assert f["linear_cross_entropy"].nflops(f["linear_cross_entropy"].issue[0])["fwd_bwd"] == 6.0 * 16384 * 1024 * 151936


def test_units_order_issue_then_compile_then_sweep():
    u = runner.units(runner.Options(groups=("issue", "sweep"), impls=runner.IMPLS))
    groups = [(g, i == "compile") for _, g, _, i in u]
    first_compile = groups.index(("issue", True))
    first_sweep = groups.index(("sweep", False))
    assert all(g == ("issue", False) for g in groups[:first_compile])
    assert first_compile < first_sweep
    assert ("sweep", True) not in groups                    # compile at sweep shapes only when asked
    assert [x[0].name for x in u[first_sweep:first_sweep + 20]].count("rmsnorm") <= 3   # round robin
    with pytest.raises(ValueError, match="unknown op"):
        runner.units(runner.Options(ops=("nope",)))


def test_targets_verdicts():
    row = {"op": "rmsnorm", "label": "16384x1024", "impl": "patchdsl", "group": "issue", "status": "ok",
           "fwd_bwd_ms": 0.040, "correct": True, "host_fwd_us": 12.0}
    doc = {"results": [row]}
    rows = {a: (b, c) for a, b, c in report.target_rows(doc, None)}
    assert rows["RMSNorm 16384x1024 fwd+bwd <= 0.045 ms"][1] == "PASS"
    row["fwd_bwd_ms"] = 0.05
    assert {a: c for a, b, c in report.target_rows(doc, None)}["RMSNorm 16384x1024 fwd+bwd <= 0.045 ms"] == "FAIL"
    row["fwd_bwd_ms"], row["correct"], row["err_max"] = 0.01, False, 0.5
    assert {a: c for a, b, c in report.target_rows(doc, None)}["RMSNorm 16384x1024 fwd+bwd <= 0.045 ms"] == "FAIL"
    host = {a: (b, c) for a, b, c in report.target_rows(doc, None)}["host time to issue one forward <= 30 us: rmsnorm 16384x1024"]
    assert host[1] == "PASS"
    lce = dict(row, op="linear_cross_entropy", label="16384x1024x151936", flops=1e12, host_fwd_us=140.0, correct=True)
    assert {a: c for a, b, c in report.target_rows({"results": [lce]}, None)}[
        "host time to issue one forward <= 150 us: linear_cross_entropy 16384x1024x151936"] == "PASS"


def _e2e_doc(mt, batch, rows):
    return {"options": {"batch": batch, "seq": 2048}, "model": {"type": mt},
            "variants": [dict(variant=n, base=n.split(":")[0], status="ok", tokens_per_s=t, peak_bytes=g * 2**30,
                              batch=batch, step_ms=s, losses=[1.0]) for n, t, g, s in rows]}


@pytest.mark.parametrize("mt,batch,ratio", [("qwen3", 16, 1.20), ("llama", 8, 1.10), ("gemma3_text", 8, 1.50)])
def test_e2e_targets_against_liger(mt, batch, ratio):
    ok = _e2e_doc(mt, batch, [("patchdsl", 100_000 * ratio + 1, 46.5, 300), ("liger", 100_000, 46.0, 330)])
    (what, measured, verdict), = report.e2e_target_rows(ok)
    assert verdict == "PASS" and f"{ratio:.2f}x Liger" in what
    slow = _e2e_doc(mt, batch, [("patchdsl", 100_000 * ratio - 10, 46.0, 300), ("liger", 100_000, 46.0, 330)])
    assert report.e2e_target_rows(slow)[0][2] == "FAIL"
    fat = _e2e_doc(mt, batch, [("patchdsl", 200_000, 47.5, 300), ("liger", 100_000, 46.0, 330)])
    assert report.e2e_target_rows(fat)[0][2] == "FAIL"                  # more than Liger + 1 GiB
    assert report.e2e_target_rows(_e2e_doc(mt, batch + 1, [("patchdsl", 1, 1, 1), ("liger", 1, 1, 1)])) == []


def test_e2e_step_target_at_batch_one():
    doc = _e2e_doc("qwen3", 1, [("patchdsl", 45_000, 10, 44.0), ("liger", 11_000, 10, 180.0)])
    rows = {a: c for a, b, c in report.e2e_target_rows(doc)}
    assert rows["e2e qwen3 1x2048: patchdsl step <= 45 ms"] == "PASS"
    doc["variants"][0]["step_ms"] = 90.0
    assert {a: c for a, b, c in report.e2e_target_rows(doc)}["e2e qwen3 1x2048: patchdsl step <= 45 ms"] == "FAIL"


def test_cli_bad_arguments():
    from patchdsl_tools.bench.cli import run

    assert run(["ops", "--impls", "nonsense", "--device", "cpu"]) == 2
    assert run(["frobnicate"]) == 2


# ----------------------------------------------------------------------------- e2e
def test_e2e_fresh_processes_same_weights_same_losses(tmp_path):
    """Each row in its own worker process: the same seeded weights and batches, so the losses agree."""
    from patchdsl_tools.bench.e2e import E2EOptions, run_e2e

    o = E2EOptions(device="cpu", dtype="fp32", batch=2, seq=8, steps=1, warmup=0, variants=("patchdsl", "hf"),
                   tiny=True, json_path=str(tmp_path / "e2e.json"), quiet=True, variant_timeout_s=300)
    doc = run_e2e(o)
    assert json.loads((tmp_path / "e2e.json").read_text())["complete"] is True
    assert doc["isolation"] == "a fresh process per row"
    v = {x["variant"]: x for x in doc["variants"]}
    assert list(v) == ["patchdsl", "hf"]                  # the order asked for
    for x in v.values():
        assert x["status"] == "ok", (x.get("error"), x.get("output_tail"), x.get("traceback"))
        assert len(x["losses"]) == 1 and x["tokens_per_s"] > 0 and x["micro_batch"] == 2
        assert x["process"]["rc"] == 0 and x["env"]["patchdsl"]
    assert v["patchdsl"]["patched_sites"] > 0 and not v["patchdsl"]["refused"]
    assert v["patchdsl"]["spec"].endswith("qwen3.kpatch")          # the family's shipped spec by default
    assert doc["loss_reference"] == "hf"
    assert doc["loss_agreement"]["patchdsl"]["max_abs_diff"] < 1e-4
    assert doc["model"]["type"] == "qwen3" and doc["env"]["torch"]
    text = report.e2e_summary(doc)
    assert "patchdsl" in text and "loss per step" in text


_FAKE_WORKER = r"""
import json, os, signal, sys, time
req, out = sys.argv[1], sys.argv[2]
r = json.load(open(req))
row, micro = r["row"], r["micro"]
mode = os.environ["FAKE_E2E"]
if row["variant"] == "compile" and mode == "crash":
    print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
if row["variant"] == "compile" and mode == "hang":
    time.sleep(60)
rec = {"variant": row["name"], "base": row["variant"], "status": "ok", "losses": [2.0, 1.5],
       "tokens_per_s": 100.0 * micro, "step_ms": 10.0, "micro_batch": micro, "batch": row["batch"],
       "env": {"torch": "x", "patchdsl": "y"}, "model": {"type": "qwen3", "params": 1}}
if row["variant"] == "patchdsl":
    rec["spec"] = row["spec"]
    rec["losses"] = [2.0, 1.5 + 1e-3]
if row["variant"] == "liger" and micro > 2:
    rec = {"variant": row["name"], "status": "oom", "error": "OutOfMemoryError: planted", "micro_batch": micro}
json.dump(rec, open(out, "w"))
"""


@pytest.mark.parametrize("mode", ["crash", "hang"])
def test_e2e_a_dying_or_hanging_worker_is_an_error_row_and_the_run_goes_on(tmp_path, monkeypatch, mode):
    """The parent's side of the isolation, with a stand-in worker (no torch in it: fast)."""
    import sys as _sys

    from patchdsl_tools.bench import e2e

    script = tmp_path / "worker.py"
    script.write_text(_FAKE_WORKER)
    monkeypatch.setattr(e2e, "_worker_cmd", lambda req, out: [_sys.executable, str(script), str(req), str(out)])
    monkeypatch.setenv("FAKE_E2E", mode)
    o = e2e.E2EOptions(device="cpu", batch=4, seq=8, variants=("hf", "compile", "liger", "patchdsl"),
                       specs=("qwen3", "llama"), quiet=True, variant_timeout_s=3,
                       json_path=str(tmp_path / "e2e.json"))
    doc = e2e.run_e2e(o)
    v = {x["variant"]: x for x in doc["variants"]}
    assert list(v) == ["hf", "compile", "liger", "patchdsl:qwen3", "patchdsl:llama"]
    bad = v["compile"]
    assert bad["status"] == "error"
    if mode == "crash":
        assert "process died (killed by SIGSEGV)" in bad["error"] and "illegal memory access" in bad["error"]
    else:
        assert bad["error"].startswith("timed out after 3 s") and bad["process"]["timed_out"]
    assert v["liger"]["status"] == "ok" and v["liger"]["micro_batch"] == 2 and len(v["liger"]["oom_retries"]) == 1
    assert v["patchdsl:llama"]["spec"].endswith("llama.kpatch")
    assert doc["loss_agreement"]["patchdsl:qwen3"]["max_abs_diff"] == pytest.approx(1e-3)
    assert doc["complete"] is True and json.loads((tmp_path / "e2e.json").read_text())["complete"] is True
    text = report.e2e_summary(doc)
    assert re.search(r"compile\s+\[1\] error", text) and "[1] compile: error" in text


def test_e2e_rows_specs_and_batches():
    from patchdsl_tools.bench.e2e import E2EOptions, default_spec, plan_rows, resolve_spec

    assert default_spec("Qwen/Qwen3-0.6B") == "qwen3"
    assert default_spec("google/gemma-3-1b-pt") == "gemma3"
    assert default_spec("meta-llama/Llama-3.2-1B") == "llama"
    assert resolve_spec("qwen3").endswith("specs/qwen3.kpatch")
    assert resolve_spec("qwen3_addnorm").endswith("bench/specs/qwen3_addnorm.kpatch")
    with pytest.raises(ValueError, match="no such file.*known:.*qwen3"):
        resolve_spec("nonexistent_spec")
    with pytest.raises(ValueError, match="unknown variant"):
        plan_rows(E2EOptions(variants=("hf", "eager")))
    rows = plan_rows(E2EOptions(model="meta-llama/Llama-3.2-1B", batches=(1, 4), seq=2048,
                                variants=("patchdsl", "liger", "patchdsl+compile"), specs=("llama", "llama_addnorm")))
    assert [r.name for r in rows] == [
        "patchdsl:llama @1x2048", "patchdsl:llama_addnorm @1x2048", "liger @1x2048",
        "patchdsl+compile:llama @1x2048", "patchdsl+compile:llama_addnorm @1x2048",
        "patchdsl:llama @4x2048", "patchdsl:llama_addnorm @4x2048", "liger @4x2048",
        "patchdsl+compile:llama @4x2048", "patchdsl+compile:llama_addnorm @4x2048"]
    assert [r.name for r in plan_rows(E2EOptions(variants=("liger", "hf"), isolate=False))] == ["hf", "liger"]


@pytest.mark.parametrize("spec", ["qwen3_addnorm", "llama_addnorm"])
def test_bench_spec_variants_plan_on_their_family(spec):
    """The spec variants in bench/specs/ plan on their family with every rule matching (meta model)."""
    import patchdsl
    from patchdsl_tools.bench.e2e import filtered_spec
    from patchdsl.model import load_model

    fam = {"qwen3": "Qwen/Qwen3-0.6B", "llama": "meta-llama/Llama-3.2-1B"}[spec.split("_")[0]]
    model = load_model(fam, meta=True, log=None).model
    text, dropped, _ = filtered_spec(spec)
    assert not dropped
    plan = patchdsl.plan(text, model, dtypes=("bf16",))
    ops = [s.op for s in plan.sites]
    n = model.config.num_hidden_layers
    assert ops.count("fused_add_rmsnorm") == n and ops.count("fused_rmsnorm") == n + 1   # input norms + final
    assert all(a == b for _, a, b in plan.totals), plan.totals            # every norm covered, once


def test_e2e_micro_batches_accumulate_to_the_same_loss(tmp_path):
    from patchdsl_tools.bench.e2e import E2EOptions, run_e2e

    kw = dict(device="cpu", dtype="fp32", batch=2, seq=8, steps=1, warmup=0, variants=("hf",), tiny=True, quiet=True,
              isolate=False)
    a = run_e2e(E2EOptions(**kw))
    b = run_e2e(E2EOptions(micro_batch=1, **kw))
    la, lb = a["variants"][0]["losses"], b["variants"][0]["losses"]
    assert b["variants"][0]["grad_accum"] == 2
    assert abs(la[0] - lb[0]) < 1e-5 and abs(la[-1] - lb[-1]) < 1e-4


def test_filtered_spec_drops_unregistered_ops(tmp_path):
    from patchdsl_tools.bench.e2e import filtered_spec

    p = tmp_path / "s.kpatch"
    p.write_text("dtype bf16\nmodel.norm: RMSNorm -> fused_rmsnorm\n*.mlp: SwiGLU -> fused_not_there\n")
    text, dropped, where = filtered_spec(str(p))
    assert dropped == ["*.mlp: SwiGLU -> fused_not_there"]
    assert "-> fused_rmsnorm" in text and where == str(p)
    assert "# (not registered yet) *.mlp" in text


def test_summary_merges_two_ops_files(ops_doc, tmp_path, capsys):
    from patchdsl_tools.bench.cli import run

    doc, path = ops_doc
    other = dict(doc, results=[dict(r, group="sweep") for r in doc["results"] if r["op"] == "rmsnorm"])
    p2 = tmp_path / "ops_sweep.json"
    p2.write_text(json.dumps(other))
    assert run(["summary", str(path), str(p2)]) == 0
    out = capsys.readouterr().out
    assert "-- sweep" in out and "== ops" in out and "== targets" in out


def test_sweep_start_skips_each_familys_first_sweep_shapes():
    full = runner.units(runner.Options(groups=("sweep",), impls=("patchdsl",), ops=("rmsnorm", "cross_entropy")))
    later = runner.units(runner.Options(groups=("sweep",), impls=("patchdsl",), ops=("rmsnorm", "cross_entropy"),
                                        sweep_start=1))
    firsts = {fam.name: fam.shapes("sweep")[0] for fam, _, _, _ in full}
    assert len(later) == len(full) - 2
    assert all(shape != firsts[fam.name] for fam, _, shape, _ in later)
    issue = runner.units(runner.Options(groups=("issue",), impls=("patchdsl",), ops=("rmsnorm",), sweep_start=5))
    assert len(issue) == 1                                   # the issue shapes are never skipped



def test_bench_llama_fused_head_is_the_shipped_spec_with_a_fused_head():
    """bench/specs/llama_fused_head.kpatch (the 8B memory row of bench/NOTES.md round eight): the shipped
    Llama spec's sites, the LM head in mode=fused (no logits chunk) instead of chunk=auto."""
    import patchdsl
    from patchdsl_tools.bench.e2e import filtered_spec
    from patchdsl.model import load_model

    model = load_model("meta-llama/Llama-3.1-8B", meta=True, log=None).model
    plans = {}
    for name in ("llama", "llama_fused_head"):
        text, dropped, _ = filtered_spec(name)
        assert not dropped
        plans[name] = patchdsl.plan(text, model, dtypes=("bf16",))
    sites = {n: {(s.path, s.op) for s in p.sites} for n, p in plans.items()}
    assert sites["llama"] == sites["llama_fused_head"]
    head = {n: next(s.flag_dict for s in p.sites if s.path == "lm_head") for n, p in plans.items()}
    assert head["llama"]["mode"] != "fused" and head["llama_fused_head"]["mode"] == "fused"

"""Patched models under tensor and expert parallelism (DTensor), gloo on the CPU: one start of 4 processes runs every
case (tests/distributed/tp_worker.py).  Each case trains the tiny model of a family parallelised and
patched with its shipped spec beside the single-process unpatched model (float32 and float64): every
step's loss and every final parameter within verify's rule (patchdsl.parity.compare).

One test function on purpose: a module-scoped fixture would start the 4 processes once per pytest-xdist
worker that gets one of the module's tests (``-n 2`` distributes tests, not modules).  Each check below
collects its failures; the test reports all of them.
"""

from __future__ import annotations

import pytest

from ..training.test_distributed import launch

EXPECTED = {"llama tp x2", "qwen3 hf_tp x2", "llama tp_sp x2", "qwen3 tp_sp x2", "llama fsdp_tp x4",
            "qwen3 fsdp_tp x4", "llama tp x4", "qwen3_moe ep x2", "mixtral ep x2", "qwen3_moe ep x4"}


def _cases(ranks):
    return [c for r in ranks for c in r["cases"]]


def _skipped(ranks):
    return {k: v for r in ranks for k, v in r["skipped"].items()}


def every_case_ran(ranks) -> list[str]:
    bad = [c["error"] + "\n" + c["traceback"] for c in _cases(ranks) if "error" in c]
    ran = {c["case"] for c in _cases(ranks)} | set(_skipped(ranks))
    if ran != EXPECTED:
        bad.append(f"cases: ran {sorted(ran)}, expected {sorted(EXPECTED)}")
    # only the cases of transformers' own TP styles / EP dispatch may be missing (transformers < 5.21)
    bad += [f"{k} skipped: {v}" for k, v in _skipped(ranks).items() if " hf_tp " not in k and " ep " not in k]
    return bad


def losses_and_parameters_match(ranks) -> list[str]:
    bad = []
    for case in sorted(EXPECTED - set(_skipped(ranks))):
        rows = [r for c in _cases(ranks) if c.get("case") == case for r in c["rows"]]
        if sum(r["name"].startswith("loss step") for r in rows) < 3 * 2:
            bad.append(f"{case}: fewer than 3 loss steps on 2 ranks")
        bad += [f"{case}: {r['name']}: {r['err']:.2e} > {r['bound']:.2e}" for r in rows if not r["ok"]]
    return bad


def the_plan_says_which_layout_each_site_sees(ranks) -> list[str]:
    seen = {c["case"]: c["placements"] for c in _cases(ranks) if "placements" in c}
    want = [("llama tp x2", "model.layers.0.self_attn", "heads over 2 ranks"),
            ("llama tp x2", "model.layers.0.mlp", "columns over 2 ranks"),
            ("llama tp x2", "lm_head", "vocab over 2 ranks"),
            ("qwen3 tp_sp x2", "model.norm", "replicated over 2 ranks"),
            ("qwen3 fsdp_tp x4", "model.layers.1.self_attn", "heads over 2 ranks"),
            ("llama tp x4", "model.layers.1.self_attn", "heads over 4 ranks")]
    bad = [f"{case}: {site} runs on {seen.get(case, {}).get(site)!r}, not {what}..."
           for case, site, what in want if not str(seen.get(case, {}).get(site, "")).startswith(what)]
    if "model.norm" in seen.get("llama tp x2", {}):
        bad.append("plain TP: model.norm should see whole tensors")
    return bad


def expert_dispatch_calls_the_fused_experts(ranks) -> list[str]:
    bad = []
    for c in _cases(ranks):
        if " ep " not in c["case"]:
            continue
        n = int(c["case"][-1])
        if set(c["placements"]) != {f"model.layers.{i}.mlp.experts" for i in range(2)} or not all(
                v.startswith(f"experts over {n} ranks") for v in c["placements"].values()):
            bad.append(f"{c['case']}: {c['placements']}")
        bad += [f"{c['case']}: {site} dispatches to {called}" for site, called in c["dispatch"].items()
                if not called or not all(q.startswith("patchdsl.ops.experts.") for q in called)]
    return bad


def vocabulary_parallel_loss_matches_float64(ranks) -> list[str]:
    bad, sizes = [], set()
    for r in ranks:
        for part in r["vocab"]:
            if not isinstance(part, list):
                bad.append(str(part))
                continue
            for c in part:
                sizes.add(c["ranks"])
                bad += [f"vocab case {c['case']} x{c['ranks']}: {k} {v:.2e}" for k, v in c["errors"].items()
                        if not v <= 1e-5]
    return bad + ([] if sizes == {2, 4} else [f"vocabulary-parallel cases ran on {sorted(sizes)} ranks"])


def refusals_name_the_reason(ranks) -> list[str]:
    ref = ranks[0]["refusals"]
    if "error" in ref:
        return [ref["error"] + ref.get("traceback", "")]
    sp, bad = ref["sp"], []
    if not ("model.norm" in sp["patched"] and "model.layers.0.mlp" in sp["patched"]):
        bad.append(f"patched under SP: {sp['patched']}")
    checks = [(sp["refused"].get("model.layers.0", ""), ("fused_add_rmsnorm", "replicated over 2 ranks",
                                                         "post_attention_layernorm")),
              (sp["refused"].get("lm_head", ""), ("fused_linear_logprobs", "vocab over 2 ranks")),
              (ref["ce_none"].get("lm_head", ""), ("reduction=none is not vocabulary-parallel",)),
              (ref["after"] or "", ("ParallelisedAfterPatch", "q_proj.weight", "Parallelise first, then patchdsl.apply"))]
    before = sp["before"]        # runtime.placements: the same decisions before apply
    for path, reason in sp["refused"].items():
        if before.get(path) != f"refused: {reason}":
            bad.append(f"placements() said {before.get(path)!r} for {path}, apply refused: {reason!r}")
    for path, where in sp["placements"].items():
        if before.get(path) != where:
            bad.append(f"placements() said {before.get(path)!r} for {path}, apply ran it on {where!r}")
    if before.get("model.layers.0.input_layernorm") != sp["placements"].get("model.layers.0.input_layernorm"):
        bad.append("input_layernorm layouts differ")
    for text, words in checks:
        bad += [f"{word!r} not in {text!r}" for word in words if word not in text]
    return bad


def a_partial_gradient_fails(ranks) -> list[str]:
    """Must fail: the same run with the sequence-parallel norms' weight gradients not summed over the ranks
    (each rank's partial sum) fails on those weights; the loss of step 1 (before any update) still passes."""
    bad = []
    for r in ranks:
        b = r["broken"]
        if "error" in b:
            bad.append(b["error"])
            continue
        failed = {row["name"] for row in b["rows"] if not row["ok"]}
        if b["passed"] or not any("input_layernorm" in n for n in failed):
            bad.append(f"the run with partial norm gradients was not caught: failed rows {sorted(failed)}")
        if not (b["rows"][0]["name"] == "loss step 1" and b["rows"][0]["ok"]):
            bad.append(f"step 1 of the broken run: {b['rows'][0]}")
    return bad


CHECKS = (every_case_ran, losses_and_parameters_match, the_plan_says_which_layout_each_site_sees,
          expert_dispatch_calls_the_fused_experts, vocabulary_parallel_loss_matches_float64,
          refusals_name_the_reason, a_partial_gradient_fails)


def test_tp_sp_fsdp_tp_and_ep_runs_match_the_single_process_model(tmp_path):
    out = tmp_path / "out.json"
    ranks = launch(4, ["-m", "tests.distributed.tp_worker", str(out)], out)
    failures = [f"{check.__name__}: {b}" for check in CHECKS for b in check(ranks)]
    assert not failures, "\n".join(failures)
    if _skipped(ranks):
        pytest.skip("ran; not here: " + "; ".join(f"{k} ({v})" for k, v in _skipped(ranks).items()))

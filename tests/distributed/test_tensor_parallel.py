"""Patched models under tensor and expert parallelism (DTensor), gloo on the CPU: one start of 4 processes runs every
case (tests/distributed/tp_worker.py).  Each case trains the tiny model of a family parallelised and
patched with its shipped spec beside the single-process unpatched model (float32 and float64): every
step's loss and every final parameter within verify's rule (patchdsl.parity.compare)."""

from __future__ import annotations

import pytest

from ..training.test_distributed import launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "out.json"
    return launch(4, ["-m", "tests.distributed.tp_worker", str(out)], out)


def _cases(ranks):
    return [c for r in ranks for c in r["cases"]]


EXPECTED = {"llama tp x2", "qwen3 hf_tp x2", "llama tp_sp x2", "qwen3 tp_sp x2", "llama fsdp_tp x4",
            "qwen3 fsdp_tp x4", "llama tp x4", "qwen3_moe ep x2", "mixtral ep x2", "qwen3_moe ep x4"}


def _skipped(ranks):
    return {k: v for r in ranks for k, v in r["skipped"].items()}


def test_every_case_ran_on_every_rank(ranks):
    errors = [c["error"] + "\n" + c["traceback"] for c in _cases(ranks) if "error" in c]
    assert not errors, "\n\n".join(errors)
    assert {c["case"] for c in _cases(ranks)} | set(_skipped(ranks)) == EXPECTED
    # only the cases of transformers' own TP styles / EP dispatch may be missing (transformers < 5.21)
    assert all(" hf_tp " in k or " ep " in k for k in _skipped(ranks)), _skipped(ranks)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_losses_and_parameters_match_the_single_process_model(ranks, case):
    if case in _skipped(ranks):
        pytest.skip(_skipped(ranks)[case])
    rows = [r for c in _cases(ranks) if c.get("case") == case for r in c["rows"]]
    assert rows, f"{case} did not run"
    bad = [f"{r['name']}: {r['err']:.2e} > {r['bound']:.2e}" for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)
    assert sum(r["name"].startswith("loss step") for r in rows) >= 3 * 2


def test_the_plan_says_which_layout_each_site_sees(ranks):
    seen = {c["case"]: c["placements"] for c in ranks[0]["cases"]}
    tp = seen["llama tp x2"]
    assert tp["model.layers.0.self_attn"].startswith("heads over 2 ranks")
    assert tp["model.layers.0.mlp"].startswith("columns over 2 ranks")
    assert tp["lm_head"].startswith("vocab over 2 ranks")
    assert "model.norm" not in tp                     # plain TP: the norms see whole tensors
    sp = next(c["placements"] for r in ranks for c in r["cases"] if c["case"] == "qwen3 tp_sp x2")
    assert sp["model.norm"].startswith("replicated over 2 ranks")
    x4 = seen["llama tp x4"]
    assert x4["model.layers.1.self_attn"].startswith("heads over 4 ranks")


def test_expert_parallel_dispatch_calls_the_fused_experts_of_the_rank(ranks):
    for c in _cases(ranks):
        if " ep " not in c["case"]:
            continue
        n = int(c["case"][-1])
        assert set(c["placements"]) == {f"model.layers.{i}.mlp.experts" for i in range(2)}, c["placements"]
        assert all(v.startswith(f"experts over {n} ranks") for v in c["placements"].values())
        for site, called in c["dispatch"].items():
            assert called and all(q.startswith("patchdsl.ops.experts.") for q in called), (site, called)


def test_vocabulary_parallel_loss_and_gradients_match_float64(ranks):
    for r in ranks:
        for part in r["vocab"]:
            assert isinstance(part, list), part
            for c in part:
                bad = {k: v for k, v in c["errors"].items() if not v <= 1e-5}
                assert not bad, (c, bad)
    assert {c["ranks"] for r in ranks for part in r["vocab"] for c in part} == {2, 4}


def test_sites_a_layout_does_not_fit_are_refused_with_the_reason(ranks):
    ref = ranks[0]["refusals"]
    assert "error" not in ref, ref
    sp = ref["sp"]
    assert "model.norm" in sp["patched"] and "model.layers.0.mlp" in sp["patched"]
    why = sp["refused"]["model.layers.0"]
    assert "fused_add_rmsnorm" in why and "replicated over 2 ranks" in why and "post_attention_layernorm" in why
    why = sp["refused"]["lm_head"]
    assert "fused_linear_logprobs" in why and "vocab over 2 ranks" in why
    assert "reduction=none is not vocabulary-parallel" in ref["ce_none"]["lm_head"]
    after = ref["after"]
    assert after and after.startswith("ParallelisedAfterPatch") and "q_proj.weight" in after
    assert "Parallelise first, then patchdsl.apply" in after


def test_a_partial_gradient_left_unreduced_fails_the_comparison(ranks):
    """Must fail: the same run with the sequence-parallel norms' weight gradients not summed over the ranks
    (each rank's partial sum) fails on those weights; the loss of step 1 (before any update) still passes."""
    for r in ranks:
        b = r["broken"]
        assert "error" not in b, b
        assert not b["passed"]
        bad = {row["name"] for row in b["rows"] if not row["ok"]}
        assert any("input_layernorm" in n for n in bad), bad
        assert b["rows"][0]["name"] == "loss step 1" and b["rows"][0]["ok"]

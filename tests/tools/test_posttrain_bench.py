"""bench/posttrain_bench.py at tiny sizes on the CPU (so the H200 script cannot rot): every case and
peer runs, the peers agree, the TRL recipe runs its three variants, and a disagreement is caught."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def bench_module():
    spec = importlib.util.spec_from_file_location("posttrain_bench", ROOT / "bench" / "posttrain_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny CPU run; on a GPU box gpu_all.sh runs it at real sizes")
def test_tiny_run_measures_every_peer_and_they_agree(tmp_path):
    pb = bench_module()
    assert pb.main(["--tiny", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "posttrain.json").read_text())
    assert doc["verdict"] == "PASS" and doc["failures"] == []
    liger = importlib.util.find_spec("liger_kernel") is not None
    for case, (_, peers) in pb.CASES.items():
        got = doc["cases"][case]["peers"]
        for peer in peers:
            if peer == "liger" and not liger:
                assert "unavailable" in got[peer]
                continue
            r = got[peer]
            assert r.get("ms") is not None, (case, peer, r)
            if peer != "torch":                      # compared with the torch peer, values and gradients
                kinds = {c["what"].split(":")[0] for c in r["checks"]}
                assert kinds >= ({"values"} if case == "logprobs_fwd" else {"grads", "loss" if case in ("dpo", "grpo") else "values"})
                assert all(c["ok"] for c in r["checks"]), (case, peer, r["checks"])
    rc = doc["recipe"]
    assert set(rc["variants"]) == {"trl", "patchdsl", "logits"}
    assert all("loss" in v for v in rc["variants"].values()), rc
    assert {c["what"] for c in rc["checks"]["patchdsl"]} == {"loss:loss", "grads:lm_head", "grads:final_norm",
                                                             "grads:layer0_q_proj"}
    text = (tmp_path / "posttrain.txt").read_text()
    assert "dpo           patchdsl" in text and "recipe: TRL DPOTrainer.compute_loss" in text


def test_a_spent_budget_skips_and_says_so(tmp_path):
    """Out of time (the GPU part's limit): every measurement is skipped, named, and the JSON written."""
    pb = bench_module()
    assert pb.main(["--tiny", "--budget", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "posttrain.json").read_text())
    n = sum(len(peers) for _, peers in pb.CASES.values()) + 1
    assert doc["verdict"] == f"PASS, partial ({n} skipped)" and "recipe" in doc["skipped"]
    assert "time budget (0 s) used up" in (tmp_path / "posttrain.txt").read_text()


def test_a_disagreeing_peer_fails_the_run():
    pb = bench_module()
    ref = {"loss": {"loss": torch.tensor(0.7)}, "grads": {"weight": torch.ones(4, 3)}}
    good = {"loss": {"loss": torch.tensor(0.7001)}, "grads": {"weight": torch.ones(4, 3) * 1.001}}
    bad = {"loss": {"loss": torch.tensor(0.7)}, "grads": {"weight": -torch.ones(4, 3)}}     # a sign error
    assert all(c["ok"] for c in pb.compare(good, ref, pb.TOL))
    checks = pb.compare(bad, ref, pb.TOL)
    assert [c["what"] for c in checks if not c["ok"]] == ["grads:weight"]
    nan = {"grads": {"weight": torch.full((4, 3), float("nan"))}}
    assert not pb.compare(nan, ref, pb.TOL)[0]["ok"]
    doc = {"cases": {"dpo": {"peers": {"liger": {"ms": 1.0, "checks": checks}, "trl": {"error": "TypeError: x"}}}},
           "recipe": {"variants": {}, "checks": {}}}
    assert pb.failures(doc) == ["dpo/liger grads:weight: rel err 2 > 0.032", "dpo/trl: TypeError: x"]

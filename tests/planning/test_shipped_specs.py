"""The spec x dtype table: every shipped spec (``specs/*.kpatch``, listed from the folder, so a spec
added later cannot escape it) passes ``verify`` against float64 in fp32, bf16 and fp16 on a tiny model
of its family (tests/shipped_specs.py), every rule checked at some site and nothing refused.

Cheap on purpose (CI runs it on 2 cores): one tiny model per spec, built once per test process and
deep-copied by ``verify`` for each dtype; ``layers=1``, which keeps one decoder layer of each layer type
(patchdsl/model/layers.py: Qwen3.5-MoE's tiny model keeps its linear- and its full-attention layer);
batch 1 x seq 8."""

from __future__ import annotations

from functools import lru_cache

import pytest

from patchdsl.parity import verify
from patchdsl.syntax import load_spec, parse_spec
from patchdsl.util.resources import shipped_spec

from ..shipped_specs import BUILDERS, SHIPPED

DTYPES = ("fp32", "bf16", "fp16")
# a spec that leaves the experts to transformers (measured slower fused at its shapes) carries the rule
# commented out for the memory it saves: verified as a user who uncomments it runs it
EXPERTS = "# *.mlp.experts: Experts -> fused_experts"


def test_every_shipped_spec_has_a_tiny_model():
    missing = set(SHIPPED) - set(BUILDERS)
    assert not missing, f"give these shipped specs a tiny model in tests/shipped_specs.py: {sorted(missing)}"
    assert "qwen3" in SHIPPED and "deepseek_v3" in SHIPPED, SHIPPED      # the folder is read, not an empty glob


@lru_cache(maxsize=1)          # the dtypes of one spec run one after the other (below): one build each
def _model(name: str):
    return BUILDERS[name]()


def _spec(name: str):
    path = shipped_spec(name)
    text = path.read_text()
    return parse_spec(text.replace(EXPERTS, EXPERTS[2:]), path) if EXPERTS in text else load_spec(path)


@pytest.mark.parametrize("name,dtype", [(s, d) for s in SHIPPED for d in DTYPES])
def test_shipped_spec_verifies(name, dtype):
    spec = _spec(name)
    report = verify(spec, _model(name), dtype=dtype, batch=1, seq=8, seed=0, device="cpu", layers=1)
    failed = [(r.path, r.op, r.quantity, r.rel_fro_err, r.tolerance) for r in report.failures()]
    assert report.passed, failed[:8]
    j = report.to_json()
    assert not j.get("refused"), j.get("refused")
    # every rule of the spec produced at least one checked site
    assert {s["op"] for s in j["sites"]} == {r.op.name for r in spec.rules}

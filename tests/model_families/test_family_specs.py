"""The shipped specs written by `patchdsl suggest` for the dense families Liger-Kernel covers
(beyond the six of tests/planning/test_shipped_specs.py): each plans on a tiny model of its family with
every rule selecting something and nothing refused, and passes verify against float64 (fp32, CPU,
tiny sizes)."""

from __future__ import annotations


import pytest

from patchdsl.parity import verify
from patchdsl.planning.planner import plan
from patchdsl.util.resources import shipped_spec
from patchdsl.syntax import load_spec

from ..kernels.helpers import tiny_family

# spec name -> model type of its family
FAMILY_SPECS = {
    "granite": "granite", "olmo2": "olmo2", "olmo3": "olmo3", "glm4": "glm4", "smollm3": "smollm3",
    "exaone4": "exaone4", "falcon_h1": "falcon_h1", "gemma2": "gemma2", "gemma": "gemma", "nemotron": "nemotron",
    "qwen3_5": "qwen3_5_text",
    "starcoder2": "starcoder2",       # not a Liger family: the plain-MLP (fused_mlp) representative with biases
}


@pytest.mark.parametrize("name", sorted(FAMILY_SPECS))
def test_family_spec_plans_cleanly(name):
    spec = load_spec(shipped_spec(name))
    p = plan(spec, tiny_family(FAMILY_SPECS[name]))
    assert not p.refused_sites, [(s.path, s.refused) for s in p.refused_sites]
    assert {s.op for s in p.sites} == {r.op.name for r in spec.rules}


def test_family_specs_say_where_they_come_from():
    for name in FAMILY_SPECS:
        text = shipped_spec(name).read_text()
        assert "Written by `patchdsl suggest`" in text, name
        assert "dtype bf16, fp32" in text, name


# Falcon-H1's Mamba-2 mixer and Qwen3.5's Gated DeltaNet run slowly on the CPU even at tiny sizes (30 s and
# 16 s for verify alone): their specs are verified by the census (python -m patchdsl_tools.census falcon_h1
# qwen3_5_text), here only planned
SLOW_MIXERS = {"falcon_h1", "qwen3_5"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(FAMILY_SPECS) - SLOW_MIXERS))
def test_family_spec_verifies(name):
    mt = FAMILY_SPECS[name]
    rep = verify(load_spec(shipped_spec(name)), lambda: tiny_family(mt), dtype="fp32", batch=1, seq=8, device="cpu")
    assert rep.passed, [(r.path, r.quantity) for r in rep.failures()][:5]
    assert not rep.to_json().get("refused")

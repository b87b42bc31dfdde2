"""The shipped specs written by `patchdsl suggest` for the dense families Liger-Kernel covers
(beyond the six of tests/planning/test_shipped_specs.py): each plans on a tiny model of its family with
every rule selecting something and nothing refused (their verify against float64 in every dtype: the
spec x dtype table, tests/planning/test_shipped_specs.py)."""

from __future__ import annotations


import pytest

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


# verified in fp32, bf16 and fp16 by the spec x dtype table: tests/planning/test_shipped_specs.py

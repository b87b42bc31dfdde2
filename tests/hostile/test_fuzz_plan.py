"""Plan loading under fuzzing: a plan file with any one value replaced by arbitrary JSON loads as a
valid plan or fails with PlanError, never another exception (issue: data never becomes code)."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchdsl.planning.plan import PatchPlan
from patchdsl.planning.plan_file import PlanError
from patchdsl.planning.planner import plan

from ..families import tiny_model

_PLAN = plan("dtype fp32\n*.input_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n*.mlp: SwiGLU -> fused_swiglu\n"
             "lm_head: Linear -> fused_linear_cross_entropy\n", tiny_model("qwen3")).to_json()


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


PATHS = [p for p in _paths(_PLAN) if p]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=10)


def _replace(doc, path, value):
    doc = json.loads(json.dumps(doc))
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(PATHS), value=JSON)
def test_any_value_replaced_loads_or_is_a_plan_error(path, value):
    try:
        PatchPlan.from_json(_replace(_PLAN, path, value))
    except PlanError:
        pass


def test_the_unmodified_plan_loads():
    assert PatchPlan.from_json(_PLAN).to_json() == _PLAN

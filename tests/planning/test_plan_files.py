"""Plan files and apply on a live model: hostile plan JSON fails cleanly, apply checks the live
module, composes with hooks and wrappers, undoes exactly what it did."""

import copy
import json
import types

import pytest
import torch

import patchdsl
from patchdsl.planning.plan import PatchPlan
from patchdsl.planning.plan_file import PlanError
from patchdsl.planning.planner import plan
from patchdsl.runtime import PatchError, UnsupportedDtype, apply, unpatch

from ..families import tiny_model

NORM = "model.norm: RMSNorm -> fused_rmsnorm"


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def plan_json(qwen):
    return json.loads(plan("dtype fp32\n" + NORM + "\n*.mlp: SwiGLU -> fused_swiglu", qwen).dumps())


def _site(d, path):
    return next(s for s in d["sites"] if s["path"] == path)


def _edit(d, fn):
    d = copy.deepcopy(d)
    fn(d)
    return d


def _set_fact(d, path, kind, name, value):
    d["modules"][path]["kinds"][kind][name] = value


HOSTILE = {
    "newline in a fact": lambda d: _set_fact(d, "model.norm", "RMSNorm", "casting", "llama\nimport os"),
    "__import__ in a flag": lambda d: _site(d, "model.norm")["flags"].update(casting="__import__('os')"),
    "code in a flag value": lambda d: _site(d, "model.norm")["flags"].update(eps="1e-6); import os; (1"),
    "inf eps flag": lambda d: _site(d, "model.norm")["flags"].update(eps=float("inf")),
    "nan eps fact": lambda d: _set_fact(d, "model.norm", "RMSNorm", "eps", float("nan")),
    "bool as a size": lambda d: _set_fact(d, "model.norm", "RMSNorm", "hidden", True),
    "negative size": lambda d: _set_fact(d, "model.norm", "RMSNorm", "hidden", -64),
    "fractional size": lambda d: _set_fact(d, "model.norm", "RMSNorm", "hidden", 64.5),
    "traversal in kernel name": lambda d: _site(d, "model.norm")["kernels"][0].update(name="../../../tmp/evil"),
    "newline in kernel name": lambda d: _site(d, "model.norm")["kernels"][0].update(name="k\nimport os"),
    "kernel params differ": lambda d: _site(d, "model.norm")["kernels"][0]["params"].update(eps=0.5),
    "kernel param code": lambda d: _site(d, "model.norm")["kernels"][0]["params"].update(tag="h\nimport os"),
    "other template": lambda d: _site(d, "model.norm")["kernels"][0].update(template="../x.py.j2"),
    "unknown op": lambda d: _site(d, "model.norm").update(op="os.system"),
    "unknown flag": lambda d: _site(d, "model.norm")["flags"].update(__class__=1),
    "newline in rule": lambda d: _site(d, "model.norm").update(rule="x\ny"),
    "bad path": lambda d: _site(d, "model.norm").update(path="model/../norm"),
    "bad target": lambda d: d.update(target="cuda; rm -rf"),
    "float64 dtype": lambda d: d.update(dtypes=["float64"]),
    "bad class": lambda d: d.update(model_class="Qwen3\nForCausalLM"),
    "host not an ancestor": lambda d: _site(d, "model.norm").update(host="lm_head"),
    "format": lambda d: d.update(format=99),
    "not an object": lambda d: d["sites"].append("x"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_crafted_plan_fails_with_a_clear_error(name, plan_json, tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHDSL_CACHE", str(tmp_path / "cache"))
    d = _edit(plan_json, HOSTILE[name])
    with pytest.raises(PlanError) as ei:
        PatchPlan.from_json(d)
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 600
    assert not (tmp_path / "cache").exists()          # nothing rendered, nothing written


def test_plan_file_round_trip_is_checked_like_a_fresh_plan(qwen, plan_json):
    p = plan("dtype fp32\n" + NORM + "\n*.mlp: SwiGLU -> fused_swiglu", qwen)
    q = PatchPlan.loads(json.dumps(plan_json))
    assert q.sites == p.sites and q.totals == p.totals and q.kernel_keys() == p.kernel_keys()
    with pytest.raises(PlanError, match="not a JSON"):
        PatchPlan.loads("{")
    with pytest.raises(PlanError):
        PatchPlan.loads("[" * 100000 + "]" * 100000)


# ------------------------------------------------------------------ apply on the live model
def test_eps_changed_after_planning_is_refused():
    m = tiny_model("qwen3")
    p = plan(NORM, m)
    m.model.norm.variance_epsilon = 1e-2
    h = apply(p, m)
    assert h.patched == [] and "RMSNorm eps: plan 1e-06, module 0.01" in h.refused[0].reason
    with pytest.raises(PatchError, match="eps"):
        apply(p, m, strict=True)
    assert "forward" not in m.model.norm.__dict__


def test_plan_of_one_instance_applied_to_another_is_refused():
    a, b = tiny_model("qwen3"), tiny_model("qwen3", rms_norm_eps=1e-5)
    p = plan(NORM, a)
    h = apply(p, b)
    assert h.patched == [] and "does not match the plan" in h.refused[0].reason
    apply(p, a).undo()


def test_strict_is_all_or_nothing():
    m = tiny_model("qwen3")
    p = plan(NORM + "\n*.mlp: SwiGLU -> fused_swiglu", m)
    m.model.layers[1].mlp.gate_proj = torch.nn.Linear(m.config.hidden_size, m.config.intermediate_size + 8,
                                                     bias=False)
    before = {n: mod.__dict__.get("forward") for n, mod in m.named_modules()}
    with pytest.raises(PatchError, match="model.layers.1.mlp"):
        apply(p, m, strict=True)
    assert {n: mod.__dict__.get("forward") for n, mod in m.named_modules()} == before
    assert not any("_patchdsl_site" in mod.__dict__ for mod in m.modules())


def test_forward_hooks_keep_running(qwen):
    seen = []
    hooks = [qwen.model.norm.register_forward_pre_hook(lambda mod, a: seen.append("pre")),
             qwen.model.norm.register_forward_hook(lambda mod, a, out: seen.append("post"))]
    try:
        with apply(plan(NORM, qwen), qwen) as h:
            assert h.patched == ["model.norm"]
            qwen.model.norm(torch.randn(2, qwen.config.hidden_size))
        assert seen == ["pre", "post"]
    finally:
        for hk in hooks:
            hk.remove()


def _accelerate_style_hook(module, calls):
    """What accelerate's add_hook_to_module does: keep the forward as _old_forward, wrap it."""
    module._hf_hook = object()
    module._old_forward = module.forward

    def new_forward(self, *args, **kwargs):
        calls.append(1)
        return self._old_forward(*args, **kwargs)

    module.forward = types.MethodType(new_forward, module)


def test_an_accelerate_hook_keeps_being_called_and_calls_the_kernel():
    m = tiny_model("qwen3")
    norm = m.model.norm
    x = torch.randn(3, m.config.hidden_size)
    ref = norm(x)
    calls = []
    _accelerate_style_hook(norm, calls)
    wrapper, old = norm.__dict__["forward"], norm.__dict__["_old_forward"]
    h = apply(plan(NORM, m), m)
    assert h.patched == ["model.norm"] and norm.__dict__["forward"] is wrapper
    assert norm.__dict__["_old_forward"] is not old        # the hook now calls the patched forward
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-5)
    assert calls == [1]
    h.undo()
    assert norm.__dict__["_old_forward"] is old and norm.__dict__["forward"] is wrapper


def test_an_unknown_instance_forward_is_refused_not_dropped():
    m = tiny_model("qwen3")
    mine = types.MethodType(lambda self, x: x * 2, m.model.norm)
    m.model.norm.forward = mine
    h = apply(plan(NORM, m), m)
    assert h.patched == [] and "replaced on the instance before apply" in h.refused[0].reason
    assert m.model.norm.forward is mine


def test_undo_keeps_a_forward_set_after_apply():
    m = tiny_model("qwen3")
    h = apply(plan(NORM, m), m)
    mine = types.MethodType(lambda self, x: x, m.model.norm)
    m.model.norm.forward = mine
    h.undo()
    assert m.model.norm.__dict__["forward"] is mine and h.left == ["Qwen3RMSNorm.forward"]


def test_deepcopy_while_patched_carries_its_own_consistent_state():
    m = tiny_model("qwen3")
    x = torch.randn(2, m.config.hidden_size)
    h = apply(plan(NORM, m), m)
    c = copy.deepcopy(m)
    h.undo()
    assert "forward" not in m.model.norm.__dict__
    assert "forward" in c.model.norm.__dict__ and c.model.norm.forward.__self__ is c.model.norm
    with torch.no_grad():
        c.model.norm.weight.mul_(3.0)          # the copy's kernel reads the copy's weight
    ref = type(c.model.norm).forward(c.model.norm, x)
    torch.testing.assert_close(c.model.norm(x), ref, rtol=1e-5, atol=1e-5)
    assert patchdsl.unpatch(c) == 1
    assert "forward" not in c.model.norm.__dict__ and "_patchdsl_site" not in c.model.norm.__dict__
    apply(plan(NORM, c), c).undo()             # and can be patched again


def test_float64_after_patching_is_a_clear_error():
    m = tiny_model("qwen3")
    h = apply(plan(NORM, m), m)
    m.double()
    with pytest.raises(UnsupportedDtype, match="float32, bfloat16 and float16 only.*undo"):
        m.model.norm(torch.randn(2, m.config.hidden_size, dtype=torch.float64))
    h.undo()


def test_a_meta_model_is_refused_at_apply(qwen):
    from patchdsl.model import load_model

    meta = load_model("Qwen/Qwen3-0.6B", meta=True, tiny=True, log=lambda s: None).model
    h = apply(plan(NORM, meta), meta)
    assert h.patched == [] and "meta device" in h.refused[0].reason


def test_apply_takes_a_plan_file_and_rejects_a_crafted_one(plan_json, tmp_path):
    m = tiny_model("qwen3")
    good = tmp_path / "plan.json"
    good.write_text(json.dumps(plan_json))
    h = apply(str(good), m)
    assert sorted(h.patched)[0] == "model.layers.0.mlp" and "model.norm" in h.patched
    h.undo()
    marker = tmp_path / "pwned"
    bad = _edit(plan_json, lambda d: _site(d, "model.norm")["flags"].update(
        casting=f"llama\nopen({str(marker)!r}, 'w')"))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    for arg in (bad, str(tmp_path / "bad.json")):
        with pytest.raises(PlanError):
            apply(arg, m)
    assert not marker.exists() and not any("forward" in mod.__dict__ for mod in m.modules())


# ------------------------------------------------------------------ bad model configs
@pytest.mark.parametrize("field, value", [
    ("hidden_size", "64"), ("hidden_size", 64.5), ("num_attention_heads", -4), ("intermediate_size", 0),
    ("vocab_size", True), ("num_hidden_layers", 2 ** 40), ("rms_norm_eps", -1e-6), ("rope_theta", "1e4"),
])
def test_a_bad_config_json_is_a_clear_error_with_exit_2(field, value, tmp_path):
    from click.testing import CliRunner

    from patchdsl.cli import main
    from patchdsl.model.loading import shipped_config_path

    d = json.loads(shipped_config_path("Qwen/Qwen3-0.6B").read_text())
    d[field] = value
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(d))
    r = CliRunner().invoke(main, ["plan", "specs/qwen3.kpatch", "--model", str(cfg)])
    assert r.exit_code == 2, r.output
    assert f'"{field}" must be' in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("rule", ["model.norm: RMSNorm -> fused_rmsnorm(eps=1e309)",
                                  "lm_head: Linear -> fused_linear_cross_entropy(z_loss=1e309)"])
def test_a_non_finite_flag_is_a_located_spec_error(rule, qwen):
    with pytest.raises(patchdsl.SpecError, match="finite") as ei:
        plan(rule, qwen)
    assert ei.value.span.line == 1


def test_a_real_accelerate_hook_wraps_the_patched_forward():
    from accelerate import hooks          # in the test extra
    calls = []

    class Count(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    m = tiny_model("qwen3")
    norm = m.model.norm
    x = torch.randn(2, m.config.hidden_size)
    ref = norm(x)
    hooks.add_hook_to_module(norm, Count())
    h = apply(plan(NORM, m), m)
    assert h.patched == ["model.norm"]
    torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-5)
    assert calls == [1] and norm.__dict__["_patchdsl_site"].changes[0][0] == "_old_forward"
    h.undo()
    hooks.remove_hook_from_module(norm)
    torch.testing.assert_close(norm(x), ref, rtol=0, atol=0)

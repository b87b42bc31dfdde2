"""Runtime: apply a plan to tiny models of every shipped family, reversibly, and nothing else."""

import copy
import sys

import pytest
import torch

import patchdsl
from patchdsl.planning.planner import plan
from patchdsl.util.resources import shipped_spec
from patchdsl.runtime import PatchError, apply
from patchdsl.syntax import load_spec

from ..families import FAMILIES, tiny_model

FAMILY_LIST = list(FAMILIES)


def _batch(vocab=320, b=2, s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return ids


def _forwards_snapshot(model):
    return {p: m.__dict__.get("forward") for p, m in model.named_modules()}


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_every_intended_module_patched_and_nothing_else(family):
    model = tiny_model(family)
    p = plan(load_spec(shipped_spec(family)), model)
    before = _forwards_snapshot(model)
    handle = apply(p, model)
    try:
        assert not handle.refused, [str(r) for r in handle.refused]
        hosts = {s.host for s in p.sites}
        after = _forwards_snapshot(model)
        changed = {k for k in after if after[k] is not before[k]}
        assert changed == hosts, (changed ^ hosts)
        # every RMSNorm is either patched itself or fused into its attention site
        covered = {c for s in p.sites for c in s.covers}
        sites = {s.path for s in p.sites}
        for path, m in model.named_modules():
            if type(m).__name__.endswith("RMSNorm"):
                assert path in sites or path in covered, path
            if path.endswith(".mlp"):
                assert path in sites, path
        assert "lm_head" in sites
    finally:
        handle.undo()
    assert _forwards_snapshot(model) == before


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_state_dict_identical_and_undo_bit_exact(family):
    model = tiny_model(family)
    model.eval()
    ids = _batch()
    ref = model(ids).logits.detach().clone()
    sd_before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    handle = patchdsl.apply(load_spec(shipped_spec(family)), model)
    sd_after = model.state_dict()
    assert list(sd_after) == list(sd_before)
    for k, (ptr, val) in sd_before.items():
        assert sd_after[k].data_ptr() == ptr and torch.equal(sd_after[k], val), k
    out = model(ids).logits
    assert (out - ref).abs().max().item() < 1e-4
    handle.undo()
    assert torch.equal(model(ids).logits, ref)


def test_context_manager_and_optimizer_built_before_patching():
    model = tiny_model("qwen3")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = _batch()
    w0 = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    with patchdsl.apply(load_spec(shipped_spec("qwen3")), model) as h:
        assert h.patched
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, w0)
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_no_process_wide_changes():
    import transformers.models.qwen3.modeling_qwen3 as mq

    globals_before = dict(vars(mq))
    cls_forwards = {c: c.forward for c in (mq.Qwen3MLP, mq.Qwen3RMSNorm, mq.Qwen3Attention, mq.Qwen3ForCausalLM)}
    f_ce = torch.nn.functional.cross_entropy
    a, b = tiny_model("qwen3"), tiny_model("qwen3")
    h = apply(plan("*.mlp: SwiGLU -> fused_swiglu", a), a)
    assert "forward" in a.model.layers[0].mlp.__dict__
    assert "forward" not in b.model.layers[0].mlp.__dict__
    c = tiny_model("qwen3")                     # built after patching: untouched
    assert "forward" not in c.model.layers[0].mlp.__dict__
    assert {k: v for k, v in vars(mq).items()} == globals_before
    assert {c_: c_.forward for c_ in cls_forwards} == cls_forwards
    assert torch.nn.functional.cross_entropy is f_ce
    h.undo()


def test_two_models_two_plans():
    a, b = tiny_model("qwen3"), tiny_model("qwen3")
    ha = apply(plan("*.mlp: SwiGLU -> fused_swiglu", a), a)
    hb = apply(plan("model.norm: RMSNorm -> fused_rmsnorm", b), b)
    assert "forward" in a.model.layers[0].mlp.__dict__ and "forward" not in a.model.norm.__dict__
    assert "forward" in b.model.norm.__dict__ and "forward" not in b.model.layers[0].mlp.__dict__
    ha.undo(), hb.undo()


def test_double_apply_is_refused_until_undo():
    m = tiny_model("qwen3")
    h = apply(plan("model.norm: RMSNorm -> fused_rmsnorm", m), m)
    with pytest.raises(PatchError, match="already patched"):
        apply(plan("model.norm: RMSNorm -> fused_rmsnorm", m), m)
    h.undo()
    apply(plan("model.norm: RMSNorm -> fused_rmsnorm", m), m).undo()


def test_refused_site_reports_reason():
    """A site whose live module no longer fits (here: the norm's forward was replaced by
    something that is not an RMSNorm after planning) is refused, named, and left alone."""
    m = tiny_model("qwen3")
    p = plan("model.norm: RMSNorm -> fused_rmsnorm", m)
    # the module changes between plan and apply: its facts no longer hold
    from dataclasses import replace

    info = p.infos["model.norm"]
    bad = replace(info, kinds={"RMSNorm": dict(info.kinds["RMSNorm"], casting="unknown")})
    p2 = replace(p, infos=dict(p.infos, **{"model.norm": bad}))
    h = apply(p2, m)
    assert h.patched == [] and len(h.refused) == 1
    r = h.refused[0]
    assert r.path == "model.norm" and r.rule.endswith(":1") and "does not match the plan" in r.reason
    assert "RMSNorm casting: plan 'unknown', module 'llama'" in r.reason
    assert "refused fused_rmsnorm on model.norm" in str(r)
    with pytest.raises(PatchError, match="model.norm"):
        apply(p2, m, strict=True)


def test_plan_for_another_model_is_rejected():
    a, b = tiny_model("qwen3"), tiny_model("llama")
    with pytest.raises(PatchError, match="Qwen3ForCausalLM"):
        apply(plan("model.norm: RMSNorm -> fused_rmsnorm", a), b)


def test_peft_lora_and_modules_to_save():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj", "v_proj"],
                          modules_to_save=["lm_head"], lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    # make LoRA deltas non-zero so that ignoring them would show
    for n, p_ in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p_, std=0.05)
    ids = _batch()
    pm.train()
    ref = copy.deepcopy(pm)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    base = pm.get_base_model()
    h = apply(plan(load_spec(shipped_spec("llama")), base), base)
    assert not h.refused, [str(r) for r in h.refused]
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-4
    grads = {n: p_.grad for n, p_ in pm.named_parameters() if p_.requires_grad}
    ref_grads = {n: p_.grad for n, p_ in ref.named_parameters() if p_.requires_grad}
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        g, r = grads[n], ref_grads[n]
        assert g is not None and r is not None, n
        assert torch.allclose(g, r, rtol=1e-3, atol=1e-5), n
    h.undo()


def test_loss_ops_refuse_a_linear_that_is_not_the_lm_head():
    m = tiny_model("qwen3")
    from patchdsl import SpecError

    for op in ("fused_cross_entropy", "fused_linear_cross_entropy"):
        # caught at plan time now, with the op's home in the hint
        with pytest.raises(SpecError) as ei:
            plan(f"*.layers.0.self_attn.q_proj: Linear -> {op}", m)
        assert "lm_head" in ei.value.render(), op

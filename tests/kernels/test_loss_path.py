"""The causal-LM loss path on tiny Qwen3 / Llama / Gemma 3 (softcap 30) / Granite models.

The patched model's loss and every parameter's gradient must match the unpatched HF model's
(``ForCausalLMLoss``: shifted labels, fp32 logits, mean or sum / num_items_in_batch), with
``shift_labels`` and ``logits_to_keep``; in eval mode / no_grad / without labels the original
forward runs and the logits are bit-identical; what cannot be reproduced is refused with a reason.
"""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from patchdsl.model.index import build_index
from patchdsl.model.forward import causal_lm
from patchdsl.ops import loss_path
from patchdsl.ops.registry import get_op
from patchdsl.planning.planner import plan
from patchdsl.runtime import PatchError, apply, patch_module
from patchdsl.runtime.patch import kernel_getter

from ..families import tiny_model
from .helpers import DEVICE, TARGET

FAMILIES = ["qwen3", "llama", "gemma3"]
FLCE = "fused_linear_cross_entropy"
CE = "fused_cross_entropy"
VOCAB = 320


def batch(b=2, s=9, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, :3] = -100           # a masked prompt
    return ids.to(DEVICE), labels.to(DEVICE)


def pair(family, dtype=torch.float32, **over):
    ref = tiny_model(family, dtype=dtype, **over).to(DEVICE)
    pat = copy.deepcopy(ref)
    ref.train(), pat.train()
    return ref, pat


def patch(model, op=FLCE):
    """Through the planner and runtime, as a spec rule on lm_head does (``op`` may carry flags)."""
    h = apply(plan(f"lm_head: Linear -> {op}", model), model, strict=True)
    assert h.patched == ["lm_head"]
    return h


def grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_step(ref_out, out, ref, pat, rtol=2e-5, atol=1e-7, grad_rtol=2e-4, grad_atol=1e-6):
    assert out.loss is not None and ref_out.loss is not None
    assert torch.allclose(out.loss.float(), ref_out.loss.float(), rtol=rtol, atol=atol), (out.loss, ref_out.loss)
    out.loss.backward()
    ref_out.loss.backward()
    gp, gr = grads(pat), grads(ref)
    assert gp.keys() == gr.keys()
    for n in gr:
        assert gp[n] is not None and gr[n] is not None, n
        assert torch.allclose(gp[n], gr[n], rtol=grad_rtol, atol=grad_atol), \
            (n, (gp[n] - gr[n]).abs().max().item(), gr[n].abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_grads_match_hf(family):
    ref, pat = pair(family)
    h = patch(pat)
    ids, labels = batch()
    out = pat(input_ids=ids, labels=labels)
    assert out.logits is None
    assert_same_step(ref(input_ids=ids, labels=labels), out, ref, pat)
    h.undo()
    assert "forward" not in pat.__dict__


@pytest.mark.parametrize("family", FAMILIES)
def test_num_items_in_batch(family):
    ref, pat = pair(family)
    patch(pat)
    ids, labels = batch(seed=1)
    n = torch.tensor(23, device=DEVICE)
    assert_same_step(ref(input_ids=ids, labels=labels, num_items_in_batch=n),
                     pat(input_ids=ids, labels=labels, num_items_in_batch=n), ref, pat)


@pytest.mark.parametrize("family", FAMILIES)
def test_shift_labels(family):
    ref, pat = pair(family)
    patch(pat)
    ids, labels = batch(seed=2)
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    shift[1, 4] = -100
    assert_same_step(ref(input_ids=ids, labels=labels, shift_labels=shift),
                     pat(input_ids=ids, labels=labels, shift_labels=shift), ref, pat)


def test_shift_labels_without_labels_gets_a_loss():
    """Documented difference: HF computes a loss only when labels is given."""
    ref, pat = pair("qwen3")
    patch(pat)
    ids, labels = batch(seed=3)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    out = pat(input_ids=ids, shift_labels=shift)
    ref_out = ref(input_ids=ids, labels=labels)
    assert torch.allclose(out.loss, ref_out.loss, rtol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_to_keep(family):
    ref, pat = pair(family)
    patch(pat)
    ids, labels = batch(seed=4)
    k = 5
    assert_same_step(ref(input_ids=ids, labels=labels[:, -k:], logits_to_keep=k),
                     pat(input_ids=ids, labels=labels[:, -k:], logits_to_keep=k), ref, pat)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_no_grad_and_no_labels_run_the_original_forward(family):
    ref, pat = pair(family)
    patch(pat)
    ids, labels = batch(seed=5)
    ref.eval(), pat.eval()
    a, b = ref(input_ids=ids, labels=labels), pat(input_ids=ids, labels=labels)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    ref.train(), pat.train()
    with torch.no_grad():
        a, b = ref(input_ids=ids, labels=labels), pat(input_ids=ids, labels=labels)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    a, b = ref(input_ids=ids), pat(input_ids=ids)
    assert b.loss is None and torch.equal(a.logits, b.logits)


def test_return_dict_false_gives_a_tuple():
    ref, pat = pair("llama")
    patch(pat)
    ids, labels = batch(seed=6)
    out = pat(input_ids=ids, labels=labels, return_dict=False)
    ref_out = ref(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and torch.allclose(out[0], ref_out[0], rtol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_mode_loss_and_grads_match_hf(family):
    """mode=fused (the logits never in memory) through the same loss path; Gemma's softcap 30 is
    applied in the kernels' tiles (weights scaled so the logits reach tens, where it matters)."""
    ref, pat = pair(family)
    if family == "gemma3":
        with torch.no_grad():
            for m in (ref, pat):
                m.lm_head.weight.mul_(400.0)
    h = patch(pat, f"{FLCE}(mode=fused)")
    assert h.plan.sites[0].keys[0].param_dict["mode"] == "fused"
    ids, labels = batch(seed=3)
    out = pat(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11))
    # gemma: logits of tens make fp32 summation order show as ~3e-6 of the largest gradient
    assert_same_step(ref(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(11)), out, ref, pat,
                     grad_atol=1e-5 if family == "gemma3" else 1e-6)


def test_gemma_softcap_is_applied_from_the_config():
    ref, pat = pair("gemma3")
    assert ref.config.final_logit_softcapping == 30.0
    with torch.no_grad():               # logits of tens, where the softcap matters
        for m in (ref, pat):
            m.lm_head.weight.mul_(400.0)
    h = patch(pat)
    key = h.plan.sites[0].keys[0]
    assert key.param_dict["softcap"] == 30.0
    # without the softcap the loss would differ: make sure the test can tell
    ids, labels = batch(seed=7)
    with torch.no_grad():
        hidden = ref.model(input_ids=ids).last_hidden_state
        raw = torch.nn.functional.cross_entropy(ref.lm_head(hidden)[:, :-1].reshape(-1, VOCAB).float(),
                                                labels[:, 1:].reshape(-1))
    out = pat(input_ids=ids, labels=labels)
    assert abs(out.loss.item() - raw.item()) > 1e-4
    assert_same_step(ref(input_ids=ids, labels=labels), out, ref, pat)


def test_softcap_flag_that_disagrees_with_the_model_is_refused():
    m = tiny_model("gemma3")
    with pytest.raises(PatchError, match="softcap"):
        patch_module(m, FLCE, softcap=None)
    m2 = tiny_model("llama")
    with pytest.raises(PatchError, match="softcap"):
        patch_module(m2, FLCE, softcap=10.0)


def test_bf16_model_matches_hf_within_bf16_tolerance():
    ref, pat = pair("qwen3", dtype=torch.bfloat16)
    patch(pat)
    ids, labels = batch(seed=8)
    out, ref_out = pat(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-2 * abs(ref_out.loss.item())
    out.loss.backward(), ref_out.loss.backward()
    gp, gr = grads(pat), grads(ref)
    for n in gr:
        rel = (gp[n].float() - gr[n].float()).norm() / gr[n].float().norm().clamp_min(1e-12)
        assert rel <= 3e-2, (n, rel.item())


def test_autocast_runs_the_head_in_the_autocast_dtype():
    ref, pat = pair("llama")
    patch(pat)
    ids, labels = batch(seed=14)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out, ref_out = pat(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-2 * abs(ref_out.loss.item())
    out.loss.backward(), ref_out.loss.backward()
    gp, gr = grads(pat), grads(ref)
    assert pat.lm_head.weight.grad.dtype == torch.float32
    for n in gr:
        rel = (gp[n] - gr[n]).norm() / gr[n].norm().clamp_min(1e-12)
        assert rel <= 3e-2, (n, rel.item())


def test_granite_logits_scaling_is_handled():
    cfg = AutoConfig.for_model("granite", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                               max_position_embeddings=64, logits_scaling=4.0, embedding_multiplier=2.0,
                               residual_multiplier=0.5, attention_multiplier=0.25)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(DEVICE)
    pat = copy.deepcopy(ref)
    ref.train(), pat.train()
    h = patch(pat)
    assert h.plan.sites[0].keys[0].param_dict["logits_scaling"] == 4.0
    ids, labels = batch(seed=9)
    assert_same_step(ref(input_ids=ids, labels=labels), pat(input_ids=ids, labels=labels), ref, pat)


def test_patch_module_on_the_causal_lm_directly():
    ref, pat = pair("llama")
    h = patch_module(pat, FLCE)
    ids, labels = batch(seed=10)
    assert_same_step(ref(input_ids=ids, labels=labels), pat(input_ids=ids, labels=labels), ref, pat)
    h.undo()
    assert "forward" not in pat.__dict__


def test_weights_are_read_at_call_time():
    ref, pat = pair("llama")
    patch(pat)
    with torch.no_grad():
        for m in (ref, pat):
            m.lm_head.weight.mul_(1.5)
    ids, labels = batch(seed=11)
    assert_same_step(ref(input_ids=ids, labels=labels), pat(input_ids=ids, labels=labels), ref, pat)


# ---------------------------------------------------------------- fused_cross_entropy
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_cross_entropy_replaces_only_the_loss_function(family):
    ref, pat = pair(family)
    assert causal_lm.loss_function_settable(type(pat))
    h = patch(pat, CE)
    assert "_loss_function" in pat.__dict__ and "forward" not in pat.__dict__
    ids, labels = batch(seed=12)
    n = torch.tensor(11, device=DEVICE)
    out, ref_out = pat(input_ids=ids, labels=labels, num_items_in_batch=n), \
        ref(input_ids=ids, labels=labels, num_items_in_batch=n)
    assert torch.equal(out.logits, ref_out.logits)
    assert_same_step(ref_out, out, ref, pat)
    h.undo()
    assert "_loss_function" not in pat.__dict__
    assert pat.loss_function.__name__ == "ForCausalLMLoss"


def test_fused_cross_entropy_forward_fallback_mode():
    """Where a class has no settable loss_function, the forward is patched to compute logits
    with lm_head and the loss with the fused kernel; exercised here directly."""
    ref, pat = pair("gemma3")
    op = get_op(CE)
    info = build_index(pat).infos[""]
    flags = op.default_flags()
    kernels = kernel_getter(op, info, flags, TARGET)
    for obj, attr, val in loss_path.install_forward(pat, kernels, flags, "logits"):
        setattr(obj, attr, val)
    ids, labels = batch(seed=13)
    out, ref_out = pat(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert torch.equal(out.logits, ref_out.logits)       # softcapped as HF does, then returned
    assert_same_step(ref_out, out, ref, pat)


# ---------------------------------------------------------------- refusals
def test_refuses_a_forward_that_does_not_call_the_loss_function():
    m = tiny_model("llama")
    src = ("def forward(self, input_ids=None, labels=None, **kwargs):\n"
           "    h = self.model(input_ids=input_ids, **kwargs).last_hidden_state\n"
           "    return self.lm_head(h)\n")
    import linecache
    fname = "<custom-forward-1>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    ns = {}
    exec(compile(src, fname, "exec"), {"torch": torch}, ns)
    m.__class__ = type("CustomLlama", (type(m),), {"forward": ns["forward"]})
    with pytest.raises(PatchError, match="self.loss_function"):
        patch_module(m, FLCE)


# What a causal LM's forward does between its last hidden state and its loss: every multiplier,
# divisor or softcap of the shipped families is reproduced (loss and gradients as HF's), each
# checked with its factor large enough to move the loss (lm_head scaled up).
SCALED = {
    # model_type: (config overrides, the kernel parameter that must carry the factor, its value)
    "falcon_h1": (dict(lm_head_multiplier=0.5, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                       mamba_chunk_size=4, mamba_n_groups=1, head_dim=16), "logit_multiplier", 0.5),
    "cohere": (dict(logit_scale=0.25), "logit_multiplier", 0.25),
    "cohere2": (dict(logit_scale=0.25, layer_types=["full_attention"]), "logit_multiplier", 0.25),
    "granite": (dict(logits_scaling=4.0), "logits_scaling", 4.0),
    "gemma2": (dict(final_logit_softcapping=2.0, head_dim=16), "softcap", 2.0),
}


@pytest.mark.parametrize("op", [FLCE, CE])
@pytest.mark.parametrize("model_type", list(SCALED))
def test_every_logit_scaling_of_a_causal_lm_forward_is_reproduced(model_type, op):
    over, param, value = SCALED[model_type]
    try:
        cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64, **over)
    except (KeyError, ValueError):
        pytest.skip(f"{model_type} is not in this transformers")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(DEVICE)
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)               # logits of tens: the factor moves the loss
    pat = copy.deepcopy(ref)
    ref.train(), pat.train()
    h = patch(pat, op)
    # the linear CE computes the logits itself and so applies the factor; the CE takes the logits
    # HF's own forward scaled (only the loss function is replaced)
    assert h.plan.sites[0].keys[0].param_dict[param] == (value if op == FLCE else None)
    ids, labels = batch(seed=12)
    assert_same_step(ref(input_ids=ids, labels=labels), pat(input_ids=ids, labels=labels), ref, pat,
                     rtol=1e-4, atol=1e-5)


_VARIANT = """
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast


class Variant(LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        {head}
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
"""

# A forward step between the hidden states and the loss -> None (reproduced by the linear CE: the
# patched loss is HF's) or the linear CE's refusal (the step named).  The CE replaces only the loss
# function, so HF's forward computes the logits: every variant's loss must be HF's.
HEAD_STEPS = {
    "pass": None,
    "logits = logits * self.logit_scale": None,             # Cohere's, on a model that has it
    "logits = logits / self.config.logits_scaling": None,   # Granite's
    "logits = logits * self.temperature": r"uses self\.temperature",
    "logits = logits * self.config.logit_temperature": r"reads config\.logit_temperature",
    "logits = logits + 1.0": r"computes `logits = logits \+ 1\.0`",
    "logits = logits * 2.0": r"computes `logits = logits \* 2\.0`",
    "logits = logits.flip(-1)": r"computes `logits = logits\.flip\(-1\)`",
    "hidden_states = hidden_states * 2.0": r"after the lm_head",
    "logits = torch.tanh(logits / self.config.logits_scaling) * self.config.logits_scaling": r"computes",
}


@pytest.mark.parametrize("head", list(HEAD_STEPS))
def test_a_forward_step_is_reproduced_or_refused_by_name(head, tmp_path, monkeypatch):
    import importlib.util
    import sys

    path = tmp_path / "variant_forward.py"
    path.write_text("import torch\n" + _VARIANT.format(head=head))
    spec = importlib.util.spec_from_file_location(f"variant_forward_{abs(hash(head))}", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                               max_position_embeddings=64, logits_scaling=4.0, logit_temperature=0.5)
    torch.manual_seed(0)
    ref = mod.Variant(cfg).to(DEVICE)
    ref.logit_scale, ref.temperature = 0.25, 0.5
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)
    causal_lm._SHAPES.clear()
    expected = HEAD_STEPS[head]
    for op in (FLCE, CE):
        pat = copy.deepcopy(ref)
        ref.train(), pat.train()
        if expected is not None and op == FLCE:
            with pytest.raises(PatchError, match=expected):
                patch_module(pat, op)
            continue
        patch_module(pat, op)
        ids, labels = batch(seed=13)
        ref.zero_grad()
        assert_same_step(ref(input_ids=ids, labels=labels), pat(input_ids=ids, labels=labels), ref, pat,
                         rtol=1e-4, atol=1e-5)


def test_refuses_a_custom_loss_function():
    m = tiny_model("llama")
    m.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(PatchError, match="custom loss_function"):
        patch_module(m, FLCE)


def test_refuses_lora_on_lm_head():
    peft = pytest.importorskip("peft")
    m = tiny_model("llama")
    pm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["lm_head"]))
    base = pm.get_base_model()
    reason = get_op(FLCE).check(base, build_index(base).infos[""], get_op(FLCE).default_flags())
    assert reason and "adapter" in reason


def test_host_is_the_causal_lm_root():
    m = tiny_model("qwen3")
    idx = build_index(m)
    op = get_op(FLCE)
    assert op.host(idx.get("lm_head"), idx) == ""
    assert get_op(CE).host(idx.get("lm_head"), idx) == ""


def test_forward_shape_of_the_shipped_families():
    from ..families import FAMILIES as ALL
    for fam in ALL:
        shape = causal_lm.forward_shape(type(tiny_model(fam)))
        assert shape.reason is None, (fam, shape.reason)
        assert {"loss", "logits"}.isdisjoint(shape.output_fields)

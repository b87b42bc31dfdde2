"""fused_linear_cross_entropy on causal LMs whose forward is not Llama's (issue 25): a decoder body
under the base_model_prefix (GPT-2 / Bloom / Falcon: ``transformer``, GPT-NeoX: ``gpt_neox``) called
with ``input_ids`` by position, OPT's ``self.model.decoder``, XGLM's ``pad_token_id`` passed to the loss
(ForCausalLMLoss ignores it), the router-logits flag Doge and-s with ``config.is_moe`` and AFMoE passes
to its body without an aux loss.  Each: loss and gradients of the patched fp32 model against the
unpatched model run in float64, on fresh random inputs; and the cases that must be refused by name."""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch

from patchdsl.model.tiny import build, tiny_family_config
from patchdsl.model.forward import causal_lm
from patchdsl.ops import loss_path
from patchdsl.parity.reference import float64_mode
from patchdsl.planning.planner import plan
from patchdsl.runtime import PatchError, apply, patch_module

FLCE = "fused_linear_cross_entropy"

# model_type -> (the body path the forward calls, arguments it passes the body by position)
FAMILIES = {
    "gpt2": ("transformer", ["input_ids"]),
    "gpt_neox": ("gpt_neox", ["input_ids"]),
    "bloom": ("transformer", ["input_ids"]),
    "falcon": ("transformer", ["input_ids"]),
    "opt": ("model.decoder", []),
    "xglm": ("model", []),
    "doge": ("model", []),
    "afmoe": ("model", []),
}


# the families again with their MoE router loss on (Doge's experts and its aux loss; the flag is held back
# from the body in transformers 5.17, given to it in 5.24): case id -> (family, config overrides)
CASES = {**{f: (f, {}) for f in FAMILIES},
         "doge+router_loss": ("doge", {"is_moe": True, "output_router_logits": True})}


def _config(family, **over):
    cfg = tiny_family_config(family)
    for k, v in over.items():
        setattr(cfg, k, v)
    for k, v in cfg.to_dict().items():          # no dropout: the float64 reference draws no masks
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k):
            setattr(cfg, k, 0.0)
    return cfg


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_loss_and_grads_match_the_float64_forward(case):
    family, over = CASES[case]
    cfg = _config(family, **over)
    try:
        model = build(cfg)
    except Exception as e:          # a family this transformers cannot build at its tiny size
        pytest.skip(f"{family} does not build: {e}")
    if over:
        try:                        # transformers 5.17's Doge with is_moe on fails in its own decoder layer
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 3, dtype=torch.long), labels=torch.zeros(1, 3, dtype=torch.long))
        except Exception as e:
            pytest.skip(f"{case}: the unpatched model's own forward fails in this transformers: {e}")
    body, positional = FAMILIES[family]
    shape = causal_lm.forward_shape(type(model))
    assert shape.reason is None, shape.reason
    assert (shape.body, shape.body_args) == (body, positional)
    ref = copy.deepcopy(model).double().train()
    pat = model.train()
    h = apply(plan(f"lm_head: Linear -> {FLCE}", pat), pat, strict=True)
    assert h.patched == ["lm_head"]
    g = torch.Generator().manual_seed(hash(family) % 1000)
    vocab = model.lm_head.out_features
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    out = pat(input_ids=ids, labels=labels)
    assert out.logits is None                     # the fused loss: no logits materialised
    with float64_mode():                          # HF's loss upcasts with .float(): kept float64 here
        ref_out = ref(input_ids=ids, labels=labels)
        ref_out.loss.backward()
    assert ref_out.loss.dtype == torch.float64
    assert torch.allclose(out.loss.double(), ref_out.loss, rtol=1e-5, atol=1e-6), (out.loss, ref_out.loss)
    if over.get("output_router_logits"):             # the router loss was added, by both, equally
        assert torch.is_tensor(ref_out.aux_loss) and torch.is_tensor(out.aux_loss) and ref_out.aux_loss > 0
        assert torch.allclose(out.aux_loss.double(), ref_out.aux_loss, rtol=1e-5, atol=1e-7)
    out.loss.backward()
    gp, gr = _grads(pat), _grads(ref)
    assert gp.keys() == gr.keys() and gr
    for n, r in gr.items():
        assert torch.allclose(gp[n].double(), r, rtol=1e-3, atol=1e-6), (n, (gp[n].double() - r).abs().max().item())
    # eval / no labels: the original forward, logits as HF's
    pat.eval()
    with torch.no_grad():
        assert pat(input_ids=ids).logits is not None
    h.undo()
    assert "forward" not in pat.__dict__


def _doge_forward_facts():
    """(the config flags Doge's forward and-s to output_router_logits, whether it passes the flag to its
    body), read from the installed forward's text: transformers 5.24 resolves `(...) and
    self.config.is_moe` and passes it on; 5.17 resolves it without is_moe and calls the body without it."""
    import inspect

    from transformers.models.doge.modeling_doge import DogeForCausalLM

    src = inspect.getsource(DogeForCausalLM.forward)
    resolved = src[src.index("output_router_logits = ("):src.index("outputs")]
    return (["is_moe"] if "self.config.is_moe" in resolved else []), "output_router_logits=output_router_logits" in src


def test_doge_router_flag_is_resolved_as_its_forward_resolves_it():
    """(output_router_logits or config's) [and config.is_moe]: given to the body where the forward gives
    it (with is_moe off, False), else held back for the aux loss alone, as the forward holds it."""
    from patchdsl.ops.loss_path.labels_loss import resolve_router_flag

    ands, to_body = _doge_forward_facts()
    model = build(_config("doge"))
    shape = causal_lm.forward_shape(type(model))
    assert shape.reason is None, shape.reason
    assert (shape.router_flag, shape.router_flag_to_body) == (ands, to_body)
    for is_moe in (False, True):
        for cfg_flag in (False, True):
            for asked in (None, False, True):
                model.config.is_moe, model.config.output_router_logits = is_moe, cfg_flag
                a = {"output_router_logits": asked}
                held = resolve_router_flag(model, shape, a, {})
                want = (asked if asked is not None else cfg_flag) and (is_moe or not ands)
                if to_body:
                    assert held == {} and a["output_router_logits"] == want
                else:
                    assert held == {"output_router_logits": want} and "output_router_logits" not in a


_GPT2_VARIANT = """
import torch
from transformers import GPT2LMHeadModel
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions


class Variant(GPT2LMHeadModel):
    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        {pre}
        outputs = self.transformer({body_args}attention_mask=attention_mask, **kwargs)
        {twice}
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        {head}
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, {loss_kw}**kwargs)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)
"""

_SOFTCAP = ("logits = logits / self.final_logit_softcapping\n        logits = torch.tanh(logits)\n"
            "        logits = logits * self.final_logit_softcapping")

# A variant of GPT-2's forward (body under `transformer`) -> None (fused, loss as HF's) or the refusal.
VARIANTS = {
    "plain": (dict(), None),
    "a step after the head": (dict(head="logits = logits * 2.0"), r"computes `logits = logits \* 2\.0`"),
    "the body twice": (dict(twice="outputs = self.transformer(input_ids, attention_mask=attention_mask, **kwargs)"),
                       r"calls self\.transformer 2 times"),
    "not its own argument by position": (dict(body_args="input_ids + 1, "), r"passes input_ids \+ 1 to self\.transformer by position"),
    "a loss argument ForCausalLMLoss reads": (dict(loss_kw="ignore_index=self.config.pad_token_id, "),
                                               r"reads config\.pad_token_id"),
    "a loss argument it ignores": (dict(loss_kw="pad_token_id=self.config.pad_token_id, "), None),
    # Mistral Large 4's softcap (an attribute set from the text config), applied with no None check
    "an unguarded softcap": (dict(head=_SOFTCAP, cap=0.05), None),
    "an unguarded softcap that is None": (dict(head=_SOFTCAP, cap=None), r"softcaps by it unconditionally"),
    "a router flag not resolved the known way": (
        dict(pre="output_router_logits = self.config.output_router_logits or False"),
        r"reads config\.output_router_logits"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_gpt2_style_forward_is_fused_or_refused_by_name(name, tmp_path, monkeypatch):
    parts, expected = VARIANTS[name]
    parts = dict(parts)
    cap = parts.pop("cap", "unset")
    fill = {"pre": "pass", "body_args": "input_ids, ", "twice": "pass", "head": "pass", "loss_kw": "", **parts}
    path = tmp_path / "gpt2_variant.py"
    path.write_text(_GPT2_VARIANT.format(**fill))
    spec = importlib.util.spec_from_file_location(f"gpt2_variant_{abs(hash(name))}", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    cfg = _config("gpt2")
    cfg.output_router_logits = False
    torch.manual_seed(0)
    ref = mod.Variant(cfg).train()
    if cap != "unset":
        ref.final_logit_softcapping = cap
    pat = copy.deepcopy(ref)
    causal_lm._SHAPES.clear()
    if expected is not None:
        with pytest.raises(PatchError, match=expected):
            patch_module(pat, FLCE)
        return
    patch_module(pat, FLCE)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    out, ref_out = pat(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert out.logits is None and torch.allclose(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,why", [
    ("roberta", r"RobertaLMHead, not an nn\.Linear: it transforms the hidden states \(dense, layer_norm\) "
                r"before its vocabulary projection decoder"),
    ("bert-generation", r"BertGenerationOnlyLMHead wrapping its vocabulary projection decoder"),
    ("modernbert-decoder", r"whose output is not the vocabulary"),
])
def test_an_lm_head_that_is_not_linear_is_refused_with_its_structure(family, why):
    import re

    from patchdsl.planning.suggestion import suggest

    model = build(_config(family))
    s = suggest(model, dtypes=("fp32",))
    assert re.search(why, s.text), s.text


def test_a_forward_computing_its_own_loss_is_refused_by_name():
    model = build(_config("cpmant"))
    with pytest.raises(PatchError, match=r"does not call self\.lm_head\( and self\.loss_function\("):
        patch_module(model, FLCE)


def test_float64_reference_keeps_a_fill_beyond_float32():
    """XGLM's attention fills with finfo(float64).min under the float64 reference: it stays float64."""
    with float64_mode():
        w = torch.zeros(2, dtype=torch.float64)
        t = torch.full((), torch.finfo(w.dtype).min)
    assert t.dtype == torch.float64 and t.item() == torch.finfo(torch.float64).min
    with float64_mode():
        assert torch.full((), 1.5).dtype == torch.get_default_dtype()      # an ordinary fill is untouched

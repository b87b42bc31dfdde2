"""The causal-LM loss path shared by ``fused_linear_cross_entropy``, ``fused_cross_entropy``,
``fused_linear_logprobs`` (its forward: :func:`make_logprobs_forward`) and ``fused_linear_jsd``
(its forward: :func:`make_jsd_forward`).

Both ops are selected on ``lm_head`` but act on the causal LM that owns it (the *host*: the
nearest ancestor with the ``CausalLM`` kind, the root ``""`` for Hugging Face models).

* ``fused_linear_cross_entropy`` replaces the host's ``forward`` (on the instance) with one that,
  when training with labels, calls ``self.model(...)`` with every argument the original forward
  passes, slices the hidden states by ``logits_to_keep`` as the original does, and computes the
  loss from the hidden states and ``lm_head``'s weight (read at call time) without materialising
  the logits.  It returns the original output class with ``loss`` set and ``logits=None``.  In
  eval mode, under ``no_grad``, or without labels it calls the original forward unchanged.
* ``fused_cross_entropy`` replaces only the loss function: Hugging Face's ``PreTrainedModel``
  has a ``loss_function`` property whose setter stores ``_loss_function`` on the instance, so the
  op sets that attribute (per instance, undone by the runtime).  Where a class has no such
  property, it patches the forward like the loss path above but computes the logits with
  ``self.lm_head`` (so they are returned) and the loss with the fused kernel.

Semantics follow ``transformers.loss.loss_utils.ForCausalLMLoss``: labels shifted left by one
with ``ignore_index`` padding at the end (or ``shift_labels`` used as given), fp32 loss math,
``sum / num_items_in_batch`` when that is given, else the mean over labels that are not ignored
(all ignored: NaN, as HF; ``num_items_in_batch=0``: inf/NaN, as HF), labels of a dtype torch's
cross_entropy refuses are refused, and a label out of bounds raises IndexError on the CPU and
trips a device-side assert on the GPU (``patchdsl/codegen/labels.py``).  One documented
difference: a call with ``shift_labels`` but no ``labels`` gets a loss (HF computes one only when
``labels`` is given).

What the forward does between the decoder body's last hidden state and the loss is read from its
source (:func:`head_transform`, :func:`_read_head`): slicing by ``logits_to_keep``, dtype casts, the lm_head call, and the
scalings of :data:`KNOWN_SCALARS` / :data:`KNOWN_SOFTCAPS` (Granite's ``logits_scaling``,
Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``, MiniCPM3's hidden-state scaling,
Gemma's ``final_logit_softcapping``, ...) are reproduced by the fused loss; any other statement
that computes the logits, the hidden states they come from or the loss refuses the site, naming it.

What a host must look like (checked, one-line refusal otherwise): ``self.model``, a plain
``nn.Linear`` ``lm_head`` (PEFT's ModulesToSaveWrapper is unwrapped; a LoRA-wrapped lm_head is
refused because its delta lives in its forward), the standard ``ForCausalLMLoss``, and a forward
whose source calls ``self.lm_head(`` and ``self.loss_function(``, passes its own arguments through
to ``self.model`` by name, and reads nothing else from ``self`` or ``self.config`` than what the
fused loss reproduces (vocab_size and the scalings of :data:`KNOWN_SCALARS` / :data:`KNOWN_SOFTCAPS`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any, Callable, Mapping

from .base import ModuleInfo
from .common import signature_binder
from .common import linear_like, unwrap

# What the patched forward may see the original forward read from ``self`` / ``self.config``.
# The scalars a causal LM's forward may scale by between its decoder body and its loss (as source
# text), each with the config attribute it mirrors (for messages; the value is read from the live
# model at plan and install time).  Whether it multiplies or divides, and the logits or the
# hidden states, is read from the forward's source (_read_head): HyperCLOVAX multiplies by the
# `logits_scaling` Granite divides by.
KNOWN_SCALARS = {
    "self.config.logits_scaling": "logits_scaling",           # Granite* (logits / s), MiniCPM3 (hidden / s), HyperCLOVAX (logits * s)
    "self.logit_scale": "logit_scale",                        # Cohere, Cohere2 (logits * s; set from config.logit_scale)
    "self.model.lm_head_multiplier": "lm_head_multiplier",    # Falcon-H1 (lm_head(h) * m; set from config.lm_head_multiplier)
    "self.config.logits_mup_width_multiplier": "logits_mup_width_multiplier",   # Inkling (hidden / m)
}
# tanh softcapping cap * tanh(logits / cap), skipped when the value is None
KNOWN_SOFTCAPS = {
    "self.config.final_logit_softcapping": "final_logit_softcapping",   # Gemma 2/3/3n/4, VaultGemma, NanoChat, Beam
    "self.config.logits_soft_cap": "logits_soft_cap",                   # RecurrentGemma
}
SELF_ATTRS = {"model", "lm_head", "loss_function", "config", "vocab_size", "training", "logit_scale"}
CONFIG_ATTRS = {"vocab_size", "final_logit_softcapping", "logits_scaling", "use_return_dict", "return_dict",
                "logits_soft_cap", "logits_mup_width_multiplier",
                "output_attentions", "output_hidden_states", "use_cache",
                # read only for warnings by some transformers versions' forwards
                "_attn_implementation", "rope_scaling", "original_max_position_embeddings"}
SUPPORTED_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")


# --------------------------------------------------------------------------- planning time
def causal_lm_host(info: ModuleInfo, index: Any) -> str:
    """Path of the nearest module (``info`` itself or an ancestor) with the CausalLM kind."""
    if "CausalLM" in info.kinds:
        return info.path
    if index is not None:
        for anc in index.ancestors(info.path):
            if "CausalLM" in anc.kinds:
                return anc.path
    return info.path


def lm_head_misfit(op: str, info: ModuleInfo, index: Any) -> str | None:
    """None when ``info`` is the lm_head of a causal LM (the loss ops' only home), else why not."""
    host = causal_lm_host(info, index)
    hinfo = index.infos.get(host) if index is not None else None
    if hinfo is None or "CausalLM" not in hinfo.kinds:
        return f"{op} fits only the lm_head of a causal LM, and no causal LM holds this module"
    if info.path != (f"{host}.lm_head" if host else "lm_head"):
        return f"{op} fits only the causal LM's lm_head"
    return None


def vocab_of(info: ModuleInfo) -> int:
    f = info.facts("CausalLM")
    if f:
        return int(f["vocab"])
    return int(info.facts("Linear")["out_features"])


def hidden_of(info: ModuleInfo) -> int:
    f = info.facts("CausalLM")
    if f:
        return int(f["hidden"])
    return int(info.facts("Linear")["in_features"])


def resolve_scaling(facts: Mapping[str, Any]) -> float | None:
    """The divisor of the logits the forward applies (Granite's logits_scaling); None when absent or 1."""
    v = facts.get("logits_scaling") if facts else None
    if v is None or float(v) == 1.0:
        return None
    return float(v)


def resolve_multiplier(facts: Mapping[str, Any]) -> float | None:
    """The multiplier of the logits the forward applies (Cohere's logit_scale, Falcon-H1's
    lm_head_multiplier); None when absent or 1."""
    v = facts.get("logit_multiplier") if facts else None
    if v is None or float(v) == 1.0:
        return None
    return float(v)


def transforms_logits(facts: Mapping[str, Any]) -> str | None:
    """What the model's forward does to its logits per the CausalLM facts (for the refusals of ops
    that take the logits as they are), or None when nothing."""
    parts = []
    if facts and facts.get("softcap"):
        parts.append(f"softcapping {facts['softcap']:g}")
    if resolve_multiplier(facts):
        parts.append(f"a multiplier {facts['logit_multiplier']:g}")
    if resolve_scaling(facts):
        parts.append(f"a divisor {facts['logits_scaling']:g}")
    return " and ".join(parts) or None


def resolve_softcap(flags: Mapping[str, Any], facts: Mapping[str, Any]) -> float | None:
    """softcap flag: auto = the config's final_logit_softcapping, none = off, a number = that."""
    v = flags.get("softcap", "auto")
    if v == "auto":
        v = facts.get("softcap") if facts else None
    if v is None or v == 0:
        return None
    return float(v)


# --------------------------------------------------------------------------- the host's forward
class ForwardShape:
    """What the host class's forward does, read from its source (no execution)."""

    def __init__(self, cls: type):
        self.cls = cls
        self.reason: str | None = None
        self.func = inspect.unwrap(cls.forward)
        self.sig = inspect.signature(self.func)
        self.var_kw = next((p.name for p in self.sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        self.output_cls: Any = None
        # what the forward does between the body's hidden states and the loss: ("hidden" | "logits",
        # "mul" | "div", source) and ("logits", "softcap", source), in order (see _read_head)
        self.steps: list[tuple[str, str, str]] = []
        try:
            src = textwrap.dedent(inspect.getsource(self.func))
        except (OSError, TypeError):
            self.reason = f"the source of {cls.__name__}.forward is not available to check"
            return
        if "self.lm_head(" not in src or "self.loss_function(" not in src:
            self.reason = (f"{cls.__name__}.forward does not call self.lm_head( and self.loss_function(; "
                           "its loss cannot be reproduced")
            return
        tree = ast.parse(src)
        # MoE (issue 24): the auxiliary load-balancing loss block, replayed by the fused forward
        self.aux, why = read_router_loss(tree.body[0], self.func.__globals__, cls.__name__)
        self.reason = why or self._analyse(tree) or self._head(tree)

    @property
    def applies_softcap(self) -> bool:
        return any(k == "softcap" for _, k, _ in self.steps)

    def _head(self, tree: ast.Module) -> str | None:
        """Read the steps between the decoder body and the loss into ``self.steps``; the reason
        when one of them is not a step the fused loss reproduces."""
        steps, why = _read_head(tree.body[0], self.cls.__name__, self.aux["var"] if self.aux else None)
        self.steps = steps
        return why

    def _analyse(self, tree: ast.Module) -> str | None:
        name = self.cls.__name__
        fn = tree.body[0]
        params = [p for p in self.sig.parameters if p != "self" and self.sig.parameters[p].kind not in
                  (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
        if "labels" not in params:
            return f"{name}.forward has no 'labels' argument"
        model_calls = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr not in SELF_ATTRS and not (self.aux and node.attr in MOE_SELF_ATTRS):
                    return f"{name}.forward uses self.{node.attr}, which the fused loss does not reproduce"
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                    and node.value.attr == "config" and node.attr not in CONFIG_ATTRS
                    and not (self.aux and node.attr in MOE_CONFIG_ATTRS)):
                return f"{name}.forward reads config.{node.attr}, which the fused loss does not reproduce"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                    and node.func.attr == "model"):
                model_calls.append(node)
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                self.output_cls = self.func.__globals__.get(node.value.func.id)
        if len(model_calls) != 1:
            return f"{name}.forward calls self.model {len(model_calls)} times (expected once)"
        call = model_calls[0]
        if call.args:
            return f"{name}.forward passes positional arguments to self.model"
        passed = set()
        for kw in call.keywords:
            if kw.arg is None:
                if not (isinstance(kw.value, ast.Name) and kw.value.id == self.var_kw):
                    return f"{name}.forward passes **{ast.unparse(kw.value)} to self.model"
                continue
            if not (isinstance(kw.value, ast.Name) and kw.value.id == kw.arg):
                return f"{name}.forward passes {kw.arg}={ast.unparse(kw.value)} to self.model (not its own argument)"
            passed.add(kw.arg)
        expected = set(params) - {"labels", "logits_to_keep", "return_dict"}
        passed.discard("return_dict")
        if passed != expected:
            diff = sorted(passed ^ expected)
            return f"{name}.forward does not pass its arguments through to self.model unchanged ({', '.join(diff)})"
        if self.output_cls is None:
            return f"{name}.forward does not return an output object the fused loss can rebuild"
        try:
            import dataclasses
            fields = {f.name for f in dataclasses.fields(self.output_cls)}
        except TypeError:
            return f"{name}.forward returns {getattr(self.output_cls, '__name__', self.output_cls)}, not a ModelOutput"
        if not {"loss", "logits"} <= fields:
            return f"{name}.forward returns {self.output_cls.__name__} without loss/logits fields"
        self.output_fields = [f for f in fields if f not in ("loss", "logits")]
        return None


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def _strip_casts(e: ast.expr) -> ast.expr:
    """``x.float()`` / ``x.to(...)`` / ``x.contiguous()`` -> ``x`` (the loss is fp32 math anyway)."""
    while (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute)
           and e.func.attr in ("float", "to", "contiguous")):
        e = e.func.value
    return e


def _is_hidden(e: ast.expr) -> bool:
    """``hidden_states`` or ``hidden_states[:, slice_indices, :]`` (HF's logits_to_keep slicing)."""
    e = _strip_casts(e)
    if isinstance(e, ast.Name) and e.id == "hidden_states":
        return True
    return (isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name) and e.value.id == "hidden_states"
            and _src(e.slice).replace(" ", "") in ("(:,slice_indices,:)", ":,slice_indices,:"))


def _is_body_output(e: ast.expr) -> bool:
    """``outputs.last_hidden_state`` / ``outputs[0]`` (any name), or that sliced by logits_to_keep."""
    e = _strip_casts(e)
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "slice_logits_to_keep" and e.args:
        e = _strip_casts(e.args[0])
    if isinstance(e, ast.Attribute) and e.attr == "last_hidden_state" and isinstance(e.value, ast.Name):
        return True
    return (isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name) and isinstance(e.slice, ast.Constant)
            and e.slice.value == 0)


def _scale_of(e: ast.expr, aliases: Mapping[str, str]) -> tuple[str, ast.expr, str] | None:
    """``X * S`` / ``X / S`` (``S * X`` too) with S a known scalar -> ("mul" | "div", X, source of S)."""
    e = _strip_casts(e)
    if not isinstance(e, ast.BinOp) or not isinstance(e.op, (ast.Mult, ast.Div)):
        return None
    for x, sc in ((e.left, e.right), (e.right, e.left)) if isinstance(e.op, ast.Mult) else ((e.left, e.right),):
        src = aliases.get(sc.id, "") if isinstance(sc, ast.Name) else _src(_strip_casts(sc))
        if src in KNOWN_SCALARS or src in KNOWN_SOFTCAPS:
            return ("mul" if isinstance(e.op, ast.Mult) else "div"), x, src
    return None


def _is_tanh(e: ast.expr) -> ast.expr | None:
    e = _strip_casts(e)
    if isinstance(e, ast.Call) and _src(e.func) in ("torch.tanh", "nn.functional.tanh", "F.tanh",
                                                    "torch.nn.functional.tanh") and len(e.args) == 1:
        return e.args[0]
    return None


def _read_head(fn: ast.AST, name: str, aux_var: str | None = None) -> tuple[list[tuple[str, str, str]], str | None]:
    """The steps of ``fn`` (a causal LM's forward) from its body's output to its loss.

    Every assignment to ``hidden_states``, to the variable the lm_head call is assigned to and to
    ``loss`` after the ``self.model(...)`` call must be one of: the body's last hidden state,
    HF's logits_to_keep slicing, ``lm_head(hidden_states)`` (a dtype cast around it is fine), a
    multiplication or division by a known scalar, the known tanh softcapping, ``loss = None`` and
    ``loss = self.loss_function(<logits>, ...)``; anything else is the reason returned.
    """
    body_line = min((n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and _src(n.func) == "self.model"),
                    default=None)
    if body_line is None:
        return [], f"{name}.forward does not call self.model"
    stmts = sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                    and n.lineno > body_line), key=lambda n: (n.lineno, n.col_offset))
    head = next((n for n in stmts if any(isinstance(c, ast.Call) and _src(c.func) == "self.lm_head"
                                         for c in ast.walk(n.value))), None)
    if head is None or not isinstance(head, ast.Assign) or len(head.targets) != 1 \
            or not isinstance(head.targets[0], ast.Name):
        return [], f"{name}.forward does not assign self.lm_head(...) to a variable"
    lv = head.targets[0].id
    steps: list[tuple[str, str, str]] = []
    aliases: dict[str, str] = {}
    pending_cap: str | None = None       # "logits / cap" seen, waiting for tanh and "* cap"
    stage = 0                            # 0 before the lm_head, 1 after it, 2 after the softcap

    def bad(n: ast.AST, why: str = "") -> tuple[list, str]:
        return steps, (f"{name}.forward computes `{_src(n)}` between its hidden states and its loss"
                       f"{why}, which the fused loss does not reproduce")

    for n in stmts:
        if isinstance(n, ast.AnnAssign):
            targets, value = [n.target], n.value
        elif isinstance(n, ast.AugAssign):
            targets, value = [n.target], ast.BinOp(left=n.target, op=n.op, right=n.value)
        else:
            targets, value = n.targets, n.value
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        touches = {lv, "hidden_states", "loss"}
        if any(not isinstance(t, ast.Name) and any(isinstance(x, ast.Name) and x.id in touches
                                                       for x in ast.walk(t)) for t in targets):
            return bad(n)                          # logits[...] = ..., hidden_states.x = ...
        if len(names) == 1 and value is not None and _src(value) in set(KNOWN_SOFTCAPS) | set(KNOWN_SCALARS):
            aliases[names[0]] = _src(value)        # cap = self.config.logits_soft_cap
            continue
        if not set(names) & touches or value is None:
            continue
        var = names[0]
        if var == "loss":
            if isinstance(value, ast.Constant) and value.value is None:
                continue
            if aux_var is not None and isinstance(n, ast.AugAssign) and _is_aux_term(n, aux_var):
                continue                           # the MoE router loss (read_router_loss), replayed

            if (isinstance(value, ast.Call) and _src(value.func) == "self.loss_function"):
                first = value.args[0] if value.args else next((k.value for k in value.keywords if k.arg == "logits"), None)
                if first is None or not (isinstance(_strip_casts(first), ast.Name) and _strip_casts(first).id == lv):
                    return bad(n, f" (the loss is not computed from `{lv}`)")
                continue
            return bad(n)
        if n is head:
            sc = _scale_of(value, aliases)
            inner = sc[1] if sc else value
            call = _strip_casts(inner)
            if not (isinstance(call, ast.Call) and _src(call.func) == "self.lm_head" and len(call.args) == 1
                    and not call.keywords and _is_hidden(call.args[0])):
                return bad(n)
            stage = 1
            if sc:
                if sc[2] in KNOWN_SOFTCAPS:
                    return bad(n)
                steps.append(("logits", sc[0], sc[2]))
            continue
        if var == "hidden_states":
            if stage:
                return bad(n, " after the lm_head")
            if _is_body_output(value) or (isinstance(value, ast.Call) and _src(value.func) == "slice_logits_to_keep"
                                          and value.args and _is_hidden(value.args[0])):
                continue
            sc = _scale_of(value, aliases)
            if sc and sc[2] in KNOWN_SCALARS and (_is_hidden(sc[1]) or _is_body_output(sc[1])):
                steps.append(("hidden", sc[0], sc[2]))
                continue
            return bad(n)
        # var == lv, after the head
        if stage == 0:
            return bad(n, " before the lm_head")
        t = _is_tanh(value)
        if pending_cap is not None:
            if t is not None and isinstance(_strip_casts(t), ast.Name) and _strip_casts(t).id == lv and pending_cap[1] == 0:
                pending_cap = (pending_cap[0], 1)
                continue
            sc = _scale_of(value, aliases)
            if pending_cap[1] == 1 and sc and sc[0] == "mul" and sc[2] == pending_cap[0] and _is_var(sc[1], lv):
                steps.append(("logits", "softcap", pending_cap[0]))
                pending_cap, stage = None, 2
                continue
            return bad(n, " (not the known tanh softcapping)")
        sc = _scale_of(value, aliases)
        if sc and sc[2] in KNOWN_SOFTCAPS:
            if sc[0] == "div" and _is_var(sc[1], lv):
                pending_cap = (sc[2], 0)           # logits / cap; tanh; * cap
                continue
            inner = _is_tanh(sc[1]) if sc[0] == "mul" else None
            isc = _scale_of(inner, aliases) if inner is not None else None
            if isc and isc[0] == "div" and isc[2] == sc[2] and _is_var(isc[1], lv):
                steps.append(("logits", "softcap", sc[2]))      # tanh(logits / cap) * cap
                stage = 2
                continue
            return bad(n)
        if sc and _is_var(sc[1], lv):
            if stage == 2:
                return bad(n, " after the softcapping")
            steps.append(("logits", sc[0], sc[2]))
            continue
        if _is_var(value, lv):
            continue                               # logits = logits.float()
        return bad(n)
    if pending_cap is not None:
        return steps, f"{name}.forward starts a softcapping by {pending_cap[0]} it does not finish"
    return steps, None


def _is_var(e: ast.expr, name: str) -> bool:
    e = _strip_casts(e)
    return isinstance(e, ast.Name) and e.id == name


# ---- MoE: the router's auxiliary load-balancing loss (issue 24) --------------------------------
# Every transformers MoE causal LM (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss, GraniteMoE, ...) ends its
# forward with
#     output_router_logits = output_router_logits if output_router_logits is not None else self.config.output_router_logits
#     ...
#     aux_loss = None
#     if output_router_logits:
#         aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
#         if labels is not None:
#             loss += self.router_aux_loss_coef * aux_loss.to(loss.device)
# The fused forward replays exactly that: the same function (the forward module's own), the same
# arguments read from the same places, the same coefficient.
MOE_SELF_ATTRS = {"router_aux_loss_coef", "num_experts", "num_experts_per_tok"}
MOE_CONFIG_ATTRS = {"output_router_logits"}
_AUX_ARGS = {"self.num_experts", "self.num_experts_per_tok", "attention_mask", "self.config.num_experts",
             "self.config.num_local_experts", "self.config.num_experts_per_tok"}


def read_router_loss(fn: ast.AST, globals_: Mapping[str, Any], name: str) -> tuple[dict | None, str | None]:
    """({"func", "args", "var"}, None) when ``fn`` adds the known MoE auxiliary loss (see above),
    (None, None) when it has no router loss, (None, reason) for one the fused loss cannot replay."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and n.args
             and isinstance(n.args[0], ast.Attribute) and n.args[0].attr == "router_logits"]
    if not calls:
        return None, None
    if len(calls) != 1 or not isinstance(calls[0].func, ast.Name):
        return None, f"{name}.forward computes its router loss in a way the fused loss does not replay"
    call = calls[0]
    args = [_src(a) for a in call.args[1:]]
    if call.keywords or any(a not in _AUX_ARGS for a in args):
        return None, (f"{name}.forward calls {_src(call.func)}({', '.join(_src(a) for a in call.args)}), "
                      "arguments the fused loss does not replay")
    func = globals_.get(call.func.id)
    if not callable(func):
        return None, f"{name}.forward's router loss function {call.func.id} cannot be found"
    assign = next((n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.value is call
                   and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)), None)
    if assign is None:
        return None, f"{name}.forward does not assign its router loss to a variable"
    var = assign.targets[0].id
    adds = [n for n in ast.walk(fn) if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)
            and n.target.id == "loss"]
    if len(adds) != 1 or not _is_aux_term(adds[0], var):
        return None, f"{name}.forward adds its router loss {var} to the loss in a way the fused loss does not replay"
    return {"func": func, "args": args, "var": var}, None


def _is_aux_term(n: ast.AugAssign, var: str) -> bool:
    """``loss += self.router_aux_loss_coef * <var>`` (a ``.to(...)`` on ``var`` allowed)."""
    v = n.value
    if not isinstance(n.op, ast.Add) or not isinstance(v, ast.BinOp) or not isinstance(v.op, ast.Mult):
        return False
    if _src(v.left) != "self.router_aux_loss_coef":
        return False
    r = v.right
    if isinstance(r, ast.Call) and isinstance(r.func, ast.Attribute) and r.func.attr == "to":
        r = r.func.value
    return isinstance(r, ast.Name) and r.id == var


def router_loss(host: Any, shape: "ForwardShape", outputs: Any, a: Mapping[str, Any]) -> Any:
    """The auxiliary loss the host's forward would add (None when output_router_logits is off)."""
    aux = shape.aux
    if not aux or not a.get("output_router_logits"):
        return None
    router_logits = outputs.get("router_logits") if hasattr(outputs, "get") else getattr(outputs, "router_logits", None)
    if router_logits is None:        # a body that recorded none (HF's function would return the int 0)
        return None
    args = [a.get(src) if not src.startswith("self.") else _read_value(host, src) for src in aux["args"]]
    return aux["func"](router_logits, *args)


def _read_value(host: Any, source: str) -> Any:
    """The value of ``self.a.b`` (``source``) on ``host``."""
    obj = host
    for part in source.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def head_transform(host: Any) -> tuple[dict[str, Any] | None, str | None]:
    """What ``host``'s forward does to its logits, as the loss kernels take it:
    ``{"softcap": cap or None, "logit_multiplier": m or None, "logits_scaling": s or None}``
    (z = softcap(lm_head(h) * m / s)), or (None, the reason it cannot be reproduced)."""
    import math

    shape = forward_shape(type(host))
    if shape.reason:
        return None, shape.reason
    mul, div, cap = 1.0, 1.0, None
    for where, kind, source in shape.steps:
        try:
            v = _read_value(host, source)
        except AttributeError:
            return None, f"{type(host).__name__}.forward reads {source}, which this model does not have"
        if v is None:
            if kind == "softcap":
                continue                       # `if ... is not None:` around it in every known forward
            return None, f"{source} is None ({type(host).__name__}.forward scales by it)"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None, (f"{source} is a {type(v).__name__}, not a number (a learned or per-token scale), "
                          "which the fused loss does not reproduce")
        v = float(v)
        if not math.isfinite(v) or v == 0:
            return None, f"{source} = {v!r}"
        if where == "hidden" and getattr(unwrap(host.lm_head), "bias", None) is not None:
            return None, (f"{type(host).__name__}.forward scales the hidden states by {source} before a biased "
                          "lm_head, which the fused loss does not reproduce")
        if kind == "softcap":
            cap = v
        elif kind == "mul":
            mul *= v
        else:
            div *= v
    return {"softcap": cap, "logit_multiplier": None if mul == 1.0 else mul,
            "logits_scaling": None if div == 1.0 else div}, None


_SHAPES: dict[type, ForwardShape] = {}


def forward_shape(cls: type) -> ForwardShape:
    s = _SHAPES.get(cls)
    if s is None:
        s = _SHAPES[cls] = ForwardShape(cls)
    return s


def loss_function_settable(cls: type) -> bool:
    """True when ``cls.loss_function`` is a property whose setter stores ``_loss_function``."""
    prop = inspect.getattr_static(cls, "loss_function", None)
    if not isinstance(prop, property) or prop.fset is None or prop.fget is None:
        return False
    try:
        return "_loss_function" in inspect.getsource(prop.fset) and "_loss_function" in inspect.getsource(prop.fget)
    except (OSError, TypeError):
        return False


def _standard_loss(host: Any) -> str | None:
    if "_loss_function" in getattr(host, "__dict__", {}):
        return "the model has a custom loss_function set on it"
    try:
        fn = host.loss_function
    except Exception as e:  # pragma: no cover - exotic models
        return f"its loss_function cannot be read ({e})"
    if getattr(fn, "__name__", "") != "ForCausalLMLoss":
        return f"its loss_function is {getattr(fn, '__name__', fn)!r}, not ForCausalLMLoss"
    return None


def host_reason(host: Any, info: ModuleInfo, flags: Mapping[str, Any], op: str) -> str | None:
    """Why the live causal LM ``host`` cannot take ``op`` (None if it can)."""
    import torch

    if not hasattr(host, "lm_head") or not hasattr(host, "model") or getattr(host, "config", None) is None:
        return "not a causal LM (needs self.model, self.lm_head and self.config)"
    lm = unwrap(host.lm_head)
    if not isinstance(lm, torch.nn.Linear):
        if linear_like(lm) is not None:
            return "lm_head is wrapped by an adapter (e.g. LoRA) whose delta the fused loss would miss"
        return f"lm_head is a {type(lm).__name__}, not an nn.Linear"
    if str(lm.weight.dtype) not in SUPPORTED_DTYPES:
        return f"lm_head weight is {lm.weight.dtype}; the kernels support float32, bfloat16, float16"
    r = _standard_loss(host)
    if r:
        return r
    if op == "fused_cross_entropy" and loss_function_settable(type(host)):
        return None          # only the loss function is replaced; the forward stays HF's
    t, why = head_transform(host)
    if why:
        return why
    if op == "fused_linear_cross_entropy":      # (fused_cross_entropy's forward replays the steps: head_logits)
        facts = info.facts("CausalLM") if info is not None else {}
        want = t["softcap"]
        got = resolve_softcap(flags, {"softcap": want})
        if (want or None) != got:
            return (f"softcap={flags.get('softcap')} resolves to {got} but the forward applies "
                    f"{'softcapping ' + format(want, 'g') if want else 'no softcapping'}")
        # the kernels are specialised for the facts the plan read: they must be the live model's
        for k, resolve in (("logit_multiplier", resolve_multiplier), ("logits_scaling", resolve_scaling)):
            if facts and resolve(facts) != t[k]:
                return (f"the plan's kernels scale the logits by {k}={resolve(facts)} but the model's forward "
                        f"applies {k}={t[k]}: plan this model again")
    elif op in ("fused_linear_logprobs", "fused_linear_jsd"):
        what = transforms_logits(t)
        if what:
            return f"the forward transforms the logits ({what}), which {op} does not reproduce"
        if forward_shape(type(host)).aux:
            return (f"the forward adds the MoE router's auxiliary loss (output_router_logits), which {op} does "
                    "not reproduce; use fused_linear_cross_entropy")
    return None


def require_host(host: Any, info: ModuleInfo, flags: Mapping[str, Any], op: str) -> None:
    """Raise ValueError with :func:`host_reason` when ``host`` cannot take ``op`` (install time)."""
    reason = host_reason(host, info, flags, op)
    if reason:
        raise ValueError(f"refused {op} on {type(host).__name__}: {reason}")


# --------------------------------------------------------------------------- sharded lm_head
def head_gather(lm: Any) -> str | None:
    """Whether ``lm``'s weight is whole only inside ``lm``'s own call, and by whose doing.

    The fused loss runs in the causal LM's forward, outside ``lm_head``'s.  That is fine when the
    weight is a plain tensor, or when FSDP2 shards it as part of an enclosing unit (``fully_shard``
    on the causal LM gathers it before the LM's forward).  It is not when something gathers it
    only around ``lm_head``'s own forward:

    * ``"fsdp2"``: ``lm_head`` is an FSDP2 unit of its own (``fully_shard(model.lm_head)``);
    * ``"zero3"``: the weight is a DeepSpeed ZeRO-3 partition (``ds_status``/``ds_shape`` set),
      gathered by ZeRO-3's hooks on the module that owns it.

    Then the loss is computed by :func:`call_as_forward` inside ``lm_head``'s call.
    """
    # fully_shard swaps the module's class for a subclass of FSDPModule (no import of torch.distributed)
    if any(c.__name__ == "FSDPModule" for c in type(lm).__mro__):
        return "fsdp2"
    w = getattr(lm, "weight", None)
    if w is not None and hasattr(w, "ds_status") and hasattr(w, "ds_shape"):
        return "zero3"
    return None


def unsharded_reason(w: Any, name: str = "lm_head.weight", hint: str | None = None) -> str | None:
    """Why ``w`` (read where it should be whole) is not the whole weight; None when it is."""
    if hasattr(w, "ds_shape") and tuple(w.shape) != tuple(w.ds_shape):
        return (f"{name} is a DeepSpeed ZeRO-3 partition of shape {tuple(w.shape)} (whole: "
                f"{tuple(w.ds_shape)}) where it should have been gathered; "
                + (hint or "is lm_head called by ZeRO-3's hooks?"))
    if type(w).__name__ == "DTensor":
        return (f"{name} is a DTensor (sharded) where it should be whole; " + (hint or
                "shard with fully_shard per decoder layer and then the causal LM (or lm_head as its own "
                "unit): docs/distributed.md"))
    return None


def call_as_forward(module: Any, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` run as ``module``'s forward, through ``module(*args)``, so the hooks that make its
    parameters whole (FSDP2's unshard/reshard and pre-backward hooks, ZeRO-3's gather/release and
    gradient hooks) run around it exactly as around ``module``'s own forward."""
    had = "forward" in module.__dict__
    prev = module.__dict__.get("forward")
    module.__dict__["forward"] = fn
    try:
        return module(*args)
    finally:
        if had:
            module.__dict__["forward"] = prev
        else:
            del module.__dict__["forward"]


# --------------------------------------------------------------------------- runtime helpers
def shift_labels_of(labels: Any, ignore_index: int) -> Any:
    """HF's shift: pad one ignore_index on the right, drop the first label."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _run_body(self: Any, a: dict, extra: dict) -> tuple[Any, Any, Any, bool]:
    """Run the causal LM's decoder body (``self.model``) on the call's arguments once the loss path
    has taken the call: pops ``logits_to_keep`` and ``return_dict`` (the config's default unless the
    call gives one) and returns (the body's outputs, its last hidden state, logits_to_keep,
    return_dict)."""
    logits_to_keep = a.pop("logits_to_keep", 0)
    return_dict = getattr(self.config, "return_dict", True)
    rd = a.pop("return_dict", None) if "return_dict" in a else extra.pop("return_dict", None)
    if rd is not None:
        return_dict = rd
    outputs = self.model(**a, **extra)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    return outputs, hidden, logits_to_keep, return_dict


def _body_fields(outputs: Any, shape: Any) -> dict[str, Any]:
    """The fields of the model's output class (past_key_values, hidden_states, ...) taken from the
    decoder body's outputs, as the loss-path forwards return them beside the loss."""
    return {f: (outputs.get(f) if hasattr(outputs, "get") else getattr(outputs, f, None)) for f in shape.output_fields}


def slice_hidden(hidden: Any, logits_to_keep: Any) -> Any:
    """The slicing the HF forward applies before lm_head (int: last k, 0 = all; tensors)."""
    import torch

    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        if logits_to_keep == 0:
            return hidden
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


def head_logits(host: Any, hidden: Any, shape: ForwardShape) -> Any:
    """The logits as the original forward computes them from the (sliced) hidden states: its
    steps (:func:`head_transform`, :func:`_read_head`) replayed in order around ``host.lm_head``."""
    import torch

    for where, kind, source in shape.steps:
        if where == "hidden":
            v = _read_value(host, source)
            hidden = hidden * v if kind == "mul" else hidden / v
    logits = host.lm_head(hidden)
    for where, kind, source in shape.steps:
        if where != "logits":
            continue
        v = _read_value(host, source)
        if kind == "softcap":
            if v is not None:
                logits = torch.tanh(logits / v) * v
        else:
            logits = logits * v if kind == "mul" else logits / v
    return logits


def original_forward(host: Any) -> Callable:
    """``original(self, *args, **kwargs)``: what ``host`` ran before it was patched: an instance-level
    forward set earlier (accelerate's fp32 output wrapper, TRL's fused head) when there is one,
    else its class's forward."""
    prev = host.__dict__.get("forward")

    def original(self, *args, **kwargs):
        if prev is not None:
            return prev(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)

    return original


def make_forward(host: Any, kernels: Callable, flags: Mapping[str, Any], mode: str) -> Callable:
    """The replacement ``forward(self, *args, **kwargs)`` for the causal LM ``host``.

    ``mode="linear"``: fused linear cross entropy from the hidden states (logits=None).
    ``mode="logits"``: logits from ``self.lm_head`` (returned), loss by the fused cross entropy.
    """
    import torch

    shape = forward_shape(type(host))
    bind = signature_binder(shape.sig)     # traceable by Dynamo, unlike sig.bind
    var_kw = shape.var_kw
    original = original_forward(host)
    ignore = int(flags.get("ignore_index", -100))
    supported = {torch.float32, torch.bfloat16, torch.float16}

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return original(self, *args, **kwargs)
        try:
            a = bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)          # let the original raise its own error
        a.pop("self", None)
        extra = dict(a.pop(var_kw, {}) or {}) if var_kw else {}
        labels = a.get("labels")
        shift = extra.get("shift_labels")
        if labels is None and shift is None:
            return original(self, *args, **kwargs)
        if extra.get("ignore_index", ignore) != ignore:
            return original(self, *args, **kwargs)          # compiled for another ignore_index
        lm = unwrap(self.lm_head)
        if lm.weight.dtype not in supported:
            return original(self, *args, **kwargs)
        a.pop("labels", None)
        if shape.aux and a.get("output_router_logits") is None:     # as the original forward resolves it
            a["output_router_logits"] = self.config.output_router_logits
        outputs, hidden, logits_to_keep, return_dict = _run_body(self, a, extra)
        hidden = slice_hidden(hidden, logits_to_keep)
        if shift is None:
            shift = shift_labels_of(labels, ignore)
        shift = shift.to(hidden.device)
        num_items = extra.get("num_items_in_batch")
        if mode == "linear":
            logits = None
            dev = hidden.device.type
            autocast = torch.get_autocast_dtype(dev) if dev != "meta" and torch.is_autocast_enabled(dev) else None

            def fused(h, y, n):
                w, b = lm.weight, lm.bias                # read now: whole here, whoever shards them
                why = unsharded_reason(w)
                if why:
                    raise RuntimeError(f"fused_linear_cross_entropy: {why}")
                if autocast is not None:                 # lm_head(...) would run in the autocast dtype
                    w = w.to(autocast)
                    b = b.to(autocast) if b is not None else None
                return kernels(w.dtype).linear_cross_entropy(h, w, b, y, n)

            # the weight whole only inside a module's own call (an FSDP2 unit, possibly PEFT's wrapper
            # around lm_head; a ZeRO-3 partition): run the loss as that module's forward
            owner = self.lm_head if head_gather(self.lm_head) == "fsdp2" else lm
            if head_gather(owner):
                loss = call_as_forward(owner, fused, hidden, shift, num_items)
            else:
                loss = fused(hidden, shift, num_items)
        else:
            logits = head_logits(self, hidden, shape)
            loss = kernels(logits.dtype).cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                                       num_items)
        rest = _body_fields(outputs, shape)
        aux_loss = router_loss(self, shape, outputs, a)
        if aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            rest["aux_loss"] = aux_loss
        out = shape.output_cls(loss=loss, logits=logits, **rest)
        return out if return_dict else out.to_tuple()

    forward.__doc__ = (f"{type(host).__name__}.forward with the fused {'linear ' if mode == 'linear' else ''}"
                       "cross-entropy loss when training with labels (patchdsl).")
    return forward


def make_loss_function(kernels: Callable, flags: Mapping[str, Any], original: Callable, vocab: int) -> Callable:
    """A drop-in for HF's ForCausalLMLoss computing the loss with the fused cross-entropy kernel."""
    import torch

    ignore = int(flags.get("ignore_index", -100))
    supported = {torch.float32, torch.bfloat16, torch.float16}

    def fused_causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=None,
                             shift_labels=None, **kwargs):
        if ((ignore_index is not None and ignore_index != ignore) or logits.shape[-1] != vocab
                or logits.dtype not in supported or (vocab_size is not None and vocab_size != vocab)):
            kw = dict(kwargs)
            if ignore_index is not None:
                kw["ignore_index"] = ignore_index
            return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            shift_labels=shift_labels, **kw)
        if shift_labels is None:
            shift_labels = shift_labels_of(labels, ignore)
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        return kernels(logits.dtype).cross_entropy(logits.reshape(-1, vocab), shift_labels, num_items_in_batch)

    return fused_causal_lm_loss


def install_forward(host: Any, kernels: Callable, flags: Mapping[str, Any], mode: str) -> list:
    return [(host, "forward", types.MethodType(make_forward(host, kernels, flags, mode), host))]


# --------------------------------------------------------------------------- per-token log-probs
_FUSED_OUTPUT: list = []

FUSED_FIELDS = ("loss", "log_probs", "entropy", "lse", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask",
                "aux_loss", "logits", "past_key_values", "hidden_states", "attentions")


def fused_output_cls() -> type:
    """The output of ``model(..., labels=..., fused_lm_head=True)`` on a model patched with
    ``fused_linear_logprobs``: TRL's ``FusedCausalLMOutput`` fields plus ``lse`` and the usual
    ``logits`` (None), ``past_key_values``, ``hidden_states``, ``attentions``.

    Every per-token field has the shape of the shifted labels ((batch, seq - 1), or (batch, seq)
    with ``shift_labels``) and is 0 where the label is ignored:
    ``log_probs`` log p(label), ``entropy`` H(p), ``lse`` logsumexp of the temperature-scaled
    logits (these three carry gradients); ``log_sum_sq_probs`` log sum p^2, ``mean_logits`` the
    mean temperature-scaled logit, ``is_top1`` whether the label is the argmax, ``label_mask``
    label != ignore_index (no gradient).  ``loss`` = -sum(log_probs) / num_items_in_batch (the
    number of labels that are not ignored when not given; NaN when all are ignored, as HF's loss).
    """
    if not _FUSED_OUTPUT:
        import dataclasses
        from typing import Optional

        import torch
        from transformers.utils import ModelOutput

        cls = dataclasses.make_dataclass(
            "FusedLogprobsOutput", [(f, Optional[Any], dataclasses.field(default=None)) for f in FUSED_FIELDS],
            bases=(ModelOutput,), namespace={"__module__": __name__, "__doc__": fused_output_cls.__doc__})
        del torch
        _FUSED_OUTPUT.append(cls)
    return _FUSED_OUTPUT[0]


def make_logprobs_forward(host: Any, kernels: Callable, flags: Mapping[str, Any]) -> Callable:
    """The replacement forward of ``fused_linear_logprobs`` (see its module docstring).

    ``fused_lm_head=True`` (train or eval, grad or not): run ``self.model`` with every other
    argument, slice by ``logits_to_keep`` as HF does, shift the labels (or take ``shift_labels``
    as given), and return :func:`fused_output_cls` from the generated kernels at the flag's
    temperature.  Training with labels and grad, without ``fused_lm_head``: the HF loss from the
    same kernels (temperature 1), the host's own output class with ``logits=None``.  Otherwise the
    original forward (an instance forward installed before, e.g. TRL's, is wrapped).
    """
    import torch

    shape = forward_shape(type(host))
    bind = signature_binder(shape.sig)     # traceable by Dynamo, unlike sig.bind
    var_kw = shape.var_kw
    original = original_forward(host)
    ignore = int(flags.get("ignore_index", -100))
    temperature = float(flags.get("temperature", 1.0))
    supported = {torch.float32, torch.bfloat16, torch.float16}
    output_cls = fused_output_cls()        # made now: a class created while Dynamo traces would break the graph

    def forward(self, *args, **kwargs):
        fused = bool(kwargs.get("fused_lm_head", False))
        if not fused and not (self.training and torch.is_grad_enabled()):
            return original(self, *args, **kwargs)
        kw = dict(kwargs)
        kw.pop("fused_lm_head", None)
        try:
            a = bind(self, *args, **kw)
        except TypeError:
            return original(self, *args, **kwargs)
        a.pop("self", None)
        extra = dict(a.pop(var_kw, {}) or {}) if var_kw else {}
        labels = a.get("labels")
        shift = extra.pop("shift_labels", None)
        num_items = extra.pop("num_items_in_batch", None)
        lm = unwrap(self.lm_head)
        if (labels is None and shift is None) or extra.get("ignore_index", ignore) != ignore \
                or lm.weight.dtype not in supported:
            if fused:
                raise ValueError("fused_lm_head=True needs labels (or shift_labels), ignore_index="
                                 f"{ignore} and a float32/bfloat16/float16 lm_head (patchdsl fused_linear_logprobs)")
            return original(self, *args, **kwargs)
        extra.pop("ignore_index", None)
        a.pop("labels", None)
        if fused:
            if "use_cache" in a:
                a["use_cache"] = False
            else:
                extra["use_cache"] = False
        outputs, hidden, logits_to_keep, return_dict = _run_body(self, a, extra)
        hidden = slice_hidden(hidden, logits_to_keep)
        if shift is None:
            hidden, targets = hidden[:, :-1], labels[..., 1:]
        else:
            targets = shift
        targets = targets.to(hidden.device)
        w, b = lm.weight, lm.bias
        dev = hidden.device.type
        if torch.is_autocast_enabled(dev):          # lm_head(...) would run in the autocast dtype
            dt = torch.get_autocast_dtype(dev)
            w = w.to(dt)
            b = b.to(dt) if b is not None else None
        mod = kernels(w.dtype)
        t = temperature if fused else 1.0
        lp, ent, lse, mean, lssq, top1 = mod.linear_logprobs(hidden, w, b, targets, t)
        mask = targets != ignore
        denom = mask.sum() if num_items is None else num_items     # all ignored: NaN (0 / 0), as HF
        loss = -lp.sum() / denom
        rest = _body_fields(outputs, shape)
        if fused:
            out = output_cls(loss=loss, log_probs=lp, entropy=ent, lse=lse, log_sum_sq_probs=lssq,
                             mean_logits=mean, is_top1=top1, label_mask=mask,
                             **{k: v for k, v in rest.items() if k in FUSED_FIELDS})
        else:
            out = shape.output_cls(loss=loss, logits=None, **rest)
        return out if return_dict else out.to_tuple()

    forward.__doc__ = (f"{type(host).__name__}.forward with fused per-token log-probs (patchdsl "
                       "fused_linear_logprobs): fused_lm_head=True returns them; a training call with labels "
                       "gets the loss from them.")
    return forward


# --------------------------------------------------------------------------- distillation (JSD)
JSD_KWARGS = ("teacher_hidden_states", "teacher_head", "distill_temperature")


def _teacher_weights(head: Any, where: str) -> tuple[Any, Any]:
    """(weight, bias) of the teacher head given at the call: an nn.Linear (PEFT's wrapper unwrapped)
    or a (vocab, hidden) weight tensor."""
    import torch

    if isinstance(head, torch.Tensor):
        return head, None
    lm = unwrap(head)
    if isinstance(lm, torch.nn.Linear):
        return lm.weight, lm.bias
    raise TypeError(f"{where}: teacher_head must be the teacher's lm_head (an nn.Linear) or its weight tensor, "
                    f"got {type(head).__name__}")


def reference_jsd(hidden: Any, w: Any, b: Any, h_t: Any, w_t: Any, b_t: Any, targets: Any, num_items: Any,
                  temperature: float, beta: float, ignore: int) -> Any:
    """The distillation loss from materialised logits in plain PyTorch (TRL's generalized_jsd_loss
    formula, fp32 math or wider): what verify's unpatched copies compute (``make_jsd_forward(host, None, ...)``)."""
    import math

    import torch
    import torch.nn.functional as F

    zs = F.linear(hidden, w, b)
    with torch.no_grad():
        zt = F.linear(h_t.to(w_t.dtype), w_t, b_t)
    wide = torch.promote_types(zs.dtype, torch.float32)
    s = (zs.to(wide) / temperature).log_softmax(-1)
    t = (zt.to(wide) / temperature).log_softmax(-1)
    if beta == 0:
        jsd = (t.exp() * (t - s)).sum(-1)
    elif beta == 1:
        jsd = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        jsd = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    if targets is None:
        mask = torch.ones(jsd.shape, dtype=torch.bool, device=jsd.device)
    else:
        mask = targets != ignore
    total = torch.where(mask, jsd, torch.zeros_like(jsd)).sum()
    den = mask.sum().clamp(min=1) if num_items is None else num_items
    return total / den


def make_jsd_forward(host: Any, kernels: Callable | None, flags: Mapping[str, Any], site: str = "lm_head") -> Callable:
    """The replacement forward of ``fused_linear_jsd`` (see :mod:`patchdsl.ops.linear_jsd`).

    A call with ``teacher_hidden_states`` (the teacher's last hidden state, after its final norm,
    (batch, seq, H_t)) and ``teacher_head`` (the teacher's lm_head or its weight): run
    ``self.model`` with every other argument, slice both hidden states by ``logits_to_keep`` as HF
    does, pair position t with ``labels[:, t + 1]`` (HF's shift; ``shift_labels`` is used as given;
    without labels every position counts) and return the host's output class with ``loss`` = the
    generalised JSD from the generated kernels and ``logits=None``, in training and in eval, with or
    without grad.  ``distill_temperature=`` overrides the flag's temperature for that call.  Any
    other call: the original forward.  Shape errors name the site and say what was expected.
    ``kernels=None``: the same call answered by :func:`reference_jsd` (verify's unpatched copies).
    """
    import torch

    shape = forward_shape(type(host))
    bind = signature_binder(shape.sig)
    var_kw = shape.var_kw
    original = original_forward(host)
    ignore = int(flags.get("ignore_index", -100))
    temperature = float(flags.get("temperature", 1.0))
    teacher_hidden = flags.get("teacher_hidden", "auto")
    beta = float(flags.get("beta", 0.5))
    supported = {torch.float32, torch.bfloat16, torch.float16}
    where = f"fused_linear_jsd on {site or '<model>'} ({type(host).__name__})"

    def forward(self, *args, **kwargs):
        if kwargs.get("teacher_hidden_states") is None and kwargs.get("teacher_head") is None:
            if "distill_temperature" in kwargs:
                raise ValueError(f"{where}: distill_temperature given without teacher_hidden_states and teacher_head")
            for k in JSD_KWARGS:
                kwargs.pop(k, None)
            return original(self, *args, **kwargs)
        kw = dict(kwargs)
        h_t = kw.pop("teacher_hidden_states", None)
        head = kw.pop("teacher_head", None)
        t = float(kw.pop("distill_temperature", temperature))
        if h_t is None or head is None:
            raise ValueError(f"{where}: give both teacher_hidden_states and teacher_head (got only "
                             f"{'teacher_head' if h_t is None else 'teacher_hidden_states'})")
        if not t > 0:
            raise ValueError(f"{where}: distill_temperature must be > 0, got {t}")
        a = bind(self, *args, **kw)
        a.pop("self", None)
        extra = dict(a.pop(var_kw, {}) or {}) if var_kw else {}
        labels = a.pop("labels", None)
        shift = extra.pop("shift_labels", None)
        num_items = extra.pop("num_items_in_batch", None)
        if extra.get("ignore_index", ignore) != ignore:
            raise ValueError(f"{where}: the kernels are specialised for ignore_index={ignore}, the call asks for "
                             f"{extra['ignore_index']}")
        extra.pop("ignore_index", None)
        lm = unwrap(self.lm_head)
        if kernels is not None and lm.weight.dtype not in supported:
            raise ValueError(f"{where}: the student lm_head weight is {lm.weight.dtype}; the kernels support "
                             "float32, bfloat16, float16")
        w_t, b_t = _teacher_weights(head, where)
        if w_t.dim() != 2 or w_t.shape[0] != lm.weight.shape[0]:
            raise ValueError(f"{where}: vocab mismatch: the teacher head has {tuple(w_t.shape)[0] if w_t.dim() else '?'} "
                             f"outputs, the student's lm_head {lm.weight.shape[0]}; teacher and student must share "
                             "one vocabulary (and its padded size)")
        if teacher_hidden != "auto" and w_t.shape[1] != int(teacher_hidden):
            raise ValueError(f"{where}: the teacher head takes hidden size {w_t.shape[1]}, but the spec says "
                             f"teacher_hidden={teacher_hidden}")
        if h_t.shape[-1] != w_t.shape[1]:
            raise ValueError(f"{where}: teacher_hidden_states have size {h_t.shape[-1]} in their last dimension, "
                             f"the teacher head expects {w_t.shape[1]} (pass the teacher's last hidden state, "
                             "after its final norm: teacher.model(...).last_hidden_state)")
        outputs, hidden, logits_to_keep, return_dict = _run_body(self, a, extra)
        if h_t.dim() != hidden.dim() or h_t.shape[:-1] != hidden.shape[:-1]:
            raise ValueError(f"{where}: teacher_hidden_states are {tuple(h_t.shape)} but the student's hidden states "
                             f"are {tuple(hidden.shape)}: run the teacher on the same input_ids")
        hidden = slice_hidden(hidden, logits_to_keep)
        h_t = slice_hidden(h_t, logits_to_keep)
        if shift is not None:
            targets = shift
        elif labels is not None:
            hidden, h_t, targets = hidden[:, :-1], h_t[:, :-1], labels[..., 1:]
        else:
            targets = None
        if targets is not None:
            targets = targets.to(hidden.device)
            if targets.shape != hidden.shape[:-1]:
                raise ValueError(f"{where}: labels give {tuple(targets.shape)} targets for hidden states "
                                 f"{tuple(hidden.shape)}")
        w, b = lm.weight, lm.bias
        dev = hidden.device.type
        if torch.is_autocast_enabled(dev):          # lm_head(...) would run in the autocast dtype
            dt = torch.get_autocast_dtype(dev)
            w, w_t = w.to(dt), w_t.to(dt)
            b = b.to(dt) if b is not None else None
            b_t = b_t.to(dt) if b_t is not None else None
        h_t = h_t.to(hidden.device)
        if kernels is None:
            loss = reference_jsd(hidden, w, b, h_t, w_t, b_t, targets, num_items, t, beta, ignore)
        else:
            loss = kernels(w.dtype).linear_jsd(hidden, w, b, h_t, w_t, b_t, targets, num_items, t)
        rest = _body_fields(outputs, shape)
        out = shape.output_cls(loss=loss, logits=None, **rest)
        return out if return_dict else out.to_tuple()

    forward.__doc__ = (f"{type(host).__name__}.forward with the fused distillation loss (patchdsl fused_linear_jsd): "
                       "teacher_hidden_states= and teacher_head= return loss = generalised JSD, logits=None.")
    forward._patchdsl_jsd = {"beta": float(flags.get("beta", 0.5)), "temperature": temperature, "ignore_index": ignore}
    return forward

"""What a causal LM's forward does between its decoder body and its loss, read from its source:
slicing by ``logits_to_keep``, casts, the lm_head call, the scalings of :data:`KNOWN_SCALARS` /
:data:`KNOWN_SOFTCAPS` and (mixture of experts) the router's auxiliary loss are reproduced; any other
step refuses the site, naming it (:func:`host_reason`)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Mapping

from ..info import ModuleInfo
from ..modules import linear_like, unwrap
from .logits import resolve_multiplier, resolve_scaling, resolve_softcap, transforms_logits
from .router_loss import (MOE_CONFIG_ATTRS, MOE_SELF_ATTRS, MOE_TEXT_CONFIG_READS, _is_aux_term, read_router_flag,
                          read_router_loss, router_config)
from .values import read_value

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
    "self.config.text_config.logits_scaling": "text_config.logits_scaling",     # HyperCLOVAX vision (logits * s)
}
# tanh softcapping cap * tanh(logits / cap), skipped when the value is None
KNOWN_SOFTCAPS = {
    "self.config.final_logit_softcapping": "final_logit_softcapping",   # Gemma 2/3/3n/4, VaultGemma, NanoChat, Beam
    # vision-language models: the language tower's config (PaliGemma in transformers 5.24)
    "self.config.text_config.final_logit_softcapping": "text_config.final_logit_softcapping",
    "getattr(self.config.get_text_config(), 'final_logit_softcapping', None)": "text_config.final_logit_softcapping",
    "self.config.logits_soft_cap": "logits_soft_cap",                   # RecurrentGemma
    # Mistral Large 4 (set from the text config's final_logit_softcapping; applied with no None check)
    "self.final_logit_softcapping": "text_config.final_logit_softcapping",
}
# softcaps a forward applies without an `is not None` guard: None there is an error of the original
# forward (a division by None), so the fused loss refuses rather than skip the softcapping
UNGUARDED_SOFTCAPS = {"self.final_logit_softcapping"}
SELF_ATTRS = {"model", "lm_head", "loss_function", "config", "vocab_size", "training", "logit_scale",
              "final_logit_softcapping"}
CONFIG_ATTRS = {"vocab_size", "final_logit_softcapping", "logits_scaling", "use_return_dict", "return_dict",
                "logits_soft_cap", "logits_mup_width_multiplier",
                "output_attentions", "output_hidden_states", "use_cache",
                # read only for warnings by some transformers versions' forwards
                "_attn_implementation", "rope_scaling", "original_max_position_embeddings"}
SUPPORTED_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")
# A vision-language model's forward (``...ForConditionalGeneration``) reads its language tower's config
# (``self.config.text_config.vocab_size``, ``self.config.get_text_config()``): these reads, and only
# these, are allowed (the values are checked against the live model: :func:`host_reason`).
TEXT_CONFIG_READS = {"self.config.text_config.vocab_size", "self.config.text_config.final_logit_softcapping",
                     "self.config.text_config.logits_scaling", "self.config.get_text_config()"}
# Arguments a vision-language forward passes to its body beside its own: ``labels=labels`` (Gemma 3 and
# PaliGemma in transformers 5.17 build their image-token attention mask from it) and a constant
# ``return_dict=True``; the fused forwards pass them the same way (:attr:`ForwardShape.body_labels`,
# :attr:`ForwardShape.body_consts`).
BODY_CONSTS = {"return_dict"}

# --------------------------------------------------------------------------- the host's forward
def body_roots(cls: type) -> tuple[str, ...]:
    """The attribute names a causal LM class may hold its decoder body under: ``model`` and its
    ``base_model_prefix`` (``transformer``: GPT-2, Bloom, Falcon, MPT ...; ``gpt_neox``; ``cpmant``)."""
    prefix = getattr(cls, "base_model_prefix", "") or ""
    return ("model",) + ((prefix,) if prefix.isidentifier() and prefix != "model" else ())


def body_path(cls: type) -> str | None:
    """The decoder body ``cls.forward`` calls, as a path from the host: ``self.<root>(`` for a root of
    :func:`body_roots`, else ``self.<root>.decoder(`` (OPT, whose base model wraps its decoder); None
    when its source calls neither (or cannot be read)."""
    try:
        src = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return None
    roots = body_roots(cls)
    for path in roots + tuple(f"{r}.decoder" for r in roots):
        if f"self.{path}(" in src:
            return path
    return None


def host_body(host: Any) -> Any:
    """The decoder body module the causal LM ``host``'s forward calls (None when it has none)."""
    path = forward_shape(type(host)).body
    obj = host
    for part in (path or "").split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if path else None


def looks_causal_lm(m: Any) -> bool:
    """``m`` holds an lm_head, a config and its decoder body (``model`` or its base_model_prefix)."""
    return (hasattr(m, "lm_head") and getattr(m, "config", None) is not None
            and any(isinstance(getattr(m, r, None), _module_type()) for r in body_roots(type(m))))


def _module_type() -> type:
    import torch

    return torch.nn.Module


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
        self.body_labels = False           # self.model(..., labels=labels, ...)
        self.body_consts: dict[str, Any] = {}   # self.model(..., return_dict=True, ...)
        self.vocab_source: str | None = None    # the loss_function's vocab_size argument (source)
        # the decoder body the forward calls, as a path from the host: "model" (Llama, ...), the
        # class's base_model_prefix ("transformer": GPT-2, Bloom, Falcon ...; "gpt_neox"), or that
        # module's decoder ("model.decoder": OPT); see body_path
        self.body = body_path(cls)
        self.body_args: list[str] = []     # arguments passed to the body by position (input_ids: GPT-2)
        try:
            src = textwrap.dedent(inspect.getsource(self.func))
        except (OSError, TypeError):
            self.reason = f"the source of {cls.__name__}.forward is not available to check"
            return
        if self.body is None:
            self.reason = (f"{cls.__name__}.forward calls neither self.model( nor its base model "
                           f"self.{getattr(cls, 'base_model_prefix', '') or 'model'}( (nor its .decoder)")
            return
        if "self.lm_head(" not in src or "self.loss_function(" not in src:
            self.reason = (f"{cls.__name__}.forward does not call self.lm_head( and self.loss_function(; "
                           "its loss cannot be reproduced")
            return
        tree = ast.parse(src)
        # MoE (issue 24): the auxiliary load-balancing loss block, replayed by the fused forward
        self.aux, why = read_router_loss(tree.body[0], self.func.__globals__, cls.__name__)
        # the router-logits flag as the forward resolves it (the call's, else the config's, and-ed with
        # config flags: Doge's `and self.config.is_moe`), passed to the body; None: not resolved there
        self.router_flag = read_router_flag(tree.body[0])
        self.router_config = router_config(tree.body[0])     # self.config, or a VL MoE's self.config.text_config
        # whether the forward passes that flag on to the body (True) or only reads it for its aux loss
        # (transformers 5.17's Doge: resolved, then the body called without it); set by _analyse
        self.router_flag_to_body = True
        self.reason = why or self._analyse(tree) or self._head(tree)

    @property
    def applies_softcap(self) -> bool:
        return any(k == "softcap" for _, k, _ in self.steps)

    def _head(self, tree: ast.Module) -> str | None:
        """Read the steps between the decoder body and the loss into ``self.steps``; the reason
        when one of them is not a step the fused loss reproduces."""
        steps, why = _read_head(tree.body[0], self.cls.__name__, self.aux["var"] if self.aux else None,
                                f"self.{self.body}")
        self.steps = steps
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and _src(n.func) == "self.loss_function":
                vs = next((k.value for k in n.keywords if k.arg == "vocab_size"),
                          n.args[2] if len(n.args) > 2 else None)
                self.vocab_source = _src(vs) if vs is not None else None
        return why

    def _analyse(self, tree: ast.Module) -> str | None:
        name = self.cls.__name__
        fn = tree.body[0]
        params = [p for p in self.sig.parameters if p != "self" and self.sig.parameters[p].kind not in
                  (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
        if "labels" not in params:
            return f"{name}.forward has no 'labels' argument"
        model_calls = []
        body_src = f"self.{self.body}"
        body_root = self.body.split(".")[0]
        parents = {c: p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
        ignored = _ignored_loss_kwargs(fn)
        for node in ast.walk(fn):
            if node in ignored:
                continue
            if (isinstance(node, ast.Attribute) and _src(node) in ("self.config.text_config", "self.config.get_text_config")):
                reads = TEXT_CONFIG_READS | (MOE_TEXT_CONFIG_READS if self.aux or self.router_flag is not None else set())
                outer = parents.get(node)
                while isinstance(outer, (ast.Attribute, ast.Call)) and _src(outer) not in reads \
                        and any(r.startswith(_src(outer)) for r in reads):
                    outer = parents.get(outer)
                if outer is None or _src(outer) not in reads:
                    what = _src(outer) if isinstance(outer, (ast.Attribute, ast.Call)) else _src(node)
                    return f"{name}.forward reads {what.replace('self.', '', 1)}, which the fused loss does not reproduce"
                continue
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr not in SELF_ATTRS and node.attr != body_root and not (self.aux and node.attr in MOE_SELF_ATTRS):
                    return f"{name}.forward uses self.{node.attr}, which the fused loss does not reproduce"
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                    and node.value.attr == "config" and node.attr not in CONFIG_ATTRS
                    and not (self.aux and node.attr in MOE_CONFIG_ATTRS)
                    and not (self.router_flag is not None
                             and node.attr in MOE_CONFIG_ATTRS | set(self.router_flag))):
                return f"{name}.forward reads config.{node.attr}, which the fused loss does not reproduce"
            if isinstance(node, ast.Call) and _src(node.func) == body_src:
                model_calls.append(node)
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                self.output_cls = self.func.__globals__.get(node.value.func.id)
        if len(model_calls) != 1:
            return f"{name}.forward calls {body_src} {len(model_calls)} times (expected once)"
        call = model_calls[0]
        passed = set()
        for arg in call.args:
            # GPT-2, Bloom, Falcon ...: self.transformer(input_ids, ...); passed the same way (_run_body)
            if not (isinstance(arg, ast.Name) and arg.id in params and arg.id not in ("labels", "logits_to_keep")):
                return f"{name}.forward passes {ast.unparse(arg)} to {body_src} by position (not its own argument)"
            self.body_args.append(arg.id)
            passed.add(arg.id)
        for kw in call.keywords:
            if kw.arg is None:
                if not (isinstance(kw.value, ast.Name) and kw.value.id == self.var_kw):
                    return f"{name}.forward passes **{ast.unparse(kw.value)} to {body_src}"
                continue
            if kw.arg in BODY_CONSTS and isinstance(kw.value, ast.Constant):
                self.body_consts[kw.arg] = kw.value.value      # return_dict=True (Gemma 3)
                continue
            if not (isinstance(kw.value, ast.Name) and kw.value.id == kw.arg):
                return f"{name}.forward passes {kw.arg}={ast.unparse(kw.value)} to {body_src} (not its own argument)"
            passed.add(kw.arg)
        if "labels" in passed:
            self.body_labels = True              # Gemma 3 / PaliGemma: the body reads the labels too
            passed.discard("labels")
        expected = set(params) - {"labels", "logits_to_keep", "return_dict"}
        passed.discard("return_dict")
        if self.router_flag is not None and "output_router_logits" in expected - passed:
            self.router_flag_to_body = False           # resolved for the aux loss, not given to the body
            expected.discard("output_router_logits")
        if passed != expected:
            diff = sorted(passed ^ expected)
            return f"{name}.forward does not pass its arguments through to {body_src} unchanged ({', '.join(diff)})"
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


def _loss_params() -> set[str]:
    """The parameters HF's ForCausalLMLoss (and fixed_cross_entropy, which it passes its **kwargs
    to) reads; another keyword is swallowed by their **kwargs, unread."""
    from transformers.loss import loss_utils

    names = set()
    for f in (loss_utils.ForCausalLMLoss, loss_utils.fixed_cross_entropy):
        names |= {p.name for p in inspect.signature(f).parameters.values() if p.kind is not p.VAR_KEYWORD}
    return names


def _ignored_loss_kwargs(fn: ast.AST) -> set[ast.AST]:
    """The nodes of keyword arguments of ``self.loss_function(...)`` that ForCausalLMLoss does not read
    (XGLM's ``pad_token_id=self.config.pad_token_id``): reading them changes nothing the loss computes
    (the loss function is checked to be ForCausalLMLoss: :func:`_standard_loss`)."""
    out: set[ast.AST] = set()
    known = None
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and _src(n.func) == "self.loss_function":
            for k in n.keywords:
                if k.arg is None:
                    continue
                known = _loss_params() if known is None else known
                if k.arg not in known:
                    out |= set(ast.walk(k.value))
    return out


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


def _read_head(fn: ast.AST, name: str, aux_var: str | None = None,
               body_src: str = "self.model") -> tuple[list[tuple[str, str, str]], str | None]:
    """The steps of ``fn`` (a causal LM's forward) from its body's output to its loss.

    Every assignment to ``hidden_states``, to the variable the lm_head call is assigned to and to
    ``loss`` after the ``self.model(...)`` call must be one of: the body's last hidden state,
    HF's logits_to_keep slicing, ``lm_head(hidden_states)`` (a dtype cast around it is fine), a
    multiplication or division by a known scalar, the known tanh softcapping, ``loss = None`` and
    ``loss = self.loss_function(<logits>, ...)``; anything else is the reason returned.
    """
    body_line = min((n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and _src(n.func) == body_src),
                    default=None)
    if body_line is None:
        return [], f"{name}.forward does not call {body_src}"
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
            v = read_value(host, source)
        except AttributeError:
            return None, f"{type(host).__name__}.forward reads {source}, which this model does not have"
        if v is None:
            if kind == "softcap" and source in UNGUARDED_SOFTCAPS:
                return None, f"{source} is None ({type(host).__name__}.forward softcaps by it unconditionally)"
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

    if not looks_causal_lm(host):
        return "not a causal LM (needs self.model (or its base model), self.lm_head and self.config)"
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
    vs = forward_shape(type(host)).vocab_source
    if vs and vs.startswith("self.config.") and "text_config" in vs:    # a vision-language model's language tower
        try:
            v = read_value(host, vs)
        except AttributeError:
            v = None
        if isinstance(v, int) and v != lm.out_features:
            # HF's loss views the logits as (-1, vocab_size): another size is not this lm_head's loss
            return (f"{type(host).__name__}.forward passes vocab_size={vs.replace('self.', '', 1)} = {v} to its loss, "
                    f"but lm_head has {lm.out_features} outputs")
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
    return None


def require_host(host: Any, info: ModuleInfo, flags: Mapping[str, Any], op: str) -> None:
    """Raise ValueError with :func:`host_reason` when ``host`` cannot take ``op`` (install time)."""
    reason = host_reason(host, info, flags, op)
    if reason:
        raise ValueError(f"refused {op} on {type(host).__name__}: {reason}")

"""The router's auxiliary load-balancing loss of a mixture-of-experts causal LM's forward, read from its
source (:func:`read_router_loss`, :func:`read_router_flag`) and replayed by the fused loss (:func:`router_loss`)."""

from __future__ import annotations

import ast
from typing import Any, Mapping

from .values import read_value

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
             "self.config.num_local_experts", "self.config.num_experts_per_tok",
             # a vision-language MoE (Qwen3-VL-MoE, GLM-4.5V): its language model's config
             "self.config.text_config.num_experts", "self.config.text_config.num_local_experts",
             "self.config.text_config.num_experts_per_tok"}
# where a forward reads its router-loss flag and coefficient: the model's own config, or (a vision-language
# MoE) its text config; every read of the text config's a fused forward may replay
ROUTER_CONFIGS = ("self.config", "self.config.text_config")
COEFFICIENTS = ("self.router_aux_loss_coef", "self.config.text_config.router_aux_loss_coef")
MOE_TEXT_CONFIG_READS = {"self.config.text_config.output_router_logits",
                         "self.config.text_config.router_aux_loss_coef"} | {
    a for a in _AUX_ARGS if a.startswith("self.config.text_config.")}
# pure functions an argument may apply to those (Doge: math.floor(math.sqrt(self.num_experts)))
_AUX_FUNCS = {"math.floor", "math.sqrt", "math.ceil", "int"}


def _aux_arg_ok(e: ast.expr) -> bool:
    """``e`` is one of :data:`_AUX_ARGS`, or :data:`_AUX_FUNCS` applied to such arguments."""
    if ast.unparse(e) in _AUX_ARGS:
        return True
    return (isinstance(e, ast.Call) and ast.unparse(e.func) in _AUX_FUNCS and not e.keywords and len(e.args) == 1
            and _aux_arg_ok(e.args[0]))


def read_router_flag(fn: ast.AST) -> list[str] | None:
    """The config flags and-ed to ``output_router_logits`` where ``fn`` resolves it as
    ``output_router_logits if output_router_logits is not None else self.config.output_router_logits``
    (``[]``, or ``["is_moe"]`` for Doge's ``(...) and self.config.is_moe``); None when it does not
    (then any read of config.output_router_logits refuses the site, naming it)."""
    for n in ast.walk(fn):
        if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == "output_router_logits"):
            continue
        v = n.value
        stds = [f"output_router_logits if output_router_logits is not None else {c}.output_router_logits"
                for c in ROUTER_CONFIGS]
        if ast.unparse(v) in stds:
            return []
        if isinstance(v, ast.BoolOp) and isinstance(v.op, ast.And) and ast.unparse(v.values[0]) == stds[0]:
            ands = []
            for x in v.values[1:]:
                if not (isinstance(x, ast.Attribute) and ast.unparse(x.value) == "self.config"):
                    return None
                ands.append(x.attr)
            return ands
        return None
    return None


def router_config(fn: ast.AST) -> str:
    """Where ``fn`` reads ``output_router_logits`` from: ``self.config``, or ``self.config.text_config`` (a
    vision-language MoE's forward)."""
    src = ast.unparse(fn)
    return ROUTER_CONFIGS[1] if f"{ROUTER_CONFIGS[1]}.output_router_logits" in src else ROUTER_CONFIGS[0]


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
    args = [ast.unparse(a) for a in call.args[1:]]
    if call.keywords or not all(_aux_arg_ok(a) for a in call.args[1:]):
        return None, (f"{name}.forward calls {ast.unparse(call.func)}({', '.join(ast.unparse(a) for a in call.args)}), "
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
    return {"func": func, "args": args, "var": var, "coef": ast.unparse(adds[0].value.left)}, None


def _is_aux_term(n: ast.AugAssign, var: str) -> bool:
    """``loss += self.router_aux_loss_coef * <var>`` (or ``self.config.text_config.router_aux_loss_coef``; a
    ``.to(...)`` on ``var`` allowed)."""
    v = n.value
    if not isinstance(n.op, ast.Add) or not isinstance(v, ast.BinOp) or not isinstance(v.op, ast.Mult):
        return False
    if ast.unparse(v.left) not in COEFFICIENTS:
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
    args = [_aux_value(host, src, a) for src in aux["args"]]
    return aux["func"](router_logits, *args)


def _aux_value(host: Any, source: str, a: Mapping[str, Any]) -> Any:
    """The value of a router-loss argument (:func:`_aux_arg_ok`: a call's argument, ``self.x.y``, or
    math functions of those) for ``host`` and the call's arguments ``a``."""
    import math

    e = ast.parse(source, mode="eval").body

    def ev(e: ast.expr) -> Any:
        src = ast.unparse(e)
        if src in _AUX_ARGS:
            return a.get(src) if not src.startswith("self.") else read_value(host, src)
        f = {"math.floor": math.floor, "math.sqrt": math.sqrt, "math.ceil": math.ceil, "int": int}[ast.unparse(e.func)]
        return f(ev(e.args[0]))

    return ev(e)

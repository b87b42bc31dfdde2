"""What a Hugging Face attention class's ``forward`` does, read from its source (:func:`analyse`).

The fused RoPE ops replace an attention module's ``forward`` on the instance with one that does what
the original does (:mod:`patchdsl.ops.attention_forward` builds it).  What the original passes to
``cache.update`` and to the attention interface (sliding_window, scaling, dropout, softcap,
``kwargs=kwargs`` ...) and how it picks the interface differ between models and transformers
versions, so they are not re-typed: :func:`analyse` reads the original class's ``forward`` source,
checks that it has the known shape (and refuses it with a one-line reason when it does not), and
compiles the original's own expressions for those arguments into one small function evaluated in the
original module's globals.  The cache argument is accepted as ``cache`` (transformers >= 5.2x) or
``past_key_values`` (earlier), positionally and by keyword.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Callable

CACHE_NAMES = ("cache", "past_key_values")
_analysis_cache: dict[type, "AttentionAnalysis | str"] = {}


@dataclass(frozen=True)
class AttentionAnalysis:
    """What :func:`analyse` found in an attention class's ``forward``."""

    cls: type
    params: tuple[str, ...]             # named parameters after self, in positional order
    kwonly: tuple[str, ...]
    defaults: dict = field(hash=False)  # name -> default value
    cache_param: str                    # "cache" or "past_key_values"
    kwargs_name: str                    # the name of the **kwargs parameter
    fused_qkv: bool                     # self.qkv_proj instead of q/k/v_proj
    qk_norm: bool                       # calls self.q_norm / self.k_norm
    extras: Callable = field(hash=False)  # (self, ns) -> (interface, update_args, update_kwargs, iface_kwargs)
    # per-layer NoPE (SmolLM3 ``if self.use_rope:``, Exaone 4 ``if self.sliding_window is None or
    # self.is_sliding:``, Granite SWA ``if position_embeddings is not None:``): the original's own
    # condition, ``rope_cond(self, ns)`` over the module and the forward's arguments; None = always rotate
    rope_cond: Callable | None = field(default=None, hash=False)
    rope_cond_text: str = ""


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _targets(stmt: ast.AST) -> list[ast.AST]:
    if isinstance(stmt, ast.Assign):
        return list(stmt.targets)
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return [stmt.target]
    return []


def _is_name_tuple(node: ast.AST, names: tuple[str, ...]) -> bool:
    return (isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == len(names)
            and all(isinstance(e, ast.Name) and e.id == n for e, n in zip(node.elts, names)))


class _ToNamespace(ast.NodeTransformer):
    """Rewrite reads of the forward's locals/parameters into ``__ns["name"]``."""

    def __init__(self, local_names: set[str]):
        self.local_names = local_names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.local_names and isinstance(node.ctx, ast.Load):
            return ast.copy_location(
                ast.Subscript(value=ast.Name("__ns", ast.Load()), slice=ast.Constant(node.id), ctx=ast.Load()), node)
        return node


def read_once(cache: dict, cls: type, read: Callable, verb: str):
    """``read(cls)``, once per class (``cache``): what a reading of ``cls.forward`` gives, or, for any
    exception while reading, the one-line refusal "could not <verb> <cls>.forward (...)" -- never a
    crash.  Shared by the attention analysis here and the RoPE swap's reading (ops.attention_swap)."""
    hit = cache.get(cls)
    if hit is None:
        try:
            hit = read(cls)
        except Exception as e:  # noqa: BLE001 - any surprise is a refusal, never a crash
            hit = f"could not {verb} {cls.__name__}.forward ({type(e).__name__}: {e})"
        cache[cls] = hit
    return hit


def analyse(cls: type) -> "AttentionAnalysis | str":
    """Analyse ``cls.forward``; return an :class:`AttentionAnalysis` or a one-line refusal reason."""
    return read_once(_analysis_cache, cls, _analyse, "analyse")


def no_rope_call_reason(name: str, src: str) -> str:
    """Why an attention forward whose source ``src`` never calls ``apply_rotary_pos_emb(`` has no RoPE call to
    fuse: it applies its rotary embedding with another function (Llama 4's ``apply_rotary_emb`` on complex
    ``freqs_cis``), or it has none."""
    import re

    other = sorted({m for m in re.findall(r"\b(\w*(?:rotary|rope)\w*)\(", src, flags=re.I)
                    if m != "apply_rotary_pos_emb" and not m[0].isupper()})
    if other:
        return (f"{name}.forward applies its rotary embedding with {other[0]}(...), not apply_rotary_pos_emb(q, k, "
                f"cos, sin), the call fused_rope replaces")
    return f"{name}.forward does not call apply_rotary_pos_emb( (no rotary embedding to fuse)"


def _analyse(cls: type) -> "AttentionAnalysis | str":
    fwd = getattr(cls, "forward", None)
    if fwd is None:
        return f"{cls.__name__} has no forward"
    try:
        src = inspect.getsource(fwd)
    except (OSError, TypeError):
        return f"the source of {cls.__name__}.forward is not available"
    tree = ast.parse(textwrap.dedent(src))
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fn is None or isinstance(fn, ast.AsyncFunctionDef):
        return f"{cls.__name__}.forward is not a plain function"
    name = cls.__name__
    if "apply_rotary_pos_emb(" not in src:
        return no_rope_call_reason(name, src)

    a = fn.args
    pos = [x.arg for x in a.posonlyargs + a.args]
    if not pos or pos[0] != "self":
        return f"{name}.forward has no self parameter"
    params = tuple(pos[1:])
    kwonly = tuple(x.arg for x in a.kwonlyargs)
    if a.vararg is not None:
        return f"{name}.forward takes *{a.vararg.arg}, which the replacement cannot reproduce"
    if a.kwarg is None:
        return f"{name}.forward takes no **kwargs for the attention interface"
    kwargs_name = a.kwarg.arg
    cache_param = next((p for p in params + kwonly if p in CACHE_NAMES), None)
    for need in ("hidden_states", "position_embeddings", "attention_mask"):
        if need not in params + kwonly:
            return f"{name}.forward has no parameter {need!r}"
    if cache_param is None:
        return f"{name}.forward has neither a 'cache' nor a 'past_key_values' parameter"
    sig = inspect.signature(inspect.unwrap(fwd))
    defaults = {p.name: p.default for p in sig.parameters.values()
                if p.default is not inspect.Parameter.empty and p.name != "self"}

    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    stmts = [n for n in ast.walk(fn) if isinstance(n, ast.stmt)]

    # q/k/v projections (separate or fused) and o_proj
    called = {n.func.attr for n in calls if isinstance(n.func, ast.Attribute) and _is_self_attr(n.func, n.func.attr)}
    fused = "qkv_proj" in called
    if not fused and not {"q_proj", "k_proj", "v_proj"} <= called:
        return f"{name}.forward does not call self.q_proj/k_proj/v_proj (or self.qkv_proj)"
    if "o_proj" not in called:
        return f"{name}.forward does not call self.o_proj"
    qk_norm = "q_norm" in called or "k_norm" in called
    if qk_norm and not {"q_norm", "k_norm"} <= called:
        return f"{name}.forward normalises only one of q and k"
    other_self_calls = called - {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm"}
    if other_self_calls:
        return f"{name}.forward also calls self.{sorted(other_self_calls)[0]}, which the replacement does not reproduce"

    rope_if = None
    for s in stmts:
        if isinstance(s, (ast.For, ast.While, ast.With, ast.Try)):
            return f"{name}.forward has a {type(s).__name__.lower()} statement the replacement does not reproduce"
        if isinstance(s, ast.If):
            t = s.test
            ok = (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == cache_param
                  and len(t.ops) == 1 and isinstance(t.ops[0], ast.IsNot)
                  and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value is None and not s.orelse)
            if not ok and rope_if is None and _is_rope_branch(s):
                rope_if = s           # per-layer NoPE: the rotation (and cos/sin unpacking) only, on a module fact
                continue
            if not ok:
                return f"{name}.forward has a branch ('if {ast.unparse(t)}') the replacement does not reproduce"

    # cos, sin = position_embeddings ; query_states, key_states = apply_rotary_pos_emb(q, k, cos, sin)
    if not any(isinstance(s, ast.Assign) and len(s.targets) == 1 and _is_name_tuple(s.targets[0], ("cos", "sin"))
               and isinstance(s.value, ast.Name) and s.value.id == "position_embeddings" for s in stmts):
        return f"{name}.forward does not unpack 'cos, sin = position_embeddings'"
    rope_calls = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "apply_rotary_pos_emb"]
    if len(rope_calls) != 1:
        return f"{name}.forward calls apply_rotary_pos_emb {len(rope_calls)} times"
    rc = rope_calls[0]
    if rc.keywords or [getattr(x, "id", None) for x in rc.args] != ["query_states", "key_states", "cos", "sin"]:
        return f"{name}.forward calls apply_rotary_pos_emb with arguments other than (query_states, key_states, cos, sin)"
    if not any(isinstance(s, ast.Assign) and s.value is rc and len(s.targets) == 1
               and _is_name_tuple(s.targets[0], ("query_states", "key_states")) for s in stmts):
        return f"{name}.forward does not assign the result of apply_rotary_pos_emb to (query_states, key_states)"

    # the KV cache update
    ups = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "update"
           and isinstance(c.func.value, ast.Name) and c.func.value.id == cache_param]
    if len(ups) != 1:
        return f"{name}.forward does not call {cache_param}.update(...) exactly once"
    up = ups[0]
    if (len(up.args) < 3 or getattr(up.args[0], "id", None) != "key_states"
            or getattr(up.args[1], "id", None) != "value_states" or not _is_self_attr(up.args[2], "layer_idx")):
        return f"{name}.forward calls {cache_param}.update with unexpected leading arguments"
    if any(isinstance(x, ast.Starred) for x in up.args) or any(k.arg is None for k in up.keywords):
        return f"{name}.forward passes *args/**kwargs to {cache_param}.update"

    # attention_interface = <expr> ; attention_interface(self, q, k, v, attention_mask, kw..., **kwargs)
    iface_assigns = [s for s in stmts if any(isinstance(t, ast.Name) and t.id == "attention_interface"
                                             for t in _targets(s))]
    if len(iface_assigns) != 1 or isinstance(iface_assigns[0], ast.AugAssign) or iface_assigns[0].value is None:
        return f"{name}.forward does not choose attention_interface in one assignment"
    iface_expr = iface_assigns[0].value
    icalls = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "attention_interface"]
    if len(icalls) != 1:
        return f"{name}.forward does not call attention_interface exactly once"
    ic = icalls[0]
    if [getattr(x, "id", None) for x in ic.args] != ["self", "query_states", "key_states", "value_states",
                                                     "attention_mask"]:
        return f"{name}.forward calls attention_interface with unexpected positional arguments"
    star = [k for k in ic.keywords if k.arg is None]
    if len(star) != 1 or not (isinstance(star[0].value, ast.Name) and star[0].value.id == kwargs_name):
        return f"{name}.forward does not forward **{kwargs_name} to attention_interface"
    iface_kws = [k for k in ic.keywords if k.arg is not None]

    # return attn_output, attn_weights
    last = fn.body[-1]
    if not (isinstance(last, ast.Return) and _is_name_tuple(last.value, ("attn_output", "attn_weights"))):
        return f"{name}.forward does not end with 'return attn_output, attn_weights'"
    if sum(isinstance(s, ast.Return) for s in stmts) != 1:
        return f"{name}.forward has more than one return"

    # Names the extracted expressions may read: parameters, cos/sin, kwargs, and locals assigned
    # once from such names (inlined).  Anything computed from q/k/v is refused.
    allowed = set(params) | set(kwonly) | {"cos", "sin", kwargs_name, "input_shape"}
    assigned: dict[str, list[ast.AST]] = {}
    for s in stmts:
        for t in _targets(s):
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    assigned.setdefault(n.id, []).append(s)
    mod = sys.modules.get(cls.__module__)
    if mod is None:
        return f"the module {cls.__module__} of {name} is not imported"
    globs = mod.__dict__

    def resolve(expr: ast.AST, depth: int = 0) -> ast.AST | str:
        for n in sorted(_names(expr) - {"self"}):
            if n in allowed:
                if n in assigned and n not in ("input_shape",):
                    return f"{name}.forward reassigns {n!r} before using it"
                continue
            if n in assigned:
                defs = assigned[n]
                s = defs[0]
                if (depth > 2 or len(defs) != 1 or not isinstance(s, (ast.Assign, ast.AnnAssign))
                        or len(_targets(s)) != 1 or not isinstance(_targets(s)[0], ast.Name)):
                    return f"{name}.forward computes {n!r} in a way the replacement cannot reproduce"
                sub = resolve(s.value, depth + 1)
                if isinstance(sub, str):
                    return sub

                class _Inline(ast.NodeTransformer):
                    def visit_Name(self, node, _n=n, _sub=sub):
                        return copy.deepcopy(_sub) if node.id == _n and isinstance(node.ctx, ast.Load) else node

                expr = _Inline().visit(copy.deepcopy(expr))
                continue
            if n not in globs and not hasattr(builtins, n):
                return f"{name}.forward uses {n!r}, which is neither a parameter nor a module global"
        return expr

    parts = []
    for e in [iface_expr] + list(up.args[3:]) + [k.value for k in up.keywords] + [k.value for k in iface_kws]:
        r = resolve(e)
        if isinstance(r, str):
            return r
        parts.append(r)
    n_up = len(up.args) - 3
    iface_node, rest = parts[0], parts[1:]
    up_args, rest = rest[:n_up], rest[n_up:]
    up_kw, if_kw = rest[:len(up.keywords)], rest[len(up.keywords):]
    local_names = allowed
    tr = _ToNamespace(local_names)
    body = ast.Tuple([
        tr.visit(iface_node),
        ast.Tuple([tr.visit(x) for x in up_args], ast.Load()),
        ast.Dict([ast.Constant(k.arg) for k in up.keywords], [tr.visit(x) for x in up_kw]),
        ast.Dict([ast.Constant(k.arg) for k in iface_kws], [tr.visit(x) for x in if_kw]),
    ], ast.Load())
    lam = ast.Lambda(ast.arguments(posonlyargs=[], args=[ast.arg("self"), ast.arg("__ns")], vararg=None,
                                   kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]), body)
    expr = ast.fix_missing_locations(ast.Expression(lam))
    code = compile(expr, f"<patchdsl: arguments of {cls.__module__}.{cls.__qualname__}.forward>", "eval")
    extras = eval(code, globs)  # noqa: S307 - the original class's own expressions, in its own module
    rope_cond, cond_text = None, ""
    if rope_if is not None:
        test = rope_if.test
        pnames = set(params) | set(kwonly)
        names = _names(test) - {"self"}
        if any(n in assigned for n in names) or any(n not in pnames and n not in globs and not hasattr(builtins, n)
                                                    for n in names):
            return (f"{name}.forward rotates under 'if {ast.unparse(test)}', which reads more than the module's "
                    f"attributes and the forward's parameters")
        lam = ast.Lambda(ast.arguments(posonlyargs=[], args=[ast.arg("self"), ast.arg("__ns")], vararg=None,
                                       kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
                         _ToNamespace(pnames).visit(copy.deepcopy(test)))
        ccode = compile(ast.fix_missing_locations(ast.Expression(lam)),
                        f"<patchdsl: rotary condition of {cls.__module__}.{cls.__qualname__}.forward>", "eval")
        rope_cond = eval(ccode, globs)  # noqa: S307 - the original's own condition, in its own module
        cond_text = ast.unparse(test)
    return AttentionAnalysis(cls, params, kwonly, defaults, cache_param, kwargs_name, fused, qk_norm, extras,
                             rope_cond, cond_text)


def _is_rope_branch(s: ast.If) -> bool:
    """``if <condition>: [cos, sin = position_embeddings]; query_states, key_states = apply_rotary_pos_emb(...)``
    with no else: the per-layer NoPE shape (the condition is checked by the caller)."""
    if s.orelse or not s.body or len(s.body) > 2:
        return False
    *first, last = s.body
    if first and not (isinstance(first[0], ast.Assign) and len(first[0].targets) == 1
                      and _is_name_tuple(first[0].targets[0], ("cos", "sin"))
                      and isinstance(first[0].value, ast.Name) and first[0].value.id == "position_embeddings"):
        return False
    return (isinstance(last, ast.Assign) and len(last.targets) == 1
            and _is_name_tuple(last.targets[0], ("query_states", "key_states"))
            and isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Name)
            and last.value.func.id == "apply_rotary_pos_emb")

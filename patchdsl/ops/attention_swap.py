"""The second way fused_rope patches an attention module: the original ``forward``, run with its
``apply_rotary_pos_emb`` resolved to the fused kernel.

:func:`patchdsl.model.forward.attention.analyse` reads (and :mod:`patchdsl.ops.attention_forward` rebuilds) forwards of the Llama shape (and fuses the
q/k transposes and norms around the kernel).  Forwards of other shapes, such as partial rotary by
slicing and concatenating (Phi, StableLM, Persimmon), a fused ``query_key_value`` split per head
(GPT-NeoX, Persimmon), q/k norms under a config branch (Cohere's ``use_qk_norm``, StableLM's and
Phi's ``qk_layernorm``), an output projection named ``dense``, run here as they are, with one
change: the name ``apply_rotary_pos_emb`` they call resolves to the fused kernel.  The forward's
own source is compiled again with that one name read from a closure cell (the function keeps its
module's globals, file and line numbers; decorators such as ``deprecate_kwarg`` are rebuilt around
it), so nothing process-wide is rebound and other instances, other models and the modeling module
keep the original.

What the swapped-in function receives is checked on a CPU stand-in (:func:`probe_swap`): the original
forward and the rebuilt one, with a plain-torch RoPE of the layout the model's own function computes,
must agree over two steps of a KV cache, and the function must be called with q/k of (batch, heads,
seq, head_dim or rotary_dim) and cos/sin of rotary_dim, as the kernel is specialised.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from ..model.forward.attention import read_once
from ..model.forward.rotary import FUSED_QKV_NAMES, ROPE_FN, fused_kv_heads, reference_rotary

SWAP_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")
_swap_cache: dict[type, "RopeSwap | str"] = {}


@dataclass(frozen=True)
class RopeSwap:
    """What :func:`analyse_swap` found (fields shared with AttentionAnalysis that the probe reads)."""

    cls: type
    chain: tuple = field(hash=False)     # the forward and the functions it wraps, outermost first
    rope: Callable = field(hash=False)   # the modeling module's apply_rotary_pos_emb
    rope_sig: Any = field(hash=False)
    params: tuple[str, ...] = ()
    kwonly: tuple[str, ...] = ()
    cache_param: str | None = None
    defaults: dict = field(default_factory=dict, hash=False)


def analyse_swap(cls: type) -> "RopeSwap | str":
    return read_once(_swap_cache, cls, _analyse_swap, "read")


def _analyse_swap(cls: type) -> "RopeSwap | str":
    name = cls.__name__
    fwd = getattr(cls, "forward", None)
    chain = [fwd]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 6:
        chain.append(chain[-1].__wrapped__)
    if not all(isinstance(f, types.FunctionType) for f in chain):
        return f"{name}.forward is not a plain Python function"
    for outer, inner in zip(chain, chain[1:]):
        if not any(c.cell_contents is inner for c in (outer.__closure__ or ()) if _has(c)):
            return f"{name}.forward is wrapped by a decorator that does not hold it in a closure"
    raw = chain[-1]
    try:
        src = textwrap.dedent(inspect.getsource(raw))
    except (OSError, TypeError):
        return f"the source of {name}.forward is not available"
    tree = ast.parse(src)
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == ROPE_FN]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == ROPE_FN]
    if not calls:
        from ..model.forward.attention import no_rope_call_reason
        return no_rope_call_reason(name, src)
    if len(calls) != 1 or len(uses) != 1:
        return f"{name}.forward uses {ROPE_FN} {len(uses)} times (the fused kernel replaces exactly one call)"
    code = raw.__code__
    if code.co_freevars:
        return (f"{name}.forward reads variables of an enclosing scope ({', '.join(code.co_freevars)}, e.g. "
                f"super()), which a recompiled forward would not see")
    if ROPE_FN not in code.co_names or ROPE_FN in code.co_varnames or ROPE_FN in code.co_freevars:
        return f"{name}.forward does not read {ROPE_FN} as a module global"
    rope = raw.__globals__.get(ROPE_FN)
    if not callable(rope):
        return f"{ROPE_FN} is not a function of {cls.__module__}"
    # with the `kernels` package installed, transformers wraps the function into a module (Func) whose
    # forward(q, k, cos, sin, ...) is the function
    target = rope.forward if hasattr(rope, "forward") and not isinstance(rope, types.FunctionType) else rope
    try:
        rsig = inspect.signature(target)
    except (TypeError, ValueError):
        return f"{cls.__module__}.{ROPE_FN} has no readable signature"
    rparams = list(rsig.parameters.values())
    if len(rparams) < 4 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in rparams[:4]):
        return f"{cls.__module__}.{ROPE_FN} does not take (q, k, cos, sin) first"
    sig = inspect.signature(raw)
    ps = list(sig.parameters.values())[1:]
    params = tuple(p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    kwonly = tuple(p.name for p in ps if p.kind == p.KEYWORD_ONLY)
    if "position_embeddings" not in params + kwonly:
        return f"{name}.forward takes no position_embeddings (cos, sin) to rotate by"
    cache = next((n for n in SWAP_CACHE_NAMES if n in params + kwonly), None)
    defaults = {p.name: p.default for p in ps if p.default is not inspect.Parameter.empty}
    return RopeSwap(cls, tuple(chain), rope, rsig, params, kwonly, cache, defaults)


def _has(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def rope_caller(sw: RopeSwap, fused: Callable) -> Callable:
    """An ``apply_rotary_pos_emb`` with the model function's signature that rotates with
    ``fused(q, k, cos, sin)`` on (batch, seq, heads, dim) views; a call the kernel does not cover
    (another ``unsqueeze_dim``, a non-None extra argument such as the old ``position_ids``) runs the
    model's own function."""
    sig = sw.rope_sig
    names = list(sig.parameters)
    original = sw.rope

    def apply_rotary_pos_emb(*args, **kwargs):
        try:
            ba = sig.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        ba.apply_defaults()
        a = ba.arguments
        q, k, cos, sin = (a[n] for n in names[:4])
        ud = a.get("unsqueeze_dim", 1)
        extra = [n for n in names[4:] if n != "unsqueeze_dim" and a.get(n) is not None]
        if extra or ud not in (1, 2) or q.dim() != 4 or k.dim() != 4:
            return original(*args, **kwargs)
        if ud == 1:                      # (batch, heads, seq, d) -> the kernel's (batch, seq, heads, d) view
            qo, ko = fused(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)
        return fused(q, k, cos, sin)

    return apply_rotary_pos_emb


_CELL = "__patchdsl_rope__"


def build_swapped_forward(sw: RopeSwap, fused: Callable) -> Callable:
    """The class's own forward (and its decorators), its ``apply_rotary_pos_emb`` resolved to
    :func:`rope_caller` ``(sw, fused)``.

    The forward's own source is compiled again with that one name read from a closure cell instead of
    the module's globals; the function keeps the modeling module's globals dict itself (nothing in it
    is written) and its file and line numbers, so tracebacks point into the modeling file and
    torch.compile (which finds a function's globals through its module) traces it as the original."""
    raw = sw.chain[-1]
    new = _recompiled(raw, rope_caller(sw, fused))
    for outer, inner in zip(reversed(sw.chain[:-1]), reversed(sw.chain[1:])):
        cells = tuple(types.CellType(new) if _has(c) and c.cell_contents is inner else c
                      for c in outer.__closure__)
        wrapped = _clone(outer, outer.__globals__, cells)
        wrapped.__wrapped__ = new
        new = wrapped
    return new


def _recompiled(raw: types.FunctionType, rope: Callable) -> types.FunctionType:
    src = textwrap.dedent(inspect.getsource(raw))
    fn = ast.parse(src).body[0]
    fn.decorator_list = []

    class _Swap(ast.NodeTransformer):
        def visit_Name(self, node):
            return ast.copy_location(ast.Name(_CELL, node.ctx), node) if node.id == ROPE_FN else node

    fn = _Swap().visit(fn)
    maker = ast.parse(f"def __patchdsl_make({_CELL}):\n    pass\n")
    maker.body[0].body = [fn, ast.Return(ast.Name(fn.name, ast.Load()))]
    ast.fix_missing_locations(maker)
    ast.increment_lineno(maker, raw.__code__.co_firstlineno - 1)
    code = compile(maker, raw.__code__.co_filename, "exec")
    ns: dict[str, Any] = {}
    exec(code, raw.__globals__, ns)  # noqa: S102 - the class's own forward source; defines one function in ns
    out = ns["__patchdsl_make"](rope)
    out.__qualname__ = raw.__qualname__
    out.__doc__ = raw.__doc__
    return out


def _clone(fn: types.FunctionType, globs: dict, closure) -> types.FunctionType:
    out = types.FunctionType(fn.__code__, globs, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    out.__dict__.update(fn.__dict__)
    out.__qualname__ = fn.__qualname__
    out.__doc__ = fn.__doc__
    return out


class CallShapeError(Exception):
    """The swapped-in function was called with shapes the kernel is not specialised for."""


def probe_reference(layout: str, expect: Callable[[], tuple]) -> Callable:
    """The plain-torch stand-in for the kernel in the probe: ``layout``'s RoPE, after checking the call's
    shapes against ``expect() -> (q heads, kv heads, call dim, rotary_dim)``."""

    def fused(q, k, cos, sin):
        nq, nk, dim, r = expect()
        if q.shape[2] != nq or k.shape[2] != nk or q.shape[-1] != dim or k.shape[-1] != dim or cos.shape[-1] != r:
            raise CallShapeError(
                f"{ROPE_FN} receives q {tuple(q.transpose(1, 2).shape)}, k {tuple(k.transpose(1, 2).shape)} and cos/sin "
                f"of width {cos.shape[-1]}, not (batch, {nq}, seq, {dim}) / (batch, {nk}, seq, {dim}) and {r}")
        return reference_rotary(q, k, cos, sin, layout)

    return fused


_swap_probe_cache: dict[tuple, str | None] = {}


def probe_swap(module: Any, facts: dict, sw: RopeSwap) -> str | None:
    """The stand-in comparison of the swapped forward (see the module docstring); None or a reason."""
    from .attention_forward import _probe

    layout = facts.get("rotary_layout")
    if layout is None:
        return (f"{sw.cls.__module__}.{ROPE_FN} computes none of the rotary layouts fused_rope knows "
                f"(rotate_half, interleaved, interleaved_half_cos) on (batch, heads, seq, head_dim) q/k")
    layer_kind = tuple(repr(getattr(module, a, None)) for a in ("layer_type", "is_sliding", "sliding_window",
                                                                 "use_qk_norm", "qk_layernorm", "use_rope"))
    key = (sw.cls, repr(sorted(facts.items())), layer_kind)
    if key in _swap_probe_cache:
        return _swap_probe_cache[key]
    d, r = int(facts["head_dim"]), int(facts["rotary_dim"])
    dim = r if facts.get("rope_input") == "rotary" else d
    holder: dict[str, Any] = {}

    def expect():
        from ..model.modules import linear_like

        stand = holder["stand"]
        nq = int(stand.config.num_attention_heads)
        nk = int(getattr(stand.config, "num_key_value_heads", None) or nq)
        kp = linear_like(getattr(stand, "k_proj", None))
        fused = next((linear_like(getattr(stand, n, None)) for n in FUSED_QKV_NAMES
                      if linear_like(getattr(stand, n, None)) is not None), None)
        if kp is not None and kp.out_features % d == 0:
            nk = kp.out_features // d           # the stand-in layer's own (as the facts read the module's)
        elif kp is None and fused is not None:
            nk = fused_kv_heads(fused.out_features, d, nq) or nk
        return nq, nk, dim, r

    def replacement_for(stand):
        holder["stand"] = stand
        return build_swapped_forward(sw, probe_reference(layout, expect))

    try:
        reason = _probe(module, facts, sw, None, None, replacement_for)
    except CallShapeError as e:
        reason = f"{sw.cls.__name__}.forward: {e}: a layout fused_rope's kernel is not specialised for"
    except Exception as e:  # noqa: BLE001
        reason = f"the stand-in comparison of {sw.cls.__name__} failed ({type(e).__name__}: {str(e)[:120]})"
    _swap_probe_cache[key] = reason
    return reason

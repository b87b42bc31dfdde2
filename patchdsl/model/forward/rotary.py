"""Rotary layouts: which elements of a head each RoPE rotation pairs, and which cos/sin entries it uses.

Three layouts are known (R = rotary_dim, the last dim of cos/sin; dims from R on pass through):

* ``rotate_half`` (Llama, Qwen, GPT-NeoX, Phi, StableLM, Persimmon): element i pairs with i + R/2,
  ``y = x * cos + rotate_half(x) * sin``;
* ``interleaved`` (Cohere, Cohere 2, Helium: ``rotate_every_two``): element 2i pairs with 2i + 1, each
  element uses its own cos/sin entry (the model's rotary embedding repeats each frequency twice);
* ``interleaved_half_cos`` (GLM, GLM-4: ``cos[..., :R/2].repeat_interleave(2)``): element 2i pairs with
  2i + 1 and both use cos[i] / sin[i] (the table's second half is never read).

For pair (a, b) with cos entries (ca, cb), sin (sa, sb):  ``y_a = x_a ca - x_b sa``, ``y_b = x_b cb + x_a sb``.

:func:`rope_function_layout` tells them apart by running the modeling module's own
``apply_rotary_pos_emb`` on small random inputs (never by its name); the kernel (templates/fused_rope.py.j2)
is specialised on the layout.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

LAYOUTS = ("rotate_half", "interleaved", "interleaved_half_cos")
ROPE_FN = "apply_rotary_pos_emb"

_layout_cache: dict[Any, dict | None] = {}


def rotate(x: Any, cos: Any, sin: Any, layout: str) -> Any:
    """RoPE of ``x`` (..., head_dim) with ``cos``/``sin`` broadcastable to (..., R); plain torch, any dtype,
    differentiable.  The first R dims rotate in ``layout``, the rest pass through."""
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"unknown rotary layout {layout!r} (one of {', '.join(LAYOUTS)})")
    r = cos.shape[-1]
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f"rotary_dim {r} must be even and at most head_dim {x.shape[-1]}")
    h = r // 2
    xr, xp = x[..., :r], x[..., r:]
    if layout == "rotate_half":
        a, b = xr[..., :h], xr[..., h:]
        ca, cb, sa, sb = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        if layout == "interleaved":
            ca, cb, sa, sb = cos[..., 0::2], cos[..., 1::2], sin[..., 0::2], sin[..., 1::2]
        else:
            ca = cb = cos[..., :h]
            sa = sb = sin[..., :h]
    ya = a * ca - b * sa
    yb = b * cb + a * sb
    y = torch.cat((ya, yb), dim=-1) if layout == "rotate_half" else torch.stack((ya, yb), dim=-1).flatten(-2)
    return torch.cat((y, xp), dim=-1) if xp.shape[-1] else y


def reference_rotary(q: Any, k: Any, cos: Any, sin: Any, layout: str = "rotate_half"):
    """RoPE of q and k in the (batch, seq, heads, head_dim) layout the kernel takes; cos/sin as HF's
    rotary embedding returns them ((seq, R) or (batch or 1, seq, R))."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return rotate(q, cos, sin, layout), rotate(k, cos, sin, layout)


def rope_function(cls: type) -> Callable | None:
    """The ``apply_rotary_pos_emb`` of ``cls``'s modeling module (None if it has none)."""
    mod = sys.modules.get(getattr(cls, "__module__", ""), None)
    fn = getattr(mod, ROPE_FN, None) if mod is not None else None
    return fn if callable(fn) else None


def rope_function_layout(fn: Callable | None) -> dict | None:
    """``{"layout": ..., "partial": bool}`` for a model's ``apply_rotary_pos_emb(q, k, cos, sin)``
    (q/k as (batch, heads, seq, head_dim), cos/sin (batch, seq, R)), probed on random float32 inputs
    against each layout; ``partial``: the function itself passes the dims beyond R through (GLM,
    GPT-NeoX) rather than needing R = head_dim.  None when it computes none of the layouts."""
    if fn is None:
        return None
    key = getattr(fn, "__wrapped__", fn)
    if key in _layout_cache:
        return _layout_cache[key]
    _layout_cache[key] = out = _probe_layout(fn)
    return out


def _run(fn: Callable, d: int, r: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 4, d, generator=g)
    k = torch.randn(2, 1, 4, d, generator=g)
    ang = torch.randn(2, 4, r, generator=g) * 2       # general angles: halves and pairs all differ
    cos, sin = ang.cos(), ang.sin()
    try:
        with torch.no_grad():
            out = fn(q.clone(), k.clone(), cos.clone(), sin.clone())
    except Exception:  # noqa: BLE001 - a function that rejects these shapes computes no layout here
        return None
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        return None
    if out[0].shape != q.shape or out[1].shape != k.shape:
        return None
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return [lay for lay in LAYOUTS
            if torch.allclose(out[0].float(), rotate(q, c, s, lay), rtol=1e-5, atol=1e-5)
            and torch.allclose(out[1].float(), rotate(k, c, s, lay), rtol=1e-5, atol=1e-5)]


def _out_dtype(fn: Callable) -> str:
    """What dtype the function returns for bf16 q/k and float32 cos/sin: ``"input"`` when it casts the
    result back to q's / k's dtype (OLMo 2/3: their rotary embedding keeps cos/sin in float32 and the
    function ends in ``.to(q_type)``), ``"promote"`` when it returns torch's promotion of the arithmetic
    (Llama: its rotary embedding casts cos/sin to the activations' dtype, so the two differ only under
    autocast, where cos/sin stay float32 and q/k come out float32 as well)."""
    import torch

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 3, 8, generator=g).bfloat16()
    ang = torch.randn(1, 3, 8, generator=g)
    try:
        with torch.no_grad():
            out = fn(q, q.clone(), ang.cos(), ang.sin())
    except Exception:  # noqa: BLE001 - refuses mixed dtypes: the arithmetic's dtype (as the kernel computes)
        return "promote"
    return "input" if out[0].dtype == q.dtype and out[1].dtype == q.dtype else "promote"


def _probe_layout(fn: Callable) -> dict | None:
    full = _run(fn, 8, 8, 0)
    if not full:
        return None
    layout = full[0]
    part = _run(fn, 12, 8, 1)
    return {"layout": layout, "partial": bool(part and layout in part), "out_dtype": _out_dtype(fn)}


# ---- the Attention kind's projection names and rotary facts -------------------------------------------
OUT_NAMES = ("o_proj", "dense", "out_proj")          # the output projection (Llama; Phi / GPT-NeoX; ...)
FUSED_QKV_NAMES = ("qkv_proj", "query_key_value")    # Phi-3; GPT-NeoX / Persimmon (split by the model itself)
_input_cache: dict[type, str] = {}


def _forward_tree(cls: type):
    import ast
    import inspect
    import textwrap

    fwd = inspect.unwrap(getattr(cls, "forward", None))
    src = textwrap.dedent(inspect.getsource(fwd))
    return src, ast.parse(src)


def _split_at_rotary(value, name: str, targets) -> bool:
    """``q_rot, q_pass = (q[..., :X], q[..., X:])`` with ``name`` the first: the rotary/pass split."""
    import ast

    if not (isinstance(targets, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
            and len(targets.elts) == len(value.elts) == 2):
        return False
    if getattr(targets.elts[0], "id", None) != name:
        return False
    a, b = value.elts
    if not (isinstance(a, ast.Subscript) and isinstance(b, ast.Subscript)):
        return False
    if ast.dump(a.value) != ast.dump(b.value):
        return False
    sa = a.slice.elts[-1] if isinstance(a.slice, ast.Tuple) else a.slice
    sb = b.slice.elts[-1] if isinstance(b.slice, ast.Tuple) else b.slice
    return (isinstance(sa, ast.Slice) and isinstance(sb, ast.Slice) and sa.lower is None and sa.upper is not None
            and sb.upper is None and sb.lower is not None and ast.dump(sa.upper) == ast.dump(sb.lower))


def rope_call_input(cls: type) -> str:
    """What the forward hands to ``apply_rotary_pos_emb``: ``"rotary"`` when it splits q into its rotary
    and pass-through parts first (``query_rot, query_pass = (q[..., :n], q[..., n:])``: Phi, StableLM,
    Persimmon) and concatenates them back itself, else ``"head"`` (whole heads; the function passes the
    rest through).  The stand-in probe checks the shapes the function then receives."""
    if cls in _input_cache:
        return _input_cache[cls]
    import ast

    out = "head"
    try:
        _, tree = _forward_tree(cls)
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id == ROPE_FN and n.args]
        first = calls[0].args[0] if len(calls) == 1 else None
        if isinstance(first, ast.Name) and any(
                isinstance(s, ast.Assign) and len(s.targets) == 1 and _split_at_rotary(s.value, first.id, s.targets[0])
                for s in ast.walk(tree)):
            out = "rotary"
    except Exception:  # noqa: BLE001 - no source: whole heads (the stand-in probe checks it)
        pass
    _input_cache[cls] = out
    return out


_calls_cache: dict[type, bool] = {}


def calls_rope_function(cls: type) -> bool:
    """Whether ``cls.forward``'s source calls ``apply_rotary_pos_emb`` (cached per class)."""
    if cls not in _calls_cache:
        try:
            src, _ = _forward_tree(cls)
            _calls_cache[cls] = f"{ROPE_FN}(" in src
        except Exception:  # noqa: BLE001 - no source: no rotary call to fuse
            _calls_cache[cls] = False
    return _calls_cache[cls]


def fused_kv_heads(width: int, head_dim: int, n_heads: int) -> int | None:
    """The kv heads of a fused q/k/v projection ``width`` = (heads + 2 x kv heads) x head_dim wide (Falcon's
    multi-query ``query_key_value`` has one), or None when the width is not of that form."""
    if width % head_dim:
        return None
    rest = width // head_dim - n_heads
    return rest // 2 if rest > 0 and rest % 2 == 0 else None


def attention_facts(m: Any, rmsnorm: Callable, linear_like: Callable) -> dict | None:
    """The ``Attention`` kind's facts (see kinds.attention)."""
    cfg = getattr(m, "config", None)
    out_name = next((n for n in OUT_NAMES if linear_like(getattr(m, n, None)) is not None), None)
    if out_name is None or cfg is None:
        return None
    q, k, v = (linear_like(getattr(m, n, None)) for n in ("q_proj", "k_proj", "v_proj"))
    qkv_name = next((n for n in FUSED_QKV_NAMES if linear_like(getattr(m, n, None)) is not None), None)
    if not (q is not None and k is not None and v is not None) and qkv_name is None:
        return None
    head_dim = getattr(m, "head_dim", None) or getattr(m, "head_size", None) or getattr(cfg, "head_dim", None)
    n_heads = getattr(cfg, "num_attention_heads", None)
    if not head_dim and n_heads and isinstance(getattr(cfg, "hidden_size", None), int):
        head_dim = cfg.hidden_size // n_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    if k is not None and isinstance(head_dim, int) and head_dim and k.out_features % head_dim == 0:
        n_kv = k.out_features // head_dim      # this layer's own (MiMo-V2's sliding layers have more kv heads)
    elif k is None and qkv_name is not None and isinstance(head_dim, int) and head_dim and isinstance(n_heads, int):
        n_kv = fused_kv_heads(linear_like(getattr(m, qkv_name)).out_features, head_dim, n_heads) or n_kv
    if not isinstance(head_dim, int) or not isinstance(n_heads, int) or not head_dim or not n_heads:
        return None
    lay = rope_function_layout(rope_function(type(m))) if calls_rope_function(type(m)) else None
    if (out_name != "o_proj" or qkv_name == "query_key_value") and lay is None:
        return None       # dense / out_proj without a rotary embedding: BERT, OPT, vision towers (no rope to fuse)
    facts: dict[str, Any] = {"head_dim": int(head_dim), "n_heads": int(n_heads), "n_kv_heads": int(n_kv),
                             "fused_qkv": qkv_name is not None}
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope_params, dict) and rope_params and all(isinstance(v, dict) for v in rope_params.values()):
        # per layer type (Gemma 3, MiMo-V2: {"full_attention": {...}, "sliding_attention": {...}}): this layer's
        lt = getattr(m, "layer_type", None)
        types_ = getattr(cfg, "layer_types", None)
        idx = getattr(m, "layer_idx", None)
        if lt is None and isinstance(types_, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types_):
            lt = types_[idx]
        rope_params = rope_params.get(lt) or next(iter(rope_params.values()))
    prf = getattr(cfg, "partial_rotary_factor", None)
    if prf is None and isinstance(rope_params, dict):
        prf = rope_params.get("partial_rotary_factor")
    if prf is None:
        prf = getattr(cfg, "rotary_pct", None)
    facts["rotary_dim"] = int(int(head_dim) * float(prf if prf is not None else 1.0))
    if lay is not None:
        facts["rotary_layout"] = lay["layout"]
        facts["rotary_out_dtype"] = lay["out_dtype"]
        facts["rope_input"] = rope_call_input(type(m))
    if out_name != "o_proj":
        facts["out_proj"] = out_name
    if qkv_name not in (None, "qkv_proj"):
        facts["qkv_proj"] = qkv_name
    qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
    if qn is not None and kn is not None:
        fq, fk = rmsnorm(qn), rmsnorm(kn)
        if fq and fk and fq["hidden"] == head_dim and fk["hidden"] == head_dim:
            facts["qk_norm"] = {"eps": fq["eps"], "offset": fq["offset"], "casting": fq["casting"]}
    return facts

"""A replacement ``forward`` for Hugging Face attention modules, shared by fused_rope and
fused_qk_norm_rope.

Swapping only ``apply_rotary_pos_emb`` would mean rebinding a module-level name (process-wide
monkey-patching), so the ops replace the attention module's ``forward`` on the instance with one
that does what the original does:

    projections through the projection MODULES (q/k/v_proj or a fused qkv_proj; PEFT LoRA works)
    -> view as (batch, seq, heads, head_dim)            (contiguous, before HF's transpose)
    -> ``qk_fn(self, q, k, cos, sin)``                   (optional q/k norm + RoPE: the op's kernel)
    -> transpose(1, 2) as HF does, cache update, attention interface, o_proj.

What the original passes to ``cache.update`` and to the attention interface is read from its
source by :func:`patchdsl.model.forward.attention.analyse` (an :class:`AttentionAnalysis`);
:func:`build_forward` builds the replacement from it.

:func:`probe` then runs the original class ``forward`` and the replacement (with a plain-torch
RoPE) on a tiny CPU stand-in of the class, with a KV cache over two steps, and compares.
"""

from __future__ import annotations

import copy
import types
from typing import Any, Callable

from ..model.forward.attention import CACHE_NAMES, AttentionAnalysis

_probe_cache: dict[tuple, str | None] = {}


def _module_norms(self, q, k):
    return self.q_norm(q), self.k_norm(k)


def build_forward(an: AttentionAnalysis, qk_fn: Callable, norm_fn: Callable | None = None) -> Callable:
    """The replacement ``forward(self, *args, **kwargs)``.

    ``qk_fn(self, q, k, cos, sin)`` takes q/k as (batch, seq, heads, head_dim) and returns them
    rotated (and normalised, for fused_qk_norm_rope) in the same layout.  On a layer the original
    does not rotate (``an.rope_cond``: per-layer NoPE) ``norm_fn(self, q, k)`` runs instead (default:
    q_norm/k_norm called per head when the original calls them, else nothing).
    """
    params, kwonly, cp, kwn = an.params, an.kwonly, an.cache_param, an.kwargs_name
    rope_cond = an.rope_cond
    if norm_fn is None:
        norm_fn = _module_norms if an.qk_norm else (lambda self, q, k: (q, k))
    other_cache = [c for c in CACHE_NAMES if c != cp]
    named = set(params) | set(kwonly)
    fused = an.fused_qkv
    extras = an.extras
    required = [p for p in params + kwonly if p not in an.defaults]

    def forward(self, *args, **kwargs):
        if len(args) > len(params):
            raise TypeError(f"forward() takes {len(params)} positional arguments but {len(args)} were given")
        ns = dict(an.defaults)
        ns.update(zip(params, args))
        # transformers 5.2x: `cache`; earlier: `past_key_values`.  Accept both (the parameter's
        # own name wins when both are given, as the deprecate_kwarg wrapper does).
        for alias in other_cache:
            if alias in kwargs:
                v = kwargs.pop(alias)
                if cp not in kwargs and ns.get(cp) is None:
                    ns[cp] = v
        # a list comprehension, not `named & kwargs.keys()`: Dynamo cannot trace set & dict_keys
        # (a compiled decoder layer, patchdsl.compile_layers, broke its graph there)
        for n in [k for k in kwargs if k in named]:
            ns[n] = kwargs.pop(n)
        for n in required:
            if n not in ns:
                raise TypeError(f"forward() missing required argument {n!r}")
        ns[kwn] = kwargs

        hidden_states = ns["hidden_states"]
        input_shape = hidden_states.shape[:-1]
        head_dim = self.head_dim
        hidden_shape = (*input_shape, -1, head_dim)
        if fused:
            qkv = self.qkv_proj(hidden_states)
            query_pos = self.config.num_attention_heads * head_dim
            n_kv = getattr(self, "num_key_value_heads", None) or self.config.num_key_value_heads
            kv_size = n_kv * head_dim
            q = qkv[..., :query_pos]
            k = qkv[..., query_pos:query_pos + kv_size]
            v = qkv[..., query_pos + kv_size:]
        else:
            q = self.q_proj(hidden_states)
            k = self.k_proj(hidden_states)
            v = self.v_proj(hidden_states)
        q = q.view(hidden_shape)
        k = k.view(hidden_shape)
        value_states = v.view(hidden_shape).transpose(1, 2)

        if rope_cond is None or rope_cond(self, ns):
            cos, sin = ns["position_embeddings"]
            q, k = qk_fn(self, q, k, cos, sin)
        else:
            cos = sin = None
            q, k = norm_fn(self, q, k)
        query_states = q.transpose(1, 2)
        key_states = k.transpose(1, 2)

        ns["cos"], ns["sin"], ns["input_shape"] = cos, sin, input_shape
        attention_interface, up_args, up_kwargs, iface_kwargs = extras(self, ns)
        cache = ns.get(cp)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, *up_args, **up_kwargs)

        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, ns["attention_mask"], **iface_kwargs, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    return forward


# ---- the stand-in probe -------------------------------------------------------------------------

def _stand_in(module: Any, facts: dict):
    """A fresh tiny fp32 CPU instance of ``type(module)`` (2 kv heads, same head_dim and GQA ratio)."""
    import torch

    cfg = copy.deepcopy(module.config)
    d = int(facts["head_dim"])
    groups = max(1, int(facts["n_heads"]) // max(1, int(facts["n_kv_heads"])))
    n_kv = min(2, int(facts["n_kv_heads"]))
    try:
        cfg.head_dim = d
    except AttributeError:          # a read-only property (Falcon: hidden_size // heads): set by hidden_size below
        pass
    cfg.num_key_value_heads = n_kv
    cfg.num_attention_heads = n_kv * groups
    # hidden = heads x head_dim: classes that derive head_dim from hidden_size / heads (Mllama, GPT-NeoX, Phi)
    # or size a norm by hidden_size where the output is heads x head_dim wide (BitNet's attn_sub_norm) agree
    cfg.hidden_size = cfg.num_attention_heads * d
    cfg._attn_implementation = "eager"
    layer_idx = getattr(module, "layer_idx", 0) or 0

    def make():
        with torch.device("meta"):
            try:
                return type(module)(cfg, layer_idx)
            except TypeError:
                return type(module)(cfg)

    with torch.random.fork_rng(devices=[]):
        stand = make()
        stand = stand.to_empty(device="cpu").float().eval()
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in stand.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.2))
            for b in stand.buffers():
                b.copy_(torch.randn(b.shape, generator=g))
    return stand


def probe(module: Any, facts: dict, an: AttentionAnalysis, qk_ref: Callable, mode: str,
          norm_fn: Callable | None = None) -> str | None:
    """Run the original class forward and the replacement (with ``qk_ref``) on a tiny stand-in.

    Two steps through a DynamicCache (a 3-token prefill, then one token), batch 2; outputs,
    attention weights and cached keys/values must agree.  Returns None or a one-line reason.
    """
    import torch

    # Layers of one class differ only by their layer type (sliding / full attention), so one
    # probe per (class, mode, facts, layer type) is enough.
    layer_kind = tuple(repr(getattr(module, a, None)) for a in ("layer_type", "is_sliding", "sliding_window"))
    if an.rope_cond is not None:         # per-layer NoPE: rotating and plain layers are probed apart
        try:
            layer_kind += (bool(an.rope_cond(module, {"position_embeddings": True})),)
        except Exception as e:  # noqa: BLE001
            return f"{an.cls.__name__}: its rotary condition ('{an.rope_cond_text}') cannot be read ({type(e).__name__})"
    key = (an.cls, mode, repr(sorted(facts.items())), layer_kind)
    if key in _probe_cache:
        return _probe_cache[key]
    reason = layout_reason(module, facts, an)
    if reason:
        return reason
    try:
        reason = _probe(module, facts, an, qk_ref, norm_fn)
    except Exception as e:  # noqa: BLE001
        reason = f"the stand-in comparison of {an.cls.__name__} failed ({type(e).__name__}: {str(e)[:120]})"
    _probe_cache[key] = reason
    del torch
    return reason


def layout_reason(module: Any, facts: dict, an: AttentionAnalysis) -> str | None:
    """Why the projections' widths are not the (heads x head_dim) layout the replacement splits, named by
    what they are (a query doubled by an output gate, as Qwen3.5's), or None."""
    from ..model.modules import linear_like

    d, nq, nk = int(facts["head_dim"]), int(facts["n_heads"]), int(facts["n_kv_heads"])
    name = an.cls.__name__
    if an.fused_qkv:
        lin = linear_like(getattr(module, "qkv_proj", None))
        if lin is not None and lin.out_features != (nq + 2 * nk) * d:
            return (f"{name}.qkv_proj produces {lin.out_features} features, not (heads + 2 x kv heads) x head_dim "
                    f"= {(nq + 2 * nk) * d}: a layout the replacement does not split")
        return None
    widths = {n: getattr(linear_like(getattr(module, n, None)), "out_features", None) for n in ("q_proj", "k_proj", "v_proj")}
    if widths["q_proj"] == 2 * nq * d:
        return (f"{name}.q_proj produces 2 x heads x head_dim features (the query and a per-head output gate, "
                f"as Qwen3.5's gated attention): the replacement does not reproduce the gate")
    want = {"q_proj": nq * d, "k_proj": nk * d, "v_proj": nk * d}
    for n, w in widths.items():
        if w is not None and w != want[n]:
            return (f"{name}.{n} produces {w} features, not {'heads' if n == 'q_proj' else 'kv heads'} x head_dim "
                    f"= {want[n]} (a head size or head count other than the config's)")
    return None


def _probe(module, facts, an, qk_ref, norm_fn=None, replacement_for=None) -> str | None:
    """``replacement_for(stand)``: the replacement forward to compare (default: build_forward's)."""
    import torch

    try:
        stand = _stand_in(module, facts)
    except Exception as e:  # noqa: BLE001
        return f"cannot build a CPU stand-in of {an.cls.__name__} to verify the replacement ({type(e).__name__}: {str(e)[:100]})"
    try:
        from transformers.cache_utils import DynamicCache
    except Exception:  # pragma: no cover
        DynamicCache = None
    g = torch.Generator().manual_seed(99)
    r = int(facts["rotary_dim"])
    hid = stand.config.hidden_size
    steps = []
    for s in (3, 1):
        x = torch.randn(2, s, hid, generator=g)
        ang = torch.randn(1, s, r, generator=g) * 2
        steps.append((x, ang.cos(), ang.sin()))
    fn = replacement_for(stand) if replacement_for is not None else build_forward(an, qk_ref, norm_fn)
    replacement = types.MethodType(fn, stand)
    original = types.MethodType(an.cls.forward, stand)
    takes_positions = "position_ids" in an.params + an.kwonly

    def run(zero_mask: bool):
        caches, results = [], []
        with torch.no_grad():
            for fwd in (original, replacement):
                cache = DynamicCache() if DynamicCache is not None else None
                outs = []
                start = 0
                for x, c, s_ in steps:
                    kw = {"position_embeddings": (c, s_), "attention_mask": None}
                    if zero_mask:      # an additive mask that masks nothing (Falcon adds the mask unconditionally)
                        kw["attention_mask"] = torch.zeros(x.shape[0], 1, x.shape[1], start + x.shape[1])
                    # other required parameters (Falcon's alibi: None when the model rotates) are None
                    kw.update({p: None for p in an.params[1:] if p not in kw and p not in (an.defaults or {})})
                    if an.cache_param is not None:
                        kw[an.cache_param] = cache
                    if takes_positions:      # Ministral 3 / Llama 4 scale queries by position
                        kw["position_ids"] = torch.arange(start, start + x.shape[1])[None].expand(x.shape[0], -1)
                    start += x.shape[1]
                    if fwd is original:
                        try:
                            outs.append(fwd(x, **kw))
                        except (RuntimeError, ValueError, IndexError) as e:
                            return (f"{an.cls.__name__}.forward itself rejects q/k rotated by cos/sin of shape "
                                    f"(batch, seq, rotary_dim={r}) on a stand-in ({type(e).__name__}: {str(e)[:90]}): "
                                    f"its rotary embedding has a layout fused_rope does not compute")
                    else:
                        outs.append(fwd(x, **kw))
                results.append(outs)
                caches.append(cache)
        return results, caches

    try:
        out = run(False)
    except TypeError as e:
        if "NoneType" not in str(e):
            raise
        out = run(True)          # the forward needs an attention mask
    if isinstance(out, str):
        return out
    results, caches = out
    for step, (o, n) in enumerate(zip(*results)):
        if not isinstance(o, tuple) or not isinstance(n, tuple) or len(o) != len(n):
            return f"{an.cls.__name__}.forward returns something other than (attn_output, attn_weights)"
        for a, b in zip(o, n):
            if (a is None) != (b is None):
                return f"the replacement returns different outputs from {an.cls.__name__}.forward"
            if a is None:
                continue
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                return (f"the replacement forward does not reproduce {an.cls.__name__}.forward on a CPU stand-in "
                        f"(step {step}, max diff {(a - b).abs().max().item():.3g})")
    if caches[0] is not None:
        for lo, ln in zip(caches[0].layers, caches[1].layers):
            for a, b in ((getattr(lo, "keys", None), getattr(ln, "keys", None)),
                         (getattr(lo, "values", None), getattr(ln, "values", None))):
                if a is None and b is None:
                    continue
                if a is None or b is None or a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                    return f"the replacement does not reproduce the KV cache of {an.cls.__name__}"
    return None

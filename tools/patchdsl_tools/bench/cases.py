"""The op families benchmarked, their shapes, inputs, float64 references, byte/FLOP counts and peers.

Each :class:`Family` describes one fused op (registry name ``op``) and how to call:

* ``patchdsl``: the op's generated module, planned exactly as a real model would plan it (a spec
  rule on a meta-device model of the right sizes -> ``PatchPlan`` -> ``KernelKey`` ->
  ``load_kernel``), then its one-call entry point (``entry_names``, bound by parameter name);
* ``hf``: what Hugging Face transformers runs (the module's own forward or function);
* ``compile``: ``torch.compile`` of that same HF function;
* ``liger``: Liger-Kernel's equivalent, when importable;
* ``cce``: Cut Cross-Entropy (linear cross entropy only), when importable.

A family whose op is not registered yet still runs its peers; its patchdsl row says
"not implemented yet" (decided from the registry at run time).

Inputs: shared ``params`` (weights, cos/sin: one copy) and rotating activation sets (``act``), so
the rotated bytes can exceed the L2.  All random, seeded; never zeros.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from patchdsl.util.vocab import torch_dtype

IGNORE_INDEX = -100


class Unavailable(Exception):
    """A peer that cannot run here (not installed, not importable)."""


class NotImplementedYet(Exception):
    """The patchdsl op is not in the registry (its template has not landed yet)."""




def _randn(g, shape, device, dtype, scale: float = 1.0, shift: float = 0.0):
    import torch

    t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
    if scale != 1.0:
        t.mul_(scale)
    if shift != 0.0:
        t.add_(shift)
    return t.to(dtype)


def _param(t):
    import torch

    return torch.nn.Parameter(t, requires_grad=True)


def _labels(g, n: int, vocab: int, device):
    """Random targets with about 1 in 32 set to the ignore index (never all ignored)."""
    import torch

    y = torch.randint(0, vocab, (n,), generator=g, device=device)
    drop = torch.randint(0, 32, (n,), generator=g, device=device) == 0
    y = torch.where(drop, torch.full_like(y, IGNORE_INDEX), y)
    y[0] = 0 if vocab > 0 else y[0]
    return y


def rotary_cos_sin(batch: int, seq: int, head_dim: int, theta: float, device, dtype):
    """cos, sin of shape (batch, seq, head_dim) as the HF rotary embedding returns them."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(dtype)[None].expand(batch, seq, head_dim).contiguous()
    sin = emb.sin().to(dtype)[None].expand(batch, seq, head_dim).contiguous()
    return cos, sin


def _rotate_half(x):
    import torch

    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope64(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _rms64(x, w, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


# ----------------------------------------------------------------------------- binding
def resolve_entry(mod: Any, names: Sequence[str]) -> tuple[Callable, str]:
    for n in names:
        fn = getattr(mod, n, None)
        if callable(fn):
            return fn, n
    public = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")
                    and getattr(v, "__module__", None) == mod.__name__)
    raise LookupError(f"none of the entry points {list(names)} in the generated module; it defines {public}")


def bind(fn: Callable, synonyms: Mapping[str, Sequence[str]], order: Sequence[str]) -> Callable[[Mapping[str, Any]], Any]:
    """Return ``call(values)`` that calls ``fn`` with ``values`` (canonical name -> value) matched to
    its parameters by name (``synonyms``), falling back to canonical ``order`` for unnamed positions."""
    sig = inspect.signature(fn)
    plan: list[tuple[str, str, bool]] = []     # (param name, canonical, keyword?)
    used: set[str] = set()
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    lookup = {}
    for canon, names in synonyms.items():
        for n in (canon, *names):
            lookup.setdefault(n, canon)
    for i, p in enumerate(params):
        canon = lookup.get(p.name)
        if canon is not None and canon not in used:
            plan.append((p.name, canon, p.kind != p.POSITIONAL_ONLY))
            used.add(canon)
        elif p.default is inspect.Parameter.empty:
            rest = [c for c in order if c not in used]
            if not rest:
                raise TypeError(f"cannot bind parameter '{p.name}' of {fn.__name__}{sig}")
            plan.append((p.name, rest[0], False))
            used.add(rest[0])
    positional = all(not kw for _, _, kw in plan)

    def call(values: Mapping[str, Any]):
        if positional:
            return fn(*[values[c] for _, c, _ in plan])
        args, kwargs = [], {}
        for name, c, kw in plan:
            if kw:
                kwargs[name] = values[c]
            else:
                args.append(values[c])
        return fn(*args, **kwargs)

    call.signature = f"{fn.__name__}{sig}"  # type: ignore[attr-defined]
    call.bound = [(n, c) for n, c, _ in plan]  # type: ignore[attr-defined]
    return call


def as_tuple(out: Any) -> tuple:
    import torch

    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(o for o in out if isinstance(o, torch.Tensor))
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return (loss,)
    raise TypeError(f"unexpected output type {type(out).__name__}")


# ----------------------------------------------------------------------------- base family
@dataclass
class Family:
    name: str
    op: str
    title: str
    act_names: tuple[str, ...]
    act_grad: tuple[str, ...]
    param_grad: tuple[str, ...]
    out_names: tuple[str, ...]
    entry_names: tuple[str, ...]
    synonyms: dict[str, tuple[str, ...]]
    canon_order: tuple[str, ...]
    issue: list[dict] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)
    tiny: list[dict] = field(default_factory=list)
    peers: tuple[str, ...] = ("hf", "compile", "liger")
    target_note: str = ""
    # flags written into the planning rule (``lm_head: Linear -> op(mode=fused)``), for a family
    # that benchmarks another mode of an op another family already covers
    flags: dict = field(default_factory=dict)
    # a family whose peers are measured under another family's name (same shapes): comparisons
    # use that family's peer rows, and its patchdsl row as the peer "<name>" (the other mode)
    peers_from: str = ""

    # -- shapes
    def shapes(self, group: str) -> list[dict]:
        return {"issue": self.issue, "sweep": self.sweep, "tiny": self.tiny}[group]

    def label(self, shape: Mapping[str, Any]) -> str:
        return shape.get("label") or "x".join(str(v) for k, v in shape.items() if k != "label")

    # -- inputs (override)
    def make_params(self, shape, dtype, device, g) -> dict:
        return {}

    def make_act(self, shape, dtype, device, g) -> dict:
        raise NotImplementedError

    def make_dys(self, shape, dtype, device, g) -> list:
        raise NotImplementedError

    # -- reference (float64, autograd by default)
    def ref_forward(self, p: dict, a: dict) -> tuple:
        raise NotImplementedError

    def reference(self, params: dict, act: dict, dys: list) -> tuple[tuple, dict]:
        import torch

        p64 = {k: (v.detach().double().requires_grad_(k in self.param_grad) if v.is_floating_point() else v)
               for k, v in params.items()}
        a64 = {k: (v.detach().double().requires_grad_(k in self.act_grad) if v.is_floating_point() else v)
               for k, v in act.items()}
        with torch.enable_grad():
            outs = self.ref_forward(p64, a64)
            leaves = [a64[n] for n in self.act_grad] + [p64[n] for n in self.param_grad]
            diff = [(o, d) for o, d in zip(outs, dys) if o.requires_grad]
            gr = torch.autograd.grad([o for o, _ in diff], leaves,
                                     [None if d is None else d.double() for _, d in diff])
        names = list(self.act_grad) + list(self.param_grad)
        return tuple(o.detach() for o in outs), dict(zip(names, (x.detach() for x in gr)))

    # -- accounting (override)
    def nbytes(self, shape, esize: int) -> dict[str, float]:
        raise NotImplementedError

    def nflops(self, shape) -> dict[str, float] | None:
        return None

    # -- planning the patchdsl kernel (override)
    def plan_model(self, shape, dtype: str) -> tuple[Any, list[str]]:
        raise NotImplementedError

    def patchdsl_values(self, params: dict, act: dict) -> dict:
        v = dict(params)
        v.update(act)
        return v

    def fix_outputs(self, outs: tuple, ref_shapes: list) -> tuple[tuple, str | None]:
        return outs, None

    # -- peers (override)
    def hf(self, params: dict, shape) -> Callable:
        raise Unavailable("no HF reference for this op")

    def liger(self, params: dict, shape) -> Callable:
        raise Unavailable("no Liger-Kernel equivalent")

    def cce(self, params: dict, shape) -> Callable:
        raise Unavailable("no Cut Cross-Entropy equivalent")


def _qwen3(hidden=1024, inter=3072, heads=16, kv=8, head_dim=128, vocab=1000, tie=False):
    from patchdsl.model.hf import default_config

    return default_config("qwen3", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                          vocab_size=vocab, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                          rope_theta=1_000_000.0)


def _meta_lm(cfg, dtype: str):
    import torch

    from patchdsl.model.hf import build_model

    with torch.device("meta"):
        return build_model(cfg, dtype=torch_dtype(dtype))


def _liger(modname: str, attr: str):
    import importlib

    try:
        m = importlib.import_module(modname)
    except Exception as e:  # not installed, or it fails to import here
        raise Unavailable(f"liger_kernel not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    try:
        return getattr(m, attr)
    except AttributeError:
        raise Unavailable(f"{modname}.{attr} not found in this liger_kernel version")


# ----------------------------------------------------------------------------- RMSNorm
class RMSNormFamily(Family):
    EPS = 1e-6

    def make_params(self, shape, dtype, device, g):
        return {"w": _param(_randn(g, (shape["hidden"],), device, torch_dtype(dtype), 0.1, 1.0))}

    def make_act(self, shape, dtype, device, g):
        return {"x": _randn(g, (shape["tokens"], shape["hidden"]), device, torch_dtype(dtype)).requires_grad_()}

    def make_dys(self, shape, dtype, device, g):
        return [_randn(g, (shape["tokens"], shape["hidden"]), device, torch_dtype(dtype))]

    def ref_forward(self, p, a):
        return (_rms64(a["x"], p["w"], self.EPS),)

    def nbytes(self, shape, esize):
        t, h = shape["tokens"], shape["hidden"]
        f = (2 * t * h + h) * esize
        b = (3 * t * h + 2 * h) * esize
        return {"fwd": f, "bwd": b, "fwd_bwd": f + b}

    def plan_model(self, shape, dtype):
        return _meta_lm(_qwen3(hidden=shape["hidden"]), dtype), ["model.norm"]

    def _hf_module(self, params, shape):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        m = Qwen3RMSNorm(shape["hidden"], eps=self.EPS)
        m.weight = params["w"]
        return m

    def hf(self, params, shape):
        m = self._hf_module(params, shape)

        def hf_rmsnorm(x):
            return m(x)

        return hf_rmsnorm

    def liger(self, params, shape):
        fn = _liger("liger_kernel.transformers.functional", "liger_rms_norm")
        w = params["w"]
        eps = self.EPS

        def liger_rmsnorm(x):
            # in_place=False: with in_place=True Liger overwrites dy with dx, which a replayed graph would feed back.
            return fn(x, w, eps, 0.0, "llama", False)

        return liger_rmsnorm


class AddRMSNormFamily(RMSNormFamily):
    def make_act(self, shape, dtype, device, g):
        dt = torch_dtype(dtype)
        return {"x": _randn(g, (shape["tokens"], shape["hidden"]), device, dt).requires_grad_(),
                "residual": _randn(g, (shape["tokens"], shape["hidden"]), device, dt).requires_grad_()}

    def make_dys(self, shape, dtype, device, g):
        dt = torch_dtype(dtype)
        return [_randn(g, (shape["tokens"], shape["hidden"]), device, dt),
                _randn(g, (shape["tokens"], shape["hidden"]), device, dt)]

    def ref_forward(self, p, a):
        s = a["x"] + a["residual"]
        return (_rms64(s, p["w"], self.EPS), s)

    def nbytes(self, shape, esize):
        t, h = shape["tokens"], shape["hidden"]
        f = (4 * t * h + h) * esize          # read x, residual, w; write y, x + residual
        b = (4 * t * h + 2 * h) * esize      # read dy, d(sum), sum; write dx (= d residual); dw
        return {"fwd": f, "bwd": b, "fwd_bwd": f + b}

    def plan_model(self, shape, dtype):
        return (_meta_lm(_qwen3(hidden=shape["hidden"]), dtype),
                ["model.layers.0.post_attention_layernorm", "model.layers.0", "model.norm"])

    def hf(self, params, shape):
        m = self._hf_module(params, shape)

        def hf_add_rmsnorm(x, residual):
            s = residual + x
            return m(s), s

        return hf_add_rmsnorm

    def liger(self, params, shape):
        fn = _liger("liger_kernel.transformers.functional", "liger_fused_add_rms_norm")
        w, eps = params["w"], self.EPS

        def liger_add_rmsnorm(x, residual):
            return fn(x, residual, w, eps, 0.0, "llama", False)

        return liger_add_rmsnorm


class LayerNormFamily(Family):
    EPS = 1e-5

    def make_params(self, shape, dtype, device, g):
        dt = torch_dtype(dtype)
        return {"w": _param(_randn(g, (shape["hidden"],), device, dt, 0.1, 1.0)),
                "b": _param(_randn(g, (shape["hidden"],), device, dt, 0.1))}

    def make_act(self, shape, dtype, device, g):
        return {"x": _randn(g, (shape["tokens"], shape["hidden"]), device, torch_dtype(dtype), 1.0, 0.3).requires_grad_()}

    def make_dys(self, shape, dtype, device, g):
        return [_randn(g, (shape["tokens"], shape["hidden"]), device, torch_dtype(dtype))]

    def ref_forward(self, p, a):
        import torch.nn.functional as F

        return (F.layer_norm(a["x"], (a["x"].shape[-1],), p["w"], p["b"], self.EPS),)

    def nbytes(self, shape, esize):
        t, h = shape["tokens"], shape["hidden"]
        f = (2 * t * h + 2 * h) * esize
        b = (3 * t * h + 4 * h) * esize
        return {"fwd": f, "bwd": b, "fwd_bwd": f + b}

    def plan_model(self, shape, dtype):
        import torch

        class LayerNormHolder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = torch.nn.LayerNorm(shape["hidden"], eps=LayerNormFamily.EPS, dtype=torch_dtype(dtype))

        with torch.device("meta"):
            return LayerNormHolder(), ["norm"]

    def hf(self, params, shape):
        import torch

        m = torch.nn.LayerNorm(shape["hidden"], eps=self.EPS)
        m.weight, m.bias = params["w"], params["b"]

        def hf_layernorm(x):
            return m(x)

        return hf_layernorm

    def liger(self, params, shape):
        fn = _liger("liger_kernel.transformers.functional", "liger_layer_norm")
        w, b, eps = params["w"], params["b"], self.EPS

        def liger_layernorm(x):
            return fn(x, w, b, eps)

        return liger_layernorm


# ----------------------------------------------------------------------------- GLU
class GLUFamily(Family):
    activation = "silu"           # HF ACT2FN name
    ref_approx = None

    def make_act(self, shape, dtype, device, g):
        dt = torch_dtype(dtype)
        return {"gate": _randn(g, (shape["tokens"], shape["intermediate"]), device, dt).requires_grad_(),
                "up": _randn(g, (shape["tokens"], shape["intermediate"]), device, dt).requires_grad_()}

    def make_dys(self, shape, dtype, device, g):
        return [_randn(g, (shape["tokens"], shape["intermediate"]), device, torch_dtype(dtype))]

    def ref_forward(self, p, a):
        import torch.nn.functional as F

        gate = a["gate"]
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate=self.ref_approx or "none")
        return (act * a["up"],)

    def nbytes(self, shape, esize):
        n = shape["tokens"] * shape["intermediate"]
        return {"fwd": 3 * n * esize, "bwd": 5 * n * esize, "fwd_bwd": 8 * n * esize}

    def plan_model(self, shape, dtype):
        return _meta_lm(_qwen3(inter=shape["intermediate"]), dtype), ["model.layers.0.mlp"]

    def hf(self, params, shape):
        from transformers.activations import ACT2FN

        act_fn = ACT2FN[self.activation]

        def hf_glu(gate, up):
            return act_fn(gate) * up         # Qwen3MLP / GemmaMLP: act_fn(gate_proj(x)) * up_proj(x)

        return hf_glu

    liger_function = "LigerSiLUMulFunction"

    def liger(self, params, shape):
        fn = _liger("liger_kernel.ops", self.liger_function).apply

        def liger_glu(gate, up):
            return fn(gate, up)

        return liger_glu


class GeGLUFamily(GLUFamily):
    activation = "gelu_pytorch_tanh"
    ref_approx = "tanh"

    def plan_model(self, shape, dtype):
        from patchdsl.model.hf import default_config

        cfg = default_config("gemma3_text", hidden_size=1152, intermediate_size=shape["intermediate"],
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=256, vocab_size=1000, hidden_activation="gelu_pytorch_tanh")
        return _meta_lm(cfg, dtype), ["model.layers.0.mlp"]

    liger_function = "LigerGELUMulFunction"


# ----------------------------------------------------------------------------- RoPE
class RopeFamily(Family):
    THETA = 1_000_000.0

    def _dims(self, shape):
        return shape["batch"], shape["seq"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]

    def make_params(self, shape, dtype, device, g):
        b, s, _, _, d = self._dims(shape)
        cos, sin = rotary_cos_sin(b, s, d, self.THETA, device, torch_dtype(dtype))
        return {"cos": cos, "sin": sin}

    def make_act(self, shape, dtype, device, g):
        # The projections' outputs viewed as (batch, seq, heads, head_dim), as in the HF attention.
        b, s, hq, hk, d = self._dims(shape)
        dt = torch_dtype(dtype)
        return {"q": _randn(g, (b, s, hq, d), device, dt).requires_grad_(),
                "k": _randn(g, (b, s, hk, d), device, dt).requires_grad_()}

    def make_dys(self, shape, dtype, device, g):
        # (batch, heads, seq, dim) views of (batch, seq, heads, dim) memory: the layout in which
        # sdpa's backward hands back the gradient of a transposed q/k (empty_like keeps strides).
        b, s, hq, hk, d = self._dims(shape)
        dt = torch_dtype(dtype)
        return [_randn(g, (b, s, hq, d), device, dt).transpose(1, 2), _randn(g, (b, s, hk, d), device, dt).transpose(1, 2)]

    def ref_forward(self, p, a):
        return _rope64(a["q"].transpose(1, 2), a["k"].transpose(1, 2), p["cos"], p["sin"])

    def nbytes(self, shape, esize):
        b, s, hq, hk, d = self._dims(shape)
        qk = b * s * (hq + hk) * d
        cs = 2 * b * s * d
        return {"fwd": (2 * qk + cs) * esize, "bwd": (2 * qk + cs) * esize, "fwd_bwd": (4 * qk + 2 * cs) * esize}

    def plan_model(self, shape, dtype):
        from patchdsl.model.hf import default_config

        _, _, hq, hk, d = self._dims(shape)
        cfg = default_config("llama", hidden_size=hq * d, intermediate_size=256, num_hidden_layers=1,
                             num_attention_heads=hq, num_key_value_heads=hk, head_dim=d, vocab_size=1000,
                             rope_theta=self.THETA)
        return _meta_lm(cfg, dtype), ["model.layers.0.self_attn"]

    def patchdsl_values(self, params, act):
        # patchdsl's rope takes q, k in the projection layout (batch, seq, heads, dim), before HF's
        # transpose, and returns that layout (fix_outputs turns it into HF's view for comparison).
        v = dict(params)
        v.update(act)
        return v

    def fix_outputs(self, outs, ref_shapes):
        # Accept (batch, seq, heads, dim) outputs too: a transpose view, free.
        fixed, note = [], None
        for o, rs in zip(outs, ref_shapes):
            if tuple(o.shape) != tuple(rs) and o.dim() == 4 and tuple(o.transpose(1, 2).shape) == tuple(rs):
                o, note = o.transpose(1, 2), "outputs in (batch, seq, heads, dim) layout"
            fixed.append(o)
        return tuple(fixed) + tuple(outs[len(ref_shapes):]), note

    def _hf_rope(self):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        return apply_rotary_pos_emb

    def hf(self, params, shape):
        rope = self._hf_rope()
        cos, sin = params["cos"], params["sin"]

        def hf_rope(q, k):
            return rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

        return hf_rope

    def liger(self, params, shape):
        fn = _liger("liger_kernel.transformers.rope", "liger_rotary_pos_emb")
        cos, sin = params["cos"], params["sin"]

        def liger_rope(q, k):
            return fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)

        return liger_rope


class QKNormRopeFamily(RopeFamily):
    EPS = 1e-6

    def make_params(self, shape, dtype, device, g):
        p = super().make_params(shape, dtype, device, g)
        d = shape["head_dim"]
        dt = torch_dtype(dtype)
        p["q_weight"] = _param(_randn(g, (d,), device, dt, 0.1, 1.0))
        p["k_weight"] = _param(_randn(g, (d,), device, dt, 0.1, 1.0))
        return p

    def ref_forward(self, p, a):
        q = _rms64(a["q"], p["q_weight"], self.EPS).transpose(1, 2)
        k = _rms64(a["k"], p["k_weight"], self.EPS).transpose(1, 2)
        return _rope64(q, k, p["cos"], p["sin"])

    def nbytes(self, shape, esize):
        b, s, hq, hk, d = self._dims(shape)
        qk = b * s * (hq + hk) * d
        cs = 2 * b * s * d
        f = (2 * qk + cs + 2 * d) * esize
        bw = (3 * qk + cs + 4 * d) * esize       # read dq/dk and the pre-norm q/k, write dq/dk; dw
        return {"fwd": f, "bwd": bw, "fwd_bwd": f + bw}

    def plan_model(self, shape, dtype):
        _, _, hq, hk, d = self._dims(shape)
        return _meta_lm(_qwen3(hidden=1024, heads=hq, kv=hk, head_dim=d), dtype), ["model.layers.0.self_attn"]

    def _norms(self, params, shape):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        qn = Qwen3RMSNorm(shape["head_dim"], eps=self.EPS)
        kn = Qwen3RMSNorm(shape["head_dim"], eps=self.EPS)
        qn.weight, kn.weight = params["q_weight"], params["k_weight"]
        return qn, kn

    def _hf_rope(self):
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        return apply_rotary_pos_emb

    def hf(self, params, shape):
        rope = self._hf_rope()
        qn, kn = self._norms(params, shape)
        cos, sin = params["cos"], params["sin"]

        def hf_qk_norm_rope(q, k):      # Qwen3Attention: q_norm(q_proj(x).view(...)).transpose(1, 2), then RoPE
            return rope(qn(q).transpose(1, 2), kn(k).transpose(1, 2), cos, sin)

        return hf_qk_norm_rope

    def liger(self, params, shape):
        rms = _liger("liger_kernel.transformers.functional", "liger_rms_norm")
        rope = _liger("liger_kernel.transformers.rope", "liger_rotary_pos_emb")
        qw, kw, cos, sin, eps = params["q_weight"], params["k_weight"], params["cos"], params["sin"], self.EPS

        def liger_qk_norm_rope(q, k):   # what apply_liger_kernel_to_qwen3 runs: LigerRMSNorm on q/k, liger RoPE
            return rope(rms(q, qw, eps, 0.0, "llama", False).transpose(1, 2),
                        rms(k, kw, eps, 0.0, "llama", False).transpose(1, 2), cos, sin)

        return liger_qk_norm_rope


# ----------------------------------------------------------------------------- cross entropy
def _ce_chunk_rows(n_cols: int) -> int:
    return max(1, (1 << 27) // max(1, n_cols))


def _store(t):
    """Keep large references in fp32 (rounding 6e-8, far under any kernel's error) to halve memory."""
    import torch

    return t.float() if t.numel() > (1 << 26) else t


def _ce64_chunk(z, y, ok, n_valid):
    """Float64 mean cross entropy of one chunk of logits ``z``: (sum of its rows' losses,
    d(mean loss)/dz), ignored rows (``ok`` false) contributing nothing.  Consumes ``z``."""
    import torch

    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, y.clamp_min(0)[:, None])[:, 0]
    loss_sum = torch.where(ok, lse - picked, torch.zeros_like(lse)).sum()
    p = torch.softmax(z, dim=-1)
    del z
    p[torch.arange(p.shape[0], device=p.device), y.clamp_min(0)] -= 1.0
    p *= (ok.double() / n_valid)[:, None]
    return loss_sum, p


class CrossEntropyFamily(Family):
    def make_act(self, shape, dtype, device, g):
        n, v = shape["tokens"], shape["vocab"]
        return {"logits": _randn(g, (n, v), device, torch_dtype(dtype), 2.0).requires_grad_(),
                "labels": _labels(g, n, v, device)}

    def make_dys(self, shape, dtype, device, g):
        return [None]

    def reference(self, params, act, dys):
        import torch

        logits, labels = act["logits"].detach(), act["labels"]
        n, v = logits.shape
        valid = labels != IGNORE_INDEX
        n_valid = valid.sum().double().clamp_min(1)
        grad = torch.empty((n, v), dtype=torch.float32 if n * v > (1 << 26) else torch.float64, device=logits.device)
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        step = _ce_chunk_rows(v)
        for i in range(0, n, step):
            loss_sum, p = _ce64_chunk(logits[i:i + step].double(), labels[i:i + step], valid[i:i + step], n_valid)
            total += loss_sum
            grad[i:i + step] = p
            del p
        return (total / n_valid,), {"logits": grad}

    def nbytes(self, shape, esize):
        n, v = shape["tokens"], shape["vocab"]
        return {"fwd": n * v * esize + 8 * n, "bwd": 2 * n * v * esize + 8 * n, "fwd_bwd": 2 * n * v * esize + 8 * n}

    def plan_model(self, shape, dtype):
        return _meta_lm(_qwen3(vocab=shape["vocab"]), dtype), ["lm_head", ""]

    def hf(self, params, shape):
        import torch.nn.functional as F

        def hf_cross_entropy(logits, labels):     # transformers' ForCausalLMLoss: upcast to fp32, mean over valid
            return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="mean")

        return hf_cross_entropy

    def liger(self, params, shape):
        cls = _liger("liger_kernel.transformers.cross_entropy", "LigerCrossEntropyLoss")
        m = cls(ignore_index=IGNORE_INDEX, reduction="mean")

        def liger_cross_entropy(logits, labels):
            return m(logits, labels)

        return liger_cross_entropy


class LinearCrossEntropyFamily(Family):
    def make_params(self, shape, dtype, device, g):
        h, v = shape["hidden"], shape["vocab"]
        return {"weight": _param(_randn(g, (v, h), device, torch_dtype(dtype), 2.0 / math.sqrt(h)))}

    def make_act(self, shape, dtype, device, g):
        n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
        return {"hidden": _randn(g, (n, h), device, torch_dtype(dtype)).requires_grad_(),
                "labels": _labels(g, n, v, device)}

    def make_dys(self, shape, dtype, device, g):
        return [None]

    def reference(self, params, act, dys):
        import torch

        h = act["hidden"].detach().double()
        w = params["weight"].detach().double()
        labels = act["labels"]
        n, v = h.shape[0], w.shape[0]
        valid = labels != IGNORE_INDEX
        n_valid = valid.sum().double().clamp_min(1)
        dh = torch.empty_like(h)
        dw = torch.zeros_like(w)
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        step = _ce_chunk_rows(v)
        for i in range(0, n, step):
            hc = h[i:i + step]
            loss_sum, p = _ce64_chunk(hc @ w.T, labels[i:i + step], valid[i:i + step], n_valid)
            total += loss_sum
            dh[i:i + step] = p @ w
            dw += p.T @ hc
            del p
        return (total / n_valid,), {"hidden": _store(dh), "weight": _store(dw)}

    def nbytes(self, shape, esize):
        n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
        io = (n * h + v * h) * esize
        return {"fwd": io + 8 * n, "bwd": 2 * io + 8 * n, "fwd_bwd": 2 * io + 8 * n}

    def nflops(self, shape):
        n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
        return {"fwd": 2.0 * n * h * v, "bwd": 4.0 * n * h * v, "fwd_bwd": 6.0 * n * h * v}

    def plan_model(self, shape, dtype):
        return _meta_lm(_qwen3(hidden=shape["hidden"], vocab=shape["vocab"]), dtype), ["lm_head"]

    def patchdsl_values(self, params, act):
        v = dict(params)
        v.update(act)
        v["bias"] = None          # the lm_head has no bias
        return v

    def hf(self, params, shape):
        import torch
        import torch.nn.functional as F

        lm_head = torch.nn.Linear(shape["hidden"], shape["vocab"], bias=False, device="meta")
        lm_head.weight = params["weight"]

        def hf_linear_cross_entropy(hidden, labels):   # logits = lm_head(h); then ForCausalLMLoss
            logits = lm_head(hidden)
            return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="mean")

        return hf_linear_cross_entropy

    def liger(self, params, shape):
        cls = _liger("liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss")
        m = cls(ignore_index=IGNORE_INDEX, reduction="mean")
        w = params["weight"]

        def liger_linear_cross_entropy(hidden, labels):
            return m(w, hidden, labels)

        return liger_linear_cross_entropy

    def cce(self, params, shape):
        try:
            from cut_cross_entropy import linear_cross_entropy
        except Exception as e:
            raise Unavailable(f"cut_cross_entropy not importable ({type(e).__name__}: {e})")
        w = params["weight"]

        def cce_linear_cross_entropy(hidden, labels):
            return linear_cross_entropy(hidden, w, labels, ignore_index=IGNORE_INDEX, reduction="mean")

        return cce_linear_cross_entropy


class LinearLogprobsFamily(LinearCrossEntropyFamily):
    """Per-token log-prob of the targets and entropy from hidden states + lm_head (temperature 1),
    with a random upstream gradient for each (what DPO/GRPO losses feed back)."""

    def make_dys(self, shape, dtype, device, g):
        n = shape["tokens"]
        return [_randn(g, (n,), device, _f32()), _randn(g, (n,), device, _f32(), 0.1)]

    def reference(self, params, act, dys):
        import torch

        h = act["hidden"].detach().double()
        w = params["weight"].detach().double()
        y = act["labels"]
        ok = y != IGNORE_INDEX
        g_lp, g_ent = (d.double() for d in dys)
        n, v = h.shape[0], w.shape[0]
        lp = torch.zeros(n, dtype=torch.float64, device=h.device)
        ent = torch.zeros_like(lp)
        dh = torch.empty_like(h)
        dw = torch.zeros_like(w)
        step = _ce_chunk_rows(v)
        for i in range(0, n, step):
            hc, yc, okc = h[i:i + step], y[i:i + step], ok[i:i + step]
            z = hc @ w.T
            ls = z.log_softmax(-1)
            p = ls.exp()
            del z
            e = -(p * ls).sum(-1)
            lt = ls.gather(1, yc.clamp(min=0)[:, None])[:, 0]
            lp[i:i + step] = torch.where(okc, lt, 0.0)
            ent[i:i + step] = torch.where(okc, e, 0.0)
            # d lp/dz = onehot - p;  d ent/dz = -p (z - E[z]) = p (ls + ent)   (z - E[z] = ls + H)
            gl = torch.where(okc, g_lp[i:i + step], 0.0)[:, None]
            ge = torch.where(okc, g_ent[i:i + step], 0.0)[:, None]
            dz = -p * gl - ge * p * (ls + e[:, None])
            del ls, p
            dz.scatter_add_(1, yc.clamp(min=0)[:, None], gl)
            dh[i:i + step] = dz @ w
            dw += dz.T @ hc
            del dz
        return (lp, ent), {"hidden": _store(dh), "weight": _store(dw)}

    def nbytes(self, shape, esize):
        n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
        io = (n * h + v * h) * esize
        return {"fwd": io + 16 * n, "bwd": 2 * io + 24 * n, "fwd_bwd": 2 * io + 24 * n}

    def nflops(self, shape):
        n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]     # the backward recomputes the logits
        return {"fwd": 2.0 * n * h * v, "bwd": 6.0 * n * h * v, "fwd_bwd": 8.0 * n * h * v}

    def hf(self, params, shape):
        import torch

        lm_head = torch.nn.Linear(shape["hidden"], shape["vocab"], bias=False, device="meta")
        lm_head.weight = params["weight"]

        def hf_linear_logprobs(hidden, labels):    # TRL without its fused head: logits, log_softmax, gather
            logits = lm_head(hidden).float()
            ls = logits.log_softmax(-1)
            ok = labels != IGNORE_INDEX
            lp = ls.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
            ent = -(ls.exp() * ls).sum(-1)
            return torch.where(ok, lp, 0.0), torch.where(ok, ent, 0.0)

        return hf_linear_logprobs

    def liger(self, params, shape):
        raise Unavailable("Liger-Kernel has no per-token log-prob op (its chunked DPO/GRPO losses fuse the loss)")

    def cce(self, params, shape):
        raise Unavailable("Cut Cross-Entropy has no per-token log-prob op")


class LinearJSDFamily(LinearCrossEntropyFamily):
    """Distillation: generalised JSD (beta 0.5, temperature 1, the op's defaults) between a teacher's
    next-token distribution (its hidden states and head, hidden size ``teacher_hidden``) and the
    student's, mean over the non-ignored tokens; gradients to the student's hidden states and head."""

    BETA = 0.5

    def make_act(self, shape, dtype, device, g):
        n, h, v, ht = shape["tokens"], shape["hidden"], shape["vocab"], shape["teacher_hidden"]
        dt = torch_dtype(dtype)
        return {"hidden": _randn(g, (n, h), device, dt).requires_grad_(), "labels": _labels(g, n, v, device),
                "teacher_hidden": _randn(g, (n, ht), device, dt),
                "teacher_weight": _randn(g, (v, ht), device, dt, 2.0 / math.sqrt(ht))}

    @classmethod
    def _jsd64(cls, zs, zt, valid, n_valid):
        s, t = zs.log_softmax(-1), zt.log_softmax(-1)
        b = cls.BETA
        m = torch_logaddexp(s + math.log1p(-b), t + math.log(b))
        jsd = b * (t.exp() * (t - m)).sum(-1) + (1 - b) * (s.exp() * (s - m)).sum(-1)
        return (jsd * valid).sum() / n_valid

    def reference(self, params, act, dys):
        import torch

        h = act["hidden"].detach().double()
        w = params["weight"].detach().double()
        ht, wt = act["teacher_hidden"].double(), act["teacher_weight"].double()
        valid = act["labels"] != IGNORE_INDEX
        n_valid = valid.sum().double().clamp_min(1)
        n, v = h.shape[0], w.shape[0]
        dh = torch.empty_like(h)
        dw = torch.zeros_like(w)
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        step = max(1, _ce_chunk_rows(v) // 2)
        for i in range(0, n, step):
            hc = h[i:i + step]
            with torch.enable_grad():
                zs = (hc @ w.T).requires_grad_()
                loss = self._jsd64(zs, ht[i:i + step] @ wt.T, valid[i:i + step], n_valid)
                (gz,) = torch.autograd.grad(loss, zs)
            total += loss.detach()
            dh[i:i + step] = gz @ w
            dw += gz.T @ hc
            del gz, zs
        return (total,), {"hidden": _store(dh), "weight": _store(dw)}

    def nbytes(self, shape, esize):
        n, h, v, ht = shape["tokens"], shape["hidden"], shape["vocab"], shape["teacher_hidden"]
        io = (n * h + v * h + n * ht + v * ht) * esize
        return {"fwd": io + 8 * n, "bwd": io + (n * h + v * h) * esize, "fwd_bwd": io + (n * h + v * h) * esize}

    def nflops(self, shape):
        n, h, v, ht = shape["tokens"], shape["hidden"], shape["vocab"], shape["teacher_hidden"]
        return {"fwd": 2.0 * n * v * (h + ht), "bwd": 4.0 * n * h * v, "fwd_bwd": 2.0 * n * v * (3 * h + ht)}

    def patchdsl_values(self, params, act):
        v = dict(params)
        v.update(act)
        v["bias"] = None
        v["teacher_bias"] = None
        return v

    def hf(self, params, shape):
        import torch

        lm_head = torch.nn.Linear(shape["hidden"], shape["vocab"], bias=False, device="meta")
        lm_head.weight = params["weight"]
        beta = self.BETA

        def hf_linear_jsd(hidden, teacher_hidden, teacher_weight, labels):
            # TRL GKDTrainer.generalized_jsd_loss on materialised logits (fp32 softmax math)
            s = lm_head(hidden).float().log_softmax(-1)
            with torch.no_grad():
                t = (teacher_hidden @ teacher_weight.T).float().log_softmax(-1)
            m = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
            jsd = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
            mask = labels != IGNORE_INDEX
            return jsd[mask].sum() / mask.sum().clamp_min(1)

        return hf_linear_jsd

    def liger(self, params, shape):
        cls = _liger("liger_kernel.transformers.fused_linear_jsd", "LigerFusedLinearJSD")
        m = cls(jsd_beta=self.BETA, ignore_index=IGNORE_INDEX, temperature=1.0)
        w = params["weight"]

        def liger_linear_jsd(hidden, teacher_hidden, teacher_weight, labels):
            return m(hidden, w, teacher_hidden, teacher_weight, labels)

        return liger_linear_jsd

    def cce(self, params, shape):
        raise Unavailable("Cut Cross-Entropy has no distillation loss")


def torch_logaddexp(a, b):
    import torch

    return torch.logaddexp(a, b)


def _f32():
    import torch

    return torch.float32


# ----------------------------------------------------------------------------- the table
_ROW_SWEEP = [{"tokens": t, "hidden": h} for h in (1024, 2048, 4096) for t in (4096, 16384)
              if (t, h) != (16384, 1024)]
_GLU_SWEEP = [{"tokens": t, "intermediate": i} for i in (3072, 8192, 14336) for t in (4096, 16384)]
_X = ("x", "hidden_states", "input", "inp", "h", "X")
_W = ("w", "weight", "W", "gamma")


# the two linear cross entropy families (chunked and mode=fused): entry-point names and shapes
_LCE_SYNONYMS = {"hidden": ("hidden", "h", "x", "hidden_states", "input", "e", "_input"),
                 "weight": ("weight", "w", "W", "lm_head_weight", "c", "lin_weight"),
                 "bias": ("bias", "b", "lm_head_bias"),
                 "labels": ("labels", "target", "targets", "y")}


def _lce_shapes() -> dict[str, list[dict]]:
    """Fresh lists per family (a family's shapes are its own to change)."""
    return dict(
        issue=[{"tokens": 16384, "hidden": 1024, "vocab": 151936},
               {"tokens": 8192, "hidden": 2304, "vocab": 256000, "label": "8192x2304x256000 (gemma2 head)"}],
        sweep=[{"tokens": 4096, "hidden": 2048, "vocab": 128256}, {"tokens": 16384, "hidden": 4096, "vocab": 128256}],
        tiny=[{"tokens": 6, "hidden": 32, "vocab": 300}])


def families() -> dict[str, Family]:
    fams: list[Family] = [
        RMSNormFamily(
            "rmsnorm", "fused_rmsnorm", "RMSNorm (Qwen3RMSNorm)", ("x",), ("x",), ("w",), ("y",),
            ("rmsnorm",), {"x": _X, "w": _W}, ("x", "w"),
            issue=[{"tokens": 16384, "hidden": 1024}], sweep=_ROW_SWEEP,
            tiny=[{"tokens": 6, "hidden": 256}, {"tokens": 3, "hidden": 200}],
            target_note="fwd+bwd <= 0.045 ms at 16384x1024"),
        AddRMSNormFamily(
            "add_rmsnorm", "fused_add_rmsnorm", "residual add + RMSNorm", ("x", "residual"), ("x", "residual"),
            ("w",), ("y", "sum"), ("add_rmsnorm", "fused_add_rmsnorm", "add_rms_norm"),
            {"x": _X, "residual": ("residual", "r", "res", "R"), "w": _W}, ("x", "residual", "w"),
            issue=[{"tokens": 16384, "hidden": 1024}], sweep=_ROW_SWEEP, tiny=[{"tokens": 6, "hidden": 256}]),
        LayerNormFamily(
            "layernorm", "fused_layernorm", "LayerNorm (nn.LayerNorm, with bias)", ("x",), ("x",), ("w", "b"),
            ("y",), ("layernorm", "layer_norm"), {"x": _X, "w": _W, "b": ("b", "bias", "beta", "B")},
            ("x", "w", "b"), issue=[{"tokens": 16384, "hidden": 1024}], sweep=_ROW_SWEEP,
            tiny=[{"tokens": 6, "hidden": 256}]),
        GLUFamily(
            "swiglu", "fused_swiglu", "SiLU(gate) * up (Qwen3MLP act part)", ("gate", "up"), ("gate", "up"), (),
            ("out",), ("swiglu", "glu", "silu_mul"), {"gate": ("gate", "g", "a"), "up": ("up", "u", "b")},
            ("gate", "up"), issue=[{"tokens": 16384, "intermediate": 3072}], sweep=[
                s for s in _GLU_SWEEP if (s["tokens"], s["intermediate"]) != (16384, 3072)],
            tiny=[{"tokens": 6, "intermediate": 96}], target_note="<= 0.19 ms at 16384x3072"),
        GeGLUFamily(
            "geglu", "fused_geglu", "GELU-tanh(gate) * up (Gemma MLP act part)", ("gate", "up"), ("gate", "up"), (),
            ("out",), ("geglu", "glu", "gelu_mul"), {"gate": ("gate", "g", "a"), "up": ("up", "u", "b")},
            ("gate", "up"), issue=[{"tokens": 16384, "intermediate": 6912, "label": "16384x6912 (gemma3-1b)"}],
            sweep=_GLU_SWEEP, tiny=[{"tokens": 6, "intermediate": 96}]),
        RopeFamily(
            "rope", "fused_rope", "RoPE on q, k (apply_rotary_pos_emb)", ("q", "k"), ("q", "k"), (), ("q", "k"),
            ("rope", "apply_rope", "rotary", "apply_rotary_pos_emb"),
            {"q": ("q", "query", "query_states", "xq"), "k": ("k", "key", "key_states", "xk"), "cos": ("cos",),
             "sin": ("sin",)}, ("q", "k", "cos", "sin"),
            issue=[{"batch": 8, "seq": 2048, "q_heads": 16, "kv_heads": 8, "head_dim": 128,
                    "label": "8x2048 q16/kv8 d128"}],
            sweep=[{"batch": 8, "seq": 2048, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "label": "8x2048 q32/kv8 d128"},
                   {"batch": 2, "seq": 4096, "q_heads": 16, "kv_heads": 8, "head_dim": 128, "label": "2x4096 q16/kv8 d128"},
                   {"batch": 4, "seq": 2048, "q_heads": 8, "kv_heads": 1, "head_dim": 256, "label": "4x2048 q8/kv1 d256"}],
            tiny=[{"batch": 1, "seq": 8, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "label": "1x8 q4/kv2 d32"}],
            target_note="q,k fwd+bwd <= 0.10 ms at 8x2048 Qwen3 heads"),
        QKNormRopeFamily(
            "qk_norm_rope", "fused_qk_norm_rope", "q_norm/k_norm + RoPE (Qwen3Attention)", ("q", "k"), ("q", "k"),
            ("q_weight", "k_weight"), ("q", "k"), ("qk_norm_rope", "fused_qk_norm_rope"),
            {"q": ("q", "query", "query_states", "xq"), "k": ("k", "key", "key_states", "xk"),
             "q_weight": ("q_weight", "q_w", "qw", "q_norm_weight", "wq"),
             "k_weight": ("k_weight", "k_w", "kw", "k_norm_weight", "wk"), "cos": ("cos",), "sin": ("sin",)},
            ("q", "k", "q_weight", "k_weight", "cos", "sin"),
            issue=[{"batch": 8, "seq": 2048, "q_heads": 16, "kv_heads": 8, "head_dim": 128,
                    "label": "8x2048 q16/kv8 d128"}],
            sweep=[{"batch": 8, "seq": 2048, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "label": "8x2048 q32/kv8 d128"}],
            tiny=[{"batch": 1, "seq": 8, "q_heads": 4, "kv_heads": 2, "head_dim": 32, "label": "1x8 q4/kv2 d32"}]),
        CrossEntropyFamily(
            "cross_entropy", "fused_cross_entropy", "cross entropy on logits (fp32-upcast HF loss)",
            ("logits", "labels"), ("logits",), (), ("loss",), ("cross_entropy", "fused_cross_entropy"),
            {"logits": ("logits", "input", "x", "z", "_input"), "labels": ("labels", "target", "targets", "y")},
            ("logits", "labels"), issue=[{"tokens": 8192, "vocab": 151936}],
            sweep=[{"tokens": t, "vocab": v} for v in (32000, 128256) for t in (4096, 16384)],
            tiny=[{"tokens": 6, "vocab": 300}], target_note="fwd+bwd <= 1.9 ms at 8192x151936"),
        LinearCrossEntropyFamily(
            "linear_cross_entropy", "fused_linear_cross_entropy", "lm_head matmul + cross entropy",
            ("hidden", "labels"), ("hidden",), ("weight",), ("loss",),
            ("linear_cross_entropy", "fused_linear_cross_entropy"),
            _LCE_SYNONYMS, ("hidden", "weight", "labels"), **_lce_shapes(), peers=("hf", "compile", "liger", "cce"),
            target_note="fwd+bwd <= 23 ms and <= 64 MB extra peak at 16384x1024x151936"),
        LinearCrossEntropyFamily(
            "linear_cross_entropy_fused", "fused_linear_cross_entropy",
            "lm_head matmul + cross entropy, mode=fused (logits never in memory; peers: linear_cross_entropy)",
            ("hidden", "labels"), ("hidden",), ("weight",), ("loss",),
            ("linear_cross_entropy", "fused_linear_cross_entropy"),
            _LCE_SYNONYMS, ("hidden", "weight", "labels"), **_lce_shapes(), peers=(), flags={"mode": "fused"},
            peers_from="linear_cross_entropy",
            target_note="fwd+bwd <= 23 ms and <= 64 MB extra peak at 16384x1024x151936 (8NHV: 25.8 ms at 790 TFLOP/s)"),
        # the label range check's cost (issue 22): the same kernels with check_labels=false, same run
        LinearCrossEntropyFamily(
            "linear_cross_entropy_nocheck", "fused_linear_cross_entropy",
            "lm_head matmul + cross entropy, check_labels=false (label range check off; peers: linear_cross_entropy)",
            ("hidden", "labels"), ("hidden",), ("weight",), ("loss",),
            ("linear_cross_entropy", "fused_linear_cross_entropy"),
            _LCE_SYNONYMS, ("hidden", "weight", "labels"), **_lce_shapes(), peers=(), flags={"check_labels": "false"},
            peers_from="linear_cross_entropy",
            target_note="the label check costs < 1% of fwd+bwd (ratio to linear_cross_entropy's patchdsl row)"),
        LinearCrossEntropyFamily(
            "linear_cross_entropy_fused_nocheck", "fused_linear_cross_entropy",
            "lm_head matmul + cross entropy, mode=fused, check_labels=false (peers: linear_cross_entropy)",
            ("hidden", "labels"), ("hidden",), ("weight",), ("loss",),
            ("linear_cross_entropy", "fused_linear_cross_entropy"),
            _LCE_SYNONYMS, ("hidden", "weight", "labels"), **_lce_shapes(), peers=(),
            flags={"mode": "fused", "check_labels": "false"}, peers_from="linear_cross_entropy",
            target_note="the label check costs < 1% of fwd+bwd (ratio to linear_cross_entropy_fused's patchdsl row)"),
        LinearLogprobsFamily(
            "linear_logprobs", "fused_linear_logprobs", "lm_head matmul + per-token log-prob and entropy",
            ("hidden", "labels"), ("hidden",), ("weight",), ("logprob", "entropy"),
            ("linear_logprobs",),
            {"hidden": ("hidden", "h", "x", "hidden_states", "input"),
             "weight": ("weight", "w", "W", "lm_head_weight"), "bias": ("bias", "b", "lm_head_bias"),
             "labels": ("labels", "targets", "target", "y")}, ("hidden", "weight", "labels"),
            issue=[{"tokens": 4096, "hidden": 1024, "vocab": 151936, "label": "4096x1024x151936 (qwen3-0.6b)"}],
            sweep=[{"tokens": 16384, "hidden": 1024, "vocab": 151936}, {"tokens": 8192, "hidden": 4096, "vocab": 128256}],
            tiny=[{"tokens": 6, "hidden": 32, "vocab": 300}], peers=("hf", "compile")),
        LinearJSDFamily(
            "linear_jsd", "fused_linear_jsd", "distillation: two lm_heads + generalised JSD (beta 0.5)",
            ("hidden", "teacher_hidden", "teacher_weight", "labels"), ("hidden",), ("weight",), ("loss",),
            ("linear_jsd",),
            {"hidden": ("hidden", "hs", "student_input", "h", "x"),
             "weight": ("weight", "ws", "student_weight", "w", "W"), "bias": ("bias", "bs", "b"),
             "teacher_hidden": ("teacher_hidden", "ht", "teacher_input"),
             "teacher_weight": ("teacher_weight", "wt", "teacher_w"), "teacher_bias": ("teacher_bias", "bt"),
             "labels": ("labels", "shift_labels", "targets", "y")},
            ("hidden", "weight", "teacher_hidden", "teacher_weight", "labels"),
            issue=[{"tokens": 4096, "hidden": 1024, "teacher_hidden": 2048, "vocab": 151936,
                    "label": "4096x1024 (teacher 2048)x151936 (qwen3-0.6b from 1.7b)"}],
            sweep=[{"tokens": 16384, "hidden": 1024, "teacher_hidden": 2048, "vocab": 151936},
                   {"tokens": 8192, "hidden": 2048, "teacher_hidden": 4096, "vocab": 128256}],
            tiny=[{"tokens": 6, "hidden": 32, "teacher_hidden": 48, "vocab": 300}],
            peers=("hf", "compile", "liger")),
    ]
    return {f.name: f for f in fams}

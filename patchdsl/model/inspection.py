"""``patchdsl inspect``: a model's modules with their structural kinds and the facts a spec author
needs (sizes, eps, offset, activation, rotary layout).

Reads a :class:`~patchdsl.index.ModelIndex` (works on the meta device) and never mutates anything.
Repeated layers are folded: modules whose paths differ only in one layer number and whose class
and facts are equal become one row, ``model.layers.{0..27}.mlp  SwiGLU  hidden=1024 inter=3072 silu``.
By default only the modules a spec is written for are shown (norms, MLPs, attention, the LM head,
and modules that look like one of those but fit no kind); ``everything=True`` shows every module.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .index import ModelIndex

# kinds worth a row by default (Linear only for the LM head)
CONCERN_KINDS = ("RMSNorm", "LayerNorm", "GatedRMSNorm", "SwiGLU", "GeGLU", "MLP", "Attention", "CausalLM", "DecoderLayer")
_INT = re.compile(r"^\d+$")
# names of modules a spec author looks for; when such a module fits no kind, inspect says so
_LOOKS_LIKE = re.compile(r"(norm|mlp|ffn|feed_?forward|attn|attention)$", re.IGNORECASE)
_CLASS_LOOKS_LIKE = re.compile(r"(Norm|NormNP|Norm1P|MLP|Mlp|FeedForward|Attention|Attn)$")


@dataclass(frozen=True)
class Row:
    """One folded row: ``pattern`` names ``paths`` (one module, or layers folded into ``{a..b}``)."""

    pattern: str
    paths: tuple[str, ...]
    cls: str
    kinds: Mapping[str, Mapping[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "paths": list(self.paths), "count": len(self.paths),
                "class": self.cls, "kinds": {k: dict(v) for k, v in self.kinds.items()}}


# ------------------------------------------------------------------ folding paths
def int_set(nums: Iterable[int]) -> str:
    """``{0..27}`` for a run, ``{0,2,5}`` otherwise (the selector syntax of docs/language.md)."""
    ns = sorted(set(nums))
    if len(ns) == 1:
        return str(ns[0])
    if ns == list(range(ns[0], ns[-1] + 1)):
        return "{%d..%d}" % (ns[0], ns[-1])
    return "{" + ",".join(map(str, ns)) + "}"


def fold_paths(paths: Iterable[str]) -> list[str]:
    """Selectors naming exactly ``paths``: paths that differ only in one integer component are
    folded into one selector (``model.layers.{0..3}.mlp``); the others are kept whole.  Order: the
    first path of each group, in the order given."""
    groups: dict[tuple, list[int]] = {}
    singles: dict[str, None] = {}
    order: list[Any] = []
    for p in paths:
        parts = p.split(".")
        ints = [i for i, x in enumerate(parts) if _INT.match(x)]
        if not ints:
            singles[p] = None
            order.append(p)
            continue
        # fold on the last integer component (layer numbers nest as layers.N.experts.M: the last varies)
        i = ints[-1]
        key = (tuple(parts[:i]), tuple(parts[i + 1:]))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(parts[i]))
    out = []
    for k in order:
        if isinstance(k, str):
            out.append(k)
        else:
            pre, post = k
            out.append(".".join(pre + (int_set(groups[k]),) + post))
    return out


# ------------------------------------------------------------------ facts as text
def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def describe(kind: str, f: Mapping[str, Any]) -> str:
    """The facts of one kind on one line, as a spec author reads them."""
    if kind == "RMSNorm":
        s = f"hidden={f.get('hidden')} eps={_num(f.get('eps'))} offset={_num(f.get('offset'))}"
        return s + (f" casting={f['casting']}" if f.get("casting") else "")
    if kind == "GatedRMSNorm":
        return (f"hidden={f.get('hidden')} eps={_num(f.get('eps'))} gate={f.get('activation')} "
                f"casting={f.get('casting')}")
    if kind == "LayerNorm":
        extra = [n for n in ("offset",) if f.get(n)]
        return (f"hidden={f.get('hidden')} eps={_num(f.get('eps'))}" + ("" if f.get("bias") else " no-bias")
                + "".join(f" {n}={_num(f[n])}" for n in extra))
    if kind in ("SwiGLU", "GeGLU"):
        s = f"hidden={f.get('hidden')} inter={f.get('intermediate')} {f.get('activation')}"
        if f.get("fused_gate_up"):
            s += " gate_up-fused"
        if f.get("bias"):
            s += " bias"
        return s
    if kind == "MLP":
        s = (f"hidden={f.get('hidden')} inter={f.get('intermediate')} {f.get('up')}->{f.get('down')} "
             f"{f.get('activation') or 'activation=' + str(f.get('act_class'))}")
        if f.get("up_bias") or f.get("down_bias"):
            s += " bias"
        if f.get("conv1d"):
            s += " conv1d"
        return s
    if kind == "Attention":
        s = (f"heads={f.get('n_heads')} kv={f.get('n_kv_heads')} head_dim={f.get('head_dim')} "
             f"rotary={f.get('rotary_dim')}")
        if f.get("rotary_layout"):
            s += f" layout={f['rotary_layout']}"
        if f.get("rope_input") == "rotary":
            s += " rotary-split"            # the forward splits q/k at rotary_dim itself (Phi, StableLM)
        for n in ("qkv_proj", "out_proj"):
            if f.get(n):
                s += f" {n}={f[n]}"
        if f.get("fused_qkv"):
            s += " qkv-fused"
        qn = f.get("qk_norm")
        if qn:
            s += f" qk_norm(eps={_num(qn.get('eps'))} offset={_num(qn.get('offset'))})"
        return s
    if kind == "CausalLM":
        s = f"vocab={f.get('vocab')} hidden={f.get('hidden')}"
        for n in ("softcap", "logits_scaling", "logit_multiplier"):
            if f.get(n) not in (None, False):
                s += f" {n}={_num(f[n])}"
        if f.get("tied"):
            s += " tied"
        if f.get("bias"):
            s += " bias"
        return s
    if kind == "Linear":
        return f"{f.get('in_features')}->{f.get('out_features')}" + (" bias" if f.get("bias") else "")
    if kind == "DecoderLayer":
        return f"layout={f.get('layout')} hidden={f.get('hidden')}"
    return " ".join(f"{k}={_num(v)}" for k, v in f.items() if not isinstance(v, Mapping))


# ------------------------------------------------------------------ rows
def _wanted(info, index: ModelIndex, everything: bool) -> bool:
    if not info.path:
        return True
    if everything:
        return True
    if any(k in info.kinds for k in CONCERN_KINDS):
        return True
    leaf = info.path.rsplit(".", 1)[-1]
    if leaf == "lm_head":
        return True
    if "Linear" in info.kinds:
        return False
    return bool(_LOOKS_LIKE.search(leaf) or _CLASS_LOOKS_LIKE.search(info.cls))


def rows(index: ModelIndex, *, everything: bool = False, fold: bool = True) -> list[Row]:
    """The rows of ``inspect``: modules (folded over layer numbers when ``fold``) in model order."""
    picked = [i for i in index if _wanted(i, index, everything)]
    if not fold:
        return [Row(i.path, (i.path,), i.cls, dict(i.kinds)) for i in picked]
    groups: dict[tuple, list] = {}
    order: list[tuple] = []
    for i in picked:
        parts = i.path.split(".") if i.path else []
        ints = [n for n, x in enumerate(parts) if _INT.match(x)]
        shape = tuple("#" if n in ints[-1:] else x for n, x in enumerate(parts))
        facts = json.dumps({k: v for k, v in i.kinds.items()}, sort_keys=True, default=repr)
        key = (shape, i.cls, facts)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(i)
    out = []
    for key in order:
        infos = groups[key]
        paths = tuple(i.path for i in infos)
        pattern = fold_paths(paths)
        out.append(Row(pattern[0] if len(pattern) == 1 else ", ".join(pattern), paths, infos[0].cls,
                       dict(infos[0].kinds)))
    return out


def kinds_text(r: Row, *, everything: bool = False) -> tuple[str, str]:
    """(kinds, facts) columns of a row; Linear is shown only when it is all the module is."""
    ks = [k for k in r.kinds if k != "Linear" or everything or len(r.kinds) == 1]
    if not ks:
        return "-", "fits no kind patchdsl knows" if not r.kinds else ""
    return ", ".join(ks), "; ".join(describe(k, r.kinds[k]) for k in ks)


def inspect_model(model: Any, *, everything: bool = False, fold: bool = True) -> dict[str, Any]:
    """What ``patchdsl inspect --json`` prints: the model's class, type, dtype and its rows."""
    from .index import build_index

    index = model if isinstance(model, ModelIndex) else build_index(model)
    return {"model_class": index.model_class, "model_type": index.model_type, "dtype": index.dtype,
            "modules": [r.to_json() for r in rows(index, everything=everything, fold=fold)]}


def render(index: ModelIndex, *, everything: bool = False, fold: bool = True) -> str:
    """The text table of ``patchdsl inspect``: path, class, kinds, facts (one line per row)."""
    rs = rows(index, everything=everything, fold=fold)
    table = [("path", "class", "kinds", "facts")]
    for r in rs:
        k, f = kinds_text(r, everything=everything)
        table.append((r.pattern or "<model>", r.cls, k, f))
    w = [max(len(t[c]) for t in table) for c in range(3)]
    lines = [f"{index.model_class} ({index.model_type or 'no model_type'}, {index.dtype}): "
             f"{len(index)} modules, {len(rs)} rows" + ("" if everything else
                                                      " (norms, MLPs, attention, LM head; --all for every module)")]
    for t in table:
        lines.append(f"{t[0].ljust(w[0])}  {t[1].ljust(w[1])}  {t[2].ljust(w[2])}  {t[3]}".rstrip())
    return "\n".join(lines) + "\n"

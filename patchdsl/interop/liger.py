"""Liger-Kernel's switches translated into a spec: ``liger_kernel_config`` + a model index -> spec text.

Liger-Kernel users turn kernels on with ``TrainingArguments(use_liger_kernel=True,
liger_kernel_config={"rope": True, ...})``.  Liger passes the config as keyword arguments to
``apply_liger_kernel_to_<model_type>``: keys the config leaves out take that function's defaults,
and keys the function does not accept are dropped silently (a misspelt ``"rms_nrom"`` turns
nothing on and says nothing).  Here every key is checked, resolved against the same per-model
defaults, and mapped to the rule that patches the same modules:

    rope                        *.self_attn: Attention -> fused_rope
                                (fused_qk_norm_rope when the attention has q_norm/k_norm and
                                rms_norm is on: the two norms and RoPE in one kernel)
    swiglu                      *.mlp: SwiGLU -> fused_swiglu (and a mixture of experts' silu experts:
                                *.experts: Experts -> fused_experts, as Liger swaps them for LigerExperts)
    geglu                       *.mlp: GeGLU -> fused_geglu
    rms_norm                    every RMSNorm: RMSNorm -> fused_rmsnorm
    layer_norm                  every LayerNorm: LayerNorm -> fused_layernorm
    relu_squared                *.mlp: MLP -> fused_mlp (Nemotron's relu2 MLPs)
    cross_entropy               lm_head: Linear -> fused_cross_entropy(ignore_index=-100)
    fused_linear_cross_entropy  lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100, chunk=auto)

Selectors are written from the model's own module paths (``*.input_layernorm``, ``model.norm``...),
so the spec patches exactly the modules the key names.  A key that is on but whose op fits no
module of the model (``swiglu`` on Gemma's GeGLU MLPs) is a *problem*, reported per site; the
caller decides whether that stops it (``patchdsl translate`` and ``kpatch_strict``) or is a warning.

:func:`translate_liger` is pure: a config and a :class:`~patchdsl.model.index.ModelIndex` in, a
:class:`LigerTranslation` out.  Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..syntax.errors import SpecError, did_you_mean

LIGER_KEYS = ("rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "layer_norm",
              "relu_squared")

# The keys each ``apply_liger_kernel_to_<model_type>`` of Liger-Kernel 0.8.5 accepts, with its defaults, for
# every model type of its MODEL_TYPE_TO_APPLY_LIGER_FN (liger_kernel/transformers/monkey_patch.py; checked
# against the installed Liger by the tests when present).
# Code: r = rope, s = swiglu, g = geglu, c = cross_entropy, f = fused_linear_cross_entropy, n = rms_norm,
# l = layer_norm, q = relu_squared; upper case = default on, lower case = accepted but off by default.
_CODES = {"r": "rope", "s": "swiglu", "g": "geglu", "c": "cross_entropy", "f": "fused_linear_cross_entropy",
          "n": "rms_norm", "l": "layer_norm", "q": "relu_squared"}
_LIGER_TABLE = {
    "deepseek_v2": "rcFNS", "deepseek_v3": "rcFNS", "deepseek_v4": "rcFNs", "exaone4": "RcFNS",
    "falcon_h1": "RcFNS", "gemma": "RcFNG", "gemma2": "RcFNG", "gemma3": "RcFLNG", "gemma3_text": "RcFNG",
    "gemma4": "rcFlNG", "gemma4_text": "rcFNG", "glm4": "rcFNS", "glm4v": "rcFNS", "glm4v_moe": "rcFNS",
    "gpt_oss": "RcFNs", "granite": "RCfNS", "hunyuan_v1_dense": "RcFNS", "hunyuan_v1_moe": "RcFNS",
    "internvl": "cFNL", "llama": "RcFNS", "llama4": "RcFNSL", "llama4_text": "RcFNSL", "llava": "cF",
    "ministral": "RcFNS", "mistral": "RcFNS", "mixtral": "RcFNS", "mllama": "RcFLNS", "mllama_text_model": "RcFLNS",
    "muse_glimmer": "RcFLNS", "nemotron": "QcF", "olmo2": "RcFNS", "olmo3": "RcFNS", "paligemma": "RcFLNG",
    "phi3": "RcFNS", "pixtral": "RNS", "qwen2": "RcFNS", "qwen2_5_vl": "RcFNS", "qwen2_5_vl_text": "RcFNS",
    "qwen2_vl": "RcFNLS", "qwen2_vl_text": "RcFNLS", "qwen3": "RcFNS", "qwen3_5": "rcFNS", "qwen3_5_moe": "rcFNS",
    "qwen3_5_moe_text": "rcFNS", "qwen3_5_text": "rcFNS", "qwen3_moe": "RcFNS", "qwen3_next": "rcFNS",
    "qwen3_vl": "RcFNs", "qwen3_vl_moe": "RcFNS", "qwen3_vl_moe_text": "RcFNS", "qwen3_vl_text": "RcFNs",
    "smollm3": "RcFNS", "smolvlm": "cFNL",
}
# Vision-language model types whose Liger function, given the model, applies the function of the language
# model's own type to the language model (the other keys passed on, the loss keys off: the outer one's loss
# is the model's): Llava, InternVL, SmolVLM.
_LIGER_DELEGATES = ("internvl", "llava", "smolvlm")
LIGER_VERSION = "0.8.5"


def liger_model_types() -> tuple[str, ...]:
    """Every model type Liger-Kernel has an ``apply_liger_kernel_to_*`` function for (sorted)."""
    return tuple(sorted(_LIGER_TABLE))


def liger_defaults(model_type: str | None, text_model_type: str | None = None) -> dict[str, bool] | None:
    """The keys Liger accepts for ``model_type`` with its defaults; None when Liger has no function for it.
    For a vision-language type whose Liger function hands the language model to that model type's own
    function (Llava, InternVL, SmolVLM), ``text_model_type`` (its ``text_config.model_type``) adds those
    keys: what Liger patches on the language model with ``use_liger_kernel`` and no config."""
    code = _LIGER_TABLE.get(model_type or "")
    if code is None:
        return None
    out = {_CODES[c.lower()]: c.isupper() for c in code}
    inner = liger_defaults(text_model_type) if model_type in _LIGER_DELEGATES and text_model_type else None
    for k, v in (inner or {}).items():
        if k not in ("cross_entropy", "fused_linear_cross_entropy"):
            out[k] = out.get(k, False) or v
    return out


def text_model_type_of(model: Any) -> str | None:
    """A vision-language model's ``text_config.model_type`` (None for a model without a text config)."""
    text = getattr(getattr(model, "config", None), "text_config", None)
    mt = getattr(text, "model_type", None)
    return mt if isinstance(mt, str) else None


class LigerConfigError(SpecError):
    """A Liger config that cannot be translated (unknown key, a value that is not a boolean...)."""


def check_liger_config(config: Any, where: str = "liger_kernel_config") -> dict[str, bool]:
    """Validate a ``liger_kernel_config`` mapping: known keys, boolean values.  Returns a plain dict."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise LigerConfigError(f"{where} must be a mapping of Liger keys to true/false, got {type(config).__name__}",
                               hint=f"keys: {', '.join(LIGER_KEYS)}")
    out: dict[str, bool] = {}
    for k, v in config.items():
        if k not in LIGER_KEYS:
            dym = did_you_mean(str(k), LIGER_KEYS)
            raise LigerConfigError(f"unknown {where} key '{k!s:.80}' (Liger would drop it silently)",
                                   hint=(dym + " " if dym else "") + f"allowed keys: {', '.join(LIGER_KEYS)}")
        if not isinstance(v, bool):
            raise LigerConfigError(f"{where} key '{k}' must be true or false, got {_shown(v)}")
        out[str(k)] = v
    return out


def parse_liger_argument(text: str) -> tuple[bool, dict[str, bool] | None]:
    """``--liger`` on the command line: JSON text or ``@file`` (JSON, or YAML for .yaml/.yml).

    Accepted values: a ``liger_kernel_config`` object (``{"rope": true, ...}``); ``true`` or ``{}``
    (``use_liger_kernel`` with no config: Liger's defaults); or a training config holding
    ``use_liger_kernel`` and/or ``liger_kernel_config`` (other keys of such a file are ignored).
    Returns ``(use_liger_kernel, liger_kernel_config or None)``.
    """
    from ..util.files import FileReadError, read_data, show

    src = "--liger"
    if text.startswith("@"):
        src = show(text[1:])
        try:
            value = read_data(text[1:], "liger", what="Liger config")
        except FileReadError as e:
            raise LigerConfigError(str(e), hint='JSON needs double quotes and lower-case true/false: {"rope": true}'
                                   if e.reason == "syntax" else None) from None
    else:
        value = _json(text, src)
    if value is True:
        return True, None
    if value is False or value is None:
        raise LigerConfigError(f"{src} {json.dumps(value)} turns Liger off: there is nothing to translate",
                               hint="give the Liger keys to translate, e.g. --liger '{\"rope\": true, \"rms_norm\": true}', "
                                    "or --liger true for Liger's defaults")
    if isinstance(value, Mapping) and ("use_liger_kernel" in value or "liger_kernel_config" in value):
        use = value.get("use_liger_kernel", False)
        if not isinstance(use, bool):
            raise LigerConfigError(f"{src}: use_liger_kernel must be true or false, got {_shown(use)}")
        cfg = value.get("liger_kernel_config")
        if isinstance(cfg, str):          # TrainingArguments accepts a JSON string here too
            cfg = _json(cfg, f"{src}: liger_kernel_config")
        return use, check_liger_config(cfg) if cfg is not None else None
    if isinstance(value, Mapping):
        return True, check_liger_config(value)
    raise LigerConfigError(f"{src} must be a JSON object of Liger keys (or true for Liger's defaults), got {_shown(value)}",
                           hint=f"e.g. --liger '{{\"rope\": true, \"rms_norm\": true}}'; keys: {', '.join(LIGER_KEYS)}")


def _shown(v: Any) -> str:
    """A value as the user wrote it (JSON: false, null, "yes"), not as Python prints it."""
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _json(text: str, src: str) -> Any:
    from ..util.files import FileReadError, LIMITS, parse_json

    if len(text) > LIMITS["json"]:
        raise LigerConfigError(f"{src} is too large ({len(text):,} characters; at most {LIMITS['json']:,})")
    try:
        return parse_json(text, src)
    except FileReadError as e:
        raise LigerConfigError(str(e), hint='JSON needs double quotes and lower-case true/false: {"rope": true}'
                               if e.reason == "syntax" else None) from None


@dataclass(frozen=True)
class LigerTranslation:
    """The spec equivalent to a Liger config on one model."""

    text: str                                   # spec text ("" when nothing translates)
    keys: tuple[tuple[str, bool], ...]          # every Liger key as resolved (config over defaults)
    rules: tuple[tuple[str, str], ...]          # (Liger key, rule line), in spec order
    problems: tuple[str, ...] = ()              # keys that are on but fit no module, one line per site
    notes: tuple[str, ...] = field(default=())  # how the keys were resolved
    misfits: tuple[tuple[str, str | None], ...] = ()   # (key that fits nothing, the key to use instead or None)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.rules)


def resolve_keys(config: Mapping[str, bool] | None, model_type: str | None,
                 index: Any = None, text_model_type: str | None = None) -> tuple[dict[str, bool], list[str]]:
    """Liger's per-model defaults with ``config`` over them, and notes saying where each came from."""
    notes = []
    given = dict(config or {})
    defaults = liger_defaults(model_type, text_model_type)
    if defaults is None:
        kinds = _present_kinds(index) if index is not None else set()
        defaults = {"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True, "rms_norm": True,
                    "swiglu": "SwiGLU" in kinds, "geglu": "GeGLU" in kinds, "layer_norm": False,
                    "relu_squared": False}
        notes.append(f"Liger {LIGER_VERSION} has no kernels for model type '{model_type}'; keys left out of the "
                     f"config take the common defaults (rope, rms_norm, the MLP's GLU, fused_linear_cross_entropy)")
    elif not given:
        notes.append(f"no liger_kernel_config: Liger's defaults for {model_type} "
                     f"(apply_liger_kernel_to_{model_type} in Liger {LIGER_VERSION})")
    else:
        notes.append(f"keys left out take Liger's defaults for {model_type}")
    keys = {k: bool(defaults.get(k, False)) for k in LIGER_KEYS}
    if given.get("cross_entropy") and given.get("fused_linear_cross_entropy"):
        raise LigerConfigError("cross_entropy and fused_linear_cross_entropy are both true: they are two ways of "
                               "computing the same loss, and Liger refuses the pair too",
                               hint="keep fused_linear_cross_entropy (no logits in memory) or cross_entropy "
                                    "(logits kept), not both")
    if given.get("cross_entropy") and "fused_linear_cross_entropy" not in given and keys["fused_linear_cross_entropy"]:
        keys["fused_linear_cross_entropy"] = False
        notes.append("cross_entropy is on, so fused_linear_cross_entropy (on by Liger's default) is off: the two "
                     "compute the same loss (Liger itself would stop here with an assertion)")
    keys.update(given)
    return keys, notes


def _silu_experts(index: Any, by_kind: Mapping[str, list[str]]) -> list[str]:
    """The routed-experts modules whose activation is silu (what Liger's swiglu key swaps on an MoE)."""
    return [p for p in by_kind.get("Experts", []) if index.infos[p].kinds["Experts"].get("activation") == "silu"]


def _present_kinds(index: Any) -> set[str]:
    return {k for info in index for k in info.kinds if info.path}


def _selectors(paths: list[str], pool: list[str]) -> list[str]:
    """Selectors naming exactly ``paths`` among ``pool`` (the modules of the same kind): ``*.leaf`` for
    a leaf name whose every module of that kind is wanted (and sits below the root), else full paths."""
    leaf_of = {p: p.rsplit(".", 1)[-1] for p in pool}
    wanted = set(paths)
    out: list[str] = []
    done: set[str] = set()
    for p in paths:
        leaf = leaf_of[p]
        if leaf in done:
            continue
        group = [q for q in pool if leaf_of[q] == leaf]
        if len(group) > 1 and all(q in wanted and "." in q for q in group):
            out.append(f"*.{leaf}")
            done.add(leaf)
        else:
            out.append(p)
    return out


def translate_liger(config: Mapping[str, Any] | None, index: Any, *, use_liger_kernel: bool = True,
                    origin: str = "liger_kernel_config", text_model_type: str | None = None) -> LigerTranslation:
    """The spec for ``index``'s model equivalent to Liger's ``config`` (None: ``use_liger_kernel``
    with Liger's defaults).  Raises :class:`LigerConfigError` for an unknown key, a non-boolean
    value, or nothing to translate; per-site misfits are returned in ``problems``.
    ``text_model_type``: a vision-language model's ``text_config.model_type`` (see :func:`liger_defaults`)."""
    given = check_liger_config(config, origin)
    if not use_liger_kernel and config is None:
        raise LigerConfigError("nothing to translate: use_liger_kernel is false and there is no liger_kernel_config",
                               hint="set use_liger_kernel: true (Liger's defaults) or give liger_kernel_config")
    keys, notes = resolve_keys(given if config is not None else None, index.model_type, index, text_model_type)
    infos = [i for i in index if i.path]
    by_kind: dict[str, list[str]] = {}
    for i in infos:
        for k in i.kinds:
            by_kind.setdefault(k, []).append(i.path)
    cls = index.model_class
    rules: list[tuple[str, str]] = []
    problems: list[str] = []
    misfits: dict[str, str | None] = {}

    attn = by_kind.get("Attention", [])
    qk = [p for p in attn if "qk_norm" in index.infos[p].kinds["Attention"]]
    fuse_qk = keys["rope"] and keys["rms_norm"]
    covered = {f"{p}.{c}" for p in (qk if fuse_qk else []) for c in ("q_norm", "k_norm")}

    # rms_norm / layer_norm
    for key, kind, op in (("rms_norm", "RMSNorm", "fused_rmsnorm"), ("layer_norm", "LayerNorm", "fused_layernorm")):
        if not keys[key]:
            continue
        pool = by_kind.get(kind, [])
        want = [p for p in pool if p not in covered]
        if want:
            rules.append((key, f"{', '.join(_selectors(want, pool))}: {kind} -> {op}"))
        elif not pool:
            other = "rms_norm" if kind == "LayerNorm" else "layer_norm"
            alt = " (its norms are " + ("RMSNorms" if by_kind.get("RMSNorm") else "LayerNorms") + f": {other})" \
                if by_kind.get("RMSNorm" if kind == "LayerNorm" else "LayerNorm") else ""
            if key in given:
                problems.append(f"{key}: {cls} has no {kind} module{alt}")
                misfits[key] = other if alt else None
            else:
                # on by Liger's default for the model type, for modules this model does not have (Llama 4's
                # layer_norm is for its vision tower, absent from Llama4ForCausalLM): Liger patches nothing
                notes.append(f"{key} (on by Liger's default) has nothing to patch: {cls} has no {kind} module{alt}")
    # rope
    if keys["rope"]:
        if not attn:
            problems.append(f"rope: {cls} has no attention module with rotary embeddings that patchdsl recognises")
            misfits["rope"] = None
        else:
            plain = [p for p in attn if p not in qk or not fuse_qk]
            fused = [p for p in attn if p in qk and fuse_qk]
            if fused:
                rules.append(("rope", f"{', '.join(_selectors(fused, attn))}: Attention -> fused_qk_norm_rope"))
            if plain:
                rules.append(("rope", f"{', '.join(_selectors(plain, attn))}: Attention -> fused_rope"))
            if fused:
                notes.append("rope + rms_norm on attention with q_norm/k_norm: fused_qk_norm_rope does both norms and "
                             "RoPE in one kernel, so the RMSNorm rule leaves q_norm/k_norm to it")
    # swiglu / geglu
    for key, kind, op, other_key, other_kind in (("swiglu", "SwiGLU", "fused_swiglu", "geglu", "GeGLU"),
                                                 ("geglu", "GeGLU", "fused_geglu", "swiglu", "SwiGLU")):
        if not keys[key]:
            continue
        pool = by_kind.get(kind, [])
        experts = _silu_experts(index, by_kind) if key == "swiglu" else []
        if pool:
            rules.append((key, f"{', '.join(_selectors(pool, pool))}: {kind} -> {op}"))
        if experts:
            # Liger's swiglu on a mixture of experts also swaps the routed experts (LigerExperts, transformers 5)
            rules.append((key, f"{', '.join(_selectors(experts, by_kind['Experts']))}: Experts -> fused_experts"))
        if pool or experts:
            continue
        others = by_kind.get(other_kind, [])
        folded: dict[tuple[str, Any], list[str]] = {}      # one line per class and activation, not per layer
        for p in others:
            folded.setdefault((index.infos[p].cls, index.infos[p].kinds[other_kind].get("activation")), []).append(p)
        for (mcls, act), paths in folded.items():
            where = paths[0] if len(paths) == 1 else f"{len(paths)} modules ({paths[0]}, ...)"
            problems.append(f"{key}: {where} ({mcls}) {'is a' if len(paths) == 1 else 'are'} {other_kind} MLP"
                            f"{'' if len(paths) == 1 else 's'} (activation {act}), not {kind}: use {other_key}")
            misfits[key] = other_key
        if not others:
            problems.append(f"{key}: {cls} has no gated MLP (gate/up/down projections) that patchdsl recognises")
            misfits[key] = None
    # relu_squared (Nemotron): the MLP's relu2 activation
    if keys["relu_squared"]:
        pool = [p for p in by_kind.get("MLP", []) if index.infos[p].kinds["MLP"].get("activation") == "relu2"]
        if pool:
            rules.append(("relu_squared", f"{', '.join(_selectors(pool, by_kind['MLP']))}: MLP -> fused_mlp"))
        else:
            problems.append(f"relu_squared: {cls} has no MLP with a relu2 activation that patchdsl recognises")
            misfits["relu_squared"] = None
    # the loss
    for key, op, flags in (("cross_entropy", "fused_cross_entropy", "ignore_index=-100"),
                           ("fused_linear_cross_entropy", "fused_linear_cross_entropy", "ignore_index=-100, chunk=auto")):
        if not keys[key]:
            continue
        hosts = [i.path for i in index if "CausalLM" in i.kinds]
        heads = [f"{h}.lm_head" if h else "lm_head" for h in hosts]
        heads = [h for h in heads if h in index.infos]
        if heads:
            rules.append((key, f"{', '.join(heads)}: Linear -> {op}({flags})"))
        else:
            problems.append(f"{key}: {cls} has no causal-LM head (self.model + lm_head) for the loss")
            misfits[key] = None
    if not rules and not problems:
        raise LigerConfigError("every Liger key is off: nothing to translate",
                               hint=f"turn on at least one of {', '.join(LIGER_KEYS)}")
    shown = json.dumps({k: v for k, v in keys.items()})
    head = [f"# Liger-Kernel config translated for {cls} ({index.model_type}) by patchdsl",
            f"# {origin} as resolved: {shown}"]
    head += [f"# {n}" for n in notes]
    width = max((len(r) for _, r in rules), default=0)
    body = [f"{r.ljust(width)}   # {k}" for k, r in rules]
    text = "\n".join(head + body) + "\n" if rules else ""
    return LigerTranslation(text, tuple(keys.items()), tuple(rules), tuple(problems), tuple(notes),
                            tuple(misfits.items()))


def fitting_config(t: LigerTranslation, index: Any, text_model_type: str | None = None) -> dict[str, bool] | None:
    """The Liger config closest to ``t``'s that translates on ``index``'s model without a problem: every
    key that fits nothing off, the key its problem names (``use geglu``) on instead; None when no such
    config translates to at least one rule.  Hints print it, so that following them works."""
    if not t.misfits:
        return None
    keys = dict(t.keys)
    for key, instead in t.misfits:
        keys[key] = False
        if instead is not None:
            keys[instead] = True
    try:
        fixed = translate_liger(keys, index, text_model_type=text_model_type)
    except LigerConfigError:
        return None
    return keys if fixed.ok else None

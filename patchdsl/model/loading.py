"""Loading models by Hub id, local directory or config.json, with or without weights.

``load_model(spec)`` resolves ``spec`` in this order:

1. an existing local path: a model directory (``config.json`` plus optional weights) or a
   ``config.json`` file (weights are loaded when they sit next to it);
2. a Hub id whose weights are in the local Hugging Face cache (``local_files_only=True``; no
   network);
3. a Hub id fetched from the Hub, only when ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` are unset,
   after a short reachability probe, so that an unreachable Hub fails in seconds, not minutes;
4. the architecture alone, with seeded random weights, from the cached ``config.json`` if there is
   one, else the config shipped in ``patchdsl/model/configs/``, else (online only) the Hub's
   ``config.json``.

Whatever happens is said in exactly one line through ``log`` and kept in ``LoadedModel.source``.
``meta=True`` builds on the meta device (no weights, no memory; for planning) and ``tiny=True``
shrinks the architecture with ``tiny_config`` (for CPU tests and demos; always random weights).

dtype: ``None`` means the checkpoint's own dtype for loaded weights and the config's dtype
(``torch_dtype``) for meta and full-size random builds; tiny builds default to float32.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..util.vocab import DTYPE_ALIASES, DTYPES, TORCH_NAMES

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
PROBE_TIMEOUT_S = 3.0          # reachability probe before any remote download
_TRUE = {"1", "on", "yes", "true"}

# the dtype names load_model takes: the vocabulary's, its aliases, and f32 / f16
_LOAD_ALIASES = {**DTYPE_ALIASES, "f32": "fp32", "f16": "fp16"}
_DTYPES = {n: TORCH_NAMES[_LOAD_ALIASES.get(n, n)] for n in (*DTYPES, *_LOAD_ALIASES)}


_NOT_PER_LAYER = {"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "mlp_only_layers"}


class ModelLoadError(ValueError):
    """The model spec could not be resolved to weights or an architecture."""


@dataclass
class LoadedModel:
    model: Any                 # a transformers PreTrainedModel (on the meta device when meta=True)
    source: str                # one line: where the weights/architecture came from
    has_weights: bool          # True only when real (pretrained) weights were loaded
    config: Any                # the PretrainedConfig the model was built from


# ---------------------------------------------------------------- shipped configs
def _id_to_file(hub_id: str) -> str:
    return hub_id.replace("/", "__") + ".json"


def shipped_models() -> list[str]:
    """Hub ids whose architecture config ships with patchdsl (no download needed)."""
    return sorted((p.stem.replace("__", "/", 1) for p in CONFIGS_DIR.glob("*.json")), key=str.lower)


def shipped_config_path(hub_id: str) -> Path | None:
    from ..util.files import is_file

    p = CONFIGS_DIR / _id_to_file(hub_id)
    if is_file(p):
        return p
    low = hub_id.lower()           # Hub ids are case-insensitive
    for q in CONFIGS_DIR.glob("*.json"):
        if q.stem.replace("__", "/", 1).lower() == low:
            return q
    return None


# ---------------------------------------------------------------- helpers
def parse_dtype(dtype: Any):
    """"fp32"/"bf16"/"fp16" (and long names), a torch.dtype, None or "auto" -> torch.dtype/None/"auto"."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        s = dtype.strip().lower().removeprefix("torch.")
        if s == "auto":
            return "auto"
        if s in _DTYPES:
            return getattr(torch, _DTYPES[s])
    raise ModelLoadError(f"unknown dtype {dtype!r}: use fp32, bf16 or fp16 (or a torch.dtype)")


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _read_config_dict(path: Path) -> dict:
    from ..util.files import FileReadError, read_json

    try:
        d = read_json(path, "config", what="model config")
    except FileReadError as e:
        raise ModelLoadError(str(e)) from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ModelLoadError(f"'{path}' is not a transformers config.json (no \"model_type\")")
    return d


# config.json fields that are sizes (positive integers) and epsilons / bases (finite numbers >= 0)
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
             "vocab_size", "head_dim", "max_position_embeddings", "moe_intermediate_size", "num_experts",
             "num_local_experts", "num_experts_per_tok", "sliding_window", "query_pre_attn_scalar")
NUMBER_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "partial_rotary_factor",
               "final_logit_softcapping", "attn_logit_softcapping", "logits_scaling", "initializer_range")
POSITIVE_KEYS = ("rope_theta",)        # of NUMBER_KEYS (also inside rope_parameters / rope_scaling): > 0
ROPE_KEYS = ("rope_parameters", "rope_scaling")
MAX_SIZE = 2 ** 31 - 1
# Sizes the generated kernels take (docs/reliability.md, "Bad model configs"):
#   head_dim: the RoPE and q/k-norm kernels hold whole heads of a token in one tile of
#     tokens_per_program x heads x head_dim/2 (padded to powers of two); Triton's largest tile is 2**20 elements.
#   vocab_size: the cross-entropy kernels scale gradient rows on a grid whose second axis is
#     vocab / 4096 programs, and a CUDA grid's second axis has at most 65,535.
KERNEL_LIMITS = {"head_dim": 1024, "vocab_size": 65535 * 4096}


def _finite(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_rope(r: Any, where: str, path: str, depth: int = 0) -> None:
    """Every number of a rope_parameters / rope_scaling object (nested per layer type in Gemma 3) is
    finite; rope_theta and the scaling factors are > 0."""
    if not isinstance(r, dict):
        return
    for k, v in r.items():
        name = f'{where}: "{path}.{k}"'
        if isinstance(v, dict) and depth < 2:
            _check_rope(v, where, f"{path}.{k}", depth + 1)
        elif isinstance(v, list):
            if not all(_finite(x) for x in v):
                raise ModelLoadError(f"{name} must be a list of finite numbers")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if not math.isfinite(v):
                raise ModelLoadError(f"{name} must be a finite number, got {json.dumps(v)}")
            if (k == "rope_theta" or k.endswith("factor")) and v <= 0:
                raise ModelLoadError(f"{name} must be > 0, got {json.dumps(v)[:40]}")


def check_config_dict(d: dict, where: str = "config.json") -> None:
    """Refuse sizes that are not positive integers (strings, fractions, negatives, zero, true/false)
    and numbers that are not finite, with the field's name; nested ``*_config`` objects too.  Also
    refused, naming the field: query heads that are not a multiple of the key/value heads, a RoPE
    base (rope_theta, top level or in rope_parameters / rope_scaling) that is not > 0, and sizes
    above what the kernels take (``KERNEL_LIMITS``)."""
    if not isinstance(d.get("model_type"), str):
        raise ModelLoadError(f"{where}: \"model_type\" must be a string")
    for k in SIZE_KEYS:
        if k not in d or d[k] is None:
            continue
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_SIZE:
            raise ModelLoadError(f"{where}: \"{k}\" must be a positive integer (at most {MAX_SIZE}), "
                                 f"got {json.dumps(v)[:40]}")
    for k in NUMBER_KEYS:
        if k not in d or d[k] is None:
            continue
        v = d[k]
        if not _finite(v) or v < 0 or (k in POSITIVE_KEYS and v == 0):
            raise ModelLoadError(f"{where}: \"{k}\" must be a finite number {'> 0' if k in POSITIVE_KEYS else '>= 0'}, "
                                 f"got {json.dumps(v)[:40]}")
    for k in ROPE_KEYS:
        _check_rope(d.get(k), where, k)
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ModelLoadError(f"{where}: \"num_attention_heads\" ({heads}) must be a multiple of "
                             f"\"num_key_value_heads\" ({kv}): each key/value head serves a whole group of query heads")
    head_dim = d.get("head_dim")
    if head_dim is None and isinstance(heads, int) and isinstance(d.get("hidden_size"), int):
        head_dim = d["hidden_size"] // heads
    sizes = {"head_dim": head_dim, "vocab_size": d.get("vocab_size")}
    for k, limit in KERNEL_LIMITS.items():
        v = sizes[k]
        if isinstance(v, int) and v > limit:
            field = k if k in d else f"{k} (hidden_size / num_attention_heads)"
            raise ModelLoadError(f"{where}: \"{field}\" is {v:,}, above what patchdsl's kernels take "
                                 f"(at most {limit:,}; docs/reliability.md)")
    for k, v in d.items():
        if k.endswith("_config") and isinstance(v, dict) and "model_type" in v:
            check_config_dict(v, f"{where} ({k})")


def config_from_dict(d: dict):
    """A PretrainedConfig from a config.json dict, without remote code (auto_map is ignored)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    check_config_dict(d)
    d = {k: v for k, v in d.items() if k not in ("auto_map", "_name_or_path")}
    model_type = d["model_type"]
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        raise ModelLoadError(f"model_type '{model_type}' is not known to transformers {_transformers_version()} "
                             f"(patchdsl does not run remote code)") from None
    try:
        return cls.from_dict(d)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise ModelLoadError(f"transformers refused this {model_type} config: {_one_line(e)}") from None


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _has_weights(directory: Path) -> bool:
    from ..util.files import is_file

    return any(is_file(directory / f) for f in WEIGHT_FILES)


def _cached(hub_id: str, filename: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    try:
        r = try_to_load_from_cache(hub_id, filename)
    except Exception:          # invalid repo id and the like: simply not cached
        return None
    return r if isinstance(r, str) and os.path.isfile(r) else None


def _one_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def _hub_reachable(hub_id: str) -> str | None:
    """None when the Hub answers for hub_id's config.json within PROBE_TIMEOUT_S, else the reason."""
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        get_hf_file_metadata(hf_hub_url(hub_id, "config.json"), timeout=PROBE_TIMEOUT_S)
        return None
    except Exception as e:  # network down, unknown or gated repo, bad id ...
        return _one_line(e)


def _looks_like_path(spec: str) -> bool:
    """Hub ids are "name" or "org/name"; anything else that does not exist is a mistyped path."""
    return (spec.endswith(".json") or spec.startswith((".", "/", "~")) or spec.count("/") > 1
            or "\\" in spec or (os.altsep is not None and os.altsep in spec))


# ---------------------------------------------------------------- tiny configs
def _round_to(x: float, m: int, lo: int) -> int:
    return max(lo, int(round(x / m)) * m)


def _resample(values: list, n: int) -> list:
    if len(values) == n or not values:
        return list(values)
    return [values[min(len(values) - 1, int(i * len(values) / n))] for i in range(n)]


def tiny_config(config, *, layers: int = 2, vocab: int = 512):
    """A shrunk copy of ``config`` for CPU tests and demos.

    Keeps the family (same config class and model class) and every structural feature: GQA/MQA/MHA,
    head_dim decoupled from hidden/heads (Qwen3, Gemma3) or not, q/k norms, partial rotary, rope
    scaling type, tied embeddings, softcapping, the mix of sliding and full attention layers (a
    sliding window of 8 so that short sequences exercise it), MLP/hidden ratio. Sizes become
    hidden 64-160, head_dim 16 or 32, ``layers`` layers (more when the layer pattern has more kinds)
    and a ``vocab`` vocabulary; special token ids beyond it are moved inside it.  A config already
    smaller keeps its own layer count and vocabulary (tiny never grows a user's model).
    """
    if getattr(config, "text_config", None) is not None and hasattr(config.text_config, "to_dict"):
        # a vision-language model: its language tower shrunk as above, the vision tower by its common
        # size names, multimodal RoPE sections with the head size (patchdsl.model.shrink)
        from .shrink import shrink_composite
        return shrink_composite(config, lambda c: tiny_config(c, layers=layers, vocab=vocab))
    d = config.to_dict()
    H0 = int(d["num_attention_heads"])
    KV0 = int(d.get("num_key_value_heads") or H0)
    hidden0 = int(d["hidden_size"])
    L0 = int(d["num_hidden_layers"])
    hd0 = d.get("head_dim") or hidden0 // H0
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    prf = d.get("partial_rotary_factor") or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)

    # heads: keep MHA / MQA / GQA (and a group ratio up to 4)
    if KV0 >= H0:
        H, KV = 4, 4
    elif KV0 == 1:
        H, KV = min(H0, 4), 1
    else:
        KV = 2
        H = 2 * max(2, min(H0 // KV0, 4))
    # head_dim: coupled (hidden == heads * head_dim) or decoupled, as in the original
    decoupled = hd0 * H0 != hidden0
    hd = 32 if decoupled else 16
    if prf:
        hd = next((c for c in (hd, 32, 64) if abs(c * prf - round(c * prf)) < 1e-9 and round(c * prf) % 2 == 0), hd)
    q = H * hd
    if not decoupled:
        hidden = q
    elif hd0 * H0 > hidden0:
        hidden = q // 2        # e.g. Qwen3: q projection wider than the residual stream
    else:
        hidden = q + 32        # e.g. Gemma3: narrower
    d.update(num_attention_heads=H, num_key_value_heads=KV, hidden_size=hidden)
    if d.get("head_dim") is not None or decoupled:
        d["head_dim"] = hd
    if d.get("query_pre_attn_scalar"):
        qs = d["query_pre_attn_scalar"] * hd / hd0
        d["query_pre_attn_scalar"] = round(qs) if isinstance(d["query_pre_attn_scalar"], int) else qs
    for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(d.get(k), int) and d[k] > 0:
            d[k] = _round_to(d[k] * hidden / hidden0, 16, 16)

    # layers: keep one of each layer kind (sliding/full/...), in order of first appearance
    types = d.get("layer_types")
    idx = sorted(types.index(t) for t in dict.fromkeys(types)) if isinstance(types, list) and len(types) == L0 else []
    n = max(min(layers, L0), len(idx), 1)
    nxt = 0
    while len(idx) < n:
        if nxt not in idx:
            idx.append(nxt)
        nxt += 1
    idx.sort()
    for k, v in list(d.items()):         # per-layer lists (layer_types, no_rope_layers, ...)
        if k in _NOT_PER_LAYER:
            continue
        if isinstance(v, list) and len(v) == L0 and L0 > 1 and all(not isinstance(x, (list, dict)) for x in v):
            d[k] = [v[min(i, L0 - 1)] for i in idx]
    d["num_hidden_layers"] = n
    if isinstance(d.get("max_window_layers"), int):
        d["max_window_layers"] = min(n, round(d["max_window_layers"] * n / L0))
    if d.get("sliding_window"):
        d["sliding_window"] = min(int(d["sliding_window"]), 8)
    _tiny_mamba(d, hidden, hidden0)
    _tiny_moe_defaults(d)
    grouped = _tiny_groups(d)
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if isinstance(d.get(k), int) and d[k] > 4 and not grouped:
            d[k] = 4
    if isinstance(d.get("num_experts_per_tok"), int):
        d["num_experts_per_tok"] = min(d["num_experts_per_tok"], 2)
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] >= n:
        # DeepSeek-V2/V3, dots1: the first k layers dense, the rest MoE; keep one of each (as layer kinds)
        d["first_k_dense_replace"] = n - 1
    _tiny_mla(d)

    # rope: long-rope factor lists follow the rotary dimension
    rot_half = int(hd * (prf or 1.0)) // 2

    def fix_rope(r):
        if isinstance(r, dict):
            for k in ("short_factor", "long_factor"):
                if isinstance(r.get(k), list):
                    r[k] = _resample(r[k], rot_half)
            for v in r.values():
                if isinstance(v, dict):
                    fix_rope(v)
    for k in ("rope_parameters", "rope_scaling"):
        fix_rope(d.get(k))

    # vocabulary and the special ids in it
    vocab = min(vocab, int(d.get("vocab_size") or vocab))
    d["vocab_size"] = vocab
    big = sorted({i for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  for i in (d.get(k) if isinstance(d.get(k), list) else [d.get(k)])
                  if isinstance(i, int) and i >= vocab})
    remap = {old: vocab - 1 - j for j, old in enumerate(big)}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = d.get(k)
        if isinstance(v, list):
            d[k] = [remap.get(i, i) for i in v]
        elif isinstance(v, int):
            d[k] = remap.get(v, v)
    d.pop("transformers_version", None)
    new = type(config).from_dict(d)
    new._name_or_path = f"tiny:{getattr(config, '_name_or_path', '') or d.get('model_type')}"
    return new


# MoE sizes a family's default config leaves None though its modelling code needs them (transformers 5.x):
# the released checkpoint's values (then shrunk as every MoE config is).  DeepSeek-V2 / V2-Lite route 6
# experts per token; dots.llm1 has 128 routed experts, 6 per token, 2 shared, the first layer dense.
_MOE_DEFAULTS = {
    "deepseek_v2": {"num_experts_per_tok": 6},
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1},
}


def _tiny_moe_defaults(d: dict) -> None:
    fills = _MOE_DEFAULTS.get(d.get("model_type"), {})
    no_experts = all(d.get(k) is None for k in ("n_routed_experts", "num_local_experts", "num_experts"))
    for k, v in fills.items():
        if d.get(k) is None or (k == "first_k_dense_replace" and no_experts):
            d[k] = v
            if k == "n_routed_experts":          # its standard names too (the census maps attribute_map's)
                for alias in ("num_local_experts", "num_experts"):
                    if alias in d and d[alias] is None:
                        d[alias] = v


def _tiny_groups(d: dict) -> bool:
    """A grouped router (DeepSeek-V2's group-limited greedy, DeepSeek-V3 / GLM-4.5's grouped top-k:
    ``n_group`` > 1) shrunk with its groups: 8 experts in at most 4 groups of 2 (the top-2 group score
    needs 2 per group), as many groups kept in proportion (at least 1, fewer than all when the original
    drops some), top-k within the kept experts.  True when it did."""
    E = next((d[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if isinstance(d.get(k), int)), None)
    ng, tg = d.get("n_group"), d.get("topk_group")
    if not (isinstance(E, int) and isinstance(ng, int) and isinstance(tg, int) and ng > 1 and E % ng == 0):
        return False
    ng2 = min(ng, 4)
    tg2 = ng2 if tg >= ng else max(1, min(ng2 - 1, round(tg * ng2 / ng)))
    E2 = 2 * ng2
    for k in ("n_routed_experts", "num_experts", "num_local_experts"):
        if isinstance(d.get(k), int):
            d[k] = E2
    d.update(n_group=ng2, topk_group=tg2)
    if isinstance(d.get("num_experts_per_tok"), int):
        d["num_experts_per_tok"] = min(d["num_experts_per_tok"], 2, tg2 * (E2 // ng2))
    return True


def _tiny_mla(d: dict) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``, ``qk_rope_head_dim``): its ranks and
    head sizes shrunk together, the rotary head size its ``head_dim`` (transformers sets it so)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if (not isinstance(d.get("kv_lora_rank"), int) or not isinstance(d.get("qk_rope_head_dim"), int)
            or d["qk_rope_head_dim"] <= 0 or (isinstance(rope, dict) and rope.get("mrope_section"))):
        return       # no MLA, a NoPE one (GLM-5's DSA), or multimodal RoPE sections sized by the shrink elsewhere
    prf = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    hd = round(16 / prf) if isinstance(prf, (int, float)) and 0 < prf < 1 else 16     # Mistral 4: head_dim x prf rotates
    d.update(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, head_dim=hd)
    if isinstance(d.get("q_lora_rank"), int):
        d["q_lora_rank"] = 48


def _tiny_mamba(d: dict, hidden: int, hidden0: int) -> None:
    """The Mamba-2 mixer of a hybrid family (Bamba, Falcon-H1, GraniteMoeHybrid: ``mamba_n_heads``,
    ``mamba_d_head``, ``mamba_d_state``, ``mamba_chunk_size``, Falcon-H1's ``mamba_d_ssm``) shrunk as the
    attention is: its default sizes stay otherwise (128 heads, a 256-wide state, chunks of 256), and
    transformers' reference scan (no ``mamba_ssm`` on a CPU) holds batch x chunk^2 x heads x state
    values, 17 GB at batch 2 in transformers 5.17.  Keeps the families' own checks: heads divide the
    mixer width (``mamba_d_ssm`` or expand x hidden) into ``mamba_d_head``, groups divide heads."""
    if not (isinstance(d.get("mamba_n_heads"), int) and isinstance(d.get("mamba_d_state"), int)):
        return
    if isinstance(d.get("mamba_d_ssm"), int):
        d["mamba_d_ssm"] = _round_to(d["mamba_d_ssm"] * hidden / hidden0, 16, 16)
        width = d["mamba_d_ssm"]
    else:
        width = int(d.get("mamba_expand") or 2) * hidden
    groups = min(int(d.get("mamba_n_groups") or 1), 2)
    heads = next(h for h in (8, 4, 2, 1) if width % h == 0 and h % groups == 0)
    d.update(mamba_n_heads=heads, mamba_d_head=width // heads, mamba_n_groups=groups,
             mamba_d_state=min(d["mamba_d_state"], 16))
    if isinstance(d.get("mamba_chunk_size"), int):
        d["mamba_chunk_size"] = min(d["mamba_chunk_size"], 16)


def _describe_tiny(cfg) -> str:
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg     # a VLM: its language tower
    return (f"tiny {cfg.model_type} (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
            f"{cfg.num_attention_heads}/{getattr(cfg, 'num_key_value_heads', None) or cfg.num_attention_heads} heads, "
            f"vocab {cfg.vocab_size})")


def _describe_sizes(cfg) -> str:
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}"


# ---------------------------------------------------------------- loading
def _from_pretrained(where: str, *, dtype, device: str, attn_implementation, local_only: bool):
    import torch

    kw: dict[str, Any] = {"dtype": "auto" if dtype is None else dtype, "trust_remote_code": False,
                          "local_files_only": local_only}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    dev = torch.device(device)
    if dev.type != "cpu":
        kw["device_map"] = str(dev)
    from transformers import AutoConfig

    model = _auto_class(AutoConfig.from_pretrained(where, local_files_only=local_only)).from_pretrained(where, **kw)
    if dev.type != "cpu" and next(model.parameters()).device != dev:
        model = model.to(dev)
    return model


def _auto_class(cfg):
    """The auto class that builds ``cfg``: the causal LM, or for a vision-language model type without
    one (Qwen2.5-VL, Qwen3-VL, Llava, PaliGemma) its image-text-to-text model (``...ForConditionalGeneration``;
    Gemma 3's causal-LM mapping already names it)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto import modeling_auto as ma

    if (cfg.model_type not in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and cfg.model_type in getattr(ma, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})):
        from transformers import AutoModelForImageTextToText
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _build(cfg, *, dtype, device: str, meta: bool, tiny: bool, seed: int, attn_implementation):
    import torch

    AutoModelForCausalLM = _auto_class(cfg)

    if dtype is None or dtype == "auto":
        cd = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        dtype = torch.float32 if tiny or cd is None else parse_dtype(str(cd))
    kw: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, **kw)
    torch.manual_seed(seed)
    dev = torch.device(device)
    if tiny or dev.type == "cpu":
        # tiny: initialise on the CPU so that every device starts from the same weights
        model = AutoModelForCausalLM.from_config(cfg, **kw)
        return model.to(dev) if dev.type != "cpu" else model
    if dev.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with dev:
        return AutoModelForCausalLM.from_config(cfg, **kw)


def load_model(spec: str | os.PathLike, *, dtype: Any = None, device: str = "cpu", meta: bool = False,
               weights: bool = True, attn_implementation: str | None = None, tiny: bool = False,
               seed: int = 0, log: Callable[[str], Any] | None = print) -> LoadedModel:
    """Load ``spec`` (Hub id, model directory or config.json path); see the module docstring.

    Raises ``ModelLoadError`` when ``spec`` resolves to nothing, with the shipped ids in the message.
    """
    dtype = parse_dtype(dtype)
    if log is None:
        log = lambda _m: None  # noqa: E731
    spec_s = os.fspath(spec)
    want_weights = weights and not meta and not tiny
    path = Path(spec_s).expanduser()

    def done(model, source: str, has_weights: bool) -> LoadedModel:
        log(source)
        return LoadedModel(model, source, has_weights, model.config)

    def from_config(cfg_dict: dict, where: str, why: str | None) -> LoadedModel:
        cfg = config_from_dict(cfg_dict)
        cfg._name_or_path = spec_s
        if tiny:
            full, cfg = cfg, tiny_config(cfg)
        try:
            model = _build(cfg, dtype=dtype, device=device, meta=meta, tiny=tiny, seed=seed,
                           attn_implementation=attn_implementation)
        except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise ModelLoadError(f"cannot build the {cfg.model_type} architecture from {where}: {_one_line(e)}") \
                from None
        if tiny:
            what = f"{_describe_tiny(cfg)}, shrunk from {_describe_sizes(full)} in {where}"
            msg = (f"{spec_s}: {what} on the meta device (no weights)" if meta
                   else f"{spec_s}: {what} with random weights (seed {seed})")
        elif meta:
            msg = f"{spec_s}: architecture from {where} on the meta device (no weights)"
        elif not weights:
            msg = (f"{spec_s}: built the architecture from {where} with random weights "
                   f"(seed {seed}; weights not requested)")
        else:
            msg = (f"no weights for {spec_s} here{why or ''}: built the architecture from {where} "
                   f"with random weights (seed {seed})")
        return done(model, msg, False)

    # 1. local directory or config.json
    hub_shaped = not _looks_like_path(spec_s)
    # a folder named like a Hub id but without config.json does not shadow the Hub id
    from ..util.files import exists, is_dir, is_file, show

    local = exists(path) and not (is_dir(path) and not is_file(path / "config.json") and hub_shaped)
    if local:
        if is_dir(path):
            directory, cfg_path = path, path / "config.json"
            if exists(cfg_path) and not is_file(cfg_path):
                raise ModelLoadError(f"'{show(cfg_path)}' is not a regular file (a folder, FIFO or device); a model "
                                     f"directory holds config.json as a file")
            if not is_file(cfg_path):
                raise ModelLoadError(f"'{show(spec_s)}' is a directory without a config.json; pass a model directory "
                                     f"(config.json plus optional weights) or the path to a config.json")
        else:
            directory, cfg_path = path.parent, path
        cfg_dict = _read_config_dict(cfg_path)
        if want_weights and cfg_path.name == "config.json" and _has_weights(directory):
            model = _from_pretrained(str(directory), dtype=dtype, device=device,
                                     attn_implementation=attn_implementation, local_only=True)
            return done(model, f"{spec_s}: pretrained weights from {directory}", True)
        return from_config(cfg_dict, str(cfg_path), None)
    if not hub_shaped:
        raise ModelLoadError(f"no such file or directory: '{show(spec_s)}' (pass a model directory, a config.json "
                             f"path, or a Hub id such as {shipped_models()[0] if shipped_models() else 'org/name'})")

    # 2./3. Hub id: weights from the local cache, then (online only) from the Hub
    hub_id = spec_s
    offline = _offline()
    why = None
    if want_weights:
        cached_cfg = _cached(hub_id, "config.json")
        if cached_cfg and any(_cached(hub_id, f) for f in WEIGHT_FILES):
            try:
                model = _from_pretrained(hub_id, dtype=dtype, device=device,
                                         attn_implementation=attn_implementation, local_only=True)
                return done(model, f"{hub_id}: pretrained weights from the local Hugging Face cache", True)
            except OSError as e:        # e.g. an incomplete sharded download
                why = f" (the cached weights did not load: {_one_line(e)})"
        if why is None and not offline:
            problem = _hub_reachable(hub_id)
            if problem is None:
                try:
                    model = _from_pretrained(hub_id, dtype=dtype, device=device,
                                             attn_implementation=attn_implementation, local_only=False)
                    return done(model, f"{hub_id}: pretrained weights from the Hugging Face Hub", True)
                except OSError as e:
                    why = f" (download failed: {_one_line(e)})"
            else:
                why = f" (not from the Hub: {problem})"

    # 4. the architecture alone: cached config.json, shipped config, (online) the Hub's config.json
    cached_cfg = _cached(hub_id, "config.json")
    if cached_cfg:
        return from_config(_read_config_dict(Path(cached_cfg)), "its cached config.json", why)
    shipped = shipped_config_path(hub_id)
    if shipped is not None:
        return from_config(_read_config_dict(shipped), "its shipped config", why)
    hub_problem = None
    if not offline:
        hub_problem = _hub_reachable(hub_id)
        if hub_problem is None:
            try:
                from huggingface_hub import hf_hub_download

                p = hf_hub_download(hub_id, "config.json", etag_timeout=PROBE_TIMEOUT_S)
                return from_config(_read_config_dict(Path(p)), "its config.json from the Hub", why)
            except Exception as e:  # noqa: BLE001 - any Hub failure means "not available"
                hub_problem = _one_line(e)
    from ..util.files import show

    hub_note = ("the Hub was not tried (HF_HUB_OFFLINE is set)" if offline
                else f"the Hub did not provide it ({hub_problem})")
    raise ModelLoadError(
        f"unknown model '{show(hub_id)}': not a local directory or config.json, not in the local Hugging Face cache, "
        f"and not a shipped architecture; {hub_note}. Shipped architectures: {', '.join(shipped_models())}. "
        f"For another model pass the path to its config.json (or to a directory holding config.json and "
        f"optionally its weights), e.g. --model path/to/config.json")

"""The one place patchdsl asks transformers for a config or a model, and the one check of a config.

Never remote code.  A model folder or a Hub repository may ship Python files that its
``config.json`` names in ``auto_map``; transformers imports them when asked to (or when a person
answers ``y`` to its "run the custom code?" prompt).  patchdsl never asks and never lets the
prompt appear: every config is made by :func:`config_from_dict` from a dict patchdsl read itself
(``auto_map`` dropped; a ``model_type`` transformers does not know refused), and every model by
:func:`build_model` (``from_config``) or :func:`load_pretrained` (``from_pretrained`` with that
config object), both with ``trust_remote_code=False``.  :func:`default_config` gives a family's
default config (``AutoConfig.for_model``) for the census, the tiny families and the benches.
``tests/hostile/test_config_entries.py`` fails on any other call of transformers' Auto classes,
``from_pretrained``, ``from_config`` or ``for_model`` in patchdsl or its tools.

One check of a config, whatever the entry (Hub id, model folder with or without weights, a
config.json path, the examples): :func:`config_from_dict` refuses, naming the field, sizes that
are not positive integers, numbers that are not finite, RoPE parameters that are not numbers, head
counts that do not divide, sizes above what the kernels take (:func:`check_config_dict`), and
values transformers' own strict validation refuses (``StrictDataclassFieldValidationError`` of
transformers 5.x, translated); :func:`check_fits` refuses, before anything is allocated, a model
whose weights alone exceed the free memory of the device.  Every refusal is a
:class:`ModelLoadError` (the command line's exit 2).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .memory import free_memory  # noqa: F401  (the one count of free memory; re-exported)


class ModelLoadError(ValueError):
    """The model spec could not be resolved to weights or an architecture."""


# ---------------------------------------------------------------- checks of a config.json dict
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
MAX_SHOWN_VALUE = 60


def _finite(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _shown(v: Any) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= MAX_SHOWN_VALUE else s[:MAX_SHOWN_VALUE - 3] + "..."


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
                raise ModelLoadError(f"{name} must be > 0, got {_shown(v)}")


def _switched_off(d: dict, key: str) -> bool:
    """The config turns the feature of ``key`` off with a flag (``use_sliding_window: false`` leaves
    ``sliding_window`` unused: Qwen2-MoE's default config holds 0 there), or uses transformers' convention
    of a 0 for it: an MLA config's ``head_dim`` is its rotary part, 0 when it has none (GLM-5's NoPE
    attention, ``qk_rope_head_dim: 0``).  Such a value is not a size anything is built with."""
    if d.get(f"use_{key}") is False:
        return True
    return key == "head_dim" and d.get(key) == 0 and d.get("qk_rope_head_dim") == 0


def _size_ok(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and 0 < v <= MAX_SIZE


def check_config_dict(d: dict, where: str = "config.json") -> None:
    """Refuse sizes that are not positive integers (strings, fractions, negatives, zero, true/false)
    and numbers that are not finite, with the field's name; nested ``*_config`` objects too.  Also
    refused, naming the field: query heads that are not a multiple of the key/value heads, a RoPE
    base (rope_theta, top level or in rope_parameters / rope_scaling) that is not > 0, and sizes
    above what the kernels take (``KERNEL_LIMITS``).

    The sizes are read by their standard names whatever the family calls them (GPT-2's ``n_head``,
    through its config class's ``attribute_map``), and named as the file names them.  What transformers
    itself accepts is not refused: a size per layer (a list of sizes, Gemma-3n's ``intermediate_size``)
    has each entry checked, and a size whose feature the config switches off (:func:`_switched_off`) is
    not checked at all."""
    if not isinstance(d.get("model_type"), str):
        raise ModelLoadError(f"{where}: \"model_type\" must be a string")
    from .config_names import attribute_map, with_standard_names

    d, added = with_standard_names(d, attribute_map(config_class(d["model_type"])))
    for k in SIZE_KEYS:
        if k not in d or d[k] is None or _switched_off(d, k):
            continue
        v = d[k]
        if not (_size_ok(v) or (isinstance(v, list) and v and len(v) <= MAX_SIZE and all(map(_size_ok, v)))):
            raise ModelLoadError(f"{where}: \"{added.get(k, k)}\" must be a positive integer (at most {MAX_SIZE}) "
                                 f"or a list of them (one per layer), got {_shown(v)}")
    for k in NUMBER_KEYS:
        if k not in d or d[k] is None:
            continue
        v = d[k]
        if not _finite(v) or v < 0 or (k in POSITIVE_KEYS and v == 0):
            raise ModelLoadError(f"{where}: \"{k}\" must be a finite number {'> 0' if k in POSITIVE_KEYS else '>= 0'}, "
                                 f"got {_shown(v)}")
    for k in ROPE_KEYS:
        _check_rope(d.get(k), where, k)
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ModelLoadError(f"{where}: \"{added.get('num_attention_heads', 'num_attention_heads')}\" ({heads}) must "
                             f"be a multiple of \"{added.get('num_key_value_heads', 'num_key_value_heads')}\" ({kv}): "
                             f"each key/value head serves a whole group of query heads")
    head_dim = d.get("head_dim")
    if not head_dim and isinstance(heads, int) and isinstance(d.get("hidden_size"), int):
        head_dim = d["hidden_size"] // heads
    sizes = {"head_dim": head_dim, "vocab_size": d.get("vocab_size")}
    for k, limit in KERNEL_LIMITS.items():
        v = sizes[k]
        if isinstance(v, int) and v > limit:
            field = added.get(k, k) if k in d else f"{k} (hidden_size / num_attention_heads)"
            raise ModelLoadError(f"{where}: \"{field}\" is {v:,}, above what patchdsl's kernels take "
                                 f"(at most {limit:,}; docs/reliability.md)")
    for k, v in d.items():
        if k.endswith("_config") and isinstance(v, dict) and "model_type" in v:
            check_config_dict(v, f"{where} ({k})")


# ---------------------------------------------------------------- configs
def transformers_version() -> str:
    import transformers

    return transformers.__version__


def one_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def _strict_errors() -> tuple[type, ...]:
    """huggingface_hub's strict-dataclass validation errors (transformers 5.x configs), if it has them."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:           # an older huggingface_hub: configs are not strict dataclasses there
        return ()
    return (StrictDataclassError,)


# what transformers raises for a config value it cannot take (besides the strict validation)
CONFIG_ERRORS = (TypeError, ValueError, KeyError, AttributeError, OverflowError, ZeroDivisionError, IndexError)


def strict_message(e: BaseException) -> str:
    """A strict validation error in one line: ``field 'x': expected str, got int (value: 5)``."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    head = lines[0].rstrip(":") if lines else type(e).__name__
    for pre, repl in (("Validation error for field ", "field "), ("Class validation error for validator ", "check ")):
        head = head.replace(pre, repl)
    cause = lines[1] if len(lines) > 1 else ""
    cause = cause.split(": ", 1)[1] if ": " in cause and cause.split(": ", 1)[0].isidentifier() else cause
    msg = f"{head}: {cause}" if cause else head
    return msg if len(msg) <= 240 else msg[:237] + "..."


def _refuse_config_error(e: BaseException, model_type: str, where: str):
    if isinstance(e, _strict_errors()):
        return ModelLoadError(f"{where}: transformers {transformers_version()} refuses this {model_type} config: "
                              f"{strict_message(e)}")
    return ModelLoadError(f"{where}: transformers refused this {model_type} config: {one_line(e)}")


def remote_code_note(d: dict) -> str:
    """A note for the one line a load says, when ``d`` names code of its own in ``auto_map``."""
    amap = d.get("auto_map")
    if not amap:
        return ""
    return (" (its auto_map, code shipped with the model, is ignored: patchdsl never runs it; built with "
            "transformers' own classes)")


def config_from_dict(d: dict, where: str = "config.json"):
    """A PretrainedConfig from a config.json dict, checked (:func:`check_config_dict`), without
    remote code: ``auto_map`` is dropped; a ``model_type`` transformers does not know is refused
    (saying so when ``auto_map`` names code of the model's own); transformers' own refusals
    (its strict validation of field types included) become a :class:`ModelLoadError` naming the field."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(d, dict):
        raise ModelLoadError(f"{where}: a config must be a JSON object, got {type(d).__name__}")
    d = _special_floats(d)
    check_config_dict(d, where)
    model_type = d["model_type"]
    if model_type not in CONFIG_MAPPING:
        amap = d.get("auto_map")
        code = (f"; its auto_map names code shipped with the model ({_shown(amap)}), which patchdsl never runs "
                f"(no trust_remote_code)" if amap else " (patchdsl does not run remote code)")
        raise ModelLoadError(f"{where}: model_type {_shown(model_type)} is not known to transformers "
                             f"{transformers_version()}{code}; use a model whose model_type transformers knows, "
                             f"or a newer transformers")
    cls = CONFIG_MAPPING[model_type]
    clean = {k: v for k, v in d.items() if k not in ("auto_map", "_name_or_path")}
    try:
        cfg = cls.from_dict(clean)
    except (*CONFIG_ERRORS, *_strict_errors()) as e:
        raise _refuse_config_error(e, model_type, where) from None
    _implied_head_dim(cfg)
    return cfg


def _special_floats(d: dict) -> dict:
    """Non-finite floats as transformers 5.2x writes them in a config.json (``{"__float__": "Infinity"}``:
    Falcon-H1's ``time_step_limit``), read back as floats as transformers' own config loading does."""
    def dec(o):
        if isinstance(o, dict):
            if len(o) == 1 and isinstance(o.get("__float__"), str) and o["__float__"] in ("Infinity", "-Infinity", "NaN"):
                return float(o["__float__"].lower().replace("infinity", "inf"))
            return {k: dec(v) for k, v in o.items()}
        if isinstance(o, list):
            return [dec(v) for v in o]
        return o

    return dec(d)


def _implied_head_dim(cfg) -> None:
    """Head sizes a config leaves None (transformers' default Hunyuan and Ministral configs: ``head_dim``;
    Nemotron's: ``num_key_value_heads``) that the modelling code reads as they are: the hidden size / heads
    and the heads (multi-head attention) they mean."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        heads = getattr(c, "num_attention_heads", None) if c is not None else None
        if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
            continue
        if "head_dim" in vars(c) and vars(c)["head_dim"] is None and isinstance(getattr(c, "hidden_size", None), int):
            c.head_dim = c.hidden_size // heads
        if "num_key_value_heads" in vars(c) and vars(c)["num_key_value_heads"] is None:
            c.num_key_value_heads = heads


def config_class(model_type: str):
    """transformers' config class of ``model_type``, None when it knows none."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]
    except (KeyError, ImportError):
        return None


def default_config(model_type: str, **kw):
    """The default config of a family transformers knows (``AutoConfig.for_model``), with ``kw`` set:
    for configs patchdsl makes itself (tiny families, convergence runs, benches)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"model_type {_shown(model_type)} is not known to transformers {transformers_version()}")
    return AutoConfig.for_model(model_type, **kw)


# ---------------------------------------------------------------- experts that grouped_mm cannot run
# transformers 5.x runs a mixture-of-experts layer's experts through torch's grouped GEMM by default
# (config._experts_implementation "grouped_mm"); that GEMM takes only operands whose strides are
# multiples of 16 bytes (8 elements of a 16-bit dtype), and transformers does not check it: a model
# whose hidden or expert widths are not multiples of 8 fails in bf16 / fp16 ("strides should be
# multiple of 16 bytes"), unpatched, on any device.  Such a model is built with transformers' eager
# experts (a loop over experts: the same sums), and the load says so.
GMM_ALIGN = 8
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_EXPERT_WIDTH_KEYS = ("hidden_size", "moe_intermediate_size", "intermediate_size", "expert_intermediate_size")


def eager_experts_if_misaligned(cfg) -> str:
    """Set transformers' eager experts on ``cfg`` (and its text config) when its experts have a
    width grouped_mm cannot take; the note for the load's line ("" when nothing changed)."""
    notes = []
    for c in {id(c): c for c in (cfg, getattr(cfg, "text_config", None)) if c is not None}.values():
        experts = [getattr(c, k, None) for k in _EXPERT_COUNT_KEYS]
        if not any(isinstance(e, int) and not isinstance(e, bool) and e > 1 for e in experts):
            continue
        odd = {k: v for k in _EXPERT_WIDTH_KEYS if isinstance(v := getattr(c, k, None), int) and v % GMM_ALIGN}
        if not odd or getattr(c, "_experts_implementation", None) == "eager":
            continue
        c._experts_implementation = "eager"
        notes.append(", ".join(f"{k} {v}" for k, v in odd.items()))
    if not notes:
        return ""
    return (f" (experts: transformers' eager loop, since its grouped_mm takes only widths that are multiples of "
            f"{GMM_ALIGN}: {'; '.join(notes)})")


# ---------------------------------------------------------------- models
def auto_class(cfg):
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


def build_model(cfg, **kw):
    """``from_config`` of ``cfg``'s auto class (``kw``: dtype, attn_implementation, ...), never remote code;
    on the device of the surrounding ``torch.device`` context, as ``from_config`` itself."""
    return auto_class(cfg).from_config(cfg, trust_remote_code=False, **kw)


def load_pretrained(where: str, cfg, **kw):
    """``from_pretrained(where)`` of ``cfg``'s auto class with ``cfg`` (made by :func:`config_from_dict`)
    as the config, so transformers reads no config of its own; never remote code."""
    kw.pop("trust_remote_code", None)
    return auto_class(cfg).from_pretrained(where, config=cfg, trust_remote_code=False, **kw)


def model_bytes(cfg, dtype) -> int:
    """Bytes of the parameters and buffers of ``cfg``'s model in ``dtype`` (built on the meta device:
    nothing is allocated)."""
    import torch

    with torch.device("meta"):
        m = build_model(cfg, dtype=dtype)
    seen: set[int] = set()
    total = 0
    for t in (*m.parameters(), *m.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def check_fits(cfg, dtype, device: Any, where: str) -> None:
    """Refuse (before anything is allocated) a model whose weights alone exceed the free memory of
    ``device``; say what to do instead."""
    import torch

    try:
        need = model_bytes(cfg, dtype)
    except (*CONFIG_ERRORS, RuntimeError, *_strict_errors()) as e:
        raise ModelLoadError(f"cannot build the {cfg.model_type} architecture from {where}: {one_line(e)}") from None
    free = free_memory(device)
    if free is None or need <= free:
        return
    gib = 2 ** 30
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)
    raise ModelLoadError(
        f"{where}: the {cfg.model_type} model's weights alone take {need / gib:,.1f} GiB in {name}, more than the "
        f"{free / gib:,.1f} GiB free on {torch.device(device)}: nothing was allocated; use --tiny (a shrunk copy "
        f"of the architecture), --layers N (verify), or a machine with more memory")

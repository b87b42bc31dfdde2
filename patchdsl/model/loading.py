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

Whatever happens is said in exactly one line through ``log`` and kept in ``LoadedModel.source``;
a full-size random build of 4 GiB or more says first, in a line of its own, what it builds and the
memory its weights take against what the device has free; any full-size build is refused at once when
its weights do not fit.
``meta=True`` builds on the meta device (no weights, no memory; for planning) and ``tiny=True``
shrinks the architecture with ``tiny_config`` (for CPU tests and demos; always random weights).

dtype: ``None`` means the checkpoint's own dtype for loaded weights and the config's dtype
(``dtype``, read from a config.json's ``torch_dtype`` too) for meta and full-size random builds; tiny builds default to float32.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..util.vocab import DTYPE_ALIASES, DTYPES, TORCH_NAMES
from .shrink import _describe_tiny, describe_shrink, tiny_config

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
PROBE_TIMEOUT_S = 3.0          # reachability probe before any remote download
_TRUE = {"1", "on", "yes", "true"}

# the dtype names load_model takes: the vocabulary's, its aliases, and f32 / f16
_LOAD_ALIASES = {**DTYPE_ALIASES, "f32": "fp32", "f16": "fp16"}
_DTYPES = {n: TORCH_NAMES[_LOAD_ALIASES.get(n, n)] for n in (*DTYPES, *_LOAD_ALIASES)}




class ModelLoadError(ValueError):
    """The model spec could not be resolved to weights or an architecture."""


@dataclass
class LoadedModel:
    model: Any                 # a transformers PreTrainedModel (on the meta device when meta=True)
    source: str                # one line: where the weights/architecture came from
    has_weights: bool          # True only when real (pretrained) weights were loaded
    config: Any                # the PretrainedConfig the model was built from
    layers: Any = None         # load_model(layers=N): the KeptLayers record (which original layers were kept)


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
    from ..util.vocab import dtype_hint

    raise ModelLoadError(f"unknown dtype {dtype!r}: {dtype_hint(dtype)} (or a torch.dtype)")


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

    d, added = with_standard_names(d, attribute_map(d["model_type"]))
    for k in SIZE_KEYS:
        if k not in d or d[k] is None or _switched_off(d, k):
            continue
        v = d[k]
        if not (_size_ok(v) or (isinstance(v, list) and v and len(v) <= MAX_SIZE and all(map(_size_ok, v)))):
            raise ModelLoadError(f"{where}: \"{added.get(k, k)}\" must be a positive integer (at most {MAX_SIZE}) "
                                 f"or a list of them (one per layer), got {json.dumps(v)[:40]}")
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


def config_from_dict(d: dict):
    """A PretrainedConfig from a config.json dict, without remote code (auto_map is ignored)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = _special_floats(d)
    check_config_dict(d)
    d = {k: v for k, v in d.items() if k not in ("auto_map", "_name_or_path")}
    model_type = d["model_type"]
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        raise ModelLoadError(f"model_type '{model_type}' is not known to transformers {_transformers_version()} "
                             f"(patchdsl does not run remote code)") from None
    try:
        cfg = cls.from_dict(d)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise ModelLoadError(f"transformers refused this {model_type} config: {_one_line(e)}") from None
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
        cd = getattr(cfg, "dtype", None)       # transformers 5 reads a config.json's torch_dtype into dtype
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


SAY_BUILD_BYTES = 4 * 2 ** 30  # a build whose weights take this much (a while to initialise) says so first


def _full_build_fits(cfg, dtype, device: str, attn_implementation, where: str) -> str | None:
    """The line saying what a full-size random build of ``cfg`` takes (its weights, counted on a model
    built on the meta device, no memory) against the free memory of ``device`` -- None for a build under
    SAY_BUILD_BYTES, done in moments; ModelLoadError when they do not fit."""
    try:
        m = _build(cfg, dtype=dtype, device=device, meta=True, tiny=False, seed=0,
                   attn_implementation=attn_implementation)
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, OverflowError, ZeroDivisionError) as e:
        raise ModelLoadError(f"cannot build the {cfg.model_type} architecture from {where}: {_one_line(e)}") from None
    return _meta_model_fits(m, device)


def _meta_model_fits(m, device: str) -> str | None:
    """:func:`_full_build_fits` of a model already on the meta device (a model cut to its kept layers)."""
    from ..util.vocab import dtype_name
    from .memory import MemoryTooSmall, check_fits, count_params, human_params

    n, dt = count_params(m), next(m.parameters()).dtype
    try:
        line = check_fits(n * dt.itemsize, device,
                          f"building the {m.config.model_type} architecture at its full sizes ({human_params(n)} "
                          f"parameters in {dtype_name(dt)}, random weights)",
                          hint="a tiny model of the same architecture fits (--tiny, the default on a CPU; "
                               "load_model(..., tiny=True))")
    except MemoryTooSmall as e:
        raise ModelLoadError(str(e)) from None
    return line if n * dt.itemsize >= SAY_BUILD_BYTES else None


def _materialise(model, device: str, seed: int):
    """A model cut on the meta device, on ``device`` with transformers' own random initialisation (what
    ``from_pretrained`` does for weights a checkpoint lacks: empty tensors, then ``initialize_weights``,
    which also fills the non-persistent buffers such as the rotary tables), weights tied again."""
    import torch

    dev = torch.device(device)
    model.to_empty(device=dev)
    for t in (*model.modules(), *model.parameters(), *model.buffers()):
        if "_is_hf_initialized" in vars(t):
            delattr(t, "_is_hf_initialized")
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    model.initialize_weights()
    model.tie_weights()
    return model


def _cut(model, n: int):
    from .layers import LayersError, keep

    try:
        return keep(model, n)
    except LayersError as e:
        raise ModelLoadError(str(e)) from None


def load_model(spec: str | os.PathLike, *, dtype: Any = None, device: str = "cpu", meta: bool = False,
               weights: bool = True, attn_implementation: str | None = None, tiny: bool = False,
               seed: int = 0, layers: int | None = None, log: Callable[[str], Any] | None = print) -> LoadedModel:
    """Load ``spec`` (Hub id, model directory or config.json path); see the module docstring.

    ``layers=N``: keep N decoder layers, at least one of each layer type (:mod:`patchdsl.model.layers`;
    ``LoadedModel.layers`` says which).  Built from a config, the model is made on the meta device, cut,
    and only the kept part is materialised on ``device``: a 671B-parameter config with ``layers=2``
    allocates two layers, the embeddings and the head.

    Raises ``ModelLoadError`` when ``spec`` resolves to nothing, with the shipped ids in the message.
    """
    dtype = parse_dtype(dtype)
    if log is None:
        log = lambda _m: None  # noqa: E731
    spec_s = os.fspath(spec)
    want_weights = weights and not meta and not tiny
    path = Path(spec_s).expanduser()

    def done(model, source: str, has_weights: bool) -> LoadedModel:
        kept = _cut(model, layers) if layers is not None else None     # a model cut while built: its record
        if kept is not None:
            source += f"; {kept.describe()}"
        log(source)
        return LoadedModel(model, source, has_weights, model.config, kept)

    def from_config(cfg_dict: dict, where: str, why: str | None) -> LoadedModel:
        cfg = config_from_dict(cfg_dict)
        cfg._name_or_path = spec_s
        if tiny:
            try:
                full, cfg = cfg, tiny_config(cfg)
            except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
                raise ModelLoadError(f"cannot shrink the {cfg.model_type} architecture from {where} to a tiny one: "
                                     f"{_one_line(e)}; --full builds it at its own sizes") from None
        # a full-size build: said before it starts (4 GiB or more), refused at once when its weights alone do
        # not fit -- counted on the meta device, after the cut with layers=N
        if not meta and not tiny and layers is None:
            said = _full_build_fits(cfg, dtype, device, attn_implementation, where)
            if said:
                log(said)
        try:
            # layers=N: built on the meta device, cut, and only what is kept materialised
            model = _build(cfg, dtype=dtype, device=device, meta=meta or layers is not None, tiny=tiny, seed=seed,
                           attn_implementation=attn_implementation)
            if layers is not None and _cut(model, layers) and not meta:
                said = None if tiny else _meta_model_fits(model, device)
                if said:
                    log(said)
                model = _materialise(model, device, seed)
        except ModelLoadError:
            raise
        except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise ModelLoadError(f"cannot build the {cfg.model_type} architecture from {where}: {_one_line(e)}") \
                from None
        if tiny:
            what = f"{_describe_tiny(cfg)}, {describe_shrink(full, cfg)} in {where}"
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

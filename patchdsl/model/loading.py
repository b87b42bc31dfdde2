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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..util.vocab import DTYPE_ALIASES, DTYPES, TORCH_NAMES
from .hf import (KERNEL_LIMITS, MAX_SIZE, NUMBER_KEYS, POSITIVE_KEYS, ROPE_KEYS, SIZE_KEYS,  # noqa: F401 (re-exported)
                 ModelLoadError, build_model, check_config_dict, check_fits, config_from_dict,
                 eager_experts_if_misaligned, load_pretrained, one_line, remote_code_note)
from .shrink import _describe_tiny, describe_shrink, tiny_config

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
PROBE_TIMEOUT_S = 3.0          # reachability probe before any remote download
_TRUE = {"1", "on", "yes", "true"}

# the dtype names load_model takes: the vocabulary's, its aliases, and f32 / f16
_LOAD_ALIASES = {**DTYPE_ALIASES, "f32": "fp32", "f16": "fp16"}
_DTYPES = {n: TORCH_NAMES[_LOAD_ALIASES.get(n, n)] for n in (*DTYPES, *_LOAD_ALIASES)}




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


def _hub_reachable(hub_id: str) -> str | None:
    """None when the Hub answers for hub_id's config.json within PROBE_TIMEOUT_S, else the reason."""
    try:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        get_hf_file_metadata(hf_hub_url(hub_id, "config.json"), timeout=PROBE_TIMEOUT_S)
        return None
    except Exception as e:  # network down, unknown or gated repo, bad id ...
        return one_line(e)


def _looks_like_path(spec: str) -> bool:
    """Hub ids are "name" or "org/name"; anything else that does not exist is a mistyped path."""
    return (spec.endswith(".json") or spec.startswith((".", "/", "~")) or spec.count("/") > 1
            or "\\" in spec or (os.altsep is not None and os.altsep in spec))


# ---------------------------------------------------------------- building
def _run_dtype(cfg, dtype, tiny: bool):
    """The dtype a model is built in: ``dtype``, else float32 for a tiny build, else the config's own."""
    import torch

    if dtype is None or dtype == "auto":
        cd = getattr(cfg, "dtype", None)        # transformers 5 reads a config.json's torch_dtype into dtype
        return torch.float32 if tiny or cd is None else parse_dtype(str(cd))
    return dtype


def _from_pretrained(where: str, cfg, *, dtype, device: str, attn_implementation, local_only: bool, what: str):
    """The weights of ``where`` into the model of ``cfg`` (checked by :func:`config_from_dict`, and
    its size against the free memory first), never remote code (:mod:`.hf`)."""
    import torch

    check_fits(cfg, _run_dtype(cfg, dtype, False), device, what)
    kw: dict[str, Any] = {"dtype": "auto" if dtype is None else dtype, "local_files_only": local_only}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    dev = torch.device(device)
    if dev.type != "cpu":
        kw["device_map"] = str(dev)
    model = load_pretrained(where, cfg, **kw)
    if dev.type != "cpu" and next(model.parameters()).device != dev:
        model = model.to(dev)
    return model


def _build(cfg, *, dtype, device: str, meta: bool, tiny: bool, seed: int, attn_implementation):
    import torch

    dtype = _run_dtype(cfg, dtype, tiny)
    kw: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if meta:
        with torch.device("meta"):
            return build_model(cfg, **kw)
    dev = torch.device(device)
    # the memory check of a full-size build is load_model's (_full_build_fits / _meta_model_fits: counted on
    # the meta device, said first when large), before this is called
    torch.manual_seed(seed)
    if tiny or dev.type == "cpu":
        # tiny: initialise on the CPU so that every device starts from the same weights
        model = build_model(cfg, **kw)
        return model.to(dev) if dev.type != "cpu" else model
    if dev.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    with dev:
        return build_model(cfg, **kw)


SAY_BUILD_BYTES = 4 * 2 ** 30  # a build whose weights take this much (a while to initialise) says so first


def _full_build_fits(cfg, dtype, device: str, attn_implementation, where: str) -> str | None:
    """The line saying what a full-size random build of ``cfg`` takes (its weights, counted on a model
    built on the meta device, no memory) against the free memory of ``device`` -- None for a build under
    SAY_BUILD_BYTES, done in moments; ModelLoadError when they do not fit."""
    try:
        m = _build(cfg, dtype=dtype, device=device, meta=True, tiny=False, seed=0,
                   attn_implementation=attn_implementation)
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, OverflowError, ZeroDivisionError) as e:
        raise ModelLoadError(f"cannot build the {cfg.model_type} architecture from {where}: {one_line(e)}") from None
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

    def architecture(cfg_dict: dict, where: str, why: str | None) -> LoadedModel:
        where_ = where if local else f"{spec_s} ({where})"        # what an error names
        cfg = config_from_dict(cfg_dict, where_)
        cfg._name_or_path = spec_s
        if tiny:
            try:
                full, cfg = cfg, tiny_config(cfg)
            except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
                raise ModelLoadError(f"cannot shrink the {cfg.model_type} architecture from {where} to a tiny one: "
                                     f"{one_line(e)}; --full builds it at its own sizes") from None
        # a full-size build: said before it starts (4 GiB or more), refused at once when its weights alone do
        # not fit -- counted on the meta device, after the cut with layers=N
        if not meta and not tiny and layers is None:
            said = _full_build_fits(cfg, dtype, device, attn_implementation, where)
            if said:
                log(said)
        note = remote_code_note(cfg_dict) + eager_experts_if_misaligned(cfg)
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
            raise ModelLoadError(f"cannot build the {cfg.model_type} architecture from {where}: {one_line(e)}") \
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
        return done(model, msg + note, False)

    def pretrained(where: str, cfg_dict: dict, cfg_where: str, local_only: bool, source: str) -> LoadedModel:
        cfg_where = cfg_where if local else f"{where} ({cfg_where})"
        cfg = config_from_dict(cfg_dict, cfg_where)
        cfg._name_or_path = where
        note = remote_code_note(cfg_dict) + eager_experts_if_misaligned(cfg)
        model = _from_pretrained(where, cfg, dtype=dtype, device=device, attn_implementation=attn_implementation,
                                 local_only=local_only, what=cfg_where)
        return done(model, source + note, True)

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
            return pretrained(str(directory), cfg_dict, str(cfg_path), True, f"{spec_s}: pretrained weights from {directory}")
        return architecture(cfg_dict, str(cfg_path), None)
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
                return pretrained(hub_id, _read_config_dict(Path(cached_cfg)), "its cached config.json", True,
                                  f"{hub_id}: pretrained weights from the local Hugging Face cache")
            except OSError as e:        # e.g. an incomplete sharded download
                why = f" (the cached weights did not load: {one_line(e)})"
        if why is None and not offline:
            problem = _hub_reachable(hub_id)
            if problem is None:
                try:
                    from huggingface_hub import hf_hub_download

                    p = hf_hub_download(hub_id, "config.json", etag_timeout=PROBE_TIMEOUT_S)
                    return pretrained(hub_id, _read_config_dict(Path(p)), "its config.json from the Hub", False,
                                      f"{hub_id}: pretrained weights from the Hugging Face Hub")
                except OSError as e:
                    why = f" (download failed: {one_line(e)})"
            else:
                why = f" (not from the Hub: {problem})"

    # 4. the architecture alone: cached config.json, shipped config, (online) the Hub's config.json
    cached_cfg = _cached(hub_id, "config.json")
    if cached_cfg:
        return architecture(_read_config_dict(Path(cached_cfg)), "its cached config.json", why)
    shipped = shipped_config_path(hub_id)
    if shipped is not None:
        return architecture(_read_config_dict(shipped), "its shipped config", why)
    hub_problem = None
    if not offline:
        hub_problem = _hub_reachable(hub_id)
        if hub_problem is None:
            try:
                from huggingface_hub import hf_hub_download

                p = hf_hub_download(hub_id, "config.json", etag_timeout=PROBE_TIMEOUT_S)
                return architecture(_read_config_dict(Path(p)), "its config.json from the Hub", why)
            except Exception as e:  # noqa: BLE001 - any Hub failure means "not available"
                hub_problem = one_line(e)
    from ..util.files import show

    hub_note = ("the Hub was not tried (HF_HUB_OFFLINE is set)" if offline
                else f"the Hub did not provide it ({hub_problem})")
    raise ModelLoadError(
        f"unknown model '{show(hub_id)}': not a local directory or config.json, not in the local Hugging Face cache, "
        f"and not a shipped architecture; {hub_note}. Shipped architectures: {', '.join(shipped_models())}. "
        f"For another model pass the path to its config.json (or to a directory holding config.json and "
        f"optionally its weights), e.g. --model path/to/config.json")

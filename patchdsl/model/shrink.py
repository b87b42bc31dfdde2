"""Shrinking a model's configuration to a tiny one when its sizes go by other names or it is a
composite of towers (vision-language): used by ``load_model(..., tiny=True)`` and by the coverage
census (:mod:`patchdsl_tools.census`)."""

from __future__ import annotations

import re

def shrink_composite(cfg, tiny_config):
    """A composite (vision-language) config shrunk: the language tower by ``tiny_config`` (as any
    family), the other towers generically (:func:`_tiny_tower`), multimodal RoPE sections with the
    head size (:func:`_fit_mrope`).  A copy; ``cfg`` is left as it is."""
    import copy

    cfg = copy.deepcopy(cfg)
    sub = {k: getattr(cfg, k) for k in ("text_config", "vision_config", "audio_config")
           if getattr(cfg, k, None) is not None and hasattr(getattr(cfg, k), "to_dict")}
    cfg.text_config = shrink_config(sub["text_config"], tiny_config)
    for k, c in sub.items():
        if k != "text_config":
            setattr(cfg, k, _tiny_tower(c, cfg.text_config))
    _fit_mrope(cfg.text_config)
    if isinstance(getattr(cfg, "mm_tokens_per_image", None), int):
        # Gemma 3: image tokens = (image_size / patch_size)^2 pooled to this many
        side = getattr(cfg.vision_config, "image_size", 32) // getattr(cfg.vision_config, "patch_size", 8)
        cfg.mm_tokens_per_image = min(cfg.mm_tokens_per_image, side * side)
    return cfg


def _fit_mrope(text) -> None:
    """Multimodal RoPE (Qwen2/2.5/3-VL): the rotary splits head_dim / 2 into temporal, height and
    width sections (``rope_parameters["mrope_section"]``, else a default in the modeling code sized
    for the full head_dim); shrunk with head_dim, in the same proportions, summing to head_dim / 2."""
    import importlib

    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict):
        return
    sec = rope.get("mrope_section")
    if sec is None:
        try:
            src = importlib.import_module(type(text).__module__.replace("configuration_", "modeling_"))
            import inspect
            m = re.search(r'mrope_section",\s*\[(\d+),\s*(\d+),\s*(\d+)\]', inspect.getsource(src))
        except Exception:
            m = None
        if m is None:
            return
        sec = [int(x) for x in m.groups()]
    hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    half = int(hd * (rope.get("partial_rotary_factor") or 1.0)) // 2
    if sum(sec) == half:
        return
    new = [max(1, round(x * half / sum(sec))) for x in sec]
    new[0] += half - sum(new)
    rope["mrope_section"] = new
    text.rope_parameters = rope


class _Shim:
    """Lets :func:`tiny_config` shrink a config whose sizes go by other names (GPT-2's ``n_embd``):
    it sees the standard names and hands back the dict it built."""

    def __init__(self, d):
        self._d = d

    def to_dict(self):
        return dict(self._d)

    @classmethod
    def from_dict(cls, d):
        return cls(d)


def shrink_config(cfg, tiny_config):
    amap = dict(getattr(cfg, "attribute_map", {}) or {})
    if not amap:
        return tiny_config(cfg)
    d = cfg.to_dict()
    for std, real in amap.items():
        if real in d and std not in d:
            d[std] = d[real]
    out = tiny_config(_Shim(d))._d
    for std, real in amap.items():
        if std in out and real in d:
            out[real] = out.pop(std)
    new = type(cfg).from_dict(out)
    return new


_TOWER_SIZES = (("hidden_size", 64), ("intermediate_size", 128), ("num_hidden_layers", 1), ("depth", 1),
                ("num_layers", 1), ("num_attention_heads", 2), ("num_heads", 2), ("num_key_value_heads", 2),
                ("image_size", 32), ("patch_size", 8), ("num_global_layers", 1))


def _tiny_tower(c, text):
    """A vision/audio tower shrunk by its common size names (sizes it does not have are left)."""
    d = c.to_dict()
    for k, v in _TOWER_SIZES:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) and d[k] > v:
            d[k] = v
    for k in ("out_hidden_size", "projection_dim", "text_hidden_size"):
        if isinstance(d.get(k), int):
            d[k] = text.hidden_size
    for k in ("intermediate_layers_indices", "deepstack_visual_indexes", "fullatt_block_indexes"):
        if isinstance(d.get(k), list):
            d[k] = [0]
    d.pop("head_dim", None) if isinstance(d.get("head_dim"), int) else None
    return type(c).from_dict(d)

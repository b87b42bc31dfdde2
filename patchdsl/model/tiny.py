"""Tiny models of a family: its default config shrunk (2 layers, small widths, eager attention and
experts), built in fp32 on the CPU with random weights -- what the census, suggest's image check and the
family tests run on."""

from __future__ import annotations

import contextlib
import re

from .shrink import shrink_composite, shrink_config


def vl_families() -> list[str]:
    """Vision-language model types (an image-text-to-text class) without a causal-LM class."""
    from transformers.models.auto import modeling_auto as ma

    vl = getattr(ma, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    return sorted(set(vl) - set(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def short_error(e: BaseException, n: int = 120) -> str:
    s = " ".join(str(e).split())
    s = re.sub(r"\s+", " ", s)
    s = s.replace("|", "/")
    return f"{type(e).__name__}: {s[:n]}" + ("..." if len(s) > n else "")


def tiny_family_config(model_type: str):
    """The family's default config, shrunk (raises when the family has no config that shrinks)."""
    from transformers import AutoConfig

    from .shrink import tiny_config

    cfg = AutoConfig.for_model(model_type)
    if getattr(cfg, "text_config", None) is not None and hasattr(cfg.text_config, "to_dict"):
        cfg = shrink_composite(cfg, tiny_config)
    else:
        cfg = shrink_config(cfg, tiny_config)
    for c in (cfg, getattr(cfg, "text_config", None)):
        # a default config that leaves head_dim None (Hunyuan, Ministral): the modeling code reads
        # config.head_dim as it is, so give it the hidden / heads it means
        if c is not None and "head_dim" in vars(c) and vars(c)["head_dim"] is None and getattr(c, "num_attention_heads", None):
            c.head_dim = c.hidden_size // c.num_attention_heads
    cfg._attn_implementation = "eager"
    # routed experts run as plain loops: verify's float64 reference cannot run grouped_mm
    cfg._experts_implementation = "eager"
    return cfg


def build(cfg, seed: int = 0):
    """The family's causal LM (its image-text-to-text model for a vision-language family), fp32, CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if cfg.model_type in vl_families():
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)


MAX_TINY_PARAMS = 40_000_000      # 160 MB in fp32; a tiny config is far below (Qwen3's: 0.2M)


def meta_params(cfg) -> int:
    """Parameters of the family's model built on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        m = build(cfg)
    return sum(p.numel() for p in m.parameters())


@contextlib.contextmanager
def quiet():
    """transformers' warnings and log lines (about tiny configs, missing fast kernels, ...) silenced
    while building and running a family's tiny model."""
    import logging
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)

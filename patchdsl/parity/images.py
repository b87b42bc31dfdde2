"""Image batches for verify: a vision-language model's vision tower runs in verify's forward.

Built from the model's config alone (no processor, no image file): seeded random pixels, the
model's image placeholder token repeated as many times as the vision tower gives features, and the
extra inputs the family's forward takes.  Two layouts cover the Hugging Face families:

* **grid** (Qwen2/2.5/3-VL and their kin: the vision config has ``patch_size``,
  ``temporal_patch_size`` and ``spatial_merge_size``): flattened patches ``[B*t*h*w, C*tp*ps*ps]``,
  ``image_grid_thw`` ``[[1, 2m, 2m]]`` per image, ``(2m*2m) / m^2`` image tokens between the vision
  start / end tokens, ``mm_token_type_ids`` where the forward takes it;
* **square** (Llava, PaliGemma, Gemma 3, SigLIP / CLIP towers ...): ``pixel_values [B, C, S, S]``
  with ``S = vision_config.image_size``; the token count is ``mm_tokens_per_image`` when the config
  states it, else ``(S / patch_size)^2``; ``image_sizes`` and ``token_type_ids`` (1 on image tokens)
  where the forward takes them; a forward taking ``pixel_attention_mask`` (Idefics3, SmolVLM) gets
  ``[B, 1, C, S, S]`` and an all-ones pixel mask.

Each sequence holds one image: ``[2 text tokens][begin][image tokens][end][text up to seq]`` (at
least 4 text tokens after the image, so a sequence may be longer than ``seq``).  Image and special
tokens are masked out of the labels (-100), as the processors' collators do.  A special token id
outside the language tower's vocabulary (a tiny config's) is moved to the top of the vocabulary on
verify's own copies of the model (``ImageRecipe.configure``).

The recipe is checked by one forward of the model (no gradient).  When the forward reports
"Image features and image tokens do not match, tokens: T, features: F" (the check most
transformers VLMs make), the count is read from the message and the batch rebuilt (at most
three times; a count that is the features' values, not their rows, is divided by the hidden size): a family whose token count the config does not state (a pixel shuffle, a dropped CLS
token) is found that way.  Any other failure is the reason the family gets no image batch
(:func:`image_recipe` returns it; verify says it).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from ..model.shrink import shrink_composite, shrink_config
from ..model.tiny import MAX_TINY_PARAMS, build, meta_params, quiet, short_error

_TOKEN_ATTRS = ("image_token_id", "image_token_index")
_BEGIN_ATTRS = ("vision_start_token_id", "boi_token_index", "boi_token_id", "image_start_token_id")
_END_ATTRS = ("vision_end_token_id", "eoi_token_index", "eoi_token_id", "image_end_token_id")
_MISMATCH = re.compile(r"tokens:\s*(\d+),\s*features:?\s*(\d+)")


@dataclass
class ImageRecipe:
    """How to build an image batch for one model (see the module doc)."""

    layout: str                      # "grid" or "square"
    token: int                       # the image placeholder id (after ``remap``)
    per_image: int                   # image tokens per image
    channels: int
    size: int = 0                    # square: the image side
    patch: tuple[int, int, int] = (0, 0, 0)     # grid: (patch_size, temporal_patch_size, spatial_merge_size)
    begin: int | None = None
    end: int | None = None
    keys: tuple[str, ...] = ()       # the extra inputs the forward takes
    remap: dict[str, int] = field(default_factory=dict)   # config attribute -> new id (inside the vocabulary)
    vocab: int = 0
    how: str = ""                    # where the token count came from

    def configure(self, model: Any) -> None:
        """Move the special ids of ``remap`` into the vocabulary on ``model``'s config (verify's own copy)."""
        for k, v in self.remap.items():
            setattr(model.config, k, v)

    def describe(self) -> str:
        shape = (f"{self.channels}x{self.size}x{self.size} pixels" if self.layout == "square" else
                 f"a {2 * self.patch[2]}x{2 * self.patch[2]} grid of {self.patch[0]}-pixel patches")
        moved = f"; special ids moved into the vocabulary: {', '.join(f'{k}={v}' for k, v in self.remap.items())}" \
            if self.remap else ""
        return f"one image per sequence ({shape}, {self.per_image} image tokens, {self.how}){moved}"

    def specials(self) -> set[int]:
        return {t for t in (self.token, self.begin, self.end) if t is not None}

    def batch(self, gen: Any, batch: int, seq: int, device: Any = "cpu") -> dict[str, Any]:
        """Input ids with the image tokens, labels (image and special tokens -100), attention mask and
        the image inputs (float32; verify casts them to each copy's dtype)."""
        import torch

        block = ([self.begin] if self.begin is not None else []) + [self.token] * self.per_image + \
            ([self.end] if self.end is not None else [])
        tail = max(4, seq - 2 - len(block))
        rows = []
        for _ in range(batch):
            text = torch.randint(0, self.vocab, (2 + tail,), generator=gen)
            rows.append(torch.cat([text[:2], torch.tensor(block, dtype=text.dtype), text[2:]]))
        ids = torch.stack(rows)
        specials = torch.tensor(sorted(self.specials()))
        free = next(i for i in range(self.vocab) if i not in self.specials())
        is_special = torch.isin(ids, specials)
        start = 2
        body = torch.zeros_like(is_special)
        body[:, start:start + len(block)] = True
        ids = torch.where(is_special & ~body, torch.full_like(ids, free), ids)   # random text never a special id
        image = ids == self.token
        out: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                               "labels": ids.masked_fill(body, -100), "use_cache": False}
        if self.layout == "grid":
            ps, tp, ms = self.patch
            thw = torch.tensor([[1, 2 * ms, 2 * ms]] * batch)
            n = int(thw.prod(-1).sum())
            out["pixel_values"] = torch.randn(n, self.channels * tp * ps * ps, generator=gen)
            out["image_grid_thw"] = thw
        elif "pixel_attention_mask" in self.keys:      # Idefics3 / SmolVLM: [B, images, C, S, S] and a pixel mask
            out["pixel_values"] = torch.randn(batch, 1, self.channels, self.size, self.size, generator=gen)
            out["pixel_attention_mask"] = torch.ones(batch, 1, self.size, self.size, dtype=torch.bool)
        else:
            out["pixel_values"] = torch.randn(batch, self.channels, self.size, self.size, generator=gen)
        if "image_sizes" in self.keys:
            out["image_sizes"] = torch.tensor([[self.size, self.size]] * batch)
        if "token_type_ids" in self.keys:
            out["token_type_ids"] = image.long()
        if "mm_token_type_ids" in self.keys:
            out["mm_token_type_ids"] = image.int()
        return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in out.items()}


def _int(x: Any) -> int | None:
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, int) for v in x):
        return x[0] if len(set(x)) == 1 else None
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _first(cfg: Any, attrs: tuple[str, ...]) -> tuple[str | None, int | None]:
    for a in attrs:
        v = _int(getattr(cfg, a, None))
        if v is not None:
            return a, v
    return None, None


def _vocab(model: Any) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    v = getattr(cfg, "vocab_size", None)
    return int(v) if isinstance(v, int) and v > 0 else int(model.get_input_embeddings().num_embeddings)


def plan_recipe(model: Any) -> tuple[ImageRecipe | None, str]:
    """The recipe read from ``model``'s config alone (not yet run), or ``(None, reason)``."""
    cfg = getattr(model, "config", None)
    vc = getattr(cfg, "vision_config", None)
    if vc is None:
        return None, "not a vision-language model (its config has no vision_config)"
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "pixel_values" not in params:
        return None, f"{type(model).__name__}.forward takes no pixel_values"
    tok_attr, token = _first(cfg, _TOKEN_ATTRS)
    if token is None:
        return None, "its config names no image placeholder token (image_token_id / image_token_index)"
    vocab = _vocab(model)
    begin_attr, begin = _first(cfg, _BEGIN_ATTRS)
    end_attr, end = _first(cfg, _END_ATTRS)
    remap: dict[str, int] = {}
    top = vocab - 1
    ids = {}
    for attr, v in ((tok_attr, token), (begin_attr, begin), (end_attr, end)):
        if attr is None:
            continue
        if v >= vocab or v < 0:
            while top in remap.values() or top in (token, begin, end):
                top -= 1
            remap[attr] = top
            v = top
        ids[attr] = v
    token = ids[tok_attr]
    begin = ids.get(begin_attr) if begin_attr else None
    end = ids.get(end_attr) if end_attr else None
    keys = tuple(k for k in ("image_sizes", "token_type_ids", "mm_token_type_ids", "image_grid_thw",
                             "pixel_attention_mask") if k in params)
    channels = _int(getattr(vc, "num_channels", None)) or _int(getattr(vc, "in_channels", None)) or 3
    common = dict(token=token, channels=channels, begin=begin, end=end, keys=keys, remap=remap, vocab=vocab)
    ps, tp, ms = (_int(getattr(vc, a, None)) for a in ("patch_size", "temporal_patch_size", "spatial_merge_size"))
    if ps and tp and ms:
        if "image_grid_thw" not in params:
            return None, f"{type(model).__name__}.forward takes no image_grid_thw for its patch grid"
        return ImageRecipe("grid", per_image=4, patch=(ps, tp, ms), how="(2m x 2m patches) / m^2", **common), ""
    size = _int(getattr(vc, "image_size", None))
    if not size:
        return None, f"its vision config ({type(vc).__name__}) states no image_size"
    n = _int(getattr(cfg, "mm_tokens_per_image", None))
    if n:
        return ImageRecipe("square", per_image=n, size=size, how="mm_tokens_per_image", **common), ""
    sf = _int(getattr(cfg, "scale_factor", None))     # Idefics3 / SmolVLM: a pixel shuffle by this factor
    if ps and sf and size % (ps * sf) == 0:
        return ImageRecipe("square", per_image=(size // ps // sf) ** 2, size=size,
                           how="(image_size / patch_size / scale_factor)^2", **common), ""
    if ps and size % ps == 0:
        return ImageRecipe("square", per_image=(size // ps) ** 2, size=size, how="(image_size / patch_size)^2",
                           **common), ""
    return ImageRecipe("square", per_image=1, size=size, how="a first guess of 1", **common), ""


def _short(e: BaseException, n: int = 160) -> str:
    s = " ".join(str(e).split())
    return f"{type(e).__name__}: {s[:n]}" + ("..." if len(s) > n else "")


def image_recipe(model: Any, *, batch: int = 1, seq: int = 8, tries: int = 4) -> tuple[ImageRecipe | None, str]:
    """A recipe whose batch ``model`` (real weights) runs, or ``(None, reason)``.  ``model``'s config gets
    the recipe's ``remap`` (pass verify's own copy).  Runs the model forward without gradient up to
    ``tries`` times, reading the token count from a features / tokens mismatch message."""
    import torch

    r, why = plan_recipe(model)
    if r is None:
        return None, why
    old = {k: getattr(model.config, k) for k in r.remap}
    r.configure(model)
    p0 = next(model.parameters(), None)
    device = p0.device if p0 is not None else "cpu"
    dtype = p0.dtype if p0 is not None and p0.is_floating_point() else torch.float32
    was = model.training
    model.eval()        # no running statistics (a BatchNorm in a vision tower) moved by the check
    try:
        return _try(model, r, old, batch, seq, tries, device, dtype)
    finally:
        model.train(was)


def _try(model, r, old, batch, seq, tries, device, dtype) -> tuple[ImageRecipe | None, str]:
    import torch

    last = sized = ""
    tc = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = _int(getattr(tc, "hidden_size", None)) or 0
    for _ in range(tries):
        b = r.batch(torch.Generator().manual_seed(0), batch, seq, device)
        b = {k: (v.to(dtype) if hasattr(v, "is_floating_point") and v.is_floating_point() else v)
             for k, v in b.items()}
        try:
            with torch.no_grad():
                model(**b)
            return r, ""
        except Exception as e:      # the family's own check: read what it expects, or give up with the reason
            last = _short(e)
            m = _MISMATCH.search(str(e))
            if not m and "image_sizes" in r.keys:     # a tower that reads no sizes (Llava's CLIP): without them
                r.keys = tuple(k for k in r.keys if k != "image_sizes")
                sized = f"with image_sizes: {last}; without: "
                continue
            if not m or int(m.group(2)) % batch or int(m.group(2)) // batch == 0:
                break
            n = int(m.group(2)) // batch
            if n == r.per_image:     # "features" counted every feature value (Mistral 3): per hidden unit
                n, rest = divmod(n, hidden) if hidden else (0, 1)
                if rest or n in (0, r.per_image):
                    break
            r.per_image = n
            r.how = "read from the model's features / tokens check"
    for k, v in old.items():     # leave the config as it was
        setattr(model.config, k, v)
    return None, f"{sized}{last} (an image batch built from its config: {r.describe()})"


def image_recipe_of(model: Any) -> tuple[ImageRecipe | None, str]:
    """(the image recipe, "") for a vision-language model an image batch runs on; (None, why not) for
    one it does not; (None, "") for a text-only model."""
    if getattr(model.config, "vision_config", None) is None:
        return None, ""
    return image_recipe(model, batch=1, seq=8)


def image_batch_check(config) -> tuple[bool | None, str]:
    """Whether verify's image batch (:mod:`patchdsl.parity.images`) runs on a tiny model shrunk from
    ``config`` (a copy; random weights, CPU): (True, ""), (False, why not), or (None, why it was not
    tried: the shrunk model does not build or is still large).  ``patchdsl suggest`` asks this before
    keeping a vision tower's rules, so that verify of its suggestion can judge them."""
    import copy
    import warnings

    from ..model.shrink import tiny_config

    with quiet():
        try:
            cfg = copy.deepcopy(config)
            cfg = shrink_composite(cfg, tiny_config) if hasattr(getattr(cfg, "text_config", None), "to_dict") \
                else shrink_config(cfg, tiny_config)
            cfg._attn_implementation = "eager"
            if meta_params(cfg) > MAX_TINY_PARAMS:
                return None, "its shrunk config is still large: not tried"
            model = build(cfg)
        except Exception as e:
            return None, f"a tiny model of its config does not build: {short_error(e)}"
    with warnings.catch_warnings():           # (transformers' log lines are shown again here)
        warnings.simplefilter("ignore")
        r, why = image_recipe_of(model)
    return r is not None, why

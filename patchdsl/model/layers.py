"""Keeping N decoder layers of a model (``verify --layers N``, ``load_model(layers=N)``) without losing a
layer type.

Models mix layer types: full and linear attention (Qwen3.5's ``layer_types``), sliding and full
attention (gpt-oss, Gemma 3), dense and mixture-of-experts layers (DeepSeek's ``first_k_dense_replace``,
Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``).  The first N layers can all be of one type
(Qwen3.5's first three are linear attention, DeepSeek-V3's first three dense), and a spec's rule for the
other type then selects nothing.  :func:`choose` keeps N layers with at least one of each type (more than
N only when there are more types than N), :func:`keep` cuts a model to them and makes its config agree,
so that the model's own code (masks per layer type, caches built from the config, the dense / sparse
choice) sees a consistent N-layer model.

A layer's type is read from the built model (:func:`layer_kinds`), not from family knowledge: the names,
classes and parameter shapes of its submodules (a MoE block, a linear-attention mixer, more key/value
heads) and its entry in the config's per-layer lists (sliding vs full attention share their modules).
It works on the meta device, so :func:`patchdsl.model.loading.load_model` decides what to keep before any
weight exists and builds only that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .modules import decoder_layers

# config lists with one entry per decoder layer (sliced to the kept layers)
PER_LAYER_KEYS = ("layer_types", "no_rope_layers", "sliding_window_pattern_list", "mlp_layer_types")
# config lists of layer indices (renumbered to the kept layers)
INDEX_KEYS = ("mlp_only_layers", "moe_layers")
# config counts of leading layers of one type (dense layers first: DeepSeek, GLM-4.5, dots1, AFMoE)
PREFIX_KEYS = ("first_k_dense_replace", "num_dense_layers")
MARK = "patchdsl_kept_layers"        # attribute of a model already cut (load_model(layers=N))


class LayersError(ValueError):
    """The model has no list of decoder layers to keep some of."""


@dataclass(frozen=True)
class KeptLayers:
    kept: tuple[int, ...]        # original indices of the layers kept, ascending
    of: int                      # decoder layers of the whole model
    kinds: tuple[str, ...]       # one short description per kept layer (its type)
    asked: int                   # the N asked for

    @property
    def used(self) -> int:
        return len(self.kept)

    def describe(self) -> str:
        """One line for people: which original layers were kept, and why more than N when so."""
        if self.used == self.of:
            return f"kept all {self.of} decoder layers"
        types = sorted(set(self.kinds))
        what = (f" ({len(types)} layer types: {', '.join(types)})" if len(types) > 1
                else f" (one layer type: {types[0]})" if types and types[0] else "")
        more = (f"; --layers {self.asked} is fewer than the layer types, so one layer of each"
                if self.used > self.asked else "")
        return f"kept decoder layers {', '.join(map(str, self.kept))} of {self.of}{what}{more}"

    def to_json(self) -> dict[str, Any]:
        return {"used": self.used, "of": self.of, "kept": list(self.kept), "kinds": list(self.kinds)}


def _config(model: Any):
    cfg = getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _configs(model: Any, holder: Any) -> list:
    """The config objects that describe the decoder layers (the model's, its text config, the holder's)."""
    out: dict[int, Any] = {}
    for c in (getattr(model, "config", None), _config(model), getattr(holder, "config", None)):
        if c is not None:
            out[id(c)] = c
    return list(out.values())


def layer_kinds(model: Any) -> list[tuple[tuple, str]] | None:
    """Per decoder layer: (a hashable signature, a short description) - layers of one type share both.
    None when the model has no list of decoder layers."""
    found = decoder_layers(model)
    if found is None:
        return None
    _, layers = found
    total = len(layers)
    cfg = _config(model)
    per_layer = {}
    for key in PER_LAYER_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, (list, tuple)) and len(v) == total:
            per_layer[key] = v
    out = []
    for i, lay in enumerate(layers):
        # names and classes, not shapes: layers whose widths alone differ (OpenELM's per-layer heads) are one
        # type, or --layers could not cut them; where shapes differ with the type the config lists it (MiMo-V2)
        structure = tuple((n, type(m).__name__) for n, m in lay.named_modules())
        entries = tuple((k, repr(v[i])) for k, v in per_layer.items())
        # what people read: the per-layer config entries, then the names of the layer's direct children
        # and their classes where those differ between the layers
        words = [str(v[i]) if k == "layer_types" else f"{k}={v[i]}" for k, v in per_layer.items()]
        out.append(((structure, entries), words))
    # the children that tell the layers apart (a MoE block instead of an MLP, linear_attn instead of self_attn)
    child_sets = [tuple((n, type(c).__name__) for n, c in lay.named_children()) for lay in layers]
    differing = {x for s in child_sets for x in s} - set.intersection(*(set(s) for s in child_sets)) if child_sets else set()
    result = []
    numbers: dict[Any, int] = {}
    for (sig, words), children in zip(out, child_sets):
        extra = [f"{n}={cls}" for n, cls in children if (n, cls) in differing]
        number = numbers.setdefault(sig, len(numbers) + 1)
        desc = " ".join(words + extra)
        if not desc and len({s for s, _ in out}) > 1:      # they differ deeper down: numbered
            desc = f"layer type {number}"
        result.append((sig, desc))
    return result


def choose(kinds: list, n: int) -> list[int]:
    """The indices to keep: the first ``n``, where they miss a type the last of them that is not the only
    one of its type among those kept replaced by the first layer of that type; one layer of each type (the
    first) when there are ``n`` types or more."""
    total = len(kinds)
    if n >= total:
        return list(range(total))
    first: dict[Any, int] = {}
    for i, k in enumerate(kinds):
        first.setdefault(k, i)
    if len(first) >= n:
        return sorted(first.values())
    kept = list(range(n))
    for idx in [i for i in first.values() if i >= n]:
        counts: dict[Any, int] = {}
        for i in kept:
            counts[kinds[i]] = counts.get(kinds[i], 0) + 1
        kept.remove(next(i for i in reversed(kept) if counts[kinds[i]] > 1))
        kept.append(idx)
    return sorted(kept)


def _fix_config(cfg: Any, keep: list[int], total: int) -> None:
    """Make ``cfg`` describe the kept layers: counts, per-layer lists, index lists, dense prefixes."""
    n = len(keep)
    new_of = {old: new for new, old in enumerate(keep)}
    if getattr(cfg, "num_hidden_layers", None) == total:
        cfg.num_hidden_layers = n
    for key in PER_LAYER_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, (list, tuple)) and len(v) == total:
            setattr(cfg, key, type(v)(v[i] for i in keep))
    for key in INDEX_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, (list, tuple)) and all(isinstance(i, int) for i in v):
            setattr(cfg, key, type(v)(new_of[i] for i in v if i in new_of))
    for key in PREFIX_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            setattr(cfg, key, sum(1 for i in keep if i < v))
    # Qwen2/3-MoE: layer i is sparse when (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers);
    # renumbered, the kept layers follow no step: every layer sparse but the kept dense ones, listed
    step = getattr(cfg, "decoder_sparse_step", None)
    if isinstance(step, int) and step > 1:
        only = set(getattr(cfg, "mlp_only_layers", None) or [])
        dense = [new_of[i] for i in keep if (i + 1) % step != 0] + sorted(only)
        cfg.decoder_sparse_step = 1
        cfg.mlp_only_layers = sorted(set(dense))


def keep(model: Any, n: int) -> KeptLayers:
    """Cut ``model`` to the decoder layers :func:`choose` picks (in place; works on the meta device), renumber
    their ``layer_idx`` and fix the config (:func:`_fix_config`); the record is kept on the model (``MARK``).
    A model already cut to at most ``n`` layers (``load_model(layers=...)``) is left as it is and its record
    returned."""
    import torch

    done = getattr(model, MARK, None)
    if isinstance(done, KeptLayers) and n >= done.used:
        return done
    if n < 1:
        raise LayersError(f"--layers must be at least 1, got {n}")
    found = decoder_layers(model)
    if found is None:
        raise LayersError(f"{type(model).__name__} has no list of decoder layers to cut to {n}")
    path, layers = found
    kinds = layer_kinds(model)
    sigs = [s for s, _ in kinds]
    total = len(layers)
    kept = choose(sigs, n)
    # cut before (load_model(layers=M), now fewer): the record names the layers of the original model
    orig = done.kept if isinstance(done, KeptLayers) else tuple(range(total))
    record = KeptLayers(tuple(orig[i] for i in kept), done.of if isinstance(done, KeptLayers) else total,
                        tuple(kinds[i][1] for i in kept), n)
    if len(kept) < total:
        holder_path, _, attr = path.rpartition(".")
        holder = model.get_submodule(holder_path) if holder_path else model
        chosen = [layers[i] for i in kept]
        for new, (old, lay) in enumerate(zip(kept, chosen)):
            for m in lay.modules():           # the layer's own index (caches, per-layer config lookups)
                if getattr(m, "layer_idx", None) == old and not isinstance(m.layer_idx, bool):
                    m.layer_idx = new
        holder._modules[attr] = torch.nn.ModuleList(chosen)
        for cfg in _configs(model, holder):
            _fix_config(cfg, kept, total)
    object.__setattr__(model, MARK, record)
    return record

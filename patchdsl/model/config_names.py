"""A config's fields by their standard names, whatever the family calls them.

transformers' configs keep some sizes under a family's own names (GPT-2: ``n_embd``, ``n_head``,
``n_layer``; Bloom: ``n_head``; gpt_bigcode, Falcon, ...) and say so in the config class's
``attribute_map`` (standard name -> the family's name).  Attribute access follows that map
(``config.num_attention_heads`` works on a GPT2Config), but ``to_dict()`` and a ``config.json``
hold the family's names only.  Every place of patchdsl that reads a config as a dict by field name
goes through :func:`with_standard_names` (and :func:`with_real_names` to write it back), so a family
with other names is read as any other.
"""

from __future__ import annotations

from typing import Any


def attribute_map(config: Any) -> dict[str, str]:
    """The ``attribute_map`` of a config object or class (for a ``config.json``'s ``model_type``:
    ``model.hf.config_class``); {} when there is none (None: a model type transformers does not know)."""
    amap = getattr(config, "attribute_map", None)
    return {str(k): str(v) for k, v in amap.items() if k != v} if isinstance(amap, dict) else {}


def with_standard_names(d: dict, amap: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """A copy of ``d`` that also holds each field the family names otherwise under its standard name,
    and those added names ({standard: family's name}); ``d`` is left as it is."""
    added = {std: real for std, real in amap.items() if std not in d and real in d}
    out = dict(d)
    for std, real in added.items():
        out[std] = d[real]
    return out, added


def with_real_names(d: dict, added: dict[str, str]) -> dict:
    """``d`` (shrunk or edited under the standard names) with those values back under the family's
    names and the standard names that :func:`with_standard_names` added removed."""
    out = dict(d)
    for std, real in added.items():
        if std in out:
            out[real] = out.pop(std)
    return out

"""A value a forward reads off its module (``self.config.vocab_size``, ...), read off the live module."""

from __future__ import annotations

from typing import Any


def read_value(host: Any, source: str) -> Any:
    """The value of ``self.a.b`` (``source``) on ``host``; ``getattr(self.config.get_text_config(),
    'name', None)`` (a vision-language forward's softcap, :data:`KNOWN_SOFTCAPS`) too."""
    pre = "getattr(self.config.get_text_config(), '"
    if source.startswith(pre):
        return getattr(host.config.get_text_config(), source[len(pre):].split("'")[0], None)
    obj = host
    for part in source.split(".")[1:]:
        obj = getattr(obj, part[:-2])() if part.endswith("()") else getattr(obj, part)   # get_text_config()
    return obj

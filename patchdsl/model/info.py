"""ModuleInfo: the index's record of one module (plain data, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ModuleInfo:
    """What the planner knows about one module (plain data, no tensors).

    ``kinds`` maps each structural kind the module fits to the facts its recogniser found
    (e.g. ``{"RMSNorm": {"hidden": 1024, "eps": 1e-6, "offset": 0.0, "casting": "llama"}}``).
    """

    path: str
    cls: str
    bases: tuple[str, ...]
    kinds: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    dtype: str | None = None
    children: tuple[str, ...] = ()

    def facts(self, kind: str) -> Mapping[str, Any]:
        return self.kinds.get(kind, {})

    def with_host(self, host: "ModuleInfo | None") -> "ModuleInfo":
        """This site's info with the facts of the module it patches through (the causal LM for
        fused_linear_cross_entropy on lm_head) added; the site's own facts win."""
        if host is None or host.path == self.path:
            return self
        from dataclasses import replace

        return replace(self, kinds={**host.kinds, **self.kinds})

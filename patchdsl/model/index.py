"""ModelIndex: what the planner may know about a model, as plain data.

Built from a live module tree (works on the meta device: recognisers probe on tiny CPU
stand-ins, never on the model's own tensors).  Shared modules (the same instance reachable by
two paths) are indexed once, under their first path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..util.vocab import dtype_name
from .info import ModuleInfo
from .kinds import KINDS
from .modules import unwrap


@dataclass(frozen=True)
class ModelIndex:
    model_class: str
    model_type: str | None
    infos: Mapping[str, ModuleInfo]      # path -> info, in named_modules() order
    aliases: Mapping[str, str]           # a second path of a shared module -> its first path
    dtype: str

    def __iter__(self) -> Iterator[ModuleInfo]:
        return iter(self.infos.values())

    def __len__(self) -> int:
        return len(self.infos)

    def get(self, path: str) -> ModuleInfo | None:
        return self.infos.get(self.aliases.get(path, path))

    @staticmethod
    def parent_path(path: str) -> str | None:
        if path == "":
            return None
        return path.rsplit(".", 1)[0] if "." in path else ""

    def ancestors(self, path: str) -> Iterator[ModuleInfo]:
        p = self.parent_path(path)
        while p is not None:
            info = self.infos.get(p)
            if info is not None:
                yield info
            p = self.parent_path(p)


def _param_dtype(m: Any) -> str | None:
    for p in m.parameters(recurse=False):
        return dtype_name(p.dtype)
    for p in m.parameters():
        return dtype_name(p.dtype)
    return None


def module_info(mod: Any, path: str, recognisers: Mapping[str, Any] | None = None) -> ModuleInfo:
    """What the index records about one module (its class, bases, kinds with facts, dtype)."""
    recognisers = KINDS if recognisers is None else recognisers
    target = unwrap(mod)
    facts = {}
    for name, fn in recognisers.items():
        try:
            f = fn(target)
        except Exception:
            f = None
        if f:
            facts[name] = f
    cls = type(target)
    bases = tuple(c.__name__ for c in cls.__mro__[1:] if c.__name__ not in ("object", "Module"))
    children = tuple(n for n, _ in mod.named_children())
    return ModuleInfo(path, cls.__name__, bases, facts, _param_dtype(target), children)


def build_index(model: Any) -> ModelIndex:
    recognisers = dict(KINDS)
    infos: dict[str, ModuleInfo] = {}
    aliases: dict[str, str] = {}
    first_path: dict[int, str] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in first_path:
            aliases[path] = first_path[id(mod)]
            continue
        first_path[id(mod)] = path
        infos[path] = module_info(mod, path, recognisers)
    cfg = getattr(model, "config", None)
    first = next(model.parameters(), None)
    return ModelIndex(type(model).__name__, getattr(cfg, "model_type", None), infos, aliases,
                      dtype_name(first.dtype) if first is not None else "fp32")

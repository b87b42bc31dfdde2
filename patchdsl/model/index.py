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


_PLAIN = (int, float, str, bool, type(None))


def structure_key(mod: Any, memo: dict | None = None) -> Any:
    """What the recognisers can read of a module, as a hashable key: its class, its plain attributes (ints,
    strings, ... as values; tensors as shape and dtype; other objects, such as the shared config or an
    activation function, by identity), its parameters' and buffers' shapes and dtypes, and its children's
    keys.  Two modules with one key get the same kinds and facts: the recognisers probe stand-ins of the
    class built from exactly these (never the module's own values), so a model's repeated layers are
    probed once (DeepSeek-V3's 58 routers at their real widths took a minute on the meta device)."""
    memo = {} if memo is None else memo
    got = memo.get(id(mod))
    if got is not None:
        return got
    import torch

    def value(v: Any, depth: int = 0) -> Any:
        if isinstance(v, _PLAIN):
            return (type(v).__name__, v)
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), str(v.dtype), v.device.type)
        if isinstance(v, (tuple, list)) and depth < 2 and len(v) <= 64:
            return (type(v).__name__,) + tuple(value(x, depth + 1) for x in v)
        return ("id", id(v))

    attrs = []
    for n, v in vars(mod).items():
        if n in ("_parameters", "_buffers", "_modules"):
            continue
        if n.startswith("_") and not isinstance(v, _PLAIN):
            continue          # torch's own bookkeeping (hooks, state-dict hooks): per instance, read by no probe
        attrs.append((n, value(v)))
    tensors = tuple((n, value(t)) for d in (mod._parameters, mod._buffers) for n, t in d.items())
    children = tuple((n, structure_key(c, memo) if c is not None else None) for n, c in mod._modules.items())
    key = (type(mod), tuple(attrs), tensors, children)
    memo[id(mod)] = key
    return key


def _recognise(target: Any, recognisers: Mapping[str, Any]) -> dict:
    facts = {}
    for name, fn in recognisers.items():
        try:
            f = fn(target)
        except Exception:
            f = None
        if f:
            facts[name] = f
    return facts


def module_info(mod: Any, path: str, recognisers: Mapping[str, Any] | None = None,
                cache: dict | None = None) -> ModuleInfo:
    """What the index records about one module (its class, bases, kinds with facts, dtype).  ``cache``
    (one per model, with :func:`build_index`): kinds and facts by :func:`structure_key`, so that modules
    alike are probed once."""
    import copy

    recognisers = KINDS if recognisers is None else recognisers
    target = unwrap(mod)
    if cache is None:
        facts = _recognise(target, recognisers)
    else:
        try:
            key = structure_key(target, cache.setdefault("__keys__", {}))
            hash(key)
        except TypeError:
            key = None
        if key is None:
            facts = _recognise(target, recognisers)
        else:
            if key not in cache:
                cache[key] = _recognise(target, recognisers)
            facts = copy.deepcopy(cache[key])
    cls = type(target)
    bases = tuple(c.__name__ for c in cls.__mro__[1:] if c.__name__ not in ("object", "Module"))
    children = tuple(n for n, _ in mod.named_children())
    return ModuleInfo(path, cls.__name__, bases, facts, _param_dtype(target), children)


def build_index(model: Any) -> ModelIndex:
    recognisers = dict(KINDS)
    cache: dict = {}
    infos: dict[str, ModuleInfo] = {}
    aliases: dict[str, str] = {}
    first_path: dict[int, str] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in first_path:
            aliases[path] = first_path[id(mod)]
            continue
        first_path[id(mod)] = path
        infos[path] = module_info(mod, path, recognisers, cache)
    cfg = getattr(model, "config", None)
    first = next(model.parameters(), None)
    return ModelIndex(type(model).__name__, getattr(cfg, "model_type", None), infos, aliases,
                      dtype_name(first.dtype) if first is not None else "fp32")

"""A site of a plan: one module, the op it gets, its resolved flags and kernel keys (frozen data that
round-trips through JSON); its one constructor (:func:`build_site`) and the per-name totals."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

from ..codegen.keys import KernelKey
from ..codegen.render import CodegenError, validate_key
from ..model.info import ModuleInfo


@dataclass(frozen=True)
class Site:
    path: str
    cls: str
    op: str
    flags: tuple[tuple[str, Any], ...]
    flag_sources: tuple[tuple[str, str], ...]
    rule: str                     # file:line of the first rule that selected the module
    rules: tuple[str, ...]        # every rule that touched it, in order
    matched_by: str               # "kind SwiGLU" / "class Qwen3MLP (SwiGLU)"
    host: str                     # module whose forward is replaced
    keys: tuple[KernelKey, ...]   # one per dtype in the plan
    covers: tuple[str, ...] = ()  # child module paths fused into this site
    refused: str = ""             # why apply would refuse this site ("" = it will be patched)
    optional: bool = False        # every rule that selected it is marked optional: a refusal is no failure

    @property
    def patched(self) -> bool:
        return not self.refused
    source: str = ""              # external ops: where the kernel comes from, with its pin

    @property
    def flag_dict(self) -> dict[str, Any]:
        return dict(self.flags)

    def key_for(self, dtype: str) -> KernelKey | None:
        return next((k for k in self.keys if k.param_dict.get("dtype") == dtype), None)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "class": self.cls, "op": self.op, "flags": dict(self.flags),
                "flag_sources": dict(self.flag_sources), "rule": self.rule, "rules": list(self.rules),
                "matched_by": self.matched_by, "host": self.host, "covers": list(self.covers),
                "refused": self.refused, "optional": self.optional, "source": self.source,
                "kernels": [k.to_json() for k in self.keys]}


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1] if path else "<root>"


def count_totals(sites: tuple[Site, ...] | list[Site], present: Mapping[str, int]) -> tuple[tuple[str, int, int], ...]:
    """Per leaf name: (name, patched, present).  A refused site and what it would fuse count as
    present, never as patched."""
    names = dict.fromkeys([_leaf(s.path) for s in sites] + [_leaf(c) for s in sites for c in s.covers])
    patched = Counter(_leaf(s.path) for s in sites if not s.refused)
    for s in sites:
        if not s.refused:
            for c in s.covers:
                patched[_leaf(c)] += 1
    return tuple((n, patched[n], max(int(present.get(n, 0)), patched[n])) for n in names)


class SiteError(ValueError):
    """Why a site cannot be built (its caller says where: a spec span, a plan file field)."""


def build_site(op: Any, path: str, cls: str, host: str, info: ModuleInfo, flags: Mapping[str, Any],
               sources: Mapping[str, str], *, dtypes: tuple[str, ...], target: str, rule: str,
               rules: tuple[str, ...], matched_by: str, covers: tuple[str, ...] = (), refused: str = "",
               optional: bool = False) -> Site:
    """The one constructor of a :class:`Site`, for the planner and for plan files alike: the op's
    ``validate`` on the resolved flags, every kernel key derived with ``key_params`` (and checked
    by ``validate_key`` for generated ops), and the external source derived from the key, never
    taken from anyone.  ``info`` is the site's facts with its host's (``with_host``).  Raises
    :class:`SiteError`."""
    bad = op.validate(flags)
    if bad:
        raise SiteError(bad)
    keys = []
    for dt in dtypes:
        try:
            params = op.key_params(info, flags, dt, target)
            key = KernelKey.for_op(op, params)
            if not op.external:         # external ops load a third-party kernel: nothing is rendered
                validate_key(key)
        except CodegenError as e:
            raise SiteError(str(e)) from None
        except (KeyError, TypeError, ValueError, ArithmeticError, AttributeError, IndexError) as e:
            # facts of the wrong shape (a plan file's `qk_norm: true` where an object belongs)
            raise SiteError(f"the module's facts do not fit {op.name} ({type(e).__name__}: {str(e)[:120]})") from None
        keys.append(key)
    source = op.source(keys[0].param_dict) if op.external and keys else ""
    return Site(path, cls, op.name, tuple(flags.items()), tuple(sources.items()), rule, tuple(rules), matched_by,
                host, tuple(keys), tuple(covers), refused, optional, source)

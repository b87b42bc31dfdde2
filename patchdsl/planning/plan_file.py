"""Plan files: an untrusted JSON document checked field by field into the fields of a plan.

Every field is typed and bounded, flags go through the op's FlagSpecs, module facts are checked
(:func:`check_fact`), and every site is rebuilt with :func:`~.site.build_site` from the recorded facts
and flags (a recorded kernel key that differs from the derived one is an error).  Errors are
:class:`PlanError`: one line, naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

from ..model.info import ModuleInfo
from ..model.kinds import KIND_NAMES
from ..ops.base import FlagTypeError
from ..ops.attention_impl import KNOWN as KNOWN_ATTENTION
from ..ops.attention_impl import AttentionChoice, attention_problem
from ..ops.registry import get_op
from ..util.vocab import DTYPES, TARGETS
from .site import Site, SiteError, build_site, count_totals

PLAN_FORMAT = 1


class PlanError(ValueError):
    """A plan file that is not a valid plan for this version of patchdsl (the message says where).

    The message is one line of at most MAX_MESSAGE characters: a value from the file that it quotes
    cannot start a new line of output or flood it."""

    MAX_MESSAGE = 1200

    def __init__(self, message: str = ""):
        text = _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(message))
        if len(text) > self.MAX_MESSAGE:
            text = text[:self.MAX_MESSAGE - 30] + f"... ({len(text):,} characters)"
        super().__init__(text)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH = re.compile(r"(?:[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Facts that are sizes: positive integers below 2**31 (a size the kernels index with).
SIZE_FACTS = frozenset({"hidden", "intermediate", "vocab", "head_dim", "n_heads", "n_kv_heads", "rotary_dim",
                        "in_features", "out_features"})
_FACT_STRINGS = re.compile(r"[A-Za-z0-9_]{1,64}")


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise PlanError(f"{where}: {what}")


def _text(v: Any, where: str, limit: int = 4096) -> str:
    _need(isinstance(v, str), where, f"expected a string, got {type(v).__name__}")
    _need(len(v) <= limit, where, f"longer than {limit} characters")
    _need(not _CONTROL.search(v), where, "contains a control character (a newline?)")
    return v


def _ident(v: Any, where: str) -> str:
    _need(isinstance(v, str) and bool(_IDENT.fullmatch(v)) and len(v) <= 200, where,
          f"expected an identifier, got {v!r:.80}")
    return v


def _mpath(v: Any, where: str) -> str:
    _need(isinstance(v, str) and bool(_PATH.fullmatch(v)) and len(v) <= 1000, where,
          f"expected a dotted module path, got {v!r:.80}")
    return v


def _obj(v: Any, where: str) -> Mapping[str, Any]:
    _need(isinstance(v, dict), where, f"expected an object, got {type(v).__name__}")
    return v


def _list(v: Any, where: str) -> list:
    _need(isinstance(v, list), where, f"expected a list, got {type(v).__name__}")
    return v


def check_fact(name: str, v: Any, where: str, depth: int = 0) -> Any:
    """A module fact (index data, plan file, config): a typed scalar or a small object of them.
    Sizes are positive integers below 2**31, numbers finite, strings short identifiers."""
    if isinstance(v, dict):
        _need(depth < 2, where, "facts nest too deep")
        return {_ident(k, where): check_fact(k, x, f"{where}.{k}", depth + 1) for k, x in v.items()}
    if name in SIZE_FACTS:
        _need(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2 ** 31, where,
              f"a size must be a positive integer below 2**31, got {v!r:.40}")
        return v
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        _need(abs(v) < 2 ** 63, where, "integer out of range")
        return v
    if isinstance(v, float):
        _need(math.isfinite(v), where, f"not a finite number: {v!r}")
        if name == "eps":
            _need(v >= 0, where, f"eps must be >= 0, got {v!r}")
        return v
    _need(isinstance(v, str) and bool(_FACT_STRINGS.fullmatch(v)), where,
          f"expected a number, true/false, null or a short identifier, got {v!r:.60}")
    return v


def _module_info(path: str, m: Any) -> ModuleInfo:
    where = f"modules[{path!r}]"
    m = _obj(m, where)
    kinds = {}
    for k, f in _obj(m.get("kinds", {}), f"{where}.kinds").items():
        _need(k in KIND_NAMES, f"{where}.kinds", f"unknown kind {k!r:.40}")
        kinds[k] = {_ident(n, f"{where}.kinds.{k}"): check_fact(n, v, f"{where}.kinds.{k}.{n}")
                    for n, v in _obj(f, f"{where}.kinds.{k}").items()}
    dtype = m.get("dtype")
    _need(dtype is None or dtype in DTYPES, f"{where}.dtype", f"expected one of {', '.join(DTYPES)} or null")
    return ModuleInfo(path, _ident(m.get("class"), f"{where}.class"),
                      tuple(_ident(b, f"{where}.bases") for b in _list(m.get("bases", []), f"{where}.bases")),
                      kinds, dtype,
                      tuple(_ident(c, f"{where}.children") for c in _list(m.get("children", []), f"{where}.children")))


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, allow_nan=True, default=repr)


def _load_site(i: int, d: Any, infos: Mapping[str, ModuleInfo], dtypes: tuple[str, ...], target: str) -> Site:
    where = f"sites[{i}]"
    d = _obj(d, where)
    path = _mpath(d.get("path"), f"{where}.path")
    where = f"site {path or '<model>'}"
    _need(path in infos, where, "its module is not described in the plan's modules")
    info = infos[path]
    _need(d.get("class") == info.cls, f"{where}.class", f"{d.get('class')!r:.60} is not the module's class {info.cls}")
    op = get_op(d.get("op")) if isinstance(d.get("op"), str) else None
    _need(op is not None, f"{where}.op", f"unknown op {d.get('op')!r:.60}")
    flags = op.default_flags()
    for name, v in _obj(d.get("flags", {}), f"{where}.flags").items():
        spec = op.flag(name) if isinstance(name, str) else None
        _need(spec is not None, f"{where}.flags", f"{op.name} has no flag {name!r:.60}")
        try:
            flags[name] = spec.coerce(v)
        except FlagTypeError as e:
            raise PlanError(f"{where}.flags: {e}") from None
    sources = {n: _text(s, f"{where}.flag_sources.{n}", 400)
               for n, s in _obj(d.get("flag_sources", {}), f"{where}.flag_sources").items() if n in flags}
    host = _mpath(d.get("host"), f"{where}.host")
    _need(host in infos, f"{where}.host", "the host module is not described in the plan's modules")
    _need(host == path or host == "" or path.startswith(host + "."), f"{where}.host",
          f"{host!r} is neither the site nor one of its ancestors")
    covers = tuple(_mpath(c, f"{where}.covers") for c in _list(d.get("covers", []), f"{where}.covers"))
    _need(all(c.startswith(path + ".") if path else True for c in covers), f"{where}.covers",
          "a covered module is not a child of the site")
    _need(set(covers) <= set(f"{path}.{c}" if path else c for c in op.covers), f"{where}.covers",
          f"{op.name} fuses only {', '.join(op.covers) or 'nothing'}")
    # The site is built as plan_index builds it (validate, keys, source); then it must carry the
    # pins a plan made here records, and the recorded kernels must be the derived ones.
    minfo = info.with_host(infos.get(host))
    try:
        site = build_site(op, path, info.cls, host, minfo, flags, sources, dtypes=dtypes, target=target,
                          rule=_text(d.get("rule"), f"{where}.rule", 400),
                          rules=tuple(_text(r, f"{where}.rules", 400) for r in _list(d.get("rules", []), f"{where}.rules")),
                          matched_by=_text(d.get("matched_by"), f"{where}.matched_by", 400), covers=covers,
                          refused=_text(d.get("refused", ""), f"{where}.refused", 1000),
                          optional=d.get("optional", False) is True)
    except SiteError as e:
        raise PlanError(f"{where}: {e}") from None
    unlocked = op.unlocked(site.flag_dict) if op.external else None
    _need(not unlocked, f"{where}.flags", unlocked or "")
    recorded = _list(d.get("kernels", []), f"{where}.kernels")
    _need(len(recorded) == len(site.keys), f"{where}.kernels", f"expected {len(site.keys)} kernel(s), one per dtype")
    for k, r in zip(site.keys, recorded):
        if _canon(k.to_json()) != _canon(r):
            rp = r.get("params") if isinstance(r, dict) and isinstance(r.get("params"), dict) else {}
            diff = [n for n in sorted(set(k.param_dict) | set(rp)) if _canon(k.param_dict.get(n)) != _canon(rp.get(n))]
            what = (f"parameter(s) {', '.join(map(str, diff[:5]))}" if diff else "its op, template or name")
            raise PlanError(f"{where}.kernels: the recorded kernel differs from the one derived from the module's "
                            f"facts and flags in {what:.200}")
    if op.external:             # the recorded source is text for people: it is re-derived, never read
        _text(d.get("source", ""), f"{where}.source", 2000)
    return site


def _attention(d: Any) -> AttentionChoice | None:
    if d is None:
        return None
    try:
        d = _obj(d, "plan.attention")
        impl = d.get("impl")
        _need(isinstance(impl, str) and bool(re.fullmatch(r"[A-Za-z0-9_]{1,64}", impl)), "plan.attention.impl",
              "expected an implementation name")
        why = attention_problem(impl)
        _need(not why, "plan.attention.impl", f"{why} (one of {', '.join(KNOWN_ATTENTION)})")
        return AttentionChoice.from_json({"impl": impl, "rule": _text(d.get("rule", ""), "plan.attention.rule", 400)})
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(f"plan.attention: {type(e).__name__}: {e}") from None


def _structure(d: Any) -> dict[str, str]:
    """plan.structure: every module path of the model planned on, with its class."""
    _need(d is not None, "plan.structure", "missing (the model's module paths and classes; plan again with this version)")
    d = _obj(d, "plan.structure")
    _need(0 < len(d) <= 1_000_000, "plan.structure", "expected between 1 and 1000000 modules")
    _need("" in d, "plan.structure", "the model itself ('') is missing")
    return {_mpath(p, "plan.structure"): _ident(c, f"plan.structure[{p!r:.80}]") for p, c in d.items()}


def plan_fields(d: Any) -> tuple:
    """The fields of :class:`~.plan.PatchPlan`, in order, read from the untrusted JSON document ``d``
    and checked as a freshly made plan's are.  Raises :class:`PlanError`."""
    try:
        d = _obj(d, "plan")
        _need(d.get("format") == PLAN_FORMAT, "plan.format", f"expected {PLAN_FORMAT} (a plan written by this version)")
        target = d.get("target")
        _need(target in TARGETS, "plan.target", f"expected one of {', '.join(TARGETS)}")
        dtypes = tuple(_list(d.get("dtypes"), "plan.dtypes"))
        _need(0 < len(dtypes) <= 3 and all(isinstance(x, str) and x in DTYPES for x in dtypes)
              and len(set(dtypes)) == len(dtypes),
              "plan.dtypes", f"expected distinct values among {', '.join(DTYPES)}")
        model_type = d.get("model_type")
        _need(model_type is None or (isinstance(model_type, str) and bool(_FACT_STRINGS.fullmatch(model_type))),
              "plan.model_type", "expected a short identifier or null")
        infos = {_mpath(p, "plan.modules"): _module_info(p, m) for p, m in _obj(d.get("modules"), "plan.modules").items()}
        structure = _structure(d.get("structure"))
        for p, i in infos.items():
            _need(structure.get(p) == i.cls, f"modules[{p!r}]", "the module is not in the plan's structure with its class")
        sites = tuple(_load_site(i, s, infos, dtypes, target) for i, s in enumerate(_list(d.get("sites"), "plan.sites")))
        for s in sites:
            _need(all(c in structure for c in s.covers), f"site {s.path or '<model>'}.covers",
                  "a covered module is not in the plan's structure")
        paths = [s.path for s in sites]
        _need(len(set(paths)) == len(paths), "plan.sites", "a module appears in two sites")
        hosts = [s.host for s in sites]
        _need(len(set(hosts)) == len(hosts), "plan.sites", "two sites replace the forward of the same module")
        totals = []
        for i, t in enumerate(_list(d.get("totals", []), "plan.totals")):
            t = _obj(t, f"plan.totals[{i}]")
            n, a, b = t.get("name"), t.get("patched"), t.get("present")
            _need(isinstance(n, str) and bool(_PATH.fullmatch(n)) and len(n) <= 200, f"plan.totals[{i}].name",
                  "expected a module name")
            _need(all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2 ** 31 for x in (a, b)) and a <= b,
                  f"plan.totals[{i}]", "expected counts 0 <= patched <= present")
            totals.append((n, a, b))
        totals = list(count_totals(sites, {n: b for n, _, b in totals}))
        return (_text(d.get("spec"), "plan.spec", 1000), _ident(d.get("model_class"), "plan.model_class"),
                model_type, target, dtypes, sites,
                tuple(_text(u, "plan.unmatched_optional", 1000)
                      for u in _list(d.get("unmatched_optional", []), "plan.unmatched_optional")),
                tuple(totals), infos, _attention(d.get("attention")), tuple(structure.items()))
    except RecursionError:
        raise PlanError("plan: nested too deeply") from None

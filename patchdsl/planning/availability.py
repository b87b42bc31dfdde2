"""Whether a plan's kernels can be had on this machine: external ops' packages, GPUs and files (a local
repository hashed against its pin), generated kernels that need hardware (fp8), the attention
implementation.  Run for a plan just made and for a plan file at apply.  Not pure."""

from __future__ import annotations

from dataclasses import replace

from ..ops.registry import get_op
from ..syntax.errors import SpecError
from .check import CheckedSpec
from .plan import PatchPlan
from .site import Site, SiteError, build_site


class Unavailable(Exception):
    """A site's kernel (``site``) or the attention implementation (``site`` None) that this machine cannot have."""

    def __init__(self, site: Site | None, message: str):
        super().__init__(message)
        self.site = site


def resolve_here(plan: PatchPlan, model_cls: type | None = None) -> PatchPlan:
    """The availability and attention checks, for a plan just made (:func:`check_available`) and for a
    plan file at apply alike: every external site's kernel must be loadable here (package, GPU,
    files; a local repository's files must hash to its ``sha256`` pin, checked before anything is
    imported) and the attention implementation must run here.  Returns the plan with each external
    site locked (``Op.lock``: a local repository's sha256 recorded, the site rebuilt by
    :func:`build_site`) and its source as resolved here.  Raises :class:`Unavailable`.  Not pure."""
    said: dict[tuple, str | None] = {}
    sites = []
    for s in plan.sites:
        op = get_op(s.op)
        if not op.external:
            for k in s.keys:        # a generated kernel this machine cannot run (fp8_linear off Hopper)
                why = op.unavailable(k.param_dict)
                if why:
                    raise Unavailable(s, f"{s.path}: {s.op} cannot be used here: {why}")
            sites.append(s)
            continue
        for k in s.keys:
            key = (s.op, k.params)
            if key not in said:
                said[key] = op.unavailable(k.param_dict)
            if said[key]:
                raise Unavailable(s, f"{s.path}: {s.source or s.op} cannot be used here: {said[key]}")
        extra = op.lock(s.keys[0].param_dict) if s.keys else {}
        if extra:
            info = plan.infos[s.path].with_host(plan.infos.get(s.host))
            try:
                s = build_site(op, s.path, s.cls, s.host, info, {**s.flag_dict, **extra},
                               {**dict(s.flag_sources), **{n: "plan (resolved here)" for n in extra}},
                               dtypes=plan.dtypes, target=plan.target, rule=s.rule, rules=s.rules,
                               matched_by=s.matched_by, covers=s.covers, refused=s.refused, optional=s.optional)
            except SiteError as e:
                raise Unavailable(s, f"{s.path}: {e}") from None
        sites.append(replace(s, source=op.resolved_source(s.keys[0].param_dict)) if s.keys else s)
    if plan.attention is not None:
        why = plan.attention.unavailable(plan.target, model_cls)
        if why:
            raise Unavailable(None, f"attention {plan.attention.impl} cannot run here: {why}")
    return replace(plan, sites=tuple(sites))


def check_available(checked: CheckedSpec, plan: PatchPlan, model_cls: type | None = None) -> PatchPlan:
    """Raise a SpecError naming the site (and its rule) whose kernel cannot be had on this machine:
    an external op whose package, GPU or files are missing, an attention implementation that
    cannot run here (:func:`resolve_here`, which a plan file meets at apply).  Returns the plan
    with each external site locked and its source as resolved here (a local repository's content
    hash, the commit a Hub pin resolved to).  Not pure."""
    spans = {cr.rule.span.short: cr.rule for cr in checked.rules}
    try:
        return resolve_here(plan, model_cls)
    except Unavailable as e:
        if e.site is None:
            raise SpecError(str(e), checked.spec.attention.span) from None
        rule = spans.get(e.site.rule)
        raise SpecError(str(e), rule.op.span if rule is not None else None) from None

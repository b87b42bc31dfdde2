"""The layout a site sees under DTensor parallelism, read from its parameters' placements at apply time.

A site's parameters (and, for an attention or an MLP, its projections') are DTensors when a tensor-,
sequence- or expert-parallel plan was applied to the model before patchdsl.  FSDP2's own sharding is
not a layout: a model with an FSDP2 unit has its parameters on a mesh whose FIRST dimension is the
data-parallel one (``init_device_mesh(..., ("dp", "tp"))`` then ``fully_shard``), and that dimension
is dropped; a 1-D mesh under FSDP2 is FSDP2's alone.  What remains must be one mesh dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..model.info import ModuleInfo

# What a site may see, and what the op then does.  An op accepts the layouts in its ``placements``
# (patchdsl.ops.base.Op); a site with DTensor parameters of any other layout is refused at apply time.
PLACEMENTS = {
    "replicated": "its parameters Replicate over the tensor-parallel mesh (SequenceParallel, replicate): the kernel "
                  "runs on each rank's local input (Replicate, or Shard(1) under sequence parallelism) and gives the "
                  "output the input's placements; weight gradients summed over the ranks when the input is sharded",
    "heads": "an attention whose q/k/v projections are colwise (Shard(0)) and o_proj rowwise (Shard(1)): each rank "
             "holds heads / ranks heads; the kernels are specialised for the local head count, and weights the op "
             "reads itself (q_norm / k_norm) get their gradients summed over the ranks",
    "columns": "a gated MLP whose gate/up projections are colwise (Shard(0)) and down projection rowwise (Shard(1)): "
               "the activation runs on each rank's intermediate / ranks columns",
    "vocab": "an LM head colwise (weight Shard(0)): a vocabulary-parallel fused loss, each rank's vocabulary slice "
             "in chunks, one all-gather of (logsumexp, target logit, logit sum) per chunk; no rank holds whole logits",
    "experts": "expert weights sharded over the experts (Shard(0), expert parallelism): each rank runs its own "
               "experts; slots routed to another rank's experts carry an out-of-range index and add nothing",
}
OTHER = "other"


@dataclass(frozen=True)
class SiteLayout:
    """What one site sees: a :data:`PLACEMENTS` name (or ``"other"``), the ranks of the mesh dimension,
    the placements as read (for people), the facts made local, and why the layout cannot run (or "")."""

    name: str
    ranks: int
    seen: str
    local: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    problem: str = ""

    def describe(self) -> str:
        return f"{self.name} over {self.ranks} ranks ({self.seen})"


def _is_dtensor(t: Any) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def has_dtensors(model: Any) -> bool:
    """Whether any parameter of ``model`` is a DTensor (the one check a non-distributed apply pays)."""
    return any(_is_dtensor(p) for p in model.parameters())


def has_fsdp(model: Any) -> bool:
    """Whether FSDP2 sharded any module of ``model`` (fully_shard swaps in a subclass of FSDPModule)."""
    return any(any(c.__name__ == "FSDPModule" for c in type(m).__mro__) for m in model.modules())


def _shard_size(size: int, ranks: int, coord: int) -> int:
    """A Shard's local size on rank ``coord`` (torch.chunk's split, as DTensor's Shard has it)."""
    chunk = -(-size // ranks)
    return max(0, min(chunk, size - coord * chunk))


def _placement(p: Any, fsdp: bool) -> tuple[Any, int, int] | str | None:
    """(placement, ranks, this rank's coordinate) of ``p`` on its one tensor-parallel mesh dimension;
    None for a plain tensor or FSDP2's own sharding; a reason for more dimensions than one."""
    if not _is_dtensor(p):
        return None
    mesh, pls = p.device_mesh, tuple(p.placements)
    dims = list(range(mesh.ndim))
    if fsdp:
        dims = dims[1:]             # the data-parallel dimension FSDP2 shards over comes first
    if not dims:
        return None
    if len(dims) > 1:
        return f"a mesh of {len(dims)} parallel dimensions besides FSDP2's (one tensor-parallel dimension is supported)"
    d = dims[0]
    coord = mesh.get_coordinate()
    return pls[d], int(mesh.size(d)), int(coord[d]) if coord is not None else 0


def _fmt(pl: Any) -> str:
    return type(pl).__name__ + (f"({pl.dim})" if hasattr(pl, "dim") else "()")


def _rows(p: Any, placement: Any, ranks: int, coord: int, dim: int) -> int:
    """This rank's size of ``p``'s dimension ``dim`` (global size if not sharded there)."""
    size = int(p.shape[dim])
    if getattr(placement, "dim", None) in (dim, dim - p.dim()):
        return _shard_size(size, ranks, coord)
    return size


def _is_shard(pl: Any, dim: int) -> bool:
    return type(pl).__name__ == "Shard" and pl.dim in (dim, dim - 2)


def site_scope(kinds: tuple[str, ...], covers: tuple[str, ...], module: Any) -> list[tuple[str, Any]]:
    """The (name, module) pairs whose parameters a site depends on: the whole module, except for an op that
    replaces a decoder layer's forward (fused_add_rmsnorm), which calls the attention and the MLP as modules
    and reads only the weights of its ``covers``."""
    if "DecoderLayer" in kinds:
        return [(c, getattr(module, c)) for c in covers if getattr(module, c, None) is not None]
    return [("", module)]


def site_layout(kinds: tuple[str, ...], module: Any, info: ModuleInfo, fsdp: bool,
                covers: tuple[str, ...] = ()) -> SiteLayout | None:
    """The layout the site ``module`` (an op of structural ``kinds``) sees, or None: no DTensor parameter."""
    found: dict[str, tuple[Any, int, int, Any]] = {}
    named = [(f"{pre}.{n}" if pre else n, p) for pre, m in site_scope(kinds, covers, module)
             for n, p in m.named_parameters()]
    for name, p in named:
        got = _placement(p, fsdp)
        if isinstance(got, str):
            return SiteLayout(OTHER, 0, f"{name} on {got}")
        if got is not None:
            found[name] = (*got, p)
    if not found:
        return None
    ranks = {r for _, r, _, _ in found.values()}
    seen = ", ".join(f"{n} {_fmt(pl)}" for n, (pl, _, _, _) in sorted(found.items()))
    if len(ranks) > 1:
        return SiteLayout(OTHER, max(ranks), seen + f": meshes of {sorted(ranks)} ranks")
    n = ranks.pop()
    shard = {k: v for k, v in found.items() if type(v[0]).__name__ != "Replicate"}
    if not shard:
        return SiteLayout("replicated", n, seen)
    kind = next((k for k in kinds if info.facts(k)), "")
    f = dict(info.facts(kind)) if kind else {}
    if kind == "Attention":
        return _heads(f, found, n, seen)
    if kind in ("SwiGLU", "GeGLU"):
        return _columns(kind, f, found, n, seen)
    if kind == "Linear" and set(shard) <= {"weight", "bias"} and _is_shard(found["weight"][0], 0):
        pl, _, c, w = found["weight"]
        return SiteLayout("vocab", n, seen, {"Placement": {"vocab_local": _rows(w, pl, n, c, 0)}})
    if kind == "Experts" and all(_is_shard(found[k][0], 0) for k in ("gate_up_proj", "down_proj") if k in found):
        pl, _, c, w = found["gate_up_proj"] if "gate_up_proj" in found else next(iter(found.values()))
        return SiteLayout("experts", n, seen, {"Experts": {"experts": _rows(w, pl, n, c, 0)}})
    return SiteLayout(OTHER, n, seen)


def _heads(f: dict, found: dict, n: int, seen: str) -> SiteLayout:
    want = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1}
    bad = [k for k, d in want.items() if k not in found or not _is_shard(found[k][0], d)]
    if bad:
        return SiteLayout(OTHER, n, seen, problem="q/k/v_proj colwise (Shard(0)) and o_proj rowwise (Shard(1)) "
                                                   f"expected; not so: {', '.join(bad)}")
    d = int(f.get("head_dim") or 0)
    local = {}
    for key, proj in (("n_heads", "q_proj.weight"), ("n_kv_heads", "k_proj.weight")):
        pl, _, c, w = found[proj]
        rows = _rows(w, pl, n, c, 0)
        if not d or rows % d or rows == 0:
            return SiteLayout("heads", n, seen, problem=f"this rank holds {rows} rows of {proj.split('.')[0]}, "
                                                       f"not whole heads of {d}")
        local[key] = rows // d
    if local["n_heads"] % local["n_kv_heads"]:
        return SiteLayout("heads", n, seen, problem=f"{local['n_heads']} local query heads are not a multiple of "
                                                   f"{local['n_kv_heads']} local key/value heads")
    return SiteLayout("heads", n, seen, {"Attention": local})


def _columns(kind: str, f: dict, found: dict, n: int, seen: str) -> SiteLayout:
    if f.get("fused_gate_up"):
        return SiteLayout(OTHER, n, seen, problem="a packed gate_up projection (its shards interleave gate and up)")
    gn, un, dn = f.get("names") or ("gate_proj", "up_proj", "down_proj")
    want = {f"{gn}.weight": 0, f"{un}.weight": 0, f"{dn}.weight": 1}
    bad = [k for k, d in want.items() if k not in found or not _is_shard(found[k][0], d)]
    if bad:
        return SiteLayout(OTHER, n, seen, problem="gate/up colwise (Shard(0)) and down rowwise (Shard(1)) expected; "
                                                   f"not so: {', '.join(bad)}")
    pl, _, c, w = found[f"{gn}.weight"]
    return SiteLayout("columns", n, seen, {kind: {"intermediate": _rows(w, pl, n, c, 0)}})


def placement_reason(op: Any, layout: SiteLayout, flags: Mapping[str, Any]) -> str | None:
    """Why ``op`` cannot run on a site of ``layout`` (None if it can): the refusal apply reports."""
    accepted = tuple(op.placements or ())
    if layout.name in accepted and not layout.problem:
        why = op.placement_reason(flags, layout.name)
        return None if why is None else f"sees {layout.describe()}: {why}"
    what = f"sees {layout.describe()}"
    if layout.problem:
        what += f": {layout.problem}"
    takes = ", ".join(accepted) if accepted else "no DTensor parameters (unsharded sites only)"
    return (f"{what}; {op.name} takes {takes} (docs/distributed.md, 'Tensor, sequence and expert "
            f"parallelism')")


def localise(info: ModuleInfo, layout: SiteLayout) -> ModuleInfo:
    """``info`` with the facts this rank computes (local heads, local widths) and a ``Placement`` entry
    naming the layout: what the op's kernels are specialised for and its forward reads."""
    from dataclasses import replace

    kinds = {k: dict(v) for k, v in info.kinds.items()}
    for k, facts in layout.local.items():
        kinds.setdefault(k, {}).update(facts)
    kinds.setdefault("Placement", {}).update({"layout": layout.name, "ranks": layout.ranks})
    return replace(info, kinds=kinds)

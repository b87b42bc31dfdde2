"""The result of ``patchdsl verify``: one row per compared quantity, a table and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Check:
    """One compared quantity.

    ``kind``: "site" (a patched module run on its own, on the reference's inputs), "end-to-end"
    (the whole model) or "step" (a training step's loss).  ``quantity``: "output", "loss",
    "logits", "grad_input", "grad_<parameter>" (relative to the site's module), or for
    end-to-end gradients "grad" with the parameter's full path in ``path``.
    """

    kind: str
    path: str
    op: str
    quantity: str
    max_abs_err: float
    max_rel_err: float
    rel_fro_err: float       # the patched model's error against float64
    reference_err: float     # the unpatched model's error (same dtype) against float64
    tolerance: float         # factor * reference_err + floor
    passed: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: _num(v) for k, v in asdict(self).items()}


def _num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "-"          # not measured (the row's note says why), never a computed NaN
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{v:.2e}"


@dataclass
class ParityReport:
    dtype: str
    device: str
    target: str
    model_class: str
    spec: str
    batch: int
    seq: int
    steps: int
    seed: int
    factor: float
    floor: float
    rows: list[Check] = field(default_factory=list)
    sites: list[dict[str, str]] = field(default_factory=list)   # {"path", "op", "host"} in plan order
    refused: list[str] = field(default_factory=list)
    refused_required: list[str] = field(default_factory=list)   # refusals of sites not marked optional
    grads_compared: int = 0
    attention: str | None = None          # the spec's attention implementation, when it sets one
    layers: dict[str, Any] | None = None  # verify(layers=N): {"used", "of", "kept": original indices, "kinds"}
    reference: dict[str, Any] = field(default_factory=dict)   # how the float64 reference was computed
    images: dict[str, Any] | None = None  # a vision-language model: {"fed": bool, "batch": how / "reason": why not}
    memory: dict[str, Any] | None = None  # CUDA: {"peak_bytes", "device_total_bytes", "params", "dtype_bytes"}
    seconds: float | None = None
    nothing_patched: str | None = None    # why the spec patches no site of this model (then nothing ran)

    # ---- results -------------------------------------------------------------------
    @property
    def passed(self) -> bool:
        """Every check passed and no site the spec asked for (a rule without '?') was refused."""
        return (bool(self.rows) and all(r.passed for r in self.rows) and not self.refused_required
                and not self.nothing_patched)

    def failures(self) -> list[Check]:
        return [r for r in self.rows if not r.passed]

    def failed_sites(self) -> list[str]:
        """Paths of the patched sites with at least one failing check, in plan order."""
        bad = {r.path for r in self.rows if r.kind == "site" and not r.passed}
        return [s["path"] for s in self.sites if s["path"] in bad]

    def site_rows(self, path: str) -> list[Check]:
        return [r for r in self.rows if r.kind == "site" and r.path == path]

    @property
    def verdict(self) -> str:
        n_sites = len(self.sites)
        if self.nothing_patched:
            return f"FAIL: the spec patches nothing on {self.model_class}: {self.nothing_patched}"
        if not self.rows:
            return "FAIL: nothing was compared"
        if self.passed:
            s = (f"PASS: {n_sites} patched site(s) and the whole model ({self.grads_compared} parameter gradients"
                 f"{f', {self.steps} step(s)' if self.steps else ''}) match float64 as well as the unpatched "
                 f"model does in {self.dtype} (factor {self.factor:g}, floor {self.floor:.1e})")
        else:
            bad = self.failed_sites()
            parts = []
            if bad:
                ops = {s["path"]: s["op"] for s in self.sites}
                parts.append(f"{len(bad)} of {n_sites} site(s) failed: "
                             + ", ".join(f"{p or '<model>'} ({ops[p]})" for p in bad[:8])
                             + (" ..." if len(bad) > 8 else ""))
            e2e = [r for r in self.failures() if r.kind == "end-to-end"]
            if e2e:
                parts.append(f"{len(e2e)} end-to-end check(s) failed")
            st = [r for r in self.failures() if r.kind == "step"]
            if st:
                parts.append(f"{len(st)} training step(s) diverged")
            if self.refused_required:
                parts.append(f"{len(self.refused_required)} site(s) the spec asked for were refused "
                             f"(start the rule with 'optional' to accept that)")
            s = "FAIL: " + "; ".join(parts)
        if self.refused:
            s += f" ({len(self.refused)} site(s) refused and left unpatched)"
        cut = self.layers_cut()
        if cut:
            s += f" [{cut} only]"
        return s

    def layers_cut(self) -> str:
        """"decoder layers 0, 3 of 61" when verify kept some layers only (``layers=N``), else ""."""
        lay = self.layers
        if not lay or lay["used"] >= lay["of"]:
            return ""
        kept = lay.get("kept") or list(range(lay["used"]))
        return f"decoder layers {', '.join(map(str, kept))} of {lay['of']}"

    # ---- output --------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        sites = []
        for s in self.sites:
            rows = self.site_rows(s["path"])
            sites.append({
                "path": s["path"], "op": s["op"], "host": s["host"], "source": s.get("source", ""),
                "passed": bool(rows) and all(r.passed for r in rows),
                "max_abs_err": _num(max((r.max_abs_err for r in rows), default=0.0)),
                "max_rel_err": _num(max((r.max_rel_err for r in rows), default=0.0)),
                "checks": [r.to_json() for r in rows],
            })
        return {
            "passed": self.passed, "verdict": self.verdict,
            "dtype": self.dtype, "device": self.device, "target": self.target,
            "model_class": self.model_class, "spec": self.spec,
            "batch": self.batch, "seq": self.seq, "n_steps": self.steps, "seed": self.seed,
            "tolerance": {"factor": self.factor, "floor": self.floor,
                          "rule": "rel_fro_err <= factor * reference_err + floor, all values finite"},
            "sites": sites,
            "end_to_end": [r.to_json() for r in self.rows if r.kind == "end-to-end"],
            "steps": [r.to_json() for r in self.rows if r.kind == "step"],
            "grads_compared": self.grads_compared,
            "refused": list(self.refused), "refused_required": list(self.refused_required),
            "attention": self.attention,
            "layers": dict(self.layers) if self.layers else None,
            "images": dict(self.images) if self.images else None,
            "reference": {k: _num(v) for k, v in self.reference.items()},
            "memory": dict(self.memory) if self.memory else None,
            "seconds": self.seconds,
        }

    def images_line(self) -> str:
        i = self.images or {}
        if i.get("fed"):
            return f"images: {i.get('batch')}"
        return f"images: none fed, text only ({i.get('reason')})"

    def table(self):
        """The report as a ``rich.table.Table``."""
        from rich.table import Table

        cut = f", {self.layers_cut()}" if self.layers_cut() else ""
        t = Table(title=f"patchdsl verify: {self.spec} on {self.model_class} ({self.dtype}, {self.device}, "
                        f"batch {self.batch} x seq {self.seq}{cut})")
        for col, just in (("", "left"), ("kind", "left"), ("path", "left"), ("op", "left"), ("quantity", "left"),
                          ("rel err", "right"), ("HF err", "right"), ("bound", "right"),
                          ("max abs", "right"), ("max rel", "right")):
            t.add_column(col, justify=just, overflow="fold")
        for r in self.rows:
            mark = "[green]ok[/]" if r.passed else "[bold red]FAIL[/]"
            q = r.quantity + (f" ({r.note})" if r.note else "")
            t.add_row(mark, r.kind, r.path or "<model>", r.op, q, _fmt(r.rel_fro_err), _fmt(r.reference_err),
                      _fmt(r.tolerance), _fmt(r.max_abs_err), _fmt(r.max_rel_err))
        return t

    def plain_lines(self) -> list[str]:
        """The table as plain fixed-column lines (one per check, never wrapped), then the verdict:
        what the CLI prints when its output is not a terminal (a file, a pipe, grep)."""
        from ..planning.text import columns

        rows = [["ok" if r.passed else "FAIL", r.kind, r.path or "<model>", r.op,
                 r.quantity + (f" ({r.note})" if r.note else ""), _fmt(r.rel_fro_err), _fmt(r.reference_err),
                 _fmt(r.tolerance), _fmt(r.max_abs_err), _fmt(r.max_rel_err)] for r in self.rows]
        out = [f"patchdsl verify: {self.spec} on {self.model_class} ({self.dtype}, {self.device}, "
               f"batch {self.batch} x seq {self.seq})"]
        out += columns(["", "kind", "path", "op", "quantity", "rel err", "HF err", "bound", "max abs", "max rel"],
                       rows, right=(5, 6, 7, 8, 9))
        if self.attention:
            out.append(f"patched model ran with attention implementation {self.attention}")
        if self.images:
            out.append(self.images_line())
        out += [f"refused: {r}" for r in self.refused]
        out.append(self.verdict)
        return out

    def render_table(self, console: Any = None) -> None:
        """Print the table, then the one-line verdict, to ``console`` (a rich Console; default stdout)."""
        if console is None:
            from rich.console import Console

            console = Console(highlight=False, soft_wrap=True)
        console.print(self.table())
        if self.attention:
            console.print(f"patched model ran with attention implementation {self.attention}")
        if self.images:
            console.print(self.images_line())
        for r in self.refused:
            console.print(f"refused: {r}")
        if self.reference:
            line = f"float64 reference: {self.reference.get('mode')} ({self.reference.get('why')})"
            if self.memory:
                line += f"; peak device memory {self.memory['peak_bytes'] / 2 ** 30:.1f} GiB"
            if self.seconds is not None:
                line += f"; {self.seconds:.0f} s"
            console.print(line)
        style = "bold green" if self.passed else "bold red"
        console.print(f"[{style}]{self.verdict}[/]")

    def exit_code(self) -> int:
        """The CLI's exit code: 0 when parity holds, 1 when a comparison failed (or nothing was
        compared), else 2 when only a site the spec requires was refused (bad input: the spec asks
        for what this model cannot have; docs/reliability.md, "Exit codes")."""
        if self.passed:
            return 0
        if self.rows and all(r.passed for r in self.rows) and self.refused_required:
            return 2
        return 1

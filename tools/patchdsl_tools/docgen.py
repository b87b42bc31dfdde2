"""Generate docs/ops.md from the op registry: ``python -m patchdsl_tools.docgen > docs/ops.md``."""

from __future__ import annotations

from patchdsl.model.kinds import KIND_DOCS
from patchdsl.ops.registry import ops


def _v(v) -> str:
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "none"
    return str(v)


def render_ops_md() -> str:
    lines = ["# Ops", "", "Generated from the op registry by `python -m patchdsl_tools.docgen`; do not edit by hand.", "",
             "## Structural kinds", "", "| kind | recognised as |", "|---|---|"]
    for name, doc in KIND_DOCS.items():
        lines.append(f"| `{name}` | {doc} |")
    for op in ops().values():
        lines += ["", f"## `{op.name}`", "", op.doc.strip(), "",
                  f"- replaces: {', '.join('`' + k + '`' for k in op.kinds)}",
                  (f"- template: `templates/{op.template}`" if not op.external
                   else "- kernel: external (loaded, not generated; see `docs/interop.md`)")]
        if op.covers:
            lines.append(f"- fuses the child modules: {', '.join('`' + c + '`' for c in op.covers)}")
        lines.append("- DTensor layouts (tensor / sequence / expert parallelism, `docs/distributed.md`): "
                     + (", ".join('`' + p + '`' for p in op.placements) if op.placements
                        else "none (unsharded parameters only)"))
        if op.flags:
            lines += ["", "| flag | type | default | meaning |", "|---|---|---|---|"]
            for f in op.flags:
                lines.append(f"| `{f.name}` | {f.describe_type()} | `{_v(f.default)}` | {f.doc} |")
        else:
            lines += ["", "No flags."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_ops_md(), end="")

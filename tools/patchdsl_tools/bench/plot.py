"""One PNG from the ops and e2e JSON documents (matplotlib is optional: without it, no plot).

Top: for each op at the issue's shapes, forward+backward time of every implementation as a
speed-up over HF eager (higher is better), with patchdsl's % of the copy bandwidth written on its
bar.  Bottom left: peak memory of fwd+bwd over HF's.  Bottom right: e2e tokens/s and peak memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMPLS = ("patchdsl", "hf", "compile", "liger", "cce")
COLORS = {"patchdsl": "#d62728", "hf": "#7f7f7f", "compile": "#1f77b4", "liger": "#2ca02c", "cce": "#9467bd"}


def plot(ops: dict | None, e2e: dict | None, path: str | Path) -> str | None:
    """Write the PNG; returns its path, or None when matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    cases = _issue_cases(ops) if ops else []
    has_e2e = bool(e2e and any(v.get("status") == "ok" for v in e2e.get("variants", [])))
    if not cases and not has_e2e:
        return None
    if not cases:             # e2e alone: one panel
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(e2e.get("variants", [])) + 2), 5))
        _e2e(ax, e2e)
        env = e2e.get("env", {})
        fig.suptitle(f"patchdsl bench e2e on {env.get('gpu', env.get('device', '?'))} - torch {env.get('torch')}, "
                     f"triton {env.get('triton')}, {env.get('date', '')}", fontsize=9)
        return _save(fig, plt, path)
    fig = plt.figure(figsize=(16, 10))
    gs = fig.add_gridspec(2, 2, height_ratios=[1.2, 1])
    if cases:
        ax = fig.add_subplot(gs[0, :])
        _bars(ax, ops, cases, "fwd_bwd_ms", invert=True,
              title="forward+backward: speed-up over HF eager (higher is better); label on patchdsl: % of copy BW")
        ax2 = fig.add_subplot(gs[1, 0])
        _bars(ax2, ops, cases, "peak_bytes", invert=False, title="fwd+bwd peak memory / HF's (lower is better)")
    if has_e2e:
        ax3 = fig.add_subplot(gs[1, 1])
        _e2e(ax3, e2e)
    env = (ops or e2e or {}).get("env", {})
    fig.suptitle(f"patchdsl bench on {env.get('gpu', env.get('device', '?'))} - torch {env.get('torch')}, "
                 f"triton {env.get('triton')}, {env.get('date', '')}")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> str:
    import io

    from patchdsl.util import files

    fig.tight_layout()
    fig.savefig(buf := io.BytesIO(), format="png", dpi=90)
    plt.close(fig)
    files.write_bytes(path, buf.getvalue(), what="plot", parents=True)
    return str(Path(path))


def _issue_cases(ops: dict) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for r in ops.get("results", []):
        if r["group"] != "sweep" and (r["op"], r["label"]) not in out:
            out.append((r["op"], r["label"]))
    order = list(dict.fromkeys(r["op"] for r in ops.get("results", [])))
    pos = {t: i for i, t in enumerate(out)}
    return sorted(out, key=lambda t: (order.index(t[0]), pos[t]))


def _bars(ax: Any, ops: dict, cases: list, field: str, invert: bool, title: str) -> None:
    by = {(r["op"], r["label"], r["impl"]): r for r in ops.get("results", []) if r.get("status") == "ok"}
    width = 0.8 / len(IMPLS)
    for j, impl in enumerate(IMPLS):
        xs, ys, labels = [], [], []
        for i, (op, label) in enumerate(cases):
            r, h = by.get((op, label, impl)), by.get((op, label, "hf"))
            if not r or not h or not r.get(field) or not h.get(field):
                continue
            xs.append(i + (j - len(IMPLS) / 2 + 0.5) * width)
            ys.append(h[field] / r[field] if invert else r[field] / h[field])
            pc = r.get("pct_copy", {}).get("fwd_bwd") if impl == "patchdsl" and field == "fwd_bwd_ms" else None
            labels.append(f"{pc:.0f}%" if pc else "")
        if xs:
            bars = ax.bar(xs, ys, width, label=impl, color=COLORS[impl])
            for b, t in zip(bars, labels):
                if t:
                    ax.annotate(t, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                                fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    if ax.get_legend_handles_labels()[0]:
        ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{o}\n{l}" for o, l in cases], fontsize=7)
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _color(name: str) -> str:
    base = name.split(" @")[0]
    if base.startswith("patchdsl+compile"):
        return "#ff7f0e"
    return COLORS.get(base.split(":")[0], "#333333")


def _e2e(ax: Any, e2e: dict) -> None:
    vs = [v for v in e2e.get("variants", []) if v.get("status") == "ok"]
    names = [v["variant"] for v in vs]
    tps = [v["tokens_per_s"] / 1000 for v in vs]
    bars = ax.bar(range(len(vs)), tps, color=[_color(n) for n in names])
    for b, v in zip(bars, vs):
        peak = v.get("peak_bytes")
        label = f"{v['tokens_per_s'] / 1000:.1f}k" + (f"\n{peak / 2**30:.1f} GiB" if peak else "")
        ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(vs)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
    o = e2e.get("options", {})
    m = e2e.get("model", {})
    bs = "/".join(str(b) for b in (o.get("batches") or [o.get("batch")]))
    failed = [v["variant"] for v in e2e.get("variants", []) if v.get("status") != "ok"]
    ax.set_title(f"e2e {m.get('name', m.get('type', ''))} batch {bs}x{o.get('seq')}: k tokens/s (label: peak memory)"
                 + (f"\nno result: {', '.join(failed)}" if failed else ""), fontsize=9)

"""The compile_perf part's verdict (bench/gpu_all.sh): every compiled row against the eager patchdsl row.

    python3 bench/compile_verdict.py compile_perf.json

One line per compiled row (tokens/s ratio, peak memory difference, warm-up, graph breaks, largest
relative loss difference from the eager patched row), then the verdict LAST, against issue 26's
target: >= 1.10x eager at <= eager peak + 1 GiB, warm-up < 60 s, 0 graph breaks, losses within
2^-8 relative (verify's bf16 floor: the compiled step runs the same kernels, Inductor re-rounds
only the glue between them).
"""

from __future__ import annotations

import json
import sys

TARGET_RATIO, TARGET_PEAK_GIB, TARGET_WARMUP_S, LOSS_REL = 1.10, 1.0, 60.0, 2.0 ** -8


def verdict(doc: dict) -> list[str]:
    rows = {v["variant"]: v for v in doc.get("variants", [])}
    eager = rows.get("patchdsl")
    if not eager or eager.get("status") != "ok":
        return [f"compile_perf verdict: no eager patchdsl row ({(eager or {}).get('error', 'missing')})"]
    lines, met = [], []
    for name, v in rows.items():
        if name == "patchdsl" or not v.get("base", name).startswith(("patchdsl+", "compile")) or "graphs" in name:
            continue
        if v.get("status") != "ok":
            lines.append(f"  {name}: {v.get('status')}: {str(v.get('error', ''))[:160]}")
            continue
        ratio = v["tokens_per_s"] / eager["tokens_per_s"]
        dpeak = (v.get("peak_bytes", 0) - eager.get("peak_bytes", 0)) / 2 ** 30
        cs = v.get("compile_stats") or {}
        n = min(len(v["losses"]), len(eager["losses"]))
        drel = max((abs(a - b) / abs(b) for a, b in zip(v["losses"][:n], eager["losses"][:n]) if b), default=float("nan"))
        warm = v.get("warmup_s", float("nan"))
        ok = (ratio >= TARGET_RATIO and dpeak <= TARGET_PEAK_GIB and warm < TARGET_WARMUP_S
              and cs.get("graph_breaks", 1) == 0 and drel <= LOSS_REL)
        if ok:
            met.append(name)
        lines.append(f"  {name}: {ratio:.3f}x eager ({v['tokens_per_s']:,.0f} vs {eager['tokens_per_s']:,.0f} tokens/s), "
                     f"peak {dpeak:+.2f} GiB, warm-up {warm:.1f} s, {cs.get('graph_breaks')} graph break(s), "
                     f"{cs.get('unique_graphs')} graph(s), max rel dloss {drel:.1e}")
    best = max((ln for ln in lines if "x eager" in ln), key=lambda ln: float(ln.split(":")[1].split("x")[0]), default=None)
    head = (f"compile_perf verdict: target (>= {TARGET_RATIO}x at <= +{TARGET_PEAK_GIB:g} GiB, warm-up < {TARGET_WARMUP_S:g} s, "
            f"0 breaks, losses within {LOSS_REL:.1e}) " + (f"MET by {', '.join(met)}" if met else "MISSED")
            + (f"; best {best.strip()}" if best and not met else ""))
    return lines + [head]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        doc = json.load(open(argv[1]))
    except (OSError, ValueError) as e:
        print(f"compile_perf verdict: no result ({type(e).__name__}: {e})")
        return 1
    print("\n".join(verdict(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

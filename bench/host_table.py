"""Host time to issue one forward, per op: the fast launch against Triton's own launcher.

    python3 bench/host_table.py FAST.json NORMAL.json

Both files are `patchdsl bench ops --impls patchdsl` outputs, the second run with
PATCHDSL_FAST_LAUNCH=0 (bench/gpu_all.sh part `host_ab`). Prints one row per op and shape:
host us per forward (fast / normal), the launches the fast run took [fast, normal], and the
issue's target (30 us; 150 us for the linear cross entropy and log-probs).
"""

from __future__ import annotations

import json
import sys

TARGET_US = {"linear_cross_entropy": 150.0, "linear_logprobs": 150.0, "linear_jsd": 150.0}


def rows(doc: dict) -> dict[tuple[str, str], dict]:
    out = {}
    for r in doc.get("results", doc.get("records", [])):
        if r.get("impl") == "patchdsl" and r.get("host_fwd_us") is not None:
            out[(r.get("op") or r.get("family"), r.get("label") or r.get("shape_label") or "")] = r
    return out


def table(fast: dict, normal: dict) -> str:
    f, n = rows(fast), rows(normal)
    lines = ["host us per forward    fast   normal   launches[fast,normal]   target",
             "-" * 76]
    for key in sorted(f):
        op, label = key
        a = f[key]["host_fwd_us"]
        b = n.get(key, {}).get("host_fwd_us")
        t = TARGET_US.get(op, 30.0)
        lines.append(f"{op:22s} {label[:18]:18s} {a:7.1f} {b if b is None else round(b, 1)!s:>8} "
                     f"{str(f[key].get('launches_fast_normal')):>14}   <= {t:.0f}: {'met' if a <= t else 'missed'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    fast, normal = (json.load(open(p)) for p in argv[1:3])
    print(table(fast, normal))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

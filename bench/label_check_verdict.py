"""One-line verdict of gpu_all.sh's label_check part (issue 22): the cost of the label range check of
the linear cross entropy, from one `bench ops` JSON holding both the checked families
(linear_cross_entropy, linear_cross_entropy_fused) and their check_labels=false twins (_nocheck),
same shapes, same run, patchdsl rows.

    python3 bench/label_check_verdict.py ops_label_check.json

Prints, per mode, fwd+bwd with and without the check, the difference in % and whether either row
synchronised with the host; the verdict is last: PASS when every pair was measured, both rows are
correct and the check costs < 1% of fwd+bwd (+ 0.01 ms of timing noise) and adds no host sync;
exit 0 on PASS, 1 otherwise (a result to read, not a test).
"""

from __future__ import annotations

import json
import sys

PAIRS = (("chunked", "linear_cross_entropy", "linear_cross_entropy_nocheck"),
         ("fused", "linear_cross_entropy_fused", "linear_cross_entropy_fused_nocheck"))
LIMIT_PCT, NOISE_MS = 1.0, 0.01


def main(path: str) -> int:
    d = json.load(open(path))
    rows = {(r["op"], r["label"]): r for r in d.get("results", [])
            if r.get("impl") == "patchdsl" and r.get("status") == "ok"}
    lines, ok, measured = [], True, 0
    for mode, on, off in PAIRS:
        for (op, label), a in sorted(rows.items()):
            if op != on or (off, label) not in rows:
                continue
            b = rows[(off, label)]
            ta, tb = a.get("fwd_bwd_ms"), b.get("fwd_bwd_ms")
            if ta is None or tb is None:
                continue
            measured += 1
            pct = 100.0 * (ta - tb) / tb if tb else float("inf")
            sync = bool(a.get("host_sync")) and not bool(b.get("host_sync"))
            good = a.get("correct") and b.get("correct") and (ta - tb <= tb * LIMIT_PCT / 100 + NOISE_MS) and not sync
            ok = ok and bool(good)
            lines.append(f"label_check {mode} {label}: fwd+bwd {ta:.3f} ms checked vs {tb:.3f} ms unchecked "
                         f"({pct:+.2f}%){'; the check adds a host sync' if sync else ''}"
                         f"{'' if a.get('correct') and b.get('correct') else '; WRONG RESULTS'}")
    for ln in lines:
        print(ln)
    if not measured:
        print("label_check: FAIL: no checked/unchecked pair measured (see bench.log)")
        return 1
    print(f"label_check: {'PASS' if ok else 'FAIL'}: the label range check costs "
          f"{'< ' if ok else 'more than '}{LIMIT_PCT:g}% of the linear CE's fwd+bwd ({measured} pair(s), patchdsl rows)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""The convergence test at Liger-Kernel's mini-model sizes on the GPU: patchdsl vs unpatched vs Liger.

    python bench/convergence.py [--budget 110] [--families llama,qwen3,gemma3] [--dtypes bf16,fp32]
                                [--steps 32 --batch 8 --seq 512] [--device cuda] [--size mini|tiny]

For each family (patchdsl.parity.convergence.FAMILIES: Liger's mini configs, 4 layers, hidden
896-1024, vocabulary 32000) and dtype: train 32 AdamW steps (lr 1e-4) on byte tokens of Python's
standard-library sources, unpatched, patched with the family's whole shipped spec, and patched
with liger_kernel's apply_liger_kernel_to_<family>(model=...) (its defaults: RoPE, RMSNorm,
SwiGLU/GeGLU, fused linear cross entropy); compare every step's loss, the top-20 log-probs of an
evaluation batch and every final parameter against the unpatched run with Liger's tolerances.
Liger patches transformers' modeling module for the whole process, so each Liger run comes after
the other runs of its family and dtype, and the module is reloaded after it (as Liger's tests do).
The verdict judges patchdsl; Liger's column is there to read beside it.

Writes convergence.json and convergence.txt into $PART_OUT (or --out); prints the verdict last.

    python bench/convergence.py --fp8 rowwise [--families llama,qwen3] [--size full] [--steps 100]

fp8 projections (issue 26 item 2): per family, bf16, train with the shipped spec and with the spec
plus `fp8_linear(recipe=...)` on every attention and MLP projection, same text and weights, and
judge the fp8 run's losses against the bf16 run's with the stated tolerance
(patchdsl.parity.convergence.FP8_STEP_RTOL per step, FP8_FINAL_RTOL on the mean of the last 10).
`--size full` is Llama-3.2-1B's and Qwen3-0.6B's widths; writes convergence_fp8.json / .txt and
prints `convergence_fp8: PASS|FAIL ...` last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path



def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v} (a run of nothing passes vacuously)")
        return v
    return parse


def _dtypes(text: str) -> list[str]:
    from patchdsl.parity.convergence import TOLERANCES

    got = [d for d in text.split(",") if d]
    bad = [d for d in got if d not in TOLERANCES]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(TOLERANCES)}, got {text!r}")
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=110.0)
    ap.add_argument("--families", default="llama,qwen3,gemma3")
    ap.add_argument("--dtypes", type=_dtypes, default="bf16,fp32")
    ap.add_argument("--steps", type=_at_least(1), default=32)
    ap.add_argument("--batch", type=_at_least(1), default=8)
    ap.add_argument("--seq", type=_at_least(2), default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="mini", choices=("mini", "tiny", "full"))
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--out", default=os.environ.get("PART_OUT", "."))
    from patchdsl.ops.fp8_linear import RECIPES

    ap.add_argument("--fp8", choices=tuple(RECIPES), help="fp8 projections against bf16 (see above)")
    ap.add_argument("--fp8-control", action="store_true", help="--fp8: also train the unpatched bf16 model and report "
                    "its per-step gap to the bf16 run next to fp8's (the drift two bf16 implementations already show)")
    ap.add_argument("--fp8-emulate", action="store_true", help="fp8_linear(emulate=true): the recipe's numerics "
                    "without fp8 matmuls (the CPU dry run)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the --fp8 run's model dtype")
    ap.add_argument("--fp8-on", default="projections", choices=("projections", "experts"),
                    help="--fp8: the attention and MLP projections (fp8_linear) or the MoE experts "
                    "(fused_experts(fp8=...), MoE families)")
    ap.add_argument("--without", default="", help="--fp8: leave out the spec rules of these kinds (e.g. Attention: "
                    "the CPU dry run, whose RoPE kernels are slow in the Triton interpreter)")
    a = ap.parse_args(argv)
    if a.fp8:
        return fp8_main(a)
    t0 = time.perf_counter()
    from patchdsl.parity import convergence as conv

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data, eval_ids, where = conv.training_data(a.steps, a.batch, a.seq)
    print(f"text: {where}; {a.steps} steps of {a.batch} x {a.seq}", flush=True)
    families = [f for f in a.families.split(",") if f]
    dtypes = a.dtypes
    results: dict[tuple[str, str], conv.FamilyResult] = {}

    def left() -> float:
        return a.budget - (time.perf_counter() - t0)

    def one(fam: str, dt: str, variant: str) -> None:
        res = results.setdefault((fam, dt), conv.FamilyResult(fam, dt, a.size, a.steps, a.batch, a.seq, where))
        if variant != "unpatched" and "unpatched" not in res.runs:
            return
        if left() < 8:
            res.skipped[variant] = "not run: out of time"
            return
        try:
            r = conv.run_variant(fam, variant, dt, a.device, data, eval_ids, a.size)
        except Exception as e:           # reported in the table, never fatal
            res.skipped[variant] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            print(f"  {fam} {dt} {variant}: {res.skipped[variant]}", flush=True)
            return
        res.runs[variant] = r
        if variant != "unpatched":
            res.checks[variant] = conv.compare(res.runs["unpatched"], r, dt)
        print(f"  {fam} {dt} {variant}: {r.seconds:.1f}s, final loss {r.losses[-1]:.4f} {r.note}", flush=True)

    liger_ok = not a.no_liger
    if liger_ok:
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            liger_ok = False
            print(f"liger-kernel missing: {e}", flush=True)
    for dt in dtypes:                   # every family in bf16 first: what a short budget cuts is fp32
        for fam in families:
            for v in ("unpatched", "patchdsl") + (("liger",) if liger_ok else ()):
                one(fam, dt, v)         # (Liger last: its process-wide patches are reverted after its run)
            if not liger_ok:
                results[(fam, dt)].skipped.setdefault("liger", "not run: liger-kernel is not installed")
    blocks = [r.table() for r in results.values()]
    text = (f"convergence ({a.size} models, {a.steps} steps of {a.batch} x {a.seq}, AdamW lr {conv.LR}, text: "
            f"{where.split(':')[0]}); max |err| against the unpatched run, ok = within Liger's tolerances\n"
            + "\n".join(blocks))
    (out / "convergence.txt").write_text(text + "\n")
    (out / "convergence.json").write_text(json.dumps({
        "size": a.size, "steps": a.steps, "batch": a.batch, "seq": a.seq, "device": a.device, "text": where,
        "results": [r.to_json() for r in results.values()]}, indent=1))
    print(text)
    judged = [r for r in results.values() if "patchdsl" in r.checks]
    n_ok = sum(r.passed for r in judged)
    lig = [r for r in results.values() if "liger" in r.checks]
    lig_ok = sum(all(c.passed for c in r.checks["liger"]) for r in lig)
    first = {f for (f, d), r in results.items() if d == dtypes[0] and "patchdsl" in r.checks}
    ok = bool(judged) and n_ok == len(judged) and first == set(families)   # every family in the first dtype
    missing = len(families) * len(dtypes) - len(judged)
    print(f"convergence: {'PASS' if ok else 'FAIL'}: patchdsl {n_ok}/{len(judged)} (family, dtype) pairs within "
          f"Liger's tolerances{f' ({missing} not run in the budget)' if missing else ''}; Liger itself "
          f"{lig_ok}/{len(lig)} ({time.perf_counter() - t0:.0f}s)")
    return 0 if ok else 1


def fp8_main(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from patchdsl.parity import convergence as conv

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    families = [f for f in a.families.split(",") if f]     # an unknown one, or one without --size, fails its row
    rows, lines = [], [f"fp8 {a.fp8_on} (recipe={a.fp8}) against bf16, {a.size} models, {a.steps} steps of "
                       f"{a.batch} x {a.seq}, AdamW lr {conv.LR}; ok = every step within {conv.FP8_STEP_RTOL * 100:g}% "
                       f"and the last {conv.FP8_FINAL_STEPS} steps' mean within {conv.FP8_FINAL_RTOL * 100:g}%"]
    for fam in families:
        if a.budget - (time.perf_counter() - t0) < 10:
            rows.append({"family": fam, "skipped": "not run: out of time"})
            lines.append(f"  {fam}: not run: out of time")
            continue
        try:
            ref, fp8, checks = conv.run_fp8(fam, device=a.device, size=a.size, steps=a.steps, batch=a.batch,
                                            seq=a.seq, dtype=a.dtype, recipe=a.fp8, emulate=a.fp8_emulate,
                                            without=tuple(w for w in a.without.split(",") if w), on=a.fp8_on)
        except Exception as e:           # reported, never fatal
            rows.append({"family": fam, "skipped": f"failed: {type(e).__name__}: {str(e)[:300]}"})
            lines.append(f"  {fam}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        ok = all(c.passed for c in checks)
        row = {"family": fam, "passed": ok, "bf16": {"losses": ref.losses, "seconds": ref.seconds, "note": ref.note},
               "fp8": {"losses": fp8.losses, "seconds": fp8.seconds, "note": fp8.note},
               "checks": [c.to_json() for c in checks]}
        lines.append(f"  {fam}: {'ok' if ok else 'FAIL'}; final loss bf16 {ref.losses[-1]:.4f}, fp8 {fp8.losses[-1]:.4f}; "
                     + "; ".join(f"{c.quantity} {c.max_abs_err:.2e} ({c.worst})" for c in checks)
                     + f"; {ref.seconds:.0f} s / {fp8.seconds:.0f} s")
        if a.fp8_control and a.budget - (time.perf_counter() - t0) > 10:
            ctl = conv.run_control(fam, device=a.device, size=a.size, steps=a.steps, batch=a.batch, seq=a.seq,
                                   dtype=a.dtype)
            g = conv.control_gaps(ref, fp8, ctl)
            row["control"] = {"losses": ctl.losses, "seconds": ctl.seconds, **g}
            med = g["median_fp8_over_control"]
            lines[-1] += (f"; control (unpatched bf16 vs the bf16 run, reported, not judged): max step gap "
                          f"{g['control_max'] * 100:.2f}% (step {g['control_worst_step']}), fp8's {g['fp8_max'] * 100:.2f}%"
                          + (f", median fp8/control {med:.1f}x" if med is not None else "")
                          + "".join(f"; step {b['step']}: fp8 {b['fp8'] * 100:.2f}% vs control {b['control'] * 100:.2f}%"
                                    for b in g["steps_beyond"][:5]))
        rows.append(row)
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    (out / "convergence_fp8.txt").write_text(text + "\n")
    (out / "convergence_fp8.json").write_text(json.dumps({
        "recipe": a.fp8, "size": a.size, "steps": a.steps, "batch": a.batch, "seq": a.seq, "device": a.device,
        "step_rtol": conv.FP8_STEP_RTOL, "final_rtol": conv.FP8_FINAL_RTOL, "results": rows}, indent=1))
    print(text)
    judged = [r for r in rows if "passed" in r]
    ok = bool(judged) and len(judged) == len(families) and all(r["passed"] for r in judged)
    print(f"convergence_fp8: {'PASS' if ok else 'FAIL'}: {sum(r['passed'] for r in judged)}/{len(families)} families "
          f"within the stated tolerance ({time.perf_counter() - t0:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

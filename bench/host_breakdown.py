"""Where the host time of one forward goes, layer by layer (issue 15, item 2: <= 30 us per forward).

    python3 bench/host_breakdown.py [--ops rmsnorm,swiglu,...] [--json OUT.json] [--tiny] [--root DIR]
    python3 bench/host_breakdown.py --compare BEFORE.json AFTER.json

Per op, at the bench's issue shape (``--tiny``: the tiny shapes, for a CPU smoke run), in ONE
process, each row timed as ``bench ops`` times ``host_fwd_us`` (``patchdsl_tools.bench.timing.eager_wall``:
N calls issued back to back, CPU time per call while the GPU works):

  loop            an empty lambda through the same loop (what the loop itself costs)
  empty_like      one ``torch.empty_like`` of the first activation (one output allocation)
  fn_floor        ``apply_function`` of an autograd.Function that returns a view of its input
                  (what any autograd.Function costs before its forward does anything)
  entry_nolaunch  the generated module's entry point (autograd, as a patched model calls it) with
                  the module's ``launch`` replaced by a no-op: Python and torch host code alone
  entry           the entry point as shipped (fast launch)
  entry_normal    the entry point with Triton's own launcher (``kernel[grid](...)``)
  bench_call      what ``bench ops`` times: the bench's call wrapper around the entry point
  liger / hf      the peers' forward through the bench's wrappers (when importable)

Derived: launch = entry - entry_nolaunch (the kernel launches of one forward, fast path),
wrapper = bench_call - entry.  Rows are host microseconds; nothing here is pass/fail.
On a machine without CUDA the kernels run in Triton's interpreter, so only the rows without a real
launch mean anything there (``--tiny`` is for checking the script, not for numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DEFAULT_OPS = ("rmsnorm", "add_rmsnorm", "layernorm", "swiglu", "geglu", "rope", "qk_norm_rope", "linear_cross_entropy")


def _noop(*args, **kwargs):
    return None


def breakdown(fam, shape: dict, dtype: str, device: str, target_ms: float, lo: int) -> dict:
    import torch

    from patchdsl_tools.bench import timing
    from patchdsl_tools.bench.cases import as_tuple
    from patchdsl_tools.bench.runner import _gen, build_patchdsl, patchdsl_entry
    from patchdsl.kernel_support import launch as L
    from patchdsl.codegen import target

    params = fam.make_params(shape, dtype, device, _gen(device, 0))
    act = fam.make_act(shape, dtype, device, _gen(device, 1))
    acts = [act[n] for n in fam.act_names]
    try:                                  # only the output layout matters here (fix_outputs); no float64 copy
        with torch.no_grad():
            ref_shapes = [tuple(t.shape) for t in as_tuple(fam.ref_forward(params, act))]
    except NotImplementedError:           # families with their own reference() (the losses): outputs as they are
        ref_shapes = []
    entry = patchdsl_entry(fam, shape, dtype, target())
    bench_call, _ = build_patchdsl(fam, params, shape, dtype, target(), ref_shapes, entry=entry)
    mod, fn = entry.module, entry.fn
    values = fam.patchdsl_values(params, dict(zip(fam.act_names, acts)))
    args = [values[c] for _, c in getattr(entry.call, "bound", [])]

    class View(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *rest):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return (g,) + (None,) * (len(args) - 1)

    def wall(call):
        for _ in range(3):
            call()
        timing.sync(device)
        return timing.eager_wall([call], device, target_ms=target_ms, lo=lo)["host_us"]

    x0 = acts[0]
    rows: dict[str, float] = {}
    rows["loop"] = wall(lambda: None)
    rows["empty_like"] = wall(lambda: torch.empty_like(x0))
    rows["fn_floor"] = wall(lambda: L.apply_function(View, *args))
    real_launch = mod.__dict__.get("launch")
    try:
        mod.launch = _noop
        rows["entry_nolaunch"] = wall(lambda: fn(*args))
    finally:
        mod.launch = real_launch
    rows["entry"] = wall(lambda: fn(*args))
    old = os.environ.get(L.ENV_FLAG)
    os.environ[L.ENV_FLAG] = "0"
    L.reset()
    try:
        rows["entry_normal"] = wall(lambda: fn(*args))
    finally:
        if old is None:
            os.environ.pop(L.ENV_FLAG, None)
        else:
            os.environ[L.ENV_FLAG] = old
        L.reset()
    fn(*args)                                          # re-learn the fast path before bench_call
    rows["bench_call"] = wall(lambda: bench_call(*acts))
    for peer in ("liger", "hf"):
        try:                                           # not installed / not importable / fails here
            call = getattr(fam, peer)(params, shape)
            rows[peer] = wall(lambda: call(*acts))
        except Exception as e:
            rows[peer] = None
            rows[f"{peer}_why"] = f"{type(e).__name__}: {str(e)[:120]}"
    rows["launch"] = rows["entry"] - rows["entry_nolaunch"]
    rows["wrapper"] = rows["bench_call"] - rows["entry"]
    return {"op": fam.name, "label": fam.label(shape), "kernel": entry.key.name, "entry": entry.name,
            "device": device, "us": rows}


COLUMNS = ("loop", "empty_like", "fn_floor", "entry_nolaunch", "launch", "entry", "entry_normal", "bench_call",
           "liger", "hf")


def table(records: list[dict]) -> str:
    head = f"{'op':14s} {'shape':22s} " + " ".join(f"{c:>14s}" for c in COLUMNS)
    lines = ["host us per forward (one process; bench/host_breakdown.py)", head, "-" * len(head)]
    for r in records:
        if "error" in r:
            lines.append(f"{r['op']:14s} {r.get('label', '')[:22]:22s} ERROR {r['error']}")
            continue
        u = r["us"]
        cells = " ".join(f"{'-' if u.get(c) is None else format(u[c], '.1f'):>14s}" for c in COLUMNS)
        lines.append(f"{r['op']:14s} {r['label'][:22]:22s} {cells}")
    return "\n".join(lines)


def compare(before: dict, after: dict) -> str:
    """Two runs of this script (e.g. an older checkout's host code via --root, then this one's):
    per op, the shipped entry point's host us and what changed in each layer."""
    a = {r["op"]: r for r in before.get("records", []) if "us" in r}
    lines = [f"host us per forward: {before.get('patchdsl_from', '?')} -> {after.get('patchdsl_from', '?')}",
             f"{'op':14s} {'entry before':>13s} {'entry after':>12s} {'nolaunch before':>16s} {'nolaunch after':>15s}"
             f" {'bench_call before':>18s} {'after':>8s}"]
    for r in after.get("records", []):
        o = a.get(r["op"])
        if o is None or "us" not in r:
            continue
        u, v = o["us"], r["us"]
        lines.append(f"{r['op']:14s} {u['entry']:13.1f} {v['entry']:12.1f} {u['entry_nolaunch']:16.1f} "
                     f"{v['entry_nolaunch']:15.1f} {u['bench_call']:18.1f} {v['bench_call']:8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--compare"]:
        if len(args) != 3:
            print("usage: host_breakdown.py --compare BEFORE.json AFTER.json", file=sys.stderr)
            return 2
        with open(args[1]) as f, open(args[2]) as g:
            print(compare(json.load(f), json.load(g)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS))
    ap.add_argument("--dtype", default=None, help="default bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of the script)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--root", default=ROOT, help="the checkout whose patchdsl is measured (default: this one; an "
                    "older checkout needs patchdsl_tools.bench.runner.patchdsl_entry, from 2026-12-03 on)")
    o = ap.parse_args(args)
    sys.path.insert(0, os.path.abspath(o.root))        # before anything imports patchdsl
    import torch

    import patchdsl

    from patchdsl_tools.bench.cases import families

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = o.dtype or ("bf16" if cuda else "fp32")
    fams = families()
    records = []
    for name in [s.strip() for s in o.ops.split(",") if s.strip()]:
        fam = fams.get(name)
        if fam is None:
            records.append({"op": name, "error": f"no bench family {name!r}"})
            continue
        shape = fam.shapes("tiny" if o.tiny else "issue")[0]
        try:
            records.append(breakdown(fam, shape, dtype, device, target_ms=20.0 if cuda else 5.0, lo=5 if cuda else 2))
        except Exception as e:
            records.append({"op": name, "label": fam.label(shape), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    print(table(records).replace("(one process;", f"(one process; patchdsl from {os.path.dirname(os.path.dirname(os.path.abspath(patchdsl.__file__)))};", 1))
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"records": records, "dtype": dtype, "device": device, "torch": torch.__version__,
                       "patchdsl_from": os.path.dirname(os.path.dirname(os.path.abspath(patchdsl.__file__)))},
                      f, indent=1)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

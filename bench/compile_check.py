"""torch.compile of a patched model on the GPU: does it run, does it match eager, how fast is it.

    python3 bench/compile_check.py [--model Qwen/Qwen3-0.6B] [--spec specs/qwen3.kpatch]
        [--batch 16] [--seq 2048] [--micro-batch N] [--steps 5] [--warmup 2] [--mode default]
        [--json out.json]
    # CPU smoke run (interpreter kernels, no Inductor):
    python3 bench/compile_check.py --device cpu --dtype fp32 --tiny --backend aot_eager --batch 2 --seq 8 \
        --steps 1 --warmup 1

Builds the model from patchdsl/model/configs (random weights, seed 0, bf16, sdpa), patches it with
the spec, and trains the same batches with AdamW twice, each in a fresh process:

* ``eager``:   the patched model as it is;
* ``compile``: ``torch.compile(patched_model)`` (Inductor, ``--mode``), with
  ``torch._dynamo.config.error_on_recompile`` on from the second step (nothing may recompile).

Prints per variant the loss of every step, tokens/s over the measured steps, the compile (first
step) time and peak memory, then the loss comparison.  Exit status: 0 when both ran and every
step's loss agrees within bf16 training tolerances (|a - b| <= 1e-2 + 5e-2 |b|, the
convergence tolerances of the design notes), 1 on a mismatch, 2 when a variant failed (its
traceback is printed).  Not part of the package or the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import patchdsl  # noqa: E402  (first: it switches Triton's interpreter on before anything imports triton)

ATOL, RTOL = 1e-2, 5e-2


def _options(a):
    from patchdsl_tools.bench.e2e import E2EOptions

    return E2EOptions(device=a.device, model=a.model, spec=a.spec, dtype=a.dtype, batch=a.batch, seq=a.seq,
                      micro_batch=a.micro_batch, steps=a.steps, warmup=a.warmup, attn="sdpa", quiet=True,
                      tiny=a.tiny)


def child(a) -> dict:
    """One variant in this process; returns its record (raises on failure)."""
    import time

    import torch
    import torch._dynamo

    from patchdsl_tools.bench.e2e import build_model, filtered_spec, make_batches, train

    o = _options(a)
    model, source = build_model(o)
    text, dropped, _ = filtered_spec(o.spec)
    handle = patchdsl.apply(patchdsl.plan(text, model, dtypes=(o.dtype,)), model)
    rec = {"variant": a.variant, "model": source, "patched": len(handle.patched),
           "refused": [str(r) for r in handle.refused], "dropped_rules": dropped}
    if a.variant == "compile":
        model = torch.compile(model, backend=a.backend, mode=None if a.mode == "default" else a.mode)
        # every step after the first must reuse the first step's graphs
        counter = {"step": 0}
        hook_target = model

        def pre_hook(_mod, _args, _kwargs):
            counter["step"] += 1
            if counter["step"] == 2:
                torch._dynamo.config.error_on_recompile = True

        hook_target.register_forward_pre_hook(pre_hook, with_kwargs=True)
    batches = make_batches(model.config.vocab_size, o, o.device)
    micro = o.micro_batch or o.batch
    t0 = time.perf_counter()
    res = train(model, batches, o, micro)
    rec.update(res)
    rec["wall_s"] = time.perf_counter() - t0
    if a.variant == "compile":
        from torch._dynamo.utils import counters

        rec["graph_breaks"] = int(sum(counters["graph_break"].values()))
        rec["unique_graphs"] = int(counters["stats"]["unique_graphs"])
    return rec


def run_variant(a, variant: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rec.json")
        cmd = [sys.executable, __file__, "--child", variant, "--child-out", out, "--model", a.model, "--spec", a.spec,
               "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--mode", a.mode, "--backend", a.backend, "--device", a.device, "--dtype", a.dtype]
        if a.tiny:
            cmd.append("--tiny")
        if a.micro_batch:
            cmd += ["--micro-batch", str(a.micro_batch)]
        print(f"--- {variant}: {' '.join(cmd[1:])}", flush=True)
        p = subprocess.run(cmd, cwd=str(ROOT))
        if p.returncode != 0 or not os.path.exists(out):
            return {"variant": variant, "error": f"exit status {p.returncode}"}
        with open(out) as f:
            return json.load(f)


def show(rec: dict) -> None:
    if "error" in rec:
        print(f"{rec['variant']:8s} FAILED ({rec['error']})")
        return
    peak = rec.get("peak_bytes", 0) / 2**30
    warm = ", ".join(f"{s:.1f}" for s in rec.get("warmup_step_s", []))
    extra = ""
    if rec["variant"] == "compile":
        extra = f", graph breaks {rec.get('graph_breaks')}, graphs {rec.get('unique_graphs')}"
    print(f"{rec['variant']:8s} {rec['tokens_per_s'] / 1e3:8.1f}k tokens/s  step {rec['step_ms']:.1f} ms  "
          f"peak {peak:.1f} GiB  warm-up steps [{warm}] s  patched {rec['patched']} sites{extra}")
    print(f"{'':8s} losses " + " ".join(f"{x:.4f}" for x in rec["losses"]))
    if rec.get("refused") or rec.get("dropped_rules"):
        print(f"{'':8s} refused {rec.get('refused')}  dropped {rec.get('dropped_rules')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B")
    ap.add_argument("--spec", default="specs/qwen3.kpatch")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mode", default="default", help="torch.compile mode (default, max-autotune-no-cudagraphs, ...)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager for a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same architecture (CPU smoke run)")
    ap.add_argument("--json", default=None, help="write both records and the verdict here")
    ap.add_argument("--child", choices=("eager", "compile"), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.variant = a.child
        try:
            rec = child(a)
        except BaseException:
            traceback.print_exc()
            return 2
        with open(a.child_out, "w") as f:
            json.dump(rec, f)
        return 0

    recs = [run_variant(a, v) for v in ("eager", "compile")]
    print()
    for r in recs:
        show(r)
    status, verdict = 0, "ok"
    if any("error" in r for r in recs):
        status, verdict = 2, "a variant failed"
    else:
        eager, comp = recs
        bad = [(i, c, e) for i, (c, e) in enumerate(zip(comp["losses"], eager["losses"]))
               if not abs(c - e) <= ATOL + RTOL * abs(e)]
        if bad or len(comp["losses"]) != len(eager["losses"]):
            status, verdict = 1, f"loss mismatch at steps {[i for i, _, _ in bad]}"
        else:
            ratio = comp["tokens_per_s"] / eager["tokens_per_s"] if eager["tokens_per_s"] else float("nan")
            verdict = f"losses agree; compiled/eager throughput {ratio:.3f}x"
    print(f"\nverdict: {verdict}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"records": recs, "verdict": verdict, "status": status}, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())

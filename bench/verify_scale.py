"""`patchdsl verify` at the sizes people fine-tune: 4-8B dense models on one GPU, in bf16.

    python bench/verify_scale.py [--budget 290] [--models all] [--batch 1 --seq 512 --steps 1]
                                 [--device cuda] [--tiny --layers 1]      # --tiny: a CPU dry run

For each model (random weights, built on the GPU from the shipped config) runs

    python -m patchdsl.cli verify <spec> --model <id> --full --device cuda --dtype bf16 \\
        --batch 1 --seq 512 --steps 1 --json --progress

in its own process (auto picks the float64 reference: streamed for these sizes), under a
per-model share of the budget, and records the verdict, the wall time, the peak device memory
(``torch.cuda.max_memory_allocated`` inside verify), how the reference was computed and its
float64 parameter peak.  Then, if time is left, measures one pure-bf16 AdamW training step of
the same model at the same batch (weights, gradients and both moments in bf16: the lightest
AdamW step) for the ratio "verify peak / training step peak".

Writes verify_scale.json and verify_scale.txt (``--name``) into $PART_OUT (or --out); prints the verdict last.

``--models vlm`` runs the multimodal specs (qwen2_5_vl, qwen3_vl, gemma3) on Qwen2.5-VL-7B-,
Qwen3-VL-8B- and Gemma-3-4b-it-shaped models (``...ForConditionalGeneration``, shipped configs in
patchdsl/model/configs/): the language tower, LM head and loss, on text-only batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


MODELS = [   # (hub id, shipped spec); the 8B models first
    ("meta-llama/Llama-3.1-8B", "llama"),
    ("Qwen/Qwen3-8B", "qwen3"),
    ("mistralai/Mistral-7B-v0.3", "mistral"),
    ("microsoft/Phi-3-mini-4k-instruct", "phi3"),
]
# --models vlm (the vlm_verify part of bench/gpu_all.sh): the multimodal specs on the language tower of
# full-size vision-language models (text-only batches; the vision tower is built, not run)
VLM_MODELS = [
    ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl"),
    ("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl"),
    ("google/gemma-3-4b-it", "gemma3"),
]
SETS = {"all": MODELS, "vlm": VLM_MODELS}


def train_step_peak(model_id: str, batch: int, seq: int, device: str) -> dict:
    """Peak memory of one bf16 AdamW step (bf16 moments) of the model at this batch, in this process."""
    import torch

    from patchdsl.model import load_model

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = load_model(model_id, meta=False, weights=False, dtype="bf16", device=device, log=None).model
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.get_text_config().vocab_size, (batch, seq), generator=g).to(device)
    out = m(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out, opt, m
    torch.cuda.empty_cache()
    return {"peak_bytes": int(peak), "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=290.0, help="seconds for everything")
    ap.add_argument("--models", default="all", help="comma-separated hub ids, or a set: all (the four dense "
                    "models), vlm (Qwen2.5-VL-7B, Qwen3-VL-8B, Gemma-3-4b-it)")
    ap.add_argument("--name", default="verify_scale", help="name of the output files and the verdict line")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--reference", default="auto", choices=("auto", "whole", "streamed"))
    ap.add_argument("--tiny", action="store_true", help="tiny architectures (a CPU dry run of the code path)")
    ap.add_argument("--no-train-step", action="store_true")
    ap.add_argument("--out", default=os.environ.get("PART_OUT", "."))
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    known = dict(MODELS + VLM_MODELS)
    models = SETS[a.models] if a.models in SETS else [(m, known.get(m, "llama")) for m in a.models.split(",")]
    rows = []
    for i, (mid, spec) in enumerate(models):
        left = a.budget - (time.perf_counter() - t_start) - 5
        n_after = len(models) - i - 1         # a model may take more than an even share, not the others' minimum
        share = min(left - 25 * n_after, max(1.6 * left / (n_after + 1), 60.0))
        if share < 15:
            rows.append({"model": mid, "verdict": "SKIPPED (no time left)", "passed": None})
            continue
        cmd = [sys.executable, "-m", "patchdsl.cli", "verify", spec, "--model", mid, "--device", a.device,
               "--dtype", a.dtype, "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps),
               "--json", "--progress", "--tiny" if a.tiny else "--full"]
        if a.layers:
            cmd += ["--layers", str(a.layers)]
        if a.reference != "auto":
            cmd += ["--reference", a.reference]
        print(f"== {mid}: {' '.join(cmd[1:])} (limit {share:.0f}s)", flush=True)
        from patchdsl_tools.bench.runner import run_offline

        rc, so, se, wall = run_offline(cmd, share)
        sys.stdout.write(se[-3000:])
        row = {"model": mid, "spec": spec, "rc": rc, "wall_s": round(wall, 1)}
        try:
            js = json.loads(so[so.index("{"):])
        except ValueError:
            js = None
        if js is not None:
            (out / f"verify_{mid.split('/')[-1]}.json").write_text(json.dumps(js, indent=1))
            ref = js.get("reference") or {}
            mem = js.get("memory") or {}
            if "error" in js:        # verify's error document (e.g. out of memory: exit 2 with what to try)
                js = {"passed": False, "verdict": f"ERROR (exit {js.get('exit_code')}): {js['error'].get('message')}"}
            row.update(passed=js["passed"], verdict=js["verdict"], seconds=js.get("seconds"),
                       reference=ref.get("mode"), why=ref.get("why"), float64_params_peak=ref.get("float64_params_peak"),
                       params=ref.get("params"), peak_bytes=mem.get("peak_bytes"),
                       device_total_bytes=mem.get("device_total_bytes"), sites=len(js.get("sites", [])),
                       grads_compared=js.get("grads_compared"), layers=js.get("layers"))
        else:
            tail = [ln for ln in (se or "").strip().splitlines() if ln.strip()][-1:] or ["no output"]
            row.update(passed=False if rc != 124 else None,
                       verdict=("TIMED OUT" if rc == 124 else f"rc {rc}: {tail[0][:300]}"))
        rows.append(row)
        print(f"-- {mid}: {row.get('verdict', '')[:160]} ({wall:.0f}s)", flush=True)
    if not a.no_train_step and a.device.startswith("cuda") and not a.tiny:
        for row in rows:
            left = a.budget - (time.perf_counter() - t_start)
            if left < 25 or row.get("peak_bytes") is None:
                continue
            try:
                row["train_step"] = train_step_peak(row["model"], a.batch, a.seq, a.device)
            except Exception as e:          # an out-of-memory here only loses the ratio
                row["train_step"] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    gib = 2 ** 30
    lines = [f"verify at scale ({a.dtype}, batch {a.batch} x seq {a.seq}, steps {a.steps}"
             f"{f', layers {a.layers}' if a.layers else ''}, {a.device})",
             f"{'model':36s} {'verdict':7s} {'ref':9s} {'wall s':>7s} {'peak GiB':>9s} {'bf16 step GiB':>13s} "
             f"{'ratio':>6s} {'f64 peak / params':>18s}"]
    for r in rows:
        ts = r.get("train_step") or {}
        pk, tp = r.get("peak_bytes"), ts.get("peak_bytes")
        v = "PASS" if r.get("passed") else ("-" if r.get("passed") is None else "FAIL")
        fr = (f"{r['float64_params_peak'] / r['params']:.3f}" if r.get("float64_params_peak") and r.get("params")
              else "-")
        lines.append(f"{r['model']:36s} {v:7s} {str(r.get('reference') or '-'):9s} {r.get('wall_s', 0):7.1f} "
                     f"{(pk / gib if pk else float('nan')):9.1f} {(tp / gib if tp else float('nan')):13.1f} "
                     f"{(pk / tp if pk and tp else float('nan')):6.2f} {fr:>18s}")
        if not r.get("passed"):
            lines.append(f"    {str(r.get('verdict'))[:300]}")
    text = "\n".join(lines)
    (out / f"{a.name}.txt").write_text(text + "\n")
    (out / f"{a.name}.json").write_text(json.dumps({"dtype": a.dtype, "batch": a.batch, "seq": a.seq,
                                                       "steps": a.steps, "layers": a.layers, "device": a.device,
                                                       "models": rows}, indent=1))
    print(text)
    ok = all(r.get("passed") for r in rows)
    n_ok = sum(1 for r in rows if r.get("passed"))
    print(f"{a.name}: {'PASS' if ok else 'FAIL'}: {n_ok}/{len(rows)} models pass "
          f"({time.perf_counter() - t_start:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

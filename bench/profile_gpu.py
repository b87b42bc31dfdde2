"""Where the GPU time goes: torch.profiler kernel tables for the slow spots (H200 only).

    python3 bench/profile_gpu.py [--what e2e,qk_norm_rope,linear_cross_entropy] [--out DIR]

* ``e2e``: one training step of Qwen3-0.6B (random weights, bf16, batch 16 x 2048, AdamW) patched
  with specs/qwen3.kpatch, after two warm-up steps; the kernels by total GPU time.
* ``qk_norm_rope`` / ``linear_cross_entropy``: one forward + backward of the op as the benchmark
  calls it, at the issue's shape, for the auto kernel and any ``--flags`` variants.
* ``amdahl``: for each ``--families`` entry (qwen3 16x2048, llama 8x2048, gemma 8x2048: the e2e
  shapes of issue 15), one profiled training step per variant (patchdsl with the shipped spec,
  Liger), each in its own process; GPU time split into gemm / attention / optimizer / aten /
  replaced-op kernels, and the bound it puts on patchdsl/Liger: even with every replaced op taking
  no time, patchdsl's step cannot be shorter than its own step less its replaced-op kernels.
  JSON per run into ``--out``.

Not part of the package or the tests: a tool for reading, printing tables only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _table(prof, n: int = 25) -> str:
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=n, max_name_column_width=70)


def profile_step(n_rows: int) -> None:
    import torch

    import patchdsl
    from patchdsl.bench.e2e import E2EOptions, build_model, filtered_spec, make_batches

    o = E2EOptions(batch=16, seq=2048, warmup=2, steps=1)
    model, _ = build_model(o)
    text, _, _ = filtered_spec(o.spec_list()[0])
    patchdsl.apply(patchdsl.plan(text, model, dtypes=("bf16",)), model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = make_batches(model.config.vocab_size, o, "cuda")

    def step(b):
        out = model(input_ids=b["input_ids"], labels=b["labels"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for b in batches[:2]:
        step(b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(batches[0])
    torch.cuda.synchronize()
    print(f"e2e step (no profiler): {1000 * (time.perf_counter() - t0):.1f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batches[1])
        torch.cuda.synchronize()
    print(_table(prof, n_rows))


def profile_op(name: str, flag_sets: list[dict], n_rows: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from patchdsl.bench import runner
    from patchdsl.bench.cases import as_tuple, families
    from patchdsl.bench.specialise import SHAPES, _fwd_bwd, build_call, plan_variant

    fam = families()[name]
    shape = SHAPES[name][0]
    params = fam.make_params(shape, "bf16", "cuda", runner._gen("cuda", 0))
    act = fam.make_act(shape, "bf16", "cuda", runner._gen("cuda", 1))
    dys = fam.make_dys(shape, "bf16", "cuda", runner._gen("cuda", 2))
    ref_shapes = [tuple(t.shape) for t in as_tuple(fam.hf(params, shape)(*[act[n] for n in fam.act_names]))]
    for flags in flag_sets:
        key, rule = plan_variant(fam, shape, "bf16", "cuda", flags or None)
        run = _fwd_bwd(fam, build_call(fam, key, params, ref_shapes), params)
        for _ in range(3):
            run(act, dys)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            run(act, dys)
        e.record()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(act, dys)
            torch.cuda.synchronize()
        print(f"--- {name} {shape.get('label')} {rule}: {s.elapsed_time(e) / 5:.3f} ms per fwd+bwd (eager, warm L2)")
        print(_table(prof, n_rows))


AMDAHL = {"qwen3": ("Qwen/Qwen3-0.6B", 16), "llama": ("meta-llama/Llama-3.2-1B", 8),
          "gemma": ("google/gemma-3-1b-pt", 8)}


def kernel_category(name: str) -> str:
    """Which part of a training step a CUDA kernel belongs to, from its name (pure, tested on the CPU)."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "efficient_attention", "cudnn")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "splitk", "matmul")):
        return "gemm"
    if any(k in n for k in ("adam", "multi_tensor", "foreach")):
        return "optimizer"
    if any(k in n for k in ("at::", "at_cuda_detail", "cub::", "void native::", "elementwise", "reduce_kernel",
                            "memcpy", "memset", "indexselect", "index_", "embedding", "scatter", "gather",
                            "cunn_", "softmax", "dropout", "cat_", "fill")):
        return "aten"
    return "replaced ops"       # Triton kernels: patchdsl's generated ones, or Liger's


def _amdahl_worker(family: str, variant: str, out: str) -> None:
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile

    import patchdsl
    from patchdsl.bench.e2e import E2EOptions, _prepare, build_model, default_spec, make_batches

    model_id, batch = AMDAHL[family]
    o = E2EOptions(model=model_id, batch=batch, seq=2048, warmup=2, steps=1)
    model, _ = build_model(o)
    spec = default_spec(model_id) if variant == "patchdsl" else None
    model, info = _prepare(variant, model, o, spec)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = make_batches(model.config.vocab_size, o, "cuda")

    def step(b):
        out_ = model(input_ids=b["input_ids"], labels=b["labels"])
        out_.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for b in batches[:2]:
        step(b)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    step(batches[0])
    e1.record()
    torch.cuda.synchronize()
    step_ms = e0.elapsed_time(e1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batches[1])
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    top: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if not t:
            continue
        c = kernel_category(ev.key)
        cats[c] = cats.get(c, 0.0) + t / 1000.0
        if c == "replaced ops":
            top[ev.key[:80]] = t / 1000.0
    rec = {"family": family, "variant": variant, "batch": batch, "seq": 2048, "step_ms": step_ms,
           "kernel_ms": cats, "kernel_total_ms": sum(cats.values()),
           "replaced_op_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25]), "info": str(info)}
    Path(out).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: rec[k] for k in ("family", "variant", "step_ms", "kernel_ms")}))


def amdahl(families: list[str], out_dir: Path, timeout_s: float) -> None:
    import json
    import subprocess

    out_dir.mkdir(parents=True, exist_ok=True)
    for fam in families:
        recs = {}
        for variant in ("patchdsl", "liger"):
            path = out_dir / f"amdahl_{fam}_{variant}.json"
            cmd = [sys.executable, __file__, "--amdahl-worker", f"{fam}:{variant}:{path}"]
            try:
                subprocess.run(cmd, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                print(f"amdahl {fam} {variant}: over {timeout_s:.0f} s")
            if path.is_file():
                recs[variant] = json.loads(path.read_text())
        if len(recs) < 2:
            print(f"amdahl {fam}: incomplete ({sorted(recs)})")
            continue
        p, lg = recs["patchdsl"], recs["liger"]
        p_ops = p["kernel_ms"].get("replaced ops", 0.0)
        rest = p["step_ms"] - p_ops
        bound = lg["step_ms"] / rest if rest > 0 else float("inf")
        lines = [f"--- {fam} {p['batch']}x2048: step patchdsl {p['step_ms']:.1f} ms, Liger {lg['step_ms']:.1f} ms "
                 f"= {lg['step_ms'] / p['step_ms']:.3f}x",
                 "  GPU ms by part      patchdsl    Liger"]
        for c in ("gemm", "attention", "aten", "optimizer", "replaced ops"):
            lines.append(f"  {c:18s} {p['kernel_ms'].get(c, 0.0):9.1f} {lg['kernel_ms'].get(c, 0.0):8.1f}")
        lines.append(f"  bound: with patchdsl's replaced-op kernels at 0 ms and the rest of its step as measured, "
                     f"patchdsl/Liger <= {bound:.3f}x")
        txt = "\n".join(lines)
        print(txt)
        (out_dir / f"amdahl_{fam}.txt").write_text(txt + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="qk_norm_rope,linear_cross_entropy,e2e")
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--families", default="qwen3,llama,gemma", help="for --what amdahl")
    ap.add_argument("--out", default=".", help="folder for the amdahl JSON and tables")
    ap.add_argument("--worker-timeout", type=float, default=120.0)
    ap.add_argument("--amdahl-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.amdahl_worker:
        fam, variant, out = a.amdahl_worker.split(":", 2)
        _amdahl_worker(fam, variant, out)
        return 0
    whats = a.what.split(",")
    for w in whats:
        t0 = time.perf_counter()
        try:
            if w == "e2e":
                profile_step(a.rows + 12)
            elif w == "qk_norm_rope":
                profile_op(w, [{}, {"bwd_programs_per_sm": 16}], a.rows)
            elif w == "amdahl":
                amdahl(a.families.split(","), Path(a.out), a.worker_timeout)
            elif w == "linear_cross_entropy":
                profile_op(w, [{}, {"chunk": 1024}], a.rows)
            else:
                print(f"unknown: {w}")
        except Exception as e:  # keep going: one failing part must not hide the others
            import traceback

            traceback.print_exc()
            print(f"{w}: FAILED: {type(e).__name__}: {e}")
        print(f"[{w}: {time.perf_counter() - t0:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

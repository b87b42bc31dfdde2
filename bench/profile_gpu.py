"""Where the GPU time goes: torch.profiler kernel tables for the slow spots (H200 only).

    python3 bench/profile_gpu.py [--what e2e,qk_norm_rope,linear_cross_entropy] [--out DIR]

* ``e2e``: one training step of Qwen3-0.6B (random weights, bf16, batch 16 x 2048, AdamW) patched
  with specs/qwen3.kpatch, after two warm-up steps; the kernels by total GPU time.
* ``qk_norm_rope`` / ``linear_cross_entropy``: one forward + backward of the op as the benchmark
  calls it, at the issue's shape, for the auto kernel and any ``--flags`` variants.

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="qk_norm_rope,linear_cross_entropy,e2e")
    ap.add_argument("--rows", type=int, default=18)
    a = ap.parse_args()
    whats = a.what.split(",")
    for w in whats:
        t0 = time.perf_counter()
        try:
            if w == "e2e":
                profile_step(a.rows + 12)
            elif w == "qk_norm_rope":
                profile_op(w, [{}, {"bwd_programs_per_sm": 16}], a.rows)
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

"""Tile sweep of fused_linear_cross_entropy(mode=fused) on the GPU: one call, a table, the best flags.

    python bench/flce_sweep.py                       # both issue shapes, bf16, ~100 s on an H200
    python bench/flce_sweep.py --shapes 16384x1024x151936 --budget 60

For every tile of ``FUSED_TILES`` (bf16 ones) it times the forward kernel (softmax statistics in
the matmul's tiles) and the backward (band kernel + the two cuBLAS matmuls) separately, at the
shape's real sizes, median of CUDA-event timings after a warm-up; then the best forward tile with
the best backward tile together (fwd+bwd, extra peak memory), a few band widths, and the chunked
mode on the same inputs for comparison.  It checks the chosen configuration against a fp32 torch
reference on the first 1024 tokens (relative error of loss, grad_h, grad_W).  Prints the spec flags
to use (``fused_linear_cross_entropy(mode=fused, tile=..., grad_tile=...)``); nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from patchdsl.bench import timing  # noqa: E402
from patchdsl.codegen import KernelKey, load_kernel, target  # noqa: E402
from patchdsl.ops.base import ModuleInfo  # noqa: E402
from patchdsl.ops.linear_cross_entropy import FUSED_TILES, INTERP_TILE  # noqa: E402
from patchdsl.ops.registry import get_op  # noqa: E402

OP = "fused_linear_cross_entropy"
SHAPES = ("16384x1024x151936", "8192x2304x256000")
SKIP_TILES = {INTERP_TILE, "m64n64k32w4s3"}          # interpreter / fp32 tiles
DEVICE = "cuda"


def build(vocab: int, hidden: int, dtype: str, flags: dict):
    op = get_op(OP)
    f = op.default_flags()
    f.update(flags)
    why = op.validate(f)
    if why:
        raise ValueError(why)
    facts = {"vocab": vocab, "hidden": hidden, "bias": False, "softcap": None, "logits_scaling": None, "tied": False}
    info = ModuleInfo("lm_head", "Linear", (), {"CausalLM": facts}, dtype=dtype)
    p = op.key_params(info, f, dtype, target())
    return load_kernel(KernelKey.make(op.name, op.template, op.kernel_name(p), p))


def timed(fn, reps: int = 5) -> float:
    """Median ms per call over ``reps`` calls after a warm-up: CUDA events (``bench ops``'
    ``time_events``), wall clock on the CPU smoke run."""
    if DEVICE == "cuda":
        return timing.time_events([fn], min_reps=reps, max_reps=reps).ms
    return timing.time_cpu([fn], min_reps=reps, max_reps=reps).ms


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sweep_shape(shape: str, dtype: str, deadline: float, reps: int) -> None:
    n, hidden, vocab = (int(v) for v in shape.split("x"))
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h = torch.randn(n, hidden, device=DEVICE, dtype=torch.float32, generator=g).to(dt)
    w = (torch.randn(vocab, hidden, device=DEVICE, dtype=torch.float32, generator=g) * hidden ** -0.5).to(dt)
    y = torch.randint(0, vocab, (n,), device=DEVICE, generator=g)
    y[::32] = -100
    go = torch.ones((), device=DEVICE)
    mm = 2.0 * n * hidden * vocab
    print(f"\n== {shape} {dtype}: one matmul-equivalent = {mm / 1e12:.2f} TFLOP; fused = 4 of them ==")
    print(f"{'tile':<20} {'fwd ms':>8} {'fwd TF/s':>9} {'bwd ms':>8} {'bwd TF/s':>9}")
    rows = {}
    for name in (FUSED_TILES if DEVICE == "cuda" else [INTERP_TILE]):
        if name in SKIP_TILES and DEVICE == "cuda":
            continue
        if time.time() > deadline:
            print(f"{name:<20} skipped (budget)")
            continue
        try:
            mod = build(vocab, hidden, dtype, {"mode": "fused", "tile": name, "grad_tile": name})
            loss, lse = mod.linear_cross_entropy_stats(h, w, None, y)
            f_ms = timed(lambda: mod.linear_cross_entropy_stats(h, w, None, y), reps)
            b_ms = timed(lambda: mod.linear_cross_entropy_grads(h, w, None, y, lse, go, None, True, True, False), reps)
        except Exception as e:          # a tile that does not fit (shared memory, registers) on this GPU
            print(f"{name:<20} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        rows[name] = (f_ms, b_ms)
        print(f"{name:<20} {f_ms:8.2f} {mm / f_ms / 1e9:9.0f} {b_ms:8.2f} {3 * mm / b_ms / 1e9:9.0f}")
    if not rows:
        return
    fwd = min(rows, key=lambda k: rows[k][0])
    bwd = min(rows, key=lambda k: rows[k][1])
    best_flags = {"mode": "fused", "tile": fwd, "grad_tile": bwd}
    # the forward's vocab and hidden loops flattened into one pipelined loop (tl.range(flatten=True))
    try:
        flat = build(vocab, hidden, dtype, dict(best_flags, flatten=True))
        f_ms = timed(lambda: flat.linear_cross_entropy_stats(h, w, None, y), reps)
        print(f"forward {fwd} flattened: {f_ms:.2f} ms ({mm / f_ms / 1e9:.0f} TFLOP/s) vs {rows[fwd][0]:.2f}")
        if f_ms < rows[fwd][0]:
            best_flags["flatten"] = True
    except Exception as e:
        print(f"forward {fwd} flattened: failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    mod = build(vocab, hidden, dtype, best_flags)
    band_rows = []
    for band in (0, 512, 2048, 4096) if DEVICE == "cuda" else (0, 512):
        if time.time() > deadline and band:
            break
        m = mod if band == 0 else build(vocab, hidden, dtype, dict(best_flags, band=band))
        lse = m.linear_cross_entropy_stats(h, w, None, y)[1]
        b_ms = timed(lambda: m.linear_cross_entropy_grads(h, w, None, y, lse, go, None, True, True, False), reps)
        band_rows.append((band or m.band_columns(n), b_ms))
    print("backward by band width (columns: ms): " + ", ".join(f"{c}: {t:.2f}" for c, t in band_rows)
          + f"  (auto = {mod.band_columns(n)})")
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()

    def step(m):
        hs.grad = ws.grad = None
        m.linear_cross_entropy(hs, ws, None, y).backward()

    total = timed(lambda: step(mod), reps)
    extra = float("nan")
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        hs.grad = ws.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(mod)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - (hs.numel() + ws.numel()) * hs.element_size()
    chunked = build(vocab, hidden, dtype, {"mode": "chunked"})
    c_total = timed(lambda: step(chunked), reps) if time.time() < deadline + 30 else float("nan")
    # correctness of the chosen configuration on the first 1024 tokens against fp32 torch
    k = min(n, 1024)
    hk, yk = h[:k].clone().requires_grad_(), y[:k]
    wk = w.clone().requires_grad_()
    lk = mod.linear_cross_entropy(hk, wk, None, yk)
    lk.backward()
    hr, wr = h[:k].float().requires_grad_(), w.float().requires_grad_()
    lr = torch.nn.functional.cross_entropy(hr @ wr.T, yk, ignore_index=-100)       # fp32 logits
    lr.backward()
    errs = (rel(lk, lr), rel(hk.grad, hr.grad), rel(wk.grad, wr.grad))
    print(f"best: {OP}({', '.join(f'{a}={b}' for a, b in best_flags.items())})")
    print(f"  fwd+bwd {total:.2f} ms ({4 * mm / total / 1e9:.0f} TFLOP/s of 8NHV), extra peak {extra / 2**20:.1f} MiB; "
          f"chunked mode {c_total:.2f} ms; error vs fp32 torch ({k} tokens): loss {errs[0]:.1e}, "
          f"grad_h {errs[1]:.1e}, grad_W {errs[2]:.1e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="tokens x hidden x vocab, comma separated")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--budget", type=float, default=100.0, help="seconds; tiles left after it are skipped")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the script's code on the CPU interpreter at tiny shapes (tests; no timing value)")
    a = ap.parse_args(argv)
    global DEVICE
    if a.cpu_smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("flce_sweep: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    shapes = [s for s in a.shapes.split(",") if s]
    t0 = time.time()
    for i, s in enumerate(shapes):
        share = (a.budget - (time.time() - t0)) / (len(shapes) - i)
        sweep_shape(s, a.dtype, time.time() + share * 0.7, a.reps)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

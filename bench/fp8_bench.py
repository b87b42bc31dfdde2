"""fp8_linear(recipe=rowwise) against bf16 projections, kernel by kernel, at a decoder layer's shapes.

Issue 26 asks fp8 projections for >= 1.3x Liger end to end on the Llama-3.1-8B shape; the prediction in
bench/NOTES.md is a few percent.  This bench measures where an fp8 projection's time goes, so that the
end-to-end number can be explained (or the slow piece fixed): for each of the seven projections of
one decoder layer (q, k, v, o, gate, up, down) at the layer's real sizes and token count:

* bf16: the three GEMMs of nn.Linear's forward and backward (y = x W^T, dx = dy W, dW = dy^T x);
* fp8 rowwise, piece by piece, exactly what the generated module runs: quantise x by rows, W by rows,
  the forward ``_scaled_mm``; dy by rows, W by columns (transposed), the grad_input ``_scaled_mm``; dy
  and x by columns along tokens (transposed, padded), the grad_weight ``_scaled_mm``;
* the whole projection fwd+bwd through autograd: nn.Linear vs the generated fp8_linear.

Each piece is timed as a CUDA graph of repeated calls (median replay); quantisation kernels report
GB/s (bytes read + written), GEMMs TFLOP/s.  The layer totals count an input shared by siblings once
(q/k/v read one x, gate/up another: the generated module quantises it once, ``kernel_support.share``), and
give recipe=rowwise_with_gw_hp's layer from the same pieces (grad_weight as the bf16 GEMM instead).
Writes fp8.json / fp8.txt under --out; prints ``fp8: ...`` last (a measurement, never a pass/fail).

    python3 bench/fp8_bench.py --out DIR [--shapes llama8b,llama1b] [--budget S]
    python3 bench/fp8_bench.py --tiny --out DIR        # CPU dry run (interpreter, emulated matmuls)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib


# name -> (hidden, intermediate, kv width (heads x head_dim), tokens): the e2e benches' shapes
SHAPES = {
    "llama8b": (4096, 14336, 1024, 4 * 2048),     # Llama-3.1-8B, 4 x 2048 (gpu_all e2e_8b)
    "llama1b": (2048, 8192, 512, 8 * 2048),       # Llama-3.2-1B, 8 x 2048 (gpu_all e2e_llama)
}
TINY = (64, 128, 32, 48)
# projection -> (in_features, out_features) as functions of (hidden, intermediate, kv); the sibling group
# whose input it shares (quantised once per group)
PROJ = {
    "q_proj": (lambda h, i, kv: (h, h), "qkv"), "k_proj": (lambda h, i, kv: (h, kv), "qkv"),
    "v_proj": (lambda h, i, kv: (h, kv), "qkv"), "o_proj": (lambda h, i, kv: (h, h), "o"),
    "gate_proj": (lambda h, i, kv: (h, i), "gu"), "up_proj": (lambda h, i, kv: (h, i), "gu"),
    "down_proj": (lambda h, i, kv: (i, h), "down"),
}
X_PIECES = ("quant x rows", "quant x cols^T")      # per input: counted once per sibling group


def kernel_module(k, n, tiny):
    from patchdsl.codegen import KernelKey, load_kernel
    from patchdsl.model.info import ModuleInfo
    from patchdsl.ops.registry import get_op

    op = get_op("fp8_linear")
    dtype, target = ("fp32", "interpreter") if tiny else ("bf16", "cuda")
    info = ModuleInfo("p", "Linear", (), {"Linear": {"in_features": k, "out_features": n, "bias": False}}, dtype)
    p = op.key_params(info, {"recipe": "rowwise", "emulate": tiny}, dtype, target)
    return load_kernel(KernelKey.for_op(op, p))


def timer(dev):
    from patchdsl_tools.bench import timing

    def t(fn, reps=4):
        if dev == "cuda":
            import torch

            g, keep = timing.capture_graph([fn] * reps, torch.cuda.Stream())
            ms = timing.time_graph(g, reps, target_ms=60.0).ms
            del g, keep
            return ms
        return timing.time_cpu([fn], target_ms=5.0, min_reps=1, max_reps=2).ms
    return t


def measure_projection(name, k, n, m, dev, tiny, t):
    import torch

    mod = kernel_module(k, n, tiny)
    dt = torch.float32 if tiny else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()))     # the same inputs every run
    x = (torch.randn(m, k, generator=g)).to(dev, dt)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dev, dt)
    dy = (torch.randn(m, n, generator=g) * 1e-2).to(dev, dt)
    e4 = mod.E4M3
    pad = mod.PAD
    xq, xs = mod.quant_rows(x, e4)
    wq, ws = mod.quant_rows(w, e4)
    dq, ds = mod.quant_rows(dy, e4)
    wtq, wts = mod.quant_cols_t(w, e4)
    dtq, dts = mod.quant_cols_t(dy, e4, pad)
    xtq, xts = mod.quant_cols_t(x, e4, pad)
    b = x.element_size()                                  # bytes of an element of x / W / dy
    rows = lambda r, c: r * c * (b + 1)                   # one read, one fp8 write   # noqa: E731
    cols = lambda r, c: r * c * (2 * b + 1)               # amax read, then read + write   # noqa: E731
    fl = 2.0 * m * k * n
    pieces = {   # piece -> (callable, bytes moved or None, flops or None, pass)
        "bf16 fwd": (lambda: x @ w.t(), None, fl, "fwd"),
        "bf16 dgrad": (lambda: dy @ w, None, fl, "bwd"),
        "bf16 wgrad": (lambda: dy.t() @ x, None, fl, "bwd"),
        "quant x rows": (lambda: mod.quant_rows(x, e4), rows(m, k), None, "fwd"),
        "quant W rows": (lambda: mod.quant_rows(w, e4), rows(n, k), None, "fwd"),
        "fp8 fwd mm": (lambda: mod.scaled_mm(xq, xs, wq, ws, dt, True), None, fl, "fwd"),
        "quant dy rows": (lambda: mod.quant_rows(dy, e4), rows(m, n), None, "bwd"),
        "quant W cols^T": (lambda: mod.quant_cols_t(w, e4), cols(n, k), None, "bwd"),
        "fp8 dgrad mm": (lambda: mod.scaled_mm(dq, ds, wtq, wts, dt, False), None, fl, "bwd"),
        "quant dy cols^T": (lambda: mod.quant_cols_t(dy, e4, pad), cols(m, n), None, "bwd"),
        "quant x cols^T": (lambda: mod.quant_cols_t(x, e4, pad), cols(m, k), None, "bwd"),
        "fp8 wgrad mm": (lambda: mod.scaled_mm(dtq, dts, xtq, xts, dt, False), None, fl, "bwd"),
    }
    res = {"projection": name, "in": k, "out": n, "tokens": m, "pieces": {}}
    for pname, (fn, nbytes, flops, _) in pieces.items():
        ms = t(fn)
        row = {"ms": ms}
        if nbytes:
            row["gbps"] = nbytes / (ms * 1e-3) / 1e9
        if flops:
            row["tflops"] = flops / (ms * 1e-3) / 1e12
        res["pieces"][pname] = row

    # the whole projection through autograd: nn.Linear against the generated module
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()

    def whole(f):
        def run():
            xr.grad = wr.grad = None
            f(xr, wr).backward(dy)
        return run

    from patchdsl.kernel_support import share

    with share.switched(False):                  # one projection alone: nothing to share
        res["whole bf16 ms"] = t(whole(lambda a, c: torch.nn.functional.linear(a, c)), reps=1)
        res["whole fp8 ms"] = t(whole(lambda a, c: mod.fp8_linear(a, c)), reps=1)
    return res


# what recipe=rowwise_with_gw_hp runs instead of these: grad_weight as the bf16 GEMM, nothing quantised for it
WGRAD_FP8_PIECES = ("fp8 wgrad mm", "quant dy cols^T", "quant x cols^T")


def layer_totals(projs):
    """bf16 and fp8 ms of the layer's seven projections (fwd+bwd), x's quantisation counted once per
    sibling group, and the fp8 time split into quantisation and GEMMs; ``gw_hp_ms``: the same layer
    under recipe=rowwise_with_gw_hp (the fp8 pieces of grad_weight replaced by the bf16 wgrad GEMM),
    from the same measured pieces."""
    bf16 = fp8_mm = quant = gw_saved = 0.0
    seen = set()
    for p in projs:
        pc = p["pieces"]
        bf16 += sum(pc[n]["ms"] for n in ("bf16 fwd", "bf16 dgrad", "bf16 wgrad"))
        fp8_mm += sum(pc[n]["ms"] for n in ("fp8 fwd mm", "fp8 dgrad mm", "fp8 wgrad mm"))
        for n, v in pc.items():
            counted = n not in X_PIECES or p["group"] not in seen
            if n.startswith("quant") and counted:
                quant += v["ms"]
            if n in WGRAD_FP8_PIECES and counted:
                gw_saved += v["ms"]
        gw_saved -= pc["bf16 wgrad"]["ms"]
        seen.add(p["group"])
    return {"bf16_ms": bf16, "fp8_ms": fp8_mm + quant, "fp8_gemm_ms": fp8_mm, "fp8_quant_ms": quant,
            "gw_hp_ms": fp8_mm + quant - gw_saved,
            "whole_bf16_ms": sum(p["whole bf16 ms"] for p in projs),
            "whole_fp8_ms": sum(p["whole fp8 ms"] for p in projs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="llama8b,llama1b")
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny sizes, interpreter, emulated matmuls")
    a = ap.parse_args(argv)
    if a.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    dev = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    os.makedirs(a.out, exist_ok=True)
    t = timer(dev)
    t0 = time.time()
    report, lines = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "shapes": {}}, []
    for shape in [s for s in a.shapes.split(",") if s]:
        h, i, kv, m = TINY if a.tiny else SHAPES[shape]
        projs = []
        for pname, (dims, group) in PROJ.items():
            if time.time() - t0 > a.budget:
                lines.append(f"{shape}: stopped at {pname} (budget)")
                break
            k, n = dims(h, i, kv)
            r = measure_projection(pname, k, n, m, dev, a.tiny, t)
            r["group"] = group
            projs.append(r)
            pc = r["pieces"]
            lines.append(f"{shape} {pname} ({m}x{k} -> {n}): " + ", ".join(
                f"{nm} {v['ms']:.3f} ms" + (f" ({v['tflops']:.0f} TF/s)" if "tflops" in v else "")
                + (f" ({v['gbps']:.0f} GB/s)" if "gbps" in v else "") for nm, v in pc.items())
                + f"; whole fwd+bwd bf16 {r['whole bf16 ms']:.3f} ms, fp8 {r['whole fp8 ms']:.3f} ms")
        report["shapes"][shape] = {"projections": projs}
        if len(projs) == len(PROJ):
            tot = layer_totals(projs)
            report["shapes"][shape]["layer"] = tot
            lines.append(f"{shape} layer (7 projections, fwd+bwd): bf16 GEMMs {tot['bf16_ms']:.2f} ms; fp8 "
                         f"{tot['fp8_ms']:.2f} ms = GEMMs {tot['fp8_gemm_ms']:.2f} + quantisation "
                         f"{tot['fp8_quant_ms']:.2f} ({tot['bf16_ms'] / tot['fp8_ms']:.2f}x bf16); rowwise_with_gw_hp "
                         f"{tot['gw_hp_ms']:.2f} ms ({tot['bf16_ms'] / tot['gw_hp_ms']:.2f}x bf16); through autograd, "
                         f"unshared: bf16 {tot['whole_bf16_ms']:.2f} ms, fp8 {tot['whole_fp8_ms']:.2f} ms")
    with open(os.path.join(a.out, "fp8.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    summary = [ln for ln in lines if " layer " in ln] or lines[-1:]
    verdict = f"fp8 ({report['device']}): " + " | ".join(summary)
    with open(os.path.join(a.out, "fp8.txt"), "w") as fh:
        fh.write("\n".join(lines + [verdict]) + "\n")
    print("\n".join(lines))
    print(verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fused_mlp on the GPU: the plain (non-gated) MLP of StarCoder2-3B (c_fc -> gelu_tanh -> c_proj, biases)
and of Nemotron/Minitron-4B (up_proj -> relu^2 -> down_proj, no bias), bf16, 8 x 2048 tokens.

Per shape: fwd+bwd time (CUDA events, median of the timed steps) and the memory a forward leaves saved
for backward (allocated after forward minus before), for the eager module, the patched module
(recompute=true, the default) and recompute=false; and the patched module's error against an fp32
run of the same module (output, input gradient, every weight gradient) next to the eager bf16 module's
own error.  Pass: every patched error <= 2 x eager's + 2^-8 floor, and recompute=true saves less than
eager.  Writes mlp.json / mlp.txt under --out; prints its verdict line (``mlp: PASS ...``) last.

    python3 bench/mlp_bench.py --out DIR [--budget S] [--tiny]     # --tiny: small shapes (CPU dry run)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time


SHAPES = {   # name -> (model_type, config sizes)
    "starcoder2-3b": ("starcoder2", dict(hidden_size=3072, intermediate_size=12288, hidden_act="gelu_pytorch_tanh",
                                         use_bias=True, residual_dropout=0.0)),
    "minitron-4b": ("nemotron", dict(hidden_size=3072, intermediate_size=9216, hidden_act="relu2", mlp_bias=False)),
}


def build_mlp(model_type, sizes, tiny):
    import importlib

    import torch
    from transformers import AutoConfig

    if tiny:
        sizes = dict(sizes, hidden_size=64, intermediate_size=256)
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                               **sizes)
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.lower() == f"{model_type}mlp")
    torch.manual_seed(0)
    return cls(cfg)


def run(args):
    import torch

    import patchdsl

    class Wrap(torch.nn.Module):
        """The MLP at path ``mlp`` (a spec selects by path)."""

        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = (2, 16) if args.tiny else (8, 2048)
    steps, warm = (2, 1) if args.tiny else (10, 3)
    rows, ok_all = [], True
    t_start = time.time()
    for name, (mt, sizes) in SHAPES.items():
        if time.time() - t_start > args.budget:
            rows.append({"shape": name, "skipped": "budget"})
            continue
        ref32 = Wrap(build_mlp(mt, sizes, args.tiny)).to(dev).float().train()
        H = 64 if args.tiny else sizes["hidden_size"]
        g = torch.Generator(device="cpu").manual_seed(1)
        x32 = torch.randn(*tokens, H, generator=g).to(dev)
        dy32 = torch.randn(*tokens, H, generator=g).to(dev)

        def grads(model, x, dy):
            for p in model.parameters():
                p.grad = None
            xi = x.clone().requires_grad_()
            out = model(xi)
            out.backward(dy)
            return [out.detach().float(), xi.grad.float()] + [p.grad.float() for p in model.parameters()]

        ref = grads(ref32, x32, dy32)
        xb, dyb = x32.bfloat16(), dy32.bfloat16()
        variants = {"eager": None, "fused_mlp": "mlp: MLP -> fused_mlp\n",
                    "fused_mlp(recompute=false)": "mlp: MLP -> fused_mlp(recompute=false)\n"}
        res = {"shape": name, "tokens": tokens[0] * tokens[1], "hidden": H, "device": dev}
        errs = {}
        for vname, spec in variants.items():
            m = copy.deepcopy(ref32).bfloat16().train()
            if spec:
                patchdsl.apply("dtype bf16\n" + spec, m)
            got = grads(m, xb, dyb)
            errs[vname] = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref)]
            # saved for backward: allocated after the forward (graph alive) minus before
            if dev == "cuda":
                xi = xb.clone().requires_grad_()
                torch.cuda.synchronize()
                m0 = torch.cuda.memory_allocated()
                out = m(xi)
                torch.cuda.synchronize()
                saved = torch.cuda.memory_allocated() - m0 - out.numel() * out.element_size()
                del out, xi
            else:
                saved = None
            times = []
            for i in range(warm + steps):
                xi = xb.clone().requires_grad_()
                if dev == "cuda":
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                t0 = time.perf_counter()
                m(xi).backward(dyb)
                if dev == "cuda":
                    e.record()
                    torch.cuda.synchronize()
                    ms = s.elapsed_time(e)
                else:
                    ms = (time.perf_counter() - t0) * 1e3
                if i >= warm:
                    times.append(ms)
            res[vname] = {"fwd_bwd_ms": statistics.median(times), "saved_bytes": saved,
                          "rel_err": errs[vname]}
            del m
        eager_err = errs["eager"]
        ok = True
        for vname in ("fused_mlp", "fused_mlp(recompute=false)"):
            bad = [i for i, (a, b) in enumerate(zip(errs[vname], eager_err)) if a > 2 * b + 2 ** -8]
            if bad:
                ok = False
                res.setdefault("failures", []).append(f"{vname}: error above 2 x eager's + 2^-8 in outputs {bad}")
        if dev == "cuda" and not res["fused_mlp"]["saved_bytes"] < res["eager"]["saved_bytes"]:
            ok = False
            res.setdefault("failures", []).append("recompute=true does not save less than eager")
        res["ok"] = ok
        ok_all &= ok
        rows.append(res)
    return rows, ok_all


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=90.0)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rows, ok = run(a)
    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['shape']}: skipped ({r['skipped']})")
            continue
        e, f, k = r["eager"], r["fused_mlp"], r["fused_mlp(recompute=false)"]
        mb = (lambda b: "n/a" if b is None else f"{b / 2 ** 20:.0f} MiB")
        lines.append(f"{r['shape']} ({r['tokens']} tokens, {r['device']}): fwd+bwd eager {e['fwd_bwd_ms']:.2f} ms, "
                     f"fused_mlp {f['fwd_bwd_ms']:.2f} ms, recompute=false {k['fwd_bwd_ms']:.2f} ms; saved for "
                     f"backward eager {mb(e['saved_bytes'])}, fused_mlp {mb(f['saved_bytes'])}, recompute=false "
                     f"{mb(k['saved_bytes'])}; max rel err eager {max(e['rel_err']):.2e}, fused_mlp "
                     f"{max(f['rel_err']):.2e}" + ("" if r["ok"] else f"; FAIL: {'; '.join(r['failures'])}"))
    with open(os.path.join(a.out, "mlp.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    verdict = "mlp: " + ("PASS" if ok else "FAIL") + " | " + " | ".join(lines)
    with open(os.path.join(a.out, "mlp.txt"), "w") as fh:
        fh.write("\n".join(lines + [verdict]) + "\n")
    print("\n".join(lines))
    print(verdict)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Does the fused router pay? (issue 24), the `moe_router` part of bench/gpu_all.sh.

The router of Qwen3-30B-A3B (Qwen3MoeTopKRouter: hidden 2048, 128 experts, top 8, norm_topk_prob) on 16384
tokens in bf16, forward + backward (random gradients for the router logits, as the auxiliary loss gives
them, and for the top-k weights, as the experts give them), in one process, each variant timed with CUDA
events (median of REPS after a warm-up):

  module      transformers' router module as it is (F.linear, softmax in fp32, torch.topk, renormalise, cast)
  fused       the same module patched with fused_router (F.linear, then one Triton kernel each way)
  compile     torch.compile of the module (default mode; norm_topk_prob on only), when it compiles
  matmul      the floor: F.linear forward + backward alone (what every variant does besides the routing)
  aux loss    transformers' load_balancing_loss_func on one layer's logits, forward + backward (the
              load-balancing statistics, which fused_router leaves to the loss: what fusing them could save)

plus the same for norm_topk_prob off (Qwen3-MoE's default).  Before timing, the fused outputs are compared
with the module's: the expert set of every token must be the module's or differ only by exact ties of its
bf16 logits (torch.topk breaks those its own way, the kernel to the lower index); the weights and the
gradients are compared with the routing held fixed.

    python bench/moe_router_bench.py --out DIR [--budget 50] [--cpu-dry]

--cpu-dry runs every code path once at a tiny shape on the CPU (Triton interpreter; no timing judged).
Writes DIR/moe_router.json and DIR/moe_router.txt and prints the table, then a one-line verdict last:
``moe_router: PAYS|DOES NOT PAY ...`` (pays: fused fwd+bwd at least 1.1x the module's at the 30B-A3B shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPE = dict(tokens=16384, hidden=2048, experts=128, top_k=8)
DRY_SHAPE = dict(tokens=40, hidden=32, experts=8, top_k=2)
REPS, WARMUP = 20, 5
PAYS_AT = 1.1


def _timer(dev):
    """ms per call: CUDA events around eager loops (patchdsl_tools.bench.timing), the median; on the CPU
    (--cpu-dry) one call's wall time (checks the code path, not a measurement)."""

    def time_ms(fn):
        if dev == "cpu":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from patchdsl_tools.bench.timing import time_events

        for _ in range(WARMUP):
            fn()
        return time_events([fn], target_ms=100.0, min_reps=REPS, max_reps=4 * REPS).ms

    return time_ms


def make_router(shape, norm, dev, dtype):
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=shape["hidden"], num_experts=shape["experts"],
                               num_experts_per_tok=shape["top_k"], norm_topk_prob=norm)
    r = Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        r.weight.normal_(0, shape["hidden"] ** -0.5)
    return r.to(dev, dtype)


def patched(router, target):
    """A copy of ``router`` with fused_router applied (through a one-module holder: the spec selects `gate`)."""
    import copy

    import torch

    from patchdsl import apply, plan

    holder = torch.nn.Module()
    holder.gate = copy.deepcopy(router)
    h = apply(plan("gate: Router -> fused_router\n", holder, target=target), holder, target=target)
    if h.refused or "forward" not in holder.gate.__dict__:
        raise RuntimeError(f"fused_router was not applied: {h.refused}")
    return holder.gate


def fwd_bwd(mod, x, g_logits, g_w):
    import torch

    def step():
        x.grad = None
        mod.weight.grad = None
        logits, w, _ = mod(x)
        torch.autograd.backward([logits, w], [g_logits, g_w])
    return step


def run(args):
    import torch
    import torch.nn.functional as F

    dev = "cpu" if args.cpu_dry else "cuda"
    shape = DRY_SHAPE if args.cpu_dry else SHAPE
    dtype = torch.bfloat16
    target = "interpreter" if args.cpu_dry else "cuda"
    time_ms = _timer(dev)
    t_start = time.time()
    rows, notes = [], []
    info = {"shape": shape, "dtype": "bf16", "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
            "torch": torch.__version__}
    try:
        import transformers
        import triton
        info.update(transformers=transformers.__version__, triton=triton.__version__)
    except Exception:
        pass
    for norm in (True, False):
        if time.time() - t_start > args.budget * 0.8:
            notes.append(f"norm_topk_prob={norm}: skipped (budget)")
            continue
        torch.manual_seed(0)
        ref = make_router(shape, norm, dev, dtype)
        fused = patched(ref, target)
        g = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(shape["tokens"], shape["hidden"], device=dev, dtype=dtype, generator=g).requires_grad_(True)
        g_logits = torch.randn(shape["tokens"], shape["experts"], device=dev, dtype=dtype, generator=g) * 1e-3
        g_w = torch.randn(shape["tokens"], shape["top_k"], device=dev, dtype=dtype, generator=g)
        # ---- agreement first.  Exact ties in the bf16 logits are common at 128 experts (8 significant
        # bits): torch.topk breaks them its own way, the kernel to the lower index, and tied experts have
        # equal weights.  So: the index sets per token, and whether every token whose set differs is
        # an exact tie (the same selected logit values); weights and gradients with the routing held
        # fixed (tokens whose sets differ left out, one upstream per (token, expert), as verify does).
        with torch.no_grad():
            l0, w0, i0 = ref(x)
            l1, w1, i1 = fused(x)
        same_order = float((i0 == i1).all(-1).float().mean())
        same = (torch.sort(i0, -1)[0] == torch.sort(i1, -1)[0]).all(-1)
        v0 = torch.sort(l0.float().gather(1, i0), -1)[0]
        v1 = torch.sort(l0.float().gather(1, i1), -1)[0]
        tie = (v0 == v1).all(-1)
        same_set, ties_only = float(same.float().mean()), bool(tie[~same].all()) if (~same).any() else True
        E = shape["experts"]

        def dense(w, i):
            return torch.zeros(w.shape[0], E, device=dev, dtype=torch.float32).scatter_(1, i, w.float())
        w_err = float(((dense(w0, i0) - dense(w1, i1)) * same[:, None]).abs().max())
        up = torch.randn(shape["tokens"], E, device=dev, generator=g) * same[:, None]
        grads = []
        for m, i_ in ((ref, i0), (fused, i1)):
            x.grad = None
            m.weight.grad = None
            lg, w, _ = m(x)
            torch.autograd.backward([lg, w], [g_logits, up.gather(1, i_).to(w.dtype)])
            grads.append((x.grad.float().clone(), m.weight.grad.float().clone()))
        gx_err = float((grads[0][0] - grads[1][0]).norm() / grads[0][0].norm().clamp_min(1e-30))
        gw_err = float((grads[0][1] - grads[1][1]).norm() / grads[0][1].norm().clamp_min(1e-30))
        # ---- timings
        variants = {"module": ref, "fused": fused}
        if norm and not args.cpu_dry and not args.no_compile:     # one compile row (compiling costs ~10-20 s)
            try:
                comp = torch.compile(make_router(shape, norm, dev, dtype))
                fwd_bwd(comp, x, g_logits, g_w)()
                variants["compile"] = comp
            except Exception as e:       # noqa: BLE001 - a compile failure is a row note, not a crash
                notes.append(f"compile (norm={norm}): {type(e).__name__}: {str(e)[:120]}")
        t = {name: time_ms(fwd_bwd(m, x, g_logits, g_w)) for name, m in variants.items()}
        wt = ref.weight.detach().clone().requires_grad_(True)

        def mm():
            x.grad = None
            wt.grad = None
            F.linear(x, wt).backward(g_logits)
        t["matmul"] = time_ms(mm)
        with torch.no_grad():
            t["fused fwd"] = time_ms(lambda: fused(x))
            t["module fwd"] = time_ms(lambda: ref(x))
        if norm:
            # the load-balancing statistics (not fused: see the op's module doc): what transformers'
            # load_balancing_loss_func costs for one layer's logits, forward + backward
            from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

            lg = l0.detach().clone().requires_grad_(True)

            def aux():
                lg.grad = None
                load_balancing_loss_func((lg,), shape["experts"], shape["top_k"], None).backward()
            t["aux loss"] = time_ms(aux)
        rows.append({"norm_topk_prob": norm, "ms": t, "same_index_sets": same_set, "same_index_order": same_order,
                     "differing_sets_are_exact_ties": ties_only, "weights_max_abs_err": w_err,
                     "grad_x_rel_fro": gx_err, "grad_weight_rel_fro": gw_err})
    return info, rows, notes


def table(info, rows, notes):
    lines = [f"fused_router vs the module: Qwen3MoeTopKRouter, {info['shape']}, bf16, fwd+bwd, {info.get('device')}, "
             f"torch {info.get('torch')}, transformers {info.get('transformers')}, triton {info.get('triton')}",
             f"{'norm':>5} {'variant':>11} {'ms':>9} {'routing ms':>11} {'x module':>9}"]
    for r in rows:
        t = r["ms"]
        for name in ("module", "compile", "fused", "matmul", "module fwd", "fused fwd", "aux loss"):
            if name not in t:
                continue
            routing = t[name] - t["matmul"] if name in ("module", "compile", "fused") else float("nan")
            speed = t["module"] / t[name] if name in ("module", "compile", "fused") else float("nan")
            lines.append(f"{str(r['norm_topk_prob']):>5} {name:>11} {t[name]:9.3f} {routing:11.3f} {speed:9.2f}")
        lines.append(f"      same expert sets on {r['same_index_sets']:.4%} of tokens (same order {r['same_index_order']:.4%}; "
                     f"the others {'all' if r['differing_sets_are_exact_ties'] else 'NOT all'} exact ties), weights max |err| "
                     f"{r['weights_max_abs_err']:.2e}, grad x rel {r['grad_x_rel_fro']:.2e}, "
                     f"grad W rel {r['grad_weight_rel_fro']:.2e}")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def verdict(rows, dry):
    if not rows:
        return "moe_router: NO RESULT (nothing ran)"
    r = rows[0]
    t = r["ms"]
    ok = r["differing_sets_are_exact_ties"] and r["grad_x_rel_fro"] < 2e-2 and r["grad_weight_rel_fro"] < 2e-2
    sp = t["module"] / t["fused"]
    extra = f"; compile {t['module'] / t['compile']:.2f}x" if "compile" in t else ""
    if dry:
        return (f"moe_router: CPU DRY RUN OK (code paths ran at a tiny shape; agreement {'ok' if ok else 'BAD'}; "
                "no timing judged)")
    word = "PAYS" if sp >= PAYS_AT and ok else "DOES NOT PAY" if ok else "DISAGREES"
    return (f"moe_router: {word}: fused {t['fused']:.3f} ms vs module {t['module']:.3f} ms fwd+bwd ({sp:.2f}x{extra}); "
            f"routing beyond the matmul {t['fused'] - t['matmul']:.3f} vs {t['module'] - t['matmul']:.3f} ms; "
            f"same expert sets on {r['same_index_sets']:.2%} of tokens (the rest exact ties)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=50)
    ap.add_argument("--cpu-dry", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    info, rows, notes = run(args)
    text = table(info, rows, notes)
    v = verdict(rows, args.cpu_dry)
    with open(os.path.join(args.out, "moe_router.json"), "w") as f:
        json.dump({"info": info, "rows": rows, "notes": notes, "verdict": v}, f, indent=1)
    with open(os.path.join(args.out, "moe_router.txt"), "w") as f:
        f.write(text + "\n" + v + "\n")
    print(text)
    print(v)
    return 0


if __name__ == "__main__":
    sys.exit(main())

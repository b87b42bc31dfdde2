"""MoE benchmark (issue 24), the `moe` part of bench/gpu_all.sh.

ops: the experts' forward + backward at the Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top 8,
     moe_intermediate 768, 16k tokens, bf16), one process: patchdsl's fused_experts, transformers'
     grouped_mm and batched_mm experts (skipped with the reason when its gathered weights cannot fit),
     Liger's fused MoE (LigerFusedMoEFunction, when liger-kernel has it), and the matmul floor (the same
     FLOPs as dense torch.mm: 2 GEMMs forward, 4 backward).
e2e: models built on the GPU (meta device, to_empty, init there), batch 4 x 2048, AdamW, bf16, sdpa: a
     4-layer Qwen3-30B-A3B-shaped model (32/4 heads, head_dim 128, vocab 151936), a 2-layer Mixtral-8x7B,
     OLMoE-1B-7B at full size, a 4-layer gpt-oss-20b (MODELS); default (transformers' grouped_mm experts)
     vs patchdsl (the model type's shipped spec) vs Liger (apply_liger_kernel_to_<model type>, where
     liger-kernel has one), each in its own process.

    python bench/moe_bench.py --out DIR [--budget 140] [--what ops,e2e] [--models qwen3_moe,mixtral,olmoe,gpt_oss]

Writes DIR/moe.json and DIR/moe.txt (the table) and prints a one-line verdict last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(tokens=16384, hidden=2048, experts=128, top_k=8, inter=768)
E2E = dict(batch=4, seq=2048, layers=4, warmup=2, steps=5)


DEV = "cuda"
TARGET = "cuda"


def _time_cuda(fn):
    """ms per call: CUDA events around eager loops (patchdsl_tools.bench.timing), the median; on the CPU
    (--cpu-dry) one call's wall time (checks the code path, not a measurement)."""
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from patchdsl_tools.bench.timing import time_events

    fn()                          # compile / autotune outside the estimate of time_events
    return time_events([fn], target_ms=150.0, min_reps=5, max_reps=30).ms


def _experts_module(dev, dt):
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=SHAPE["hidden"], num_experts=SHAPE["experts"],
                               num_experts_per_tok=SHAPE["top_k"], moe_intermediate_size=SHAPE["inter"])
    with torch.device("meta"):
        m = Qwen3MoeExperts(cfg)
    m.to_empty(device=dev)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.02)
        m.down_proj.normal_(0, 0.02)
    return m.to(dt), cfg


def profile_kernels(fn, x0, idx, w0, dy, params, reps=3) -> dict:
    """GPU time per kernel name (ms per fwd+bwd) of ``fn``, from torch.profiler."""
    from patchdsl_tools.bench.timing import kernel_profile

    x = x0.detach().clone().requires_grad_(True)
    w = w0.detach().clone().requires_grad_(True)

    def step():
        for p in params:
            p.grad = None
        fn(x, idx, w).backward(dy)

    return kernel_profile(step, reps, width=60, most=1000)


def run_ops(budget: float) -> list[dict]:
    import torch

    dev, dt = DEV, (torch.bfloat16 if DEV == "cuda" else torch.float32)
    T, H, E, K, I = (SHAPE[k] for k in ("tokens", "hidden", "experts", "top_k", "inter"))
    g = torch.Generator(device=dev).manual_seed(0)
    x0 = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    router = torch.randn(E, H, device=dev, dtype=dt, generator=g) * 0.02
    probs = torch.softmax((x0 @ router.t()).float(), -1)
    w0, idx = torch.topk(probs, K, -1)
    w0 = (w0 / w0.sum(-1, keepdim=True)).to(dt)
    dy = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    mod, cfg = _experts_module(dev, dt)
    rows = []
    t_end = time.time() + budget

    def case(name, fwd, params):
        if time.time() > t_end:
            rows.append({"impl": name, "skipped": "budget"})
            return
        x = x0.detach().clone().requires_grad_(True)
        w = w0.detach().clone().requires_grad_(True)

        def step():
            for p in params:
                p.grad = None
            out = fwd(x, idx, w)
            out.backward(dy)
        try:
            cuda = dev == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            ms = _time_cuda(step)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
            # fwd alone
            with torch.no_grad():
                fms = _time_cuda(lambda: fwd(x, idx, w))
            rows.append({"impl": name, "fwd_bwd_ms": ms, "fwd_ms": fms, "extra_peak_gib": peak})
        except torch.cuda.OutOfMemoryError as e:
            rows.append({"impl": name, "skipped": f"out of memory ({str(e)[:80]})"})
        except Exception as e:
            rows.append({"impl": name, "skipped": f"{type(e).__name__}: {str(e)[:160]}"})
        print(f"  experts {json.dumps(rows[-1])}", flush=True)      # as it goes: a cut run keeps what finished
        if dev == "cuda":
            torch.cuda.empty_cache()

    params = [mod.gate_up_proj, mod.down_proj]
    for p in params:
        p.requires_grad_(True)
    # patchdsl
    try:
        from patchdsl.codegen.cache import load_kernel
        from patchdsl.codegen.keys import KernelKey
        from patchdsl.model.info import ModuleInfo
        from patchdsl.model.kinds.experts import experts as recognise
        from patchdsl.ops.registry import get_op

        op = get_op("fused_experts")
        facts = recognise(mod)
        info = ModuleInfo("experts", type(mod).__name__, (), {"Experts": facts})
        params_k = op.key_params(info, {}, "bf16" if dev == "cuda" else "fp32", TARGET)
        kmod = load_kernel(KernelKey.for_op(op, params_k))
        case("patchdsl", lambda x, i, w: kmod.experts(x, i, w, mod.gate_up_proj, mod.down_proj), params)
        rows[-1]["tiles"] = dict(kmod.TILES)
        # correctness at this shape against grouped_mm (bf16 both; relative Frobenius error)
        with torch.no_grad():
            cfg._experts_implementation = "grouped_mm"
            a = kmod.experts(x0[:4096], idx[:4096], w0[:4096], mod.gate_up_proj, mod.down_proj).float()
            b = mod(x0[:4096], idx[:4096], w0[:4096]).float()
            rows[-1]["rel_err_vs_grouped_mm"] = float((a - b).norm() / b.norm())
        if dev == "cuda":
            rows[-1]["kernels_ms"] = profile_kernels(lambda x, i, w: kmod.experts(x, i, w, mod.gate_up_proj, mod.down_proj),
                                                     x0, idx, w0, dy, params)
            print(f"  experts kernels {json.dumps(rows[-1]['kernels_ms'])}", flush=True)
    except Exception as e:
        rows.append({"impl": "patchdsl", "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
    # transformers: the module's own forward, which dispatches on config._experts_implementation (this
    # bench's own config object: nothing else shares it)
    def hf(impl):
        def run(x, i, w):
            cfg._experts_implementation = impl
            return mod(x, i, w)
        return run

    case("grouped_mm", hf("grouped_mm"), params)
    need = T * K * (2 * I * H + H * I) * 2 / 2**30
    free = torch.cuda.mem_get_info()[0] / 2**30 if dev == "cuda" else 1.0
    if need > 0.8 * free:
        rows.append({"impl": "batched_mm", "skipped": f"gathers {need:.0f} GiB of expert weights (free {free:.0f} GiB)"})
    else:
        case("batched_mm", hf("batched_mm"), params)
    # Liger
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        idx32 = idx.to(torch.int32)           # as LigerExperts.forward passes it
        case("liger", lambda x, i, w: LigerFusedMoEFunction.apply(x, mod.gate_up_proj, mod.down_proj, idx32, w), params)
    except ImportError as e:
        rows.append({"impl": "liger", "skipped": f"not installed ({e})"})
    # matmul floor: the same FLOPs as dense GEMMs (S = T*K rows)
    S = T * K
    a = torch.randn(S, H, device=dev, dtype=dt)
    wgu = torch.randn(H, 2 * I, device=dev, dtype=dt)
    hmid = torch.randn(S, I, device=dev, dtype=dt)
    wd = torch.randn(I, H, device=dev, dtype=dt)
    dout = torch.randn(S, H, device=dev, dtype=dt)
    dgu = torch.randn(S, 2 * I, device=dev, dtype=dt)
    f_ms = _time_cuda(lambda: (a @ wgu, hmid @ wd))
    fb_ms = _time_cuda(lambda: (a @ wgu, hmid @ wd, dout @ wd.t(), dout.t() @ hmid, dgu @ wgu.t(), a.t() @ dgu))
    flops_fb = 6 * 2 * S * H * I * 1.0 * 3 / 3     # fwd 2*S*H*2I + 2*S*I*H = 6SHI; fwd+bwd = 3x
    rows.append({"impl": "matmul floor", "fwd_bwd_ms": fb_ms, "fwd_ms": f_ms,
                 "tflops_fwd_bwd": 3 * 6 * S * H * I / (fb_ms * 1e-3) / 1e12})
    del flops_fb
    return rows


# End-to-end models (random weights built on the GPU): name -> (model_type, config, shipped spec, what Liger calls).
# Qwen3-30B-A3B's layer shape in 4 layers (the baseline), Mixtral-8x7B in 2 layers, OLMoE-1B-7B at
# full size, gpt-oss-20b cut to 4 layers.
MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                    intermediate_size=6144, vocab_size=151936, num_hidden_layers=4,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                    tie_word_embeddings=False), "qwen3_moe.kpatch"),
    "mixtral": ("mixtral", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
                                vocab_size=32000, num_hidden_layers=2, tie_word_embeddings=False), "mixtral.kpatch"),
    "olmoe": ("olmoe", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                            num_experts_per_tok=8, intermediate_size=1024, vocab_size=50304, num_hidden_layers=16,
                            tie_word_embeddings=False), "olmoe.kpatch"),
    "gpt_oss": ("gpt_oss", dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880,
                                vocab_size=201088, num_hidden_layers=4, tie_word_embeddings=False), "gpt_oss.kpatch"),
}
MODEL_NAMES = {"qwen3_moe": "4-layer Qwen3-30B-A3B shape", "mixtral": "2-layer Mixtral-8x7B shape",
               "olmoe": "OLMoE-1B-7B (full size)", "gpt_oss": "4-layer gpt-oss-20b shape"}
# gpt-oss's attention sinks have no SDPA path in transformers: eager attention for every variant
ATTN = {"gpt_oss": "eager"}
TINY_MODEL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                  num_hidden_layers=1)


def build_model(name: str, dt):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    mt, kw, _ = MODELS[name]
    kw = dict(kw)
    if DEV == "cpu":      # --cpu-dry
        for k in ("num_experts", "num_local_experts"):
            if k in kw:
                kw[k] = 4
        kw.update(TINY_MODEL, num_experts_per_tok=2, intermediate_size=96,
                  **({"moe_intermediate_size": 32} if "moe_intermediate_size" in kw else {}))
    cfg = AutoConfig.for_model(mt, max_position_embeddings=4096, **kw)
    attn = ATTN.get(name, "sdpa")
    cfg._attn_implementation = attn
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model.to_empty(device=DEV)
    with torch.no_grad():
        for n, p in model.named_parameters():
            owner = n.rsplit(".", 1)[0]
            if "norm" in owner.rsplit(".", 1)[-1] and n.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    for path, m in list(model.named_modules()):
        if path.endswith("rotary_emb"):      # its inv_freq buffer was never materialised: build it on the device
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
            with torch.device(DEV):
                setattr(parent, path.rsplit(".", 1)[-1], type(m)(config=m.config if hasattr(m, "config") else model.config))
    return model.to(dt)


def run_e2e_worker(impl: str, name: str) -> dict:
    import torch

    torch.manual_seed(0)
    t0 = time.time()
    model = build_model(name, torch.bfloat16 if DEV == "cuda" else torch.float32)
    build_s = time.time() - t0
    note = ""
    if impl == "patchdsl":
        from patchdsl.planning.planner import plan
        from patchdsl.runtime import apply

        spec = os.path.join(ROOT, "specs", MODELS[name][2])
        dts = ("bf16",) if DEV == "cuda" else ("fp32",)
        p = plan(spec, model, target=TARGET, dtypes=dts)
        h = apply(p, model, target=TARGET)
        note = f"{len(h.patched)} sites patched" + (f"; refused: {[str(r) for r in h.refused][:2]}" if h.refused else "")
    elif impl == "liger":
        import liger_kernel.transformers as lt

        fn = getattr(lt, f"apply_liger_kernel_to_{MODELS[name][0]}", None)
        if fn is None:
            import liger_kernel
            raise SystemExit(f"liger-kernel {getattr(liger_kernel, '__version__', '')} has no "
                             f"apply_liger_kernel_to_{MODELS[name][0]}")
        fn(model=model)
    model.train()
    note = (note + "; " if note else "") + f"experts_implementation={getattr(model.config, '_experts_implementation', None)}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    B, L = E2E["batch"], E2E["seq"]
    g = torch.Generator(device=DEV).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (B, L), device=DEV, generator=g)

    def step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    losses = []
    cuda = DEV == "cuda"
    for _ in range(E2E["warmup"]):
        losses.append(float(step()))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(E2E["steps"]):
        losses.append(step())
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / E2E["steps"] * 1e3
    return {"impl": impl, "model": name, "step_ms": ms, "tokens_per_s": B * L / (ms / 1e3),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"), "build_s": build_s,
            "losses": [float(x) for x in losses], "note": note}


def verdict(res: dict, what: str, seconds: float) -> str:
    """The one-line `moe:` verdict gpu_all.sh files in its summary.

    With the ops part: the experts op against grouped_mm (PASS needs its relative error under 2e-2),
    plus the Qwen3-MoE e2e ratio when that ran.  With e2e alone: each model's patchdsl step against
    its default step; FAIL when any requested row did not finish."""
    if "ops" in what.split(","):
        ops = {r["impl"]: r for r in res.get("ops", [])}
        ours, hf = ops.get("patchdsl", {}), ops.get("grouped_mm", {})
        if not ("fwd_bwd_ms" in ours and "fwd_bwd_ms" in hf):
            return f"moe: FAIL no experts timing ({ours.get('skipped', '')[:120]})"
        ok = ours.get("rel_err_vs_grouped_mm", 1.0) < 2e-2
        lib = ops.get("liger", {})
        vs_liger = f", {lib['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x liger" if "fwd_bwd_ms" in lib else ""
        e2e = {r["impl"]: r for r in res.get("e2e", []) if "step_ms" in r and r.get("model") == "qwen3_moe"}
        e2e_s = (f"; e2e {e2e['default']['step_ms'] / e2e['patchdsl']['step_ms']:.2f}x default"
                 f" (first-step loss {e2e['patchdsl']['losses'][0]:.4f} vs {e2e['default']['losses'][0]:.4f})"
                 if "default" in e2e and "patchdsl" in e2e else "; e2e incomplete")
        return (f"moe: {'PASS' if ok else 'FAIL (numerics)'} experts {hf['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x grouped_mm"
                f"{vs_liger} (rel.err {ours.get('rel_err_vs_grouped_mm', float('nan')):.1e}){e2e_s} in {seconds:.0f}s")
    rows = res.get("e2e", [])
    if not rows:
        return "moe: FAIL nothing measured (neither the experts op nor an e2e row)"
    missing = [f"{r.get('model')} {r.get('impl')}: {str(r.get('skipped', ''))[:80]}" for r in rows if "step_ms" not in r]
    parts = []
    for model in dict.fromkeys(r.get("model") for r in rows):
        by = {r["impl"]: r for r in rows if r.get("model") == model and "step_ms" in r}
        if "default" in by:
            parts += [f"{model} {impl} {by['default']['step_ms'] / r['step_ms']:.2f}x default"
                      for impl, r in by.items() if impl != "default"]
    head = "FAIL " + "; ".join(missing) + ("; " if parts else "") if missing else "e2e "
    return f"moe: {head}{', '.join(parts) or 'no ratio'} in {seconds:.0f}s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=140)
    ap.add_argument("--what", default="ops,e2e")
    ap.add_argument("--ops-budget", type=float, default=0.0, help="seconds for the experts rows "
                    "(default: min(60, 0.42 x budget))")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--impls", default="default,patchdsl,liger")
    ap.add_argument("--models", default="qwen3_moe", help=f"end-to-end models, comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--model", default="qwen3_moe", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-dry", action="store_true", help="tiny shapes on the CPU (Triton interpreter): checks "
                    "the code paths without a GPU (no measurement)")
    a = ap.parse_args()
    if a.cpu_dry:
        global DEV, TARGET
        DEV, TARGET = "cpu", "interpreter"
        SHAPE.update(tokens=32, hidden=32, experts=4, top_k=2, inter=24)
        E2E.update(batch=1, seq=16, layers=1, warmup=1, steps=1)
    if a.worker:
        print("RESULT " + json.dumps(run_e2e_worker(a.worker, a.model)), flush=True)
        return
    t0 = time.time()
    res: dict = {"shape": SHAPE, "e2e_shape": E2E}
    try:
        import torch
        res["device"] = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)"
        res["torch"] = torch.__version__
    except Exception:
        pass
    lines = []
    if "ops" in a.what:
        ops = run_ops(a.ops_budget if a.ops_budget else min(60.0, a.budget * 0.42))
        res["ops"] = ops
        base = next((r for r in ops if r["impl"] == "grouped_mm" and "fwd_bwd_ms" in r), None)
        lines.append(f"experts fwd+bwd, T={SHAPE['tokens']} H={SHAPE['hidden']} E={SHAPE['experts']} "
                     f"k={SHAPE['top_k']} I={SHAPE['inter']} bf16 ({res.get('device', '?')})")
        for r in ops:
            if "fwd_bwd_ms" in r:
                sp = f"  {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x grouped_mm" if base else ""
                extra = f"  rel.err vs grouped_mm {r['rel_err_vs_grouped_mm']:.1e}" if "rel_err_vs_grouped_mm" in r else ""
                lines.append(f"  {r['impl']:<13} fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  fwd {r['fwd_ms']:7.2f} ms{sp}{extra}")
            else:
                lines.append(f"  {r['impl']:<13} skipped: {r['skipped']}")
    if "e2e" in a.what:
        e2e = []
        impls = a.impls.split(",")
        jobs = [(m, impl) for m in a.models.split(",") for impl in impls]
        for i, (name, impl) in enumerate(jobs):
            left = a.budget - (time.time() - t0) - 3
            if left < 20:
                e2e.append({"impl": impl, "model": name, "skipped": "budget"})
                continue
            per = min(left / (len(jobs) - i) * 1.6, left)     # a slow first worker may borrow from the rest
            try:
                p = subprocess.run([sys.executable, __file__, "--worker", impl, "--model", name]
                                   + (["--cpu-dry"] if a.cpu_dry else []),
                                   capture_output=True, text=True, timeout=per, cwd=ROOT)
                got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                if got:
                    e2e.append(json.loads(got[-1][7:]))
                else:
                    err = (p.stderr or "").strip().splitlines()
                    e2e.append({"impl": impl, "model": name, "skipped": f"rc {p.returncode}: " + (err[-1][-300:] if err else ""),
                                "stderr": "\n".join(err[-30:])})
            except subprocess.TimeoutExpired:
                e2e.append({"impl": impl, "model": name, "skipped": f"timed out after {per:.0f}s"})
            r = e2e[-1]
            print(f"  e2e {name} {impl}: " + (f"{r['step_ms']:.1f} ms/step, peak {r['peak_gib']:.1f} GiB" if "step_ms" in r
                                              else r["skipped"]), flush=True)
        res["e2e"] = e2e
        for name in a.models.split(","):
            rows_m = [r for r in e2e if r.get("model") == name]
            lines.append(f"e2e {MODEL_NAMES[name]}, {E2E['batch']}x{E2E['seq']}, AdamW, bf16, {ATTN.get(name, 'sdpa')}")
            base = next((r for r in rows_m if r["impl"] == "default" and "step_ms" in r), None)
            for r in rows_m:
                if "step_ms" in r:
                    sp = f"  {base['step_ms'] / r['step_ms']:.2f}x default" if base else ""
                    lines.append(f"  {r['impl']:<9} {r['step_ms']:8.1f} ms/step {r['tokens_per_s'] / 1e3:6.1f}k tok/s "
                                 f"peak {r['peak_gib']:5.1f} GiB  loss {r['losses'][-1]:.3f}{sp}  {r['note']}")
                else:
                    lines.append(f"  {r['impl']:<9} skipped: {r['skipped']}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "moe.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "moe.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(verdict(res, a.what, time.time() - t0))


if __name__ == "__main__":
    main()

"""``patchdsl bench specialise``: does each specialised kernel beat the generic form it replaces?

For every op family of :mod:`.cases` and a couple of real shapes (Qwen3 bf16, 16384 tokens), the
kernel a real model gets (``auto`` flags, planned exactly as :func:`.runner.plan_key` plans it) is
compared with one or more *generic* variants of the same op at the same shape: the same template
rendered with flags that force its general path (a smaller ``block`` -> the row is looped in
tiles and usually masked; a smaller head tile -> heads looped; ``programs_per_sm=0`` -> no
persistent grid).  The generic flags are derived from the auto kernel's own parameters (e.g.
``block`` = auto BLOCK / 4), so the generic variant really differs at every shape; a variant whose
flags give the auto kernel again is reported as ``same kernel`` and not timed.

Per variant: one forward + backward on fresh seeded inputs, compared with the float64 reference
(:meth:`.cases.Family.reference`) and with the auto variant's outputs and gradients; then, on a
GPU, forward + backward timed by CUDA-graph replay over rotating input sets (eagerly with CUDA
events when the call syncs with the host).  On the CPU the correctness call itself is timed once
through the Triton interpreter: the times mean nothing there.

Rows: ``{op, shape, variant, flags, time_ms, err, err_vs_auto, source_features, ...}``; the summary
table printed last gives ratio = generic / specialised (>= 1.0: the specialisation pays).
Timing never decides the exit status: 1 only when a variant's numbers are wrong.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import runner, timing
from .cases import Family, as_tuple, bind, resolve_entry

KIND = "patchdsl-bench-specialise"

# Real shapes per family (GPU): Qwen3-0.6B at 16384 tokens first, then a second real model size.
SHAPES: dict[str, list[dict]] = {
    "rmsnorm": [{"tokens": 16384, "hidden": 1024, "label": "16384x1024 (qwen3-0.6b)"},
                {"tokens": 16384, "hidden": 2560, "label": "16384x2560 (qwen3-4b)"}],
    "add_rmsnorm": [{"tokens": 16384, "hidden": 1024, "label": "16384x1024 (qwen3-0.6b)"},
                    {"tokens": 16384, "hidden": 2560, "label": "16384x2560 (qwen3-4b)"}],
    "layernorm": [{"tokens": 16384, "hidden": 1024, "label": "16384x1024"},
                  {"tokens": 16384, "hidden": 2560, "label": "16384x2560"}],
    "swiglu": [{"tokens": 16384, "intermediate": 3072, "label": "16384x3072 (qwen3-0.6b)"},
               {"tokens": 16384, "intermediate": 9728, "label": "16384x9728 (qwen3-4b)"}],
    "geglu": [{"tokens": 16384, "intermediate": 3072, "label": "16384x3072"},
              {"tokens": 16384, "intermediate": 6912, "label": "16384x6912 (gemma3-1b)"}],
    "rope": [{"batch": 8, "seq": 2048, "q_heads": 16, "kv_heads": 8, "head_dim": 128,
              "label": "8x2048 q16/kv8 d128 (qwen3-0.6b)"},
             {"batch": 8, "seq": 2048, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
              "label": "8x2048 q32/kv8 d128 (qwen3-4b)"}],
    "qk_norm_rope": [{"batch": 8, "seq": 2048, "q_heads": 16, "kv_heads": 8, "head_dim": 128,
                      "label": "8x2048 q16/kv8 d128 (qwen3-0.6b)"},
                     {"batch": 8, "seq": 2048, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                      "label": "8x2048 q32/kv8 d128 (qwen3-4b)"}],
    "cross_entropy": [{"tokens": 16384, "vocab": 151936, "label": "16384x151936 (qwen3)"}],
    "linear_cross_entropy": [{"tokens": 16384, "hidden": 1024, "vocab": 151936,
                              "label": "16384x1024x151936 (qwen3-0.6b)"}],
}


def _smaller_block(p: Mapping[str, Any], div: int = 4) -> int:
    return max(16, int(p["BLOCK"]) // div)


def _head_tile(p: Mapping[str, Any]) -> int:
    """rope / qk_norm_rope: a block of a quarter of the auto q head tile (heads looped in ~4 tiles)."""
    return max(16, int(p["q_block_heads"]) * int(p["half_pad"]) // 4)


@dataclass(frozen=True)
class Variant:
    name: str
    flags: Callable[[Mapping[str, Any]], dict]    # auto key params -> flags forcing the generic path
    what: str


_LOOP = Variant("generic", lambda p: {"block": _smaller_block(p)}, "block = auto/4: the row looped in tiles")
# Which flags give each op its general (looped / masked / non-persistent) path.
GENERIC: dict[str, tuple[Variant, ...]] = {
    "rmsnorm": (_LOOP,),
    "add_rmsnorm": (_LOOP,),
    "layernorm": (_LOOP,),
    "swiglu": (_LOOP,),
    "geglu": (_LOOP,),
    "rope": (Variant("generic", lambda p: {"block": _head_tile(p)}, "head tile = auto/4: heads looped"),),
    "qk_norm_rope": (Variant("generic", lambda p: {"block": _head_tile(p)}, "head tile = auto/4: heads looped"),),
    "cross_entropy": (
        Variant("generic", lambda p: {"block": _smaller_block(p, 8), "programs_per_sm": 0},
                "block = auto/8 and one program per row"),
    ),
    "linear_cross_entropy": (
        Variant("generic", lambda p: {"block": _smaller_block(p, 8), "programs_per_sm": 0},
                "row kernel: block = auto/8 and one program per row"),
    ),
}

# Launch choices measured against the auto kernel with ``--tune`` (not "generic" forms: candidates
# for the auto defaults; ratio < 1 means the candidate was faster).
TUNE: dict[str, tuple[Variant, ...]] = {
    "cross_entropy": (
        Variant("persistent_1", lambda p: {"programs_per_sm": 1}, "persistent grid, 1 program per SM"),
        Variant("persistent_2", lambda p: {"programs_per_sm": 2}, "persistent grid, 2 programs per SM"),
    ),
    "linear_cross_entropy": tuple(
        Variant(f"chunk_{c}", lambda p, c=c: {"chunk": c}, f"{c} tokens per chunk") for c in (512, 1024, 2048)
    ) + (Variant("chunk_1024_pps1", lambda p: {"chunk": 1024, "programs_per_sm": 1},
                 "1024 tokens per chunk, persistent row kernel 1/SM"),),
    # fused linear CE: a few tiles for both kernels (the tile sweep of bench/NOTES.md timed every tile, the two
    # kernels separately, and picks the best pair)
    "linear_cross_entropy_fused": tuple(
        Variant(f"tile_{t}", lambda p, t=t: {"tile": t, "grad_tile": t}, f"both kernels in tiles {t}")
        for t in ("m128n128k64w8s4", "m256n128k64w8s3", "m128n256k64w8s4")
    ) + (Variant("band_4096", lambda p: {"band": 4096}, "backward bands of 4096 vocab columns"),
         Variant("flatten", lambda p: {"flatten": True}, "forward loops flattened into one pipelined loop")),
    "qk_norm_rope": tuple(
        Variant(f"bwd_block_{n}", lambda p, n=n: {"bwd_block": n}, f"backward tile of {n} elements")
        for n in (512, 4096)
    ) + (
        Variant("bwd_pps_32", lambda p: {"bwd_programs_per_sm": 32}, "backward grid 32 programs per SM"),
        Variant("bwd_warps_2", lambda p: {"bwd_warps": 2}, "backward 2 warps per program"),
    ),
}


@dataclass
class Options:
    device: str = "cuda"
    dtype: str = "bf16"
    ops: tuple[str, ...] | None = None
    tiny: bool = False
    eager: bool = False             # also time the HF eager form (what an unpatched model runs)
    tune: bool = False              # also time the TUNE candidates
    budget_s: float = 1e9
    target_ms: float = 60.0
    json_path: str | None = None
    txt_path: str | None = None     # the summary table, rewritten after every shape (a killed run keeps it)
    seed: int = runner.SEED
    quiet: bool = False


# ----------------------------------------------------------------------------- planning and source
def plan_variant(fam: Family, shape: dict, dtype: str, target: str, flags: Mapping[str, Any] | None):
    """(KernelKey, site rule) for ``fam`` at ``shape``: the auto plan, or the same rule with ``flags``
    written into the spec (``model.norm: RMSNorm -> fused_rmsnorm(block=256)``), as a user would."""
    from patchdsl.model.index import build_index
    from patchdsl.ops.registry import get_op
    from patchdsl.planning.planner import plan

    op = get_op(fam.op)
    if op is None:
        raise runner.NotImplementedYet(f"op {fam.op} is not in the registry")
    key, rule = runner.plan_key(fam, op, shape, dtype, target)
    if not flags:
        return key, rule
    path = rule.split(":", 1)[0]
    merged = dict(getattr(fam, "flags", {}))          # a family's own flags (mode=fused), then the variant's
    merged.update(flags)
    args = ", ".join(f"{k}={v}" for k, v in merged.items())
    rule = f"{rule.split('(', 1)[0]}({args})"
    model, _ = fam.plan_model(shape, dtype)
    p = plan(rule + "\n", build_index(model), target=target, dtypes=(dtype,))
    site = next(s for s in p.sites if s.path == path)
    return site.key_for(dtype), rule


def kernel_bodies(src: str) -> dict[str, str]:
    """The text of each @triton.jit function of a generated module, by name."""
    out: dict[str, str] = {}
    lines = src.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"def (\w+)\(", lines[i]) if i and lines[i - 1].startswith("@triton.jit") else None
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or lines[j][0] in " \t)"):
            j += 1
        out[m.group(1)] = "\n".join(lines[i:j])
        i = j
    return out


def source_facts(src: str) -> dict[str, Any]:
    """Loops and masked accesses in the main kernels (not the small dW-sum / scaling helpers)."""
    main = {n: b for n, b in kernel_bodies(src).items() if not re.search(r"sum|scale", n)}
    text = "\n".join(main.values())
    return {"kernels": sorted(main), "loops": len(re.findall(r"^\s*for \w+ in range\(", text, re.M)),
            "masked_accesses": text.count("mask="), "lines": src.count("\n") + 1,
            "sha256": hashlib.sha256(src.encode()).hexdigest()[:16]}


def describe(params: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
    """A short phrase: 'one-pass, 4 rows/program, no mask' / 'looped 4 tiles of 256, masked'."""
    p = params
    parts = []
    if "single_pass" in p:
        parts.append("one-pass" if p["single_pass"] else f"looped {p['n_tiles']} tiles of {p['BLOCK']}")
    if "q_loop" in p:
        for h in ("q", "k"):
            n, b = int(p["n_q_heads" if h == "q" else "n_kv_heads"]), int(p[f"{h}_block_heads"])
            parts.append(f"{h} heads looped {-(-n // b)} tiles of {b}" if p[f"{h}_loop"] else f"{h} heads in one tile")
        if int(p.get("tokens_per_program", 1)) > 1:
            parts.append(f"{p['tokens_per_program']} tokens/program")
    rows = p.get("ROWS", p.get("rows_per_program"))
    if rows and int(rows) > 1:
        parts.append(f"{rows} rows/program")
    if "programs_per_sm" in p:
        parts.append(f"persistent {p['programs_per_sm']}/SM" if p["programs_per_sm"] else "program per row")
    if "chunk" in p:
        parts.append(f"chunks of {p['chunk']} tokens")
    parts.append("masked" if facts["masked_accesses"] else "no mask")
    return ", ".join(parts)


# ----------------------------------------------------------------------------- calling a kernel
def build_call(fam: Family, key, params: dict, ref_shapes: list) -> Callable:
    """The generated module of ``key`` called as :func:`.runner.build_patchdsl` calls it."""
    from patchdsl.codegen import load_kernel

    b = bind(resolve_entry(load_kernel(key), fam.entry_names)[0], fam.synonyms, fam.canon_order)

    def call(*act):
        return fam.fix_outputs(as_tuple(b(fam.patchdsl_values(params, dict(zip(fam.act_names, act))))),
                               ref_shapes)[0]

    return call


def _fwd_bwd(fam: Family, call: Callable, params: dict):
    import torch

    n_out = len(fam.out_names)

    def run(act: dict, dys: list):
        outs = as_tuple(call(*[act[n] for n in fam.act_names]))[:n_out]
        leaves = [act[n] for n in fam.act_grad] + [params[n] for n in fam.param_grad]
        pairs = [(o, d) for o, d in zip(outs, dys) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True)
        return outs, grads

    return run


def _time(fam: Family, run: Callable, shape: dict, o: Options, ctx: runner.Context) -> tuple[timing.Timed, str | None]:
    """Forward + backward per call on a GPU: CUDA-graph replay over rotating input sets (cold L2)."""
    import torch

    dev = o.device
    per_set = max(1.0, fam.nbytes(shape, runner.DTYPE_BYTES[o.dtype])["fwd"])
    k = int(min(32, max(1, math.ceil(4.0 * ctx.l2_bytes / per_set))))
    sets = [(fam.make_act(shape, o.dtype, dev, runner._gen(dev, o.seed + 10 + 2 * i)),
             fam.make_dys(shape, o.dtype, dev, runner._gen(dev, o.seed + 11 + 2 * i))) for i in range(k)]
    calls = [(lambda a=a, d=d: run(a, d)) for a, d in sets]
    for c in calls:
        c()
    timing.sync(dev)
    sync_msg = timing.makes_host_sync(calls[0], dev)
    if sync_msg is None:
        try:
            g, keep = timing.capture_graph(calls, torch.cuda.Stream())
            t = timing.time_graph(g, len(calls), o.target_ms)
            del g, keep
            return t, None
        except Exception as e:
            sync_msg = f"graph capture failed ({runner._short(e)})"
    return timing.time_events(calls, o.target_ms), sync_msg


# ----------------------------------------------------------------------------- one (op, shape)
def run_shape(fam: Family, shape: dict, o: Options, ctx: runner.Context, target: str) -> list[dict]:
    """Rows for the auto variant and each generic variant of ``fam`` at ``shape``."""
    cuda = timing.is_cuda(o.device)
    label = fam.label(shape)
    base = {"op": fam.name, "op_name": fam.op, "shape": {k: v for k, v in shape.items() if k != "label"},
            "label": label, "dtype": o.dtype, "target": target}
    rows: list[dict] = []
    try:
        auto_key, auto_rule = plan_variant(fam, shape, o.dtype, target, None)
    except Exception as e:
        return [{**base, "variant": "auto", "status": "error", "error": runner._short(e)}]
    todo: list[tuple[str, dict, Any, str, str]] = [("auto", {}, auto_key, auto_rule, "what the planner picks")]
    for v in GENERIC.get(fam.name, ()) + (TUNE.get(fam.name, ()) if o.tune else ()):
        try:
            flags = v.flags(auto_key.param_dict)
            key, rule = plan_variant(fam, shape, o.dtype, target, flags)
            todo.append((v.name, flags, key, rule, v.what))
        except Exception as e:
            rows.append({**base, "variant": v.name, "status": "error", "error": runner._short(e)})
    ref_outs, ref_grads = runner._reference(fam, shape, ctx)
    ref_shapes = [tuple(r.shape) for r in ref_outs]
    names = list(fam.act_grad) + list(fam.param_grad)
    auto_res = None
    auto_src = None
    for vname, flags, key, rule, what in todo:
        rec: dict[str, Any] = {**base, "variant": vname, "flags": flags, "why": what, "rule": rule,
                               "kernel": key.name, "status": "ok",
                               "tune": any(v.name == vname for v in TUNE.get(fam.name, ()))}
        try:
            from patchdsl.codegen import render

            src = render(key)
            facts = source_facts(src)
            rec.update({"source_features": describe(key.param_dict, facts), "source": facts,
                        "params": {k: v for k, v in key.param_dict.items() if k not in ("tag",)}})
            if vname != "auto" and key == auto_key:
                rec.update(status="same kernel", error="these flags give the auto kernel at this shape")
                rows.append(rec)
                continue
            rec["source_differs"] = None if vname == "auto" else src != auto_src
            if vname == "auto":
                auto_src = src
            params = fam.make_params(shape, o.dtype, o.device, runner._gen(o.device, o.seed))
            run = _fwd_bwd(fam, build_call(fam, key, params, ref_shapes), params)
            act = fam.make_act(shape, o.dtype, o.device, runner._gen(o.device, o.seed + 1))
            dys = fam.make_dys(shape, o.dtype, o.device, runner._gen(o.device, o.seed + 2))
            t0 = time.perf_counter()
            outs, grads = run(act, dys)
            timing.sync(o.device)
            once_ms = (time.perf_counter() - t0) * 1000
            got = [x.detach() for x in outs] + [None if g is None else g.detach() for g in grads]
            want = list(ref_outs) + [ref_grads[n] for n in names]
            errs = [float("inf") if g is None else runner.rel_err(g, w) for g, w in zip(got, want)]
            rec["err"] = max(errs)
            rec["errs"] = dict(zip([f"out:{n}" for n in fam.out_names[:len(ref_outs)]] + [f"grad:{n}" for n in names],
                                   errs))
            if vname == "auto":
                auto_res = got
                rec["err_vs_auto"] = 0.0
            elif auto_res is not None:
                rec["err_vs_auto"] = max(float("inf") if a is None or g is None else runner.rel_err(g, a)
                                         for g, a in zip(got, auto_res))
            rec["tol"] = runner.TOL[o.dtype]
            rec["correct"] = bool(rec["err"] <= rec["tol"] and rec.get("err_vs_auto", 0.0) <= rec["tol"])
            del outs, grads, act, dys
            if vname != "auto":
                del got
            if cuda:
                t, note = _time(fam, run, shape, o, ctx)
                rec.update(time_ms=t.ms, spread=[t.p20, t.p80], timing_method=t.method, reps=t.reps)
                if note:
                    rec["timing_note"] = note
            else:
                rec.update(time_ms=once_ms, timing_method="cpu_once (Triton interpreter: means nothing)", reps=1)
        except Exception as e:
            rec.update(status="error", error=runner._short(e))
            runner._check_context(ctx)
        rows.append(rec)
        runner._cleanup(o.device)
    if o.eager:
        rows.append(_eager_row(fam, shape, o, ctx, base, ref_shapes))
    auto_ms = next((r.get("time_ms") for r in rows if r["variant"] == "auto" and r["status"] == "ok"), None)
    for r in rows:
        if auto_ms and r.get("time_ms") and r["variant"] != "auto":
            r["ratio"] = r["time_ms"] / auto_ms
    return rows


def _eager_row(fam: Family, shape: dict, o: Options, ctx: runner.Context, base: dict, ref_shapes: list) -> dict:
    """The HF eager form (what the op replaces), timed the same way, for scale."""
    rec: dict[str, Any] = {**base, "variant": "hf_eager", "flags": {}, "why": "unpatched HF code",
                           "source_features": "PyTorch eager", "status": "ok"}
    try:
        params = fam.make_params(shape, o.dtype, o.device, runner._gen(o.device, o.seed))
        run = _fwd_bwd(fam, fam.hf(params, shape), params)
        if timing.is_cuda(o.device):
            t, note = _time(fam, run, shape, o, ctx)
            rec.update(time_ms=t.ms, spread=[t.p20, t.p80], timing_method=t.method, reps=t.reps)
        else:
            act = fam.make_act(shape, o.dtype, o.device, runner._gen(o.device, o.seed + 1))
            dys = fam.make_dys(shape, o.dtype, o.device, runner._gen(o.device, o.seed + 2))
            t0 = time.perf_counter()
            run(act, dys)
            rec.update(time_ms=(time.perf_counter() - t0) * 1000, timing_method="cpu_once", reps=1)
    except Exception as e:
        rec.update(status="error", error=runner._short(e))
    return rec


# ----------------------------------------------------------------------------- the whole run
def shapes_for(name: str, fam: Family, tiny: bool) -> list[dict]:
    return fam.tiny[:1] if tiny else SHAPES.get(name, fam.issue)


def run_specialise(o: Options) -> dict[str, Any]:
    from patchdsl.codegen import ensure_triton, target as codegen_target

    ensure_triton()
    fams = runner.select_families(o.ops)
    ctx = runner.Context(runner.Options(device=o.device, dtype=o.dtype, seed=o.seed, quiet=o.quiet))
    if timing.is_cuda(o.device):
        import torch

        idx = timing.device_index(o.device)
        torch.cuda.set_device(idx)
        ctx.l2_bytes = int(getattr(torch.cuda.get_device_properties(idx), "L2_cache_size", 0) or (60 << 20))
    tgt = codegen_target()
    doc: dict[str, Any] = {"kind": KIND, "env": runner.environment(o.device),
                           "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(o).items()},
                           "generic_variants": {n: [{"variant": v.name, "what": v.what} for v in GENERIC.get(n, ())]
                                                for n in fams},
                           "results": [], "complete": False}
    # round robin: every op's first shape, then the second ones (a run cut by its budget covers every op)
    todo = []
    per = {n: shapes_for(n, f, o.tiny) for n, f in fams.items()}
    for i in range(max([len(s) for s in per.values()] + [0])):
        todo += [(fams[n], s[i]) for n, s in per.items() if i < len(s)]
    runner.write_json(o.json_path, runner._finite(doc))
    for fam, shape in todo:
        if time.perf_counter() - ctx.t0 > o.budget_s:
            doc["results"].append({"op": fam.name, "label": fam.label(shape), "variant": "*", "status": "skipped",
                                   "error": f"time budget ({o.budget_s:.0f} s) spent"})
            continue
        if ctx.broken:
            doc["results"].append({"op": fam.name, "label": fam.label(shape), "variant": "*", "status": "skipped",
                                   "error": f"CUDA context broken earlier: {ctx.broken}"})
            continue
        rows = run_shape(fam, shape, o, ctx, tgt)
        ctx.ref_key = ctx.ref_val = None
        doc["results"] += rows
        doc["elapsed_s"] = time.perf_counter() - ctx.t0
        runner.write_json(o.json_path, runner._finite(doc))
        _write_text(o.txt_path, table(doc))
        for r in rows:
            ctx.log(_line(r))
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - ctx.t0
    doc["summary"] = summary_rows(doc)
    runner.write_json(o.json_path, runner._finite(doc))
    _write_text(o.txt_path, table(doc))
    return runner._finite(doc)


def _write_text(path: str | None, text: str) -> None:
    if path:
        from patchdsl.util import files

        files.write_text(path, text + "\n", what="results table", parents=True)


def _line(r: dict) -> str:
    head = f"{r['op']} {r.get('label', '')} {r['variant']}"
    if r.get("status") != "ok":
        return f"{head}: {r.get('status')}: {r.get('error', '')}"
    t = r.get("time_ms")
    return f"{head}: {r.get('source_features', '')}; {t:.4f} ms; err {r.get('err', float('nan')):.2e}" \
        if isinstance(t, float) else f"{head}: {r.get('source_features', '')}"


def summary_rows(doc: dict) -> list[dict]:
    return [{"op": r["op"], "label": r.get("label"), "variant": r["variant"], "ratio": r["ratio"]}
            for r in doc.get("results", []) if isinstance(r.get("ratio"), float)]


def wrong(doc: dict) -> bool:
    return any(r.get("correct") is False or r.get("status") == "error" and r.get("variant") != "hf_eager"
               for r in doc.get("results", []))


def table(doc: dict) -> str:
    """The summary: one line per variant, ratio = time / auto time (>= 1.0: specialisation pays)."""
    res = doc.get("results", [])
    cpu = not str(doc.get("options", {}).get("device", "")).startswith("cuda")
    w = [20, 26, 15, 26, 66, 9, 6, 8, 8]
    head = ["op", "shape", "variant", "flags", "source", "ms", "ratio", "err", "vs auto"]
    lines = ["specialised vs generic kernels (ratio = variant / auto time; >= 1.00 means the specialisation pays)"
             + (" [CPU interpreter: times mean nothing]" if cpu else ""),
             "  ".join(h.ljust(n) for h, n in zip(head, w))]
    for r in res:
        flags = ",".join(f"{k}={v}" for k, v in (r.get("flags") or {}).items()) or "auto"
        if r.get("status") != "ok":
            cells = [r["op"], str(r.get("label", "")), r["variant"], flags, f"{r.get('status')}: {r.get('error', '')}"]
        else:
            t, ratio, err, va = r.get("time_ms"), r.get("ratio"), r.get("err"), r.get("err_vs_auto")
            bad = " BAD" if r.get("correct") is False else ""
            cells = [r["op"], str(r.get("label", "")), r["variant"], flags, r.get("source_features", ""),
                     f"{t:.4f}" if isinstance(t, float) else "-",
                     f"{ratio:.2f}" if isinstance(ratio, float) else ("1.00" if r["variant"] == "auto" else "-"),
                     f"{err:.1e}" if isinstance(err, float) else "-",
                     (f"{va:.1e}" if isinstance(va, float) else "-") + bad]
        lines.append("  ".join(c[:n].ljust(n) if i < len(cells) - 1 else c for i, (c, n) in enumerate(zip(cells, w))))
    timed = [r for r in res if isinstance(r.get("ratio"), float) and r["variant"] != "hf_eager"]
    ratios = [r["ratio"] for r in timed if not r.get("tune")]
    if ratios and not cpu:
        slower = [f"{r['op']} {r['label']} {r['variant']}" for r in timed if not r.get("tune") and r["ratio"] < 1.0]
        lines.append(f"generic/specialised: min {min(ratios):.2f}, geomean "
                     f"{math.exp(sum(math.log(x) for x in ratios) / len(ratios)):.2f}; "
                     + (f"generic FASTER for: {'; '.join(slower)}" if slower else "specialised never slower"))
    better = [f"{r['op']} {r['label']} {r['variant']} ({r['ratio']:.2f})" for r in timed
              if r.get("tune") and r["ratio"] < 1.0]
    if better and not cpu:
        lines.append("tuning candidates faster than auto: " + "; ".join(better))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI (called from .cli)
def add_parser(sub) -> None:
    s = sub.add_parser("specialise", help="each specialised kernel vs the generic (looped/masked) form of the same op")
    s.add_argument("--out", help="output folder (default: $OUT, else a new bench-results/specialise-<time>/)")
    s.add_argument("--json-out", "--json", dest="json", metavar="F",
                   help="write the results JSON here (default: OUT/specialise.json); --json is its old name")
    s.add_argument("--txt", help="also write the summary table here (default: next to the JSON, .txt)")
    s.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    s.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    s.add_argument("--ops", help="comma-separated op families (default: all)")
    s.add_argument("--tiny", action="store_true", help="tiny shapes (default on the CPU)")
    s.add_argument("--eager", action="store_true", help="also time HF eager, for scale")
    s.add_argument("--tune", action="store_true", help="also time launch-choice candidates for the auto defaults")
    s.add_argument("--budget", type=float, default=1e9, help="seconds; shapes not started by then are skipped")
    s.add_argument("--target-ms", type=float, default=60.0, help="timed replays per measurement, in ms")
    s.add_argument("--seed", type=int, default=runner.SEED)
    s.add_argument("--quiet", action="store_true")


def main(a, device: str, out_dir, ops: tuple[str, ...] | None = None) -> int:
    """``a``: the parsed arguments; ``ops``: the op families asked for (parsed by the caller)."""
    from pathlib import Path

    path = a.json or str(Path(out_dir) / "specialise.json")
    txt = a.txt or str(Path(path).with_suffix(".txt"))
    o = Options(txt_path=txt, device=device, dtype=a.dtype, ops=ops, tiny=a.tiny or not timing.is_cuda(device),
                eager=a.eager, tune=a.tune, budget_s=a.budget, target_ms=a.target_ms, json_path=path, seed=a.seed, quiet=a.quiet)
    try:
        doc = run_specialise(o)
    except ValueError as ex:
        print(str(ex), file=sys.stderr)
        return 2
    print(f"results: {path}, {txt}")
    print(table(doc))
    return 1 if wrong(doc) else 0

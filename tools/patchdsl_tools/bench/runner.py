"""Run the per-op benchmark units and collect one JSON document.

A unit is (op family, shape, implementation).  Units run in priority order (the issue's shapes
first, then torch.compile at those shapes, then the sweep) and each is wrapped: an error, an
out-of-memory or an unavailable peer becomes a row with a status and the message, never a stop.
After a CUDA error that poisons the context the remaining units are marked skipped.  The JSON is
rewritten after every unit, so a run killed by its time limit still leaves its results.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

from . import timing
from patchdsl.util.vocab import DTYPE_BYTES
from .cases import (Family, NotImplementedYet, Unavailable, as_tuple, bind, families,
                    resolve_entry)

IMPLS = ("patchdsl", "hf", "compile", "liger", "cce")
MODES = ("fwd", "bwd", "fwd_bwd")
TOL = {"bf16": 2e-2, "fp16": 4e-3, "fp32": 1e-3}
SEED = 1234


@dataclass
class Options:
    device: str = "cuda"
    dtype: str = "bf16"
    groups: tuple[str, ...] = ("issue", "sweep")
    ops: tuple[str, ...] | None = None
    impls: tuple[str, ...] = IMPLS
    budget_s: float = 1e9
    compile_sweep: bool = False
    sweep_start: int = 0            # skip each family's first sweep shapes (measured by an earlier run)
    compile_backend: str = "inductor"
    target_ms: float = 100.0
    l2_multiple: float = 4.0
    max_rotations: int = 32
    rotation_mem_cap: int = 12 << 30
    json_path: str | None = None
    seed: int = SEED
    quiet: bool = False


@dataclass
class Context:
    opts: Options
    ceilings: dict[str, Any] = field(default_factory=dict)
    broken: str | None = None
    l2_bytes: int = 60 << 20
    ref_key: Any = None
    ref_val: Any = None
    t0: float = field(default_factory=time.perf_counter)

    def log(self, msg: str) -> None:
        if not self.opts.quiet:
            print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- helpers
def _gen(device: str, seed: int):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64, chunked; inf if out has a non-finite value or a wrong shape."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=o.device)
    den = torch.zeros((), dtype=torch.float64, device=o.device)
    bad = torch.zeros((), dtype=torch.bool, device=o.device)
    step = 1 << 26
    for i in range(0, o.numel(), step):
        oc, rc = o[i:i + step].double(), r[i:i + step].double().to(o.device)
        bad |= ~torch.isfinite(oc).all()
        num += (oc - rc).pow(2).sum()
        den += rc.pow(2).sum()
    if bool(bad):
        return float("inf")
    d = float(den)
    return math.sqrt(float(num) / (d if d > 0 else 1.0))


def _nbytes(ts) -> int:
    return int(sum(t.numel() * t.element_size() for t in ts if t is not None))


def plan_key(fam: Family, op: Any, shape: dict, dtype: str, target: str):
    """The KernelKey a real model of these sizes would get: a one-rule spec planned on a meta model."""
    from patchdsl.model.index import build_index
    from patchdsl.planning.planner import plan

    model, prefer = fam.plan_model(shape, dtype)
    index = build_index(model)
    path = kind = None
    for p in list(prefer) + [i.path for i in index]:
        info = index.get(p)
        if info is None:
            continue
        ks = [k for k in op.kinds if k in info.kinds]
        if ks:
            path, kind = p, ks[0]
            break
    if path is None:
        raise LookupError(f"no module of kind {'/'.join(op.kinds)} in the planning model for {fam.op}")
    args = ", ".join(f"{k}={v}" for k, v in getattr(fam, "flags", {}).items())
    rule = f"{path or '*'}: {kind} -> {op.name}" + (f"({args})" if args else "")
    p = plan(rule + "\n", index, target=target, dtypes=(dtype,))
    site = next((s for s in p.sites if s.path == path), None) or (p.sites[0] if p.sites else None)
    if site is None:
        raise LookupError(f"planning '{rule}' gave no site")
    key = site.key_for(dtype)
    if key is None:
        raise LookupError(f"the plan for {path} has no kernel for {dtype}")
    return key, rule


class Entry(NamedTuple):
    """The op's generated module as a real model would plan it, its entry point (and the name it was
    found under), the entry bound to the family's value names, the kernel key and the planned rule."""
    module: Any
    fn: Callable
    name: str
    call: Callable
    key: Any
    rule: str


def patchdsl_entry(fam: Family, shape: dict, dtype: str, target: str) -> Entry:
    from patchdsl.codegen import load_kernel
    from patchdsl.ops.registry import get_op

    op = get_op(fam.op)
    if op is None:
        raise NotImplementedYet(f"op {fam.op} is not in the registry yet (its op module has not landed)")
    key, rule = plan_key(fam, op, shape, dtype, target)
    mod = load_kernel(key)
    fn, name = resolve_entry(mod, fam.entry_names)
    return Entry(mod, fn, name, bind(fn, fam.synonyms, fam.canon_order), key, rule)


def build_patchdsl(fam: Family, params: dict, shape: dict, dtype: str, target: str, ref_shapes: list,
                   entry: Entry | None = None):
    """The bench's call of the patchdsl op (``entry``: one already planned, else planned here)."""
    e = entry or patchdsl_entry(fam, shape, dtype, target)
    b, key, site = e.call, e.key, e.rule
    names = fam.act_names
    notes: list[str] = []

    def call(*act):
        outs, note = fam.fix_outputs(as_tuple(b(fam.patchdsl_values(params, dict(zip(names, act))))), ref_shapes)
        if note and not notes:
            notes.append(note)
        return outs

    return call, {"kernel": key.name, "entry": getattr(b, "signature", ""), "site": site, "notes": notes}


def build_impl(fam: Family, impl: str, params: dict, shape: dict, ctx: Context, ref_shapes: list):
    o = ctx.opts
    if impl == "patchdsl":
        from patchdsl.codegen import target

        return build_patchdsl(fam, params, shape, o.dtype, target(), ref_shapes)
    if impl == "hf":
        return fam.hf(params, shape), {}
    if impl == "compile":
        import torch

        torch._dynamo.reset()
        return torch.compile(fam.hf(params, shape), backend=o.compile_backend, dynamic=False), \
            {"backend": o.compile_backend}
    if impl == "liger":
        return fam.liger(params, shape), {}
    if impl == "cce":
        return fam.cce(params, shape), {}
    raise ValueError(impl)


def _reference(fam: Family, shape: dict, ctx: Context):
    key = (fam.name, json.dumps(shape, sort_keys=True))
    if ctx.ref_key == key:
        return ctx.ref_val
    ctx.ref_key = ctx.ref_val = None
    _cleanup(ctx.opts.device)
    o = ctx.opts
    params = fam.make_params(shape, o.dtype, o.device, _gen(o.device, o.seed))
    act = fam.make_act(shape, o.dtype, o.device, _gen(o.device, o.seed + 1))
    dys = fam.make_dys(shape, o.dtype, o.device, _gen(o.device, o.seed + 2))
    outs, grads = fam.reference(params, act, dys)
    ctx.ref_key, ctx.ref_val = key, (outs, grads)
    return outs, grads


def _cleanup(device: str) -> None:
    if timing.is_cuda(device):       # only device memory needs returning promptly
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _short(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"[:400]


# ----------------------------------------------------------------------------- one unit
def run_unit(fam: Family, group: str, shape: dict, impl: str, ctx: Context) -> dict[str, Any]:
    import torch

    o = ctx.opts
    dev = o.device
    cuda = timing.is_cuda(dev)
    esize = DTYPE_BYTES[o.dtype]
    rec: dict[str, Any] = {"op": fam.name, "op_name": fam.op, "group": group, "label": fam.label(shape),
                           "shape": {k: v for k, v in shape.items() if k != "label"}, "impl": impl,
                           "dtype": o.dtype, "status": "ok"}
    nb = fam.nbytes(shape, esize)
    nf = fam.nflops(shape)
    rec["bytes"] = nb
    if nf:
        rec["flops"] = nf
    t_unit = time.perf_counter()
    try:
        ref_outs, ref_grads = _reference(fam, shape, ctx)
        ref_shapes = [tuple(r.shape) for r in ref_outs]
        params = fam.make_params(shape, o.dtype, dev, _gen(dev, o.seed))
        call, info = build_impl(fam, impl, params, shape, ctx, ref_shapes)
        rec.update({k: v for k, v in info.items() if k != "notes"})
        n_out = len(fam.out_names)

        def run(act: dict):
            outs = as_tuple(call(*[act[n] for n in fam.act_names]))
            if len(outs) < n_out:
                raise ValueError(f"{impl} returned {len(outs)} tensor(s), expected {n_out} ({', '.join(fam.out_names)})")
            return outs[:n_out]

        def leaves(act: dict) -> list:
            return [act[n] for n in fam.act_grad] + [params[n] for n in fam.param_grad]

        def grads_of(outs, act, dys, retain=False):
            pairs = [(ot, d) for ot, d in zip(outs, dys) if ot.requires_grad]
            if not pairs:
                raise ValueError(f"{impl}: no output requires grad")
            return torch.autograd.grad([p[0] for p in pairs], leaves(act), [p[1] for p in pairs],
                                       retain_graph=retain, allow_unused=True)

        # ---- correctness on the reference inputs (fresh copies: some peers write into their inputs)
        act0 = fam.make_act(shape, o.dtype, dev, _gen(dev, o.seed + 1))
        dys0 = fam.make_dys(shape, o.dtype, dev, _gen(dev, o.seed + 2))
        outs = run(act0)
        out_errs = [rel_err(a, b) for a, b in zip(outs, ref_outs)]
        gr = grads_of(outs, act0, dys0)
        names = list(fam.act_grad) + list(fam.param_grad)
        grad_errs = {}
        for n, g in zip(names, gr):
            grad_errs[n] = float("inf") if g is None else rel_err(g, ref_grads[n])
        rec["out_shapes_ok"] = all(tuple(a.shape) == tuple(b) for a, b in zip(outs, ref_shapes))
        rec["err_out"] = max(out_errs) if out_errs else None
        rec["err_grads"] = grad_errs
        rec["err_max"] = max([*out_errs, *grad_errs.values()])
        rec["tol"] = TOL[o.dtype]
        rec["correct"] = bool(rec["err_max"] <= TOL[o.dtype])
        if info.get("notes"):
            rec["notes"] = list(info["notes"])
        del outs, gr, act0, dys0
        _cleanup(dev)

        # ---- rotating input sets
        bytes_fwd = max(1.0, nb["fwd"])
        k = 1 if cuda else 2
        if cuda:
            k = int(min(o.max_rotations, max(1, math.ceil(o.l2_multiple * ctx.l2_bytes / bytes_fwd))))
        sets, dys = [], []
        for i in range(k):
            sets.append(fam.make_act(shape, o.dtype, dev, _gen(dev, o.seed + 10 + 2 * i)))
            dys.append(fam.make_dys(shape, o.dtype, dev, _gen(dev, o.seed + 11 + 2 * i)))
            if i == 0 and cuda:
                per = _nbytes(sets[0].values()) + _nbytes(dys[0])
                k = max(1, min(k, o.rotation_mem_cap // max(1, per)))
            if len(sets) >= k:
                break
        rec["rotations"] = len(sets)

        fwd_calls = [(lambda a=a: run(a)) for a in sets]
        fb_calls = [(lambda a=a, d=d: grads_of(run(a), a, d)) for a, d in zip(sets, dys)]

        # ---- memory (set 0): what the forward keeps, and the fwd+bwd peak
        mem = timing.memory_of(lambda: run(sets[0]), lambda outs: grads_of(outs, sets[0], dys[0]), dev)
        if mem:
            rec.update(mem)
            out_b = sum(math.prod(s) for s in ref_shapes) * esize
            grad_b = _nbytes(leaves(sets[0]))
            rec["extra_peak_bytes"] = int(mem["peak_bytes"] - out_b - grad_b)

        # ---- host synchronisation (decides graph or events)
        if cuda:
            for c in fb_calls:       # warm-up: compiles, autotunes, allocator
                c()
            timing.sync(dev)
        sync_msg = timing.makes_host_sync(fb_calls[0], dev)
        rec["host_sync"] = sync_msg
        method_notes: list[str] = []

        times: dict[str, timing.Timed] = {}
        errors: dict[str, str] = {}
        stream = torch.cuda.Stream() if cuda else None
        for mode in ("fwd", "fwd_bwd", "bwd"):
            bwd_outs: list = []

            def prep():
                bwd_outs.clear()
                bwd_outs.extend(run(a) for a in sets)

            if mode == "fwd":
                calls, prepare = fwd_calls, None
            elif mode == "fwd_bwd":
                calls, prepare = fb_calls, None
            else:
                calls = [(lambda i=i: grads_of(bwd_outs[i], sets[i], dys[i], retain=True)) for i in range(len(sets))]
                prepare = prep
            try:
                t = None
                if cuda and sync_msg is None:
                    try:
                        g, keep = timing.capture_graph(calls, stream, prepare)
                        t = timing.time_graph(g, len(calls), o.target_ms)
                        del g, keep
                    except Exception as e:   # not capturable: time this mode with events, say why
                        method_notes.append(f"{mode}: graph capture failed ({_short(e)}); timed eagerly with events")
                        _check_context(ctx)
                        if ctx.broken:
                            raise
                        _cleanup(dev)
                if t is None:
                    if prepare is not None:
                        prepare()
                    if cuda:
                        t = timing.time_events(calls, o.target_ms)
                    else:
                        t = timing.time_cpu(calls, target_ms=o.target_ms, min_reps=1, max_reps=5)
                times[mode] = t
            except Exception as e:
                errors[mode] = _short(e)
                _check_context(ctx)
                if ctx.broken:
                    raise
            bwd_outs.clear()
            timing.sync(dev)
        if "bwd" not in times and "fwd" in times and "fwd_bwd" in times:
            # e.g. a backward that consumes its saved buffers cannot be replayed: bwd = (fwd+bwd) - fwd
            f, fb = times["fwd"], times["fwd_bwd"]
            times["bwd"] = timing.Timed(max(0.0, fb.ms - f.ms), max(0.0, fb.p20 - f.p80), max(0.0, fb.p80 - f.p20),
                                        "derived: fwd_bwd - fwd", min(f.reps, fb.reps))
            rec["bwd_derived"] = errors.pop("bwd", "")
        if method_notes:
            rec["timing_notes"] = method_notes
        rec["timing_method"] = sorted({t.method for t in times.values()})
        for mode, t in times.items():
            rec[f"{mode}_ms"] = t.ms
            rec[f"{mode}_spread"] = [t.p20, t.p80]
            rec[f"{mode}_reps"] = t.reps
        if errors:
            rec["mode_errors"] = errors

        # ---- eager per-call wall and host time
        try:
            wall_ms, lo = (40.0, 5) if cuda else (min(40.0, o.target_ms), 1)
            from patchdsl.kernel_support import launch as _launch
            n0 = _launch.counts()
            ew = timing.eager_wall(fwd_calls, dev, target_ms=wall_ms, lo=lo)
            rec["eager_fwd_ms"], rec["host_fwd_us"] = ew["eager_ms"], ew["host_us"]
            if impl == "patchdsl":   # kernel launches in that loop: [fast (compiled launcher), normal (kernel[grid])]
                rec["launches_fast_normal"] = [a - b for a, b in zip(_launch.counts(), n0)]
            ew = timing.eager_wall(fb_calls, dev, target_ms=wall_ms, lo=lo)
            rec["eager_fwd_bwd_ms"], rec["host_fwd_bwd_us"] = ew["eager_ms"], ew["host_us"]
            for mode in ("fwd", "fwd_bwd"):
                if f"{mode}_ms" in rec:
                    rec[f"overhead_{mode}_us"] = max(0.0, (rec[f"eager_{mode}_ms"] - rec[f"{mode}_ms"]) * 1000)
        except Exception as e:
            errors["eager"] = _short(e)
            rec["mode_errors"] = errors

        _derive(rec, ctx)
        if errors and not times:
            rec["status"] = "error"
            rec["error"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
        del sets, dys, fwd_calls, fb_calls, call, params
    except Unavailable as e:
        rec["status"], rec["error"] = "unavailable", str(e)
    except NotImplementedYet as e:
        rec["status"], rec["error"] = "not implemented", str(e)
    except Exception as e:
        rec["status"], rec["error"] = "error", _short(e)
        rec["traceback"] = traceback.format_exc(limit=8)[-3000:]
        _check_context(ctx)
    rec["unit_s"] = time.perf_counter() - t_unit
    _cleanup(dev)
    if impl == "compile":
        try:
            import torch

            torch._dynamo.reset()
        except Exception:
            pass
    return rec


def _check_context(ctx: Context) -> None:
    if not timing.is_cuda(ctx.opts.device):
        return
    import torch

    try:
        torch.cuda.synchronize()
        torch.empty(1, device=ctx.opts.device).add_(1)
        torch.cuda.synchronize()
    except Exception as e:
        ctx.broken = _short(e)


def _derive(rec: dict, ctx: Context) -> None:
    copy = ctx.ceilings.get("copy", {}).get("gbps")
    mm = ctx.ceilings.get("matmul_bf16", {}).get("tflops")
    for mode in MODES:
        ms = rec.get(f"{mode}_ms")
        if not ms:
            continue
        b = rec["bytes"][mode]
        gbps = b / (ms * 1e-3) / 1e9
        rec.setdefault("gbps", {})[mode] = gbps
        floor = 0.0
        if copy:
            rec.setdefault("pct_copy", {})[mode] = 100.0 * gbps / copy
            floor = b / (copy * 1e9) * 1e3
        fl = rec.get("flops", {}).get(mode)
        if fl:
            tf = fl / (ms * 1e-3) / 1e12
            rec.setdefault("tflops", {})[mode] = tf
            if mm:
                rec.setdefault("pct_matmul", {})[mode] = 100.0 * tf / mm
                floor = max(floor, fl / (mm * 1e12) * 1e3)
        if floor:
            rec.setdefault("floor_ms", {})[mode] = floor


# ----------------------------------------------------------------------------- the whole run
def environment(device: str) -> dict[str, Any]:
    import datetime
    import platform

    import torch

    from patchdsl._version import __version__

    def ver(dist: str) -> str | None:
        try:
            from importlib.metadata import version

            return version(dist)
        except Exception:
            return None

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "triton": ver("triton"),
        "transformers": ver("transformers"), "liger_kernel": ver("liger-kernel") or ver("liger_kernel"),
        "cut_cross_entropy": ver("cut-cross-entropy") or ver("cut_cross_entropy"), "patchdsl": __version__,
        "device": device, "hostname": platform.node(),
    }
    if timing.is_cuda(device):
        p = torch.cuda.get_device_properties(timing.device_index(device))
        env.update({"gpu": p.name, "sm_count": p.multi_processor_count, "gpu_mem_bytes": p.total_memory,
                    "l2_bytes": getattr(p, "L2_cache_size", None), "cuda": torch.version.cuda})
    try:
        import subprocess

        root = Path(__file__).resolve().parents[3]
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=5)
        env["git"] = r.stdout.strip() or None
    except Exception:
        env["git"] = None
    return env


def comparisons(results: list[dict]) -> list[dict]:
    """patchdsl / peer ratios per (op, shape), from units measured in the same run."""
    out = []
    by = {}
    for r in results:
        if r.get("status") == "ok":
            by[(r["op"], r["label"], r["impl"])] = r
    src_of = {name: f.peers_from for name, f in families().items() if f.peers_from}
    for (op, label, impl), pd in list(by.items()):
        if impl != "patchdsl":
            continue
        src = src_of.get(op)
        for peer in IMPLS[1:] + ((src,) if src else ()):
            if peer == src:      # the other mode of the same op, measured as the other family's patchdsl row
                pr = by.get((src, label, "patchdsl"))
            else:
                pr = by.get((op, label, peer)) or (by.get((src, label, peer)) if src else None)
            if not pr:
                continue
            row = {"op": op, "label": label, "group": pd["group"], "peer": peer}
            for m in MODES:
                a, b = pd.get(f"{m}_ms"), pr.get(f"{m}_ms")
                if a and b:
                    row[f"ratio_{m}"] = a / b
            for m in ("peak_bytes", "fwd_resident_bytes", "host_fwd_us", "host_fwd_bwd_us"):
                a, b = pd.get(m), pr.get(m)
                if a is not None and b:
                    row[f"ratio_{m}"] = a / b
            out.append(row)
    return out


def select_families(ops: tuple[str, ...] | None) -> dict[str, Family]:
    """The op families named in ``ops`` (all when None); ValueError naming any unknown one."""
    fams = families()
    if ops:
        unknown = [o for o in ops if o not in fams]
        if unknown:
            raise ValueError(f"unknown op(s) {unknown}; known: {', '.join(fams)}")
        fams = {k: v for k, v in fams.items() if k in ops}
    return fams


def units(opts: Options) -> list[tuple[Family, str, dict, str]]:
    fams = select_families(opts.ops)
    out = []
    for group in opts.groups:
        plain, comp = [], []
        # round robin over the families (first shape of each, then the second...), so that a run cut
        # short by its time budget still covers every op
        n = max([len(f.shapes(group)) for f in fams.values()] + [0])
        for i in range(opts.sweep_start if group == "sweep" else 0, n):
            for fam in fams.values():
                shapes = fam.shapes(group)
                if i >= len(shapes):
                    continue
                for impl in ("patchdsl",) + fam.peers:
                    if impl not in opts.impls:
                        continue
                    (comp if impl == "compile" else plain).append((fam, group, shapes[i], impl))
        out += plain
        if group != "sweep" or opts.compile_sweep:
            out += comp
    return out


def write_json(path: str | None, doc: dict) -> None:
    if not path:
        return
    from patchdsl.util import files

    files.write_text(path, json.dumps(doc, indent=1, default=_json_default), what="results JSON", parents=True)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return str(o)


def _finite(o):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return "inf" if o > 0 else ("-inf" if o < 0 else "nan")
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def run_ops(opts: Options, on_result: Callable[[dict], None] | None = None) -> dict[str, Any]:
    from patchdsl.codegen import ensure_triton

    ensure_triton()
    ctx = Context(opts)
    if timing.is_cuda(opts.device):
        import torch

        idx = timing.device_index(opts.device)
        torch.cuda.set_device(idx)
        p = torch.cuda.get_device_properties(idx)
        ctx.l2_bytes = int(getattr(p, "L2_cache_size", 0) or (60 << 20))
        try:
            import torch._dynamo

            for name, val in (("cache_size_limit", 256), ("recompile_limit", 256),
                              ("accumulated_cache_size_limit", 4096), ("accumulated_recompile_limit", 4096)):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, val)
        except Exception:
            pass
    doc: dict[str, Any] = {"kind": "patchdsl-bench-ops", "env": environment(opts.device),
                           "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()},
                           "ceilings": {}, "results": [], "comparisons": [], "complete": False}
    ctx.log("measuring the copy bandwidth and the bf16 matmul rate")
    try:
        ctx.ceilings = timing.measure_ceilings(opts.device)
    except Exception as e:
        ctx.ceilings = {"error": _short(e)}
    doc["ceilings"] = ctx.ceilings
    c = ctx.ceilings
    if "copy" in c:
        ctx.log(f"copy {c['copy']['gbps']:.0f} GB/s, matmul {c['matmul_bf16']['tflops']:.1f} TFLOP/s")
    todo = units(opts)
    write_json(opts.json_path, _finite(doc))
    for i, (fam, group, shape, impl) in enumerate(todo):
        elapsed = time.perf_counter() - ctx.t0
        base = {"op": fam.name, "op_name": fam.op, "group": group, "label": fam.label(shape),
                "shape": {k: v for k, v in shape.items() if k != "label"}, "impl": impl, "dtype": opts.dtype}
        if ctx.broken:
            rec = {**base, "status": "skipped", "error": f"CUDA context broken earlier: {ctx.broken}"}
        elif elapsed > opts.budget_s:
            rec = {**base, "status": "skipped", "error": f"time budget ({opts.budget_s:.0f} s) spent"}
        else:
            rec = run_unit(fam, group, shape, impl, ctx)
        doc["results"].append(rec)
        doc["comparisons"] = comparisons(doc["results"])
        doc["elapsed_s"] = time.perf_counter() - ctx.t0
        write_json(opts.json_path, _finite(doc))
        if rec["status"] != "skipped" or i == len(todo) - 1 or not opts.quiet:
            ctx.log(_line(rec, i + 1, len(todo)))
        if on_result:
            on_result(rec)
    ctx.ref_key = ctx.ref_val = None
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - ctx.t0
    write_json(opts.json_path, _finite(doc))
    return _finite(doc)


def _line(rec: dict, i: int, n: int) -> str:
    head = f"({i}/{n}) {rec['op']} {rec['label']} {rec['impl']}"
    if rec["status"] != "ok":
        return f"{head}: {rec['status']}: {rec.get('error', '')}"
    parts = [f"{m} {rec[m + '_ms']:.4f} ms" for m in MODES if rec.get(m + "_ms") is not None]
    err = rec.get("err_max")
    parts.append(f"err {err:.2e}" if isinstance(err, float) else f"err {err}")
    if rec.get("peak_bytes") is not None:
        parts.append(f"peak {rec['peak_bytes'] / 2**20:.0f} MiB")
    if rec.get("host_sync"):
        parts.append("HOST SYNC")
    return f"{head}: " + ", ".join(parts) + f" [{rec['unit_s']:.1f}s]"


def run_offline(cmd: list[str], limit: float) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds) of ``cmd`` run with the Hub offline under ``limit``
    seconds; a run past the limit is exit 124 with what it printed so far."""
    import subprocess
    import time

    def text(x) -> str:
        return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        rc, so, se = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, so, se = 124, text(e.stdout), text(e.stderr)
    return rc, so, se, time.perf_counter() - t0

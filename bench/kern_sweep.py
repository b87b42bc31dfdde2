"""Kernel variants of RMSNorm, the GLUs (issue 15 item 4) and qk-norm+RoPE, checked and timed in ONE GPU call.

    python3 bench/kern_sweep.py                          # GPU: RMSNorm and the GLUs, <= --budget-s (80) seconds
    python3 bench/kern_sweep.py --ops rmsnorm --only default,atomic,atomic_prefetch
    python3 bench/kern_sweep.py --ops qk_norm_rope,qk_norm_rope_q32 --budget-s 40 --target-ms 30 --compile no
                                                         # fused_qk_norm_rope at 16x2048 tokens, 16/8 and 32/8 heads
    python3 bench/kern_sweep.py --device cpu --tiny      # CPU smoke run (interpreter; times mean nothing)

Each variant is the op's generated module with some template parameters replaced (the knobs are
documented where their defaults live: ``RMS_TUNING`` in patchdsl/ops/rmsnorm.py, ``GLU_TUNING``
and ``glu_config`` in patchdsl/ops/swiglu.py, ``QK_TUNING`` in patchdsl/ops/qk_norm_rope.py), built from the KernelKey a real model gets at the
issue's shape (``runner.plan_key``), then:

* checked: one forward + backward on seeded random inputs against the float64 reference of
  ``patchdsl/bench/cases.py`` (relative Frobenius error of the output and every gradient, bar
  ``runner.TOL``); a variant over the bar is reported and never a winner;
* timed as ``bench ops`` times (``patchdsl/bench/timing.py``): forward, and forward+backward,
  each the median over CUDA-graph replays of one call per rotating input set (sets several times
  the L2, so each call starts cold); bwd = fwd+bwd - fwd.

Floors measured in the same process, per op, with the op's own read:write mix (a plain copy is
1:1; RMSNorm's backward reads 2 tensors per one written, GeGLU's forward 2:1 and backward 3:2,
and HBM runs read-heavy mixes faster than a copy): ``copy`` (x -> y), ``add`` (torch.add(a, b,
out=c): 2 reads, 1 write) and ``rw32`` (a Triton kernel reading 3 tensors and writing 2, best of
two launch shapes).  The "floor" column is the sum of the floors of the op's forward and backward
mixes at its sizes; ``torch.compile`` of the HF function is timed last when the budget leaves
room (``--compile`` forces it, ``--no-compile`` skips it).

For RMSNorm and qk-norm+RoPE, whose forward and backward are separate kernels, the best forward
launch and the best backward scheme are also combined into one more variant (``combo``) and timed.

Prints one table per op and the winner of each, last; writes ``kern_sweep.json`` (every number)
and ``kern_sweep.txt`` (the tables) to ``--out`` or ``$PART_OUT`` (default ``bench/results/kern_sweep``).
Exit status 1 when a variant's numbers are wrong (a race, a broken variant), else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import patchdsl  # noqa: E402,F401  (first: switches Triton's interpreter on when there is no GPU)

KIND = "patchdsl-kern-sweep"


@dataclass(frozen=True)
class Variant:
    name: str
    over: Mapping[str, Any] | Callable[[Mapping[str, Any], Mapping[str, Any]], Mapping[str, Any]]
    what: str
    part: str = "both"          # which kernel it changes: fwd, bwd, both (RMSNorm's combo uses it)

    def params(self, auto: Mapping[str, Any], shape: Mapping[str, Any]) -> dict[str, Any]:
        over = self.over(auto, shape) if callable(self.over) else self.over
        return {**auto, **over}


def _rows_block(block: int, warps: int) -> Callable:
    """GLU rows layout with another block: single pass when the row fits, else looped."""
    def over(auto, shape):
        inter = int(shape["intermediate"])
        return {"glu_layout": "rows", "BLOCK": block, "single_pass": block >= inter, "n_tiles": -(-inter // block),
                "ROWS": 1, "num_warps": warps}
    return over


def _flat(block: int, warps: int, evict: bool = False) -> dict:
    return {"glu_layout": "flat", "FLAT_BLOCK": block, "num_warps": warps, "evict": evict}


# In priority order: a run cut by its budget has measured the most promising ones.
RMS = [
    Variant("default", {}, "shipped: fwd 4 rows/4 warps; bwd 4 rows/2 warps, 4 programs/SM, partial rows + sum kernel"),
    Variant("atomic", {"dw_reduce": "atomic"}, "dW by fp32 atomics + last-program ticket (one launch)", "bwd"),
    Variant("atomic_prefetch", {"dw_reduce": "atomic", "bwd_prefetch": True}, "+ next rows loaded before the math", "bwd"),
    Variant("atomic_fwdzero", {"dw_reduce": "atomic", "dw_zero": "forward"},
            "atomic, accumulator zeroed by the forward (no fill launch)", "both"),
    Variant("atomic_fwdzero_prefetch", {"dw_reduce": "atomic", "dw_zero": "forward", "bwd_prefetch": True},
            "atomic, zeroed by the forward, prefetch", "both"),
    Variant("fwd_r8_w4", {"ROWS": 8, "num_warps": 4}, "fwd 8 rows/program, 4 warps", "fwd"),
    Variant("fwd_r16_w8", {"ROWS": 16, "num_warps": 8}, "fwd 16 rows/program, 8 warps", "fwd"),
    Variant("atomic_r8_w4", {"dw_reduce": "atomic", "BWD_ROWS": 8, "bwd_warps": 4}, "8 rows/step, 4 warps", "bwd"),
    Variant("atomic_pps8", {"dw_reduce": "atomic", "bwd_programs_per_sm": 8}, "8 programs/SM", "bwd"),
    Variant("atomic_pps2_w4", {"dw_reduce": "atomic", "bwd_programs_per_sm": 2, "bwd_warps": 4},
            "2 programs/SM, 4 warps", "bwd"),
    Variant("atomic_evict", {"dw_reduce": "atomic", "evict": True}, "+ evict_first on x/dy (fwd and bwd)", "both"),
    Variant("atomic_stages2", {"dw_reduce": "atomic", "bwd_stages": 2}, "tl.range num_stages=2", "bwd"),
    Variant("atomic_prefetch_w4", {"dw_reduce": "atomic", "bwd_prefetch": True, "bwd_warps": 4},
            "prefetch, 4 warps", "bwd"),
    Variant("atomic_r8_w8", {"dw_reduce": "atomic", "BWD_ROWS": 8, "bwd_warps": 8}, "8 rows/step, 8 warps", "bwd"),
    Variant("atomic_pps8_r2", {"dw_reduce": "atomic", "bwd_programs_per_sm": 8, "BWD_ROWS": 2},
            "8 programs/SM, 2 rows/step", "bwd"),
    Variant("kernel_prefetch", {"bwd_prefetch": True}, "deterministic dW path with prefetch", "bwd"),
    Variant("fwd_r8_w8", {"ROWS": 8, "num_warps": 8}, "fwd 8 rows/program, 8 warps", "fwd"),
    Variant("fwd_r2_w2", {"ROWS": 2, "num_warps": 2}, "fwd 2 rows/program, 2 warps", "fwd"),
    Variant("atomic_stages3", {"dw_reduce": "atomic", "bwd_stages": 3}, "tl.range num_stages=3", "bwd"),
    Variant("atomic_pps1_r16_w8", {"dw_reduce": "atomic", "bwd_programs_per_sm": 1, "BWD_ROWS": 16, "bwd_warps": 8},
            "1 program/SM, 16 rows/step, 8 warps", "bwd"),
    Variant("atomic_prefetch_pps8_r2", {"dw_reduce": "atomic", "bwd_prefetch": True, "bwd_programs_per_sm": 8,
                                        "BWD_ROWS": 2}, "prefetch, 8 programs/SM, 2 rows/step", "bwd"),
    Variant("fwd_r1_w2", {"ROWS": 1, "num_warps": 2}, "fwd 1 row/program, 2 warps", "fwd"),
]
GEGLU = [
    Variant("default", {}, "shipped: flat, 1024 elements/program, 4 warps (GLU_TUNING since the r3run2 sweep)"),
    Variant("rows_4096_w8", _rows_block(4096, 8), "rows: a program per row, 2 tiles of 4096 (last masked), 8 warps "
            "(the default before r3run2)"),
    Variant("flat_1024_w4", _flat(1024, 4), "flat, 1024 elements/program, 4 warps (Inductor's shape)"),
    Variant("flat_2048_w8", _flat(2048, 8), "flat, 2048/program, 8 warps"),
    Variant("flat_1024_w4_evict", _flat(1024, 4, True), "flat 1024/4 warps, evict_first"),
    Variant("flat_2048_w4", _flat(2048, 4), "flat, 2048/program, 4 warps"),
    Variant("flat_4096_w8", _flat(4096, 8), "flat, 4096/program, 8 warps"),
    Variant("flat_2048_w8_evict", _flat(2048, 8, True), "flat 2048/8 warps, evict_first"),
    Variant("flat_4096_w4", _flat(4096, 4), "flat, 4096/program, 4 warps"),
    Variant("rows_evict", lambda auto, shape: {**_rows_block(4096, 8)(auto, shape), "evict": True},
            "rows 4096/8 warps, evict_first"),
    Variant("flat_8192_w8", _flat(8192, 8), "flat, 8192/program, 8 warps"),
    Variant("rows_2048_w4", _rows_block(2048, 4), "rows, 4 tiles of 2048 (last masked), 4 warps"),
]
SWIGLU = [
    Variant("default", {}, "shipped: flat, 1024 elements/program, 4 warps"),
    Variant("rows_4096_w8", _rows_block(4096, 8), "rows: 3072 in one masked block of 4096, 8 warps (before r3run2)"),
    Variant("flat_1024_w4", _flat(1024, 4), "flat, 1024/program, 4 warps"),
    Variant("flat_2048_w8", _flat(2048, 8), "flat, 2048/program, 8 warps"),
    Variant("flat_4096_w8", _flat(4096, 8), "flat, 4096/program, 8 warps"),
]


def _qk_bwd(tokens: int, warps: int, pps: int, prefetch: bool = False) -> dict:
    return {"bwd_layout": "block", "bwd_tokens": tokens, "bwd_warps": warps, "bwd_programs_per_sm": pps,
            **({"bwd_prefetch": True} if prefetch else {})}


def _qk_fwd(tokens: int, warps: int) -> dict:
    return {"fwd_layout": "block", "fwd_tokens": tokens, "num_warps": warps}


# fused_qk_norm_rope (``QK_TUNING`` in patchdsl/ops/qk_norm_rope.py): "block" = (tokens x all heads x
# half) tiles, every load of a step issued before the first reduction, the backward's dW terms
# accumulated in fp32 tiles and reduced once per program.  The backward grid is persistent, so its
# programs per SM are set to what fits at once (registers per thread from ptxas -v for sm_90 at
# these shapes, 64K registers per SM) or to whole multiples of it: one more program than fits runs
# as a second wave on its own.  Shipped default at 16 q heads: 115 registers x 2 warps, 8 resident of
# 16 per SM (two waves), each with one 4-head tile (2 KB) of loads in flight: ~16 KB per SM.
QK = [
    Variant("default", {}, "shipped: fwd a program per token, heads in one tile; bwd token by token, 4-head tiles, "
            "16 programs/SM, 2 warps"),
    Variant("bwd_t1_w4_p3", _qk_bwd(1, 4, 3), "bwd block: 1 token x all heads per step, 4 warps (158 regs: 3 fit/SM, "
            "36 KB in flight)", "bwd"),
    Variant("bwd_t2_w4_p2", _qk_bwd(2, 4, 2), "bwd block: 2 tokens, 4 warps (254 regs: 2 fit, 48 KB)", "bwd"),
    Variant("fwd_t2_w4", _qk_fwd(2, 4), "fwd block: 2 tokens x all heads per program, 4 warps (96 regs)", "fwd"),
    Variant("bwd_t1_w8_p2_pf", _qk_bwd(1, 8, 2, True), "bwd block, next step's loads before this step's math: "
            "1 token, 8 warps (128 regs: 2 fit, 24 KB always in flight)", "bwd"),
    Variant("bwd_t1_w2_p4", _qk_bwd(1, 2, 4), "bwd block: 1 token, 2 warps (247 regs: 4 fit, 48 KB)", "bwd"),
    Variant("bwd_t1_w8_p2", _qk_bwd(1, 8, 2), "bwd block: 1 token, 8 warps (96 regs: 2 fit, 24 KB)", "bwd"),
    Variant("fwd_t4_w8", _qk_fwd(4, 8), "fwd block: 4 tokens per program, 8 warps (100 regs)", "fwd"),
    Variant("bwd_t1_w4_p2_pf", _qk_bwd(1, 4, 2, True), "bwd block, prefetch: 1 token, 4 warps (230 regs: 2 fit)", "bwd"),
    Variant("bwd_t1_w4_p12", _qk_bwd(1, 4, 12), "bwd block: 1 token, 4 warps, 4 waves of 3/SM", "bwd"),
    Variant("bwd_t4_w8_p1", _qk_bwd(4, 8, 1), "bwd block: 4 tokens, 8 warps (1 fits, 48 KB)", "bwd"),
    Variant("fwd_t1_w4", _qk_fwd(1, 4), "fwd block: 1 token per program, 4 warps (56 regs)", "fwd"),
    Variant("bwd_t2_w4_p8", _qk_bwd(2, 4, 8), "bwd block: 2 tokens, 4 warps, 4 waves of 2/SM", "bwd"),
    Variant("fwd_t2_w8", _qk_fwd(2, 8), "fwd block: 2 tokens per program, 8 warps", "fwd"),
    Variant("bwd_t2_w8_p1", _qk_bwd(2, 8, 1), "bwd block: 2 tokens, 8 warps (171 regs: 1 fits, 24 KB)", "bwd"),
    Variant("bwd_pps32", {"bwd_programs_per_sm": 32}, "per_token bwd, 32 programs/SM (4 waves of 8)", "bwd"),
    Variant("fwd_tpp2", {"tokens_per_program": 2}, "per_token fwd, 2 tokens per program (looped)", "fwd"),
]
# 32 q heads (Qwen3-4B/8B): a step is 20 KB of loads per token; the registers double with the q tile
QK32 = [
    QK[0],
    Variant("bwd_t1_w4_p2", _qk_bwd(1, 4, 2), "bwd block: 1 token x all heads, 4 warps (231 regs: 2 fit, 40 KB)", "bwd"),
    Variant("bwd_t1_w16_p1", _qk_bwd(1, 16, 1), "bwd block: 1 token, 16 warps (97 regs: 1 fits, 20 KB)", "bwd"),
    Variant("fwd_t2_w8", _qk_fwd(2, 8), "fwd block: 2 tokens per program, 8 warps (120 regs)", "fwd"),
    Variant("bwd_t1_w16_p1_pf", _qk_bwd(1, 16, 1, True), "bwd block, prefetch: 1 token, 16 warps (128 regs: 1 fits, "
            "20 KB always in flight)", "bwd"),
    Variant("bwd_t2_w8_p1", _qk_bwd(2, 8, 1), "bwd block: 2 tokens, 8 warps (224 regs: 1 fits, 40 KB)", "bwd"),
    Variant("bwd_t1_w4_p8", _qk_bwd(1, 4, 8), "bwd block: 1 token, 4 warps, 4 waves of 2/SM", "bwd"),
    Variant("fwd_t1_w8", _qk_fwd(1, 8), "fwd block: 1 token per program, 8 warps (64 regs)", "fwd"),
    Variant("bwd_t1_w8_p1", _qk_bwd(1, 8, 1), "bwd block: 1 token, 8 warps (151 regs: 1 fits, 20 KB)", "bwd"),
    Variant("fwd_t2_w4", _qk_fwd(2, 4), "fwd block: 2 tokens per program, 4 warps", "fwd"),
    Variant("bwd_pps32", {"bwd_programs_per_sm": 32}, "per_token bwd, 32 programs/SM", "bwd"),
]
VARIANTS = {"rmsnorm": RMS, "geglu": GEGLU, "swiglu": SWIGLU, "qk_norm_rope": QK, "qk_norm_rope_q32": QK32}
# sweep entries that are another shape of a family
FAMILY = {"qk_norm_rope_q32": "qk_norm_rope"}
# the forward launch's template parameters, for the combined best-forward + best-backward variant
FWD_KEYS = {"rmsnorm": ("ROWS", "num_warps"), "qk_norm_rope": ("fwd_layout", "fwd_tokens", "num_warps", "tokens_per_program"),
            "qk_norm_rope_q32": ("fwd_layout", "fwd_tokens", "num_warps", "tokens_per_program")}
# The op's kernels as read:write mixes per element of its (tokens x width) tensors: (floor, count).
MIXES = {"rmsnorm": {"fwd": [("copy", 1)], "bwd": [("add", 1)]},
         "geglu": {"fwd": [("add", 1)], "bwd": [("rw32", 1)]},
         "swiglu": {"fwd": [("add", 1)], "bwd": [("rw32", 1)]},
         # fwd reads q, k and writes them (1:1); bwd reads dq, dk, q, k and writes dq, dk (2:1);
         # rstd and cos/sin (~3%) are left out of the floor
         "qk_norm_rope": {"fwd": [("copy", 1)], "bwd": [("add", 1)]},
         "qk_norm_rope_q32": {"fwd": [("copy", 1)], "bwd": [("add", 1)]}}
SHAPES = {"rmsnorm": {"tokens": 16384, "hidden": 1024}, "geglu": {"tokens": 16384, "intermediate": 6912},
          "swiglu": {"tokens": 16384, "intermediate": 3072},
          # one Qwen3-0.6B training step's tokens (16 x 2048); Qwen3-4B/8B heads
          "qk_norm_rope": {"batch": 16, "seq": 2048, "q_heads": 16, "kv_heads": 8, "head_dim": 128,
                           "label": "16x2048 q16/kv8 d128"},
          "qk_norm_rope_q32": {"batch": 16, "seq": 2048, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                               "label": "16x2048 q32/kv8 d128"}}
EST_S = 2.5          # a variant's compile + check + timing on the GPU, for the budget
SHARE = {"rmsnorm": 0.45, "geglu": 0.4, "swiglu": 0.15, "qk_norm_rope": 0.6, "qk_norm_rope_q32": 0.4}    # of the budget


def elements(name: str, shape: Mapping[str, Any]) -> int:
    """Elements of the op's streamed tensors (the floors' size): tokens x width, or q and k."""
    if "head_dim" in shape:
        return int(shape["batch"]) * int(shape["seq"]) * (int(shape["q_heads"]) + int(shape["kv_heads"])) * int(shape["head_dim"])
    return int(shape["tokens"]) * int(shape.get("hidden") or shape["intermediate"])


# ----------------------------------------------------------------------------- floors
_RW32: list = []


def _rw32_kernel():
    """The 3-read, 2-write floor kernel (built once per process)."""
    if _RW32:
        return _RW32[0]
    import triton
    import triton.language as tl

    @triton.jit
    def rw32(A, B, C, D, E, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        a = tl.load(A + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=m, other=0.0).to(tl.float32)
        c = tl.load(C + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(D + offs, (a * b + c).to(D.dtype.element_ty), mask=m)
        tl.store(E + offs, (a * c - b).to(E.dtype.element_ty), mask=m)

    _RW32.append(rw32)
    return rw32


def measure_floors(n: int, dtype, device: str, l2: int, target_ms: float) -> dict[str, Any]:
    """Per-element time of copy (1R:1W), add (2R:1W) and rw32 (3R:2W) over ``n`` elements."""
    import torch
    import triton

    from patchdsl.bench import timing

    esize = torch.empty((), dtype=dtype).element_size()
    out: dict[str, Any] = {}
    cuda = timing.is_cuda(device)
    k = max(1, min(8, math.ceil(4 * l2 / (2 * n * esize)))) if cuda else 1
    bufs = [[torch.randn(n, device=device, dtype=torch.float32).to(dtype) for _ in range(5)] for _ in range(k)]
    rw32 = _rw32_kernel()
    kinds: dict[str, tuple[int, list[Callable]]] = {
        "copy": (2, [lambda b=b: b[3].copy_(b[0]) for b in bufs]),
        "add": (3, [lambda b=b: torch.add(b[0], b[1], out=b[3]) for b in bufs]),
    }
    for blk, w in ((1024, 4), (2048, 8)):
        kinds[f"rw32_{blk}_w{w}"] = (5, [lambda b=b, blk=blk, w=w: rw32[(triton.cdiv(n, blk),)](
            b[0], b[1], b[2], b[3], b[4], n, BLOCK=blk, num_warps=w) for b in bufs])
    for name, (tensors, calls) in kinds.items():
        t = _time(calls, device, target_ms)
        nbytes = tensors * n * esize
        out[name] = {"ms": t.ms, "bytes": nbytes, "gbps": nbytes / (t.ms * 1e-3) / 1e9, "method": t.method}
    best = min((v for k_, v in out.items() if k_.startswith("rw32_")), key=lambda v: v["ms"])
    out["rw32"] = dict(best)
    # the output of rw32 is checked, so a wrong floor kernel cannot pass as fast
    b = bufs[0]
    rw32[(triton.cdiv(n, 1024),)](b[0], b[1], b[2], b[3], b[4], n, BLOCK=1024, num_warps=4)
    a, bb, c = (x.double() for x in b[:3])
    out["rw32_err"] = max(_rel(b[3], a * bb + c), _rel(b[4], a * c - bb))
    del bufs
    return out


def _rel(x, ref) -> float:
    x = x.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- timing
def _time(calls: list[Callable], device: str, target_ms: float):
    """Median per call: CUDA-graph replay on a GPU (events if capture fails), one timed pass on the CPU."""
    from patchdsl.bench import timing

    if not timing.is_cuda(device):
        t0 = time.perf_counter()
        for c in calls:
            c()
        ms = (time.perf_counter() - t0) * 1000 / len(calls)
        return timing.Timed(ms, ms, ms, "cpu_once (Triton interpreter: means nothing)", 1)
    import torch

    for c in calls:
        c()
    torch.cuda.synchronize()
    try:
        g, keep = timing.capture_graph(calls, torch.cuda.Stream())
        t = timing.time_graph(g, len(calls), target_ms)
        del g, keep
        return t
    except Exception:
        torch.cuda.synchronize()
        return timing.time_events(calls, target_ms)


# ----------------------------------------------------------------------------- one op
def run_op(name: str, variants: list[Variant], shape: dict, a: argparse.Namespace, ctx, t_end: float,
           floors: bool = True) -> dict[str, Any]:
    import torch

    from patchdsl.bench import runner, specialise, timing
    from patchdsl.bench.cases import families, torch_dtype
    from patchdsl.codegen import KernelKey, load_kernel, target
    from patchdsl.ops.registry import get_op

    fam = families()[FAMILY.get(name, name)]
    dev, dtype = a.device, a.dtype
    cuda = timing.is_cuda(dev)
    tgt = target()
    auto_key, rule = runner.plan_key(fam, get_op(fam.op), shape, dtype, tgt)
    auto = auto_key.param_dict
    ref_outs, ref_grads = runner._reference(fam, shape, ctx)
    ref_shapes = [tuple(r.shape) for r in ref_outs]
    names = list(fam.act_grad) + list(fam.param_grad)
    nb = fam.nbytes(shape, runner.DTYPE_SIZE[dtype])
    k = int(min(32, max(1, math.ceil(4.0 * ctx.l2_bytes / max(1.0, nb["fwd"]))))) if cuda else 1
    sets = [(fam.make_act(shape, dtype, dev, runner._gen(dev, a.seed + 10 + 2 * i)),
             fam.make_dys(shape, dtype, dev, runner._gen(dev, a.seed + 11 + 2 * i))) for i in range(k)]
    doc: dict[str, Any] = {"op": name, "op_name": fam.op, "shape": shape, "label": fam.label(shape), "rule": rule,
                           "auto_params": auto, "bytes": nb, "rotations": k, "rows": []}
    if floors:
        # the same element count as the op's tensors, the op's own read:write mixes
        n = elements(name, shape)
        try:
            fl = doc["floors"] = measure_floors(n, torch_dtype(dtype), dev, ctx.l2_bytes, a.target_ms)
            per = {m: sum(fl[f]["ms"] * c for f, c in MIXES[name][m]) for m in ("fwd", "bwd")}
            doc["floor_ms"] = {**per, "fwd_bwd": per["fwd"] + per["bwd"]}
            _log(a, f"{name} floors: " + ", ".join(f"{kk} {v['gbps']:.0f} GB/s" for kk, v in fl.items()
                                                  if isinstance(v, dict)))
        except Exception as e:
            doc["floors_error"] = f"{type(e).__name__}: {e}"[:300]
            runner._check_context(ctx)

    base_errs: dict[str, float] = {}

    def measure(vname: str, params: dict, what: str, part: str) -> dict[str, Any]:
        rec: dict[str, Any] = {"variant": vname, "what": what, "part": part,
                               "over": {kk: v for kk, v in params.items() if auto.get(kk) != v}, "status": "ok"}
        t0 = time.perf_counter()
        try:
            key = KernelKey.make(auto_key.op, auto_key.template, auto_key.name, params)
            load_kernel(key)
            fparams = fam.make_params(shape, dtype, dev, runner._gen(dev, a.seed))
            call = specialise.build_call(fam, key, fparams, ref_shapes)
            run = specialise._fwd_bwd(fam, call, fparams)
            act = fam.make_act(shape, dtype, dev, runner._gen(dev, a.seed + 1))
            dys = fam.make_dys(shape, dtype, dev, runner._gen(dev, a.seed + 2))
            want = list(ref_outs) + [ref_grads[nm] for nm in names]
            labels = [f"out:{o}" for o in fam.out_names[:len(ref_outs)]] + [f"grad:{nm}" for nm in names]
            errs = [0.0] * len(want)
            for _ in range(3 if params.get("dw_reduce") == "atomic" else 1):    # a race moves between runs
                outs, grads = run(act, dys)
                got = [o.detach() for o in outs] + [None if g is None else g.detach() for g in grads]
                errs = [max(e, float("inf") if g is None else runner.rel_err(g, w)) for e, g, w in zip(errs, got, want)]
                del outs, grads, got
            rec["errs"] = dict(zip(labels, errs))
            rec["err"] = max(errs)
            rec["tol"] = runner.TOL[dtype]
            rec["correct"] = bool(rec["err"] <= rec["tol"])
            # Rounding sets these errors (the same for every variant of one function): a variant clearly
            # worse than the shipped kernel is suspect even under the bar -- e.g. a dW that lost one
            # program's share (1/528 at 16384x1024 on an H200) to a race.
            worse = [lb for lb, e in rec["errs"].items() if base_errs and e > 1.25 * base_errs.get(lb, e) + 1e-4]
            if worse:
                rec["correct"] = False
                rec["worse_than_default"] = worse
            if vname == "default":
                base_errs.update(rec["errs"])
            del act, dys
            n_out = len(fam.out_names)
            fwd = [(lambda s=s: call(*[s[0][nm] for nm in fam.act_names])[:n_out]) for s in sets]
            fb = [(lambda s=s: run(*s)) for s in sets]
            tf = _time(fwd, dev, a.target_ms)
            tfb = _time(fb, dev, a.target_ms)
            rec.update(fwd_ms=tf.ms, fwd_bwd_ms=tfb.ms, bwd_ms=max(0.0, tfb.ms - tf.ms), method=tfb.method,
                       spread_fwd_bwd=[tfb.p20, tfb.p80], reps=tfb.reps)
            fl = doc.get("floor_ms")
            if fl:
                rec["pct_of_floor"] = {m: 100.0 * fl[m] / rec[f"{m}_ms"] for m in ("fwd", "bwd", "fwd_bwd")
                                       if rec.get(f"{m}_ms")}
            rec["gbps_fwd_bwd"] = nb["fwd_bwd"] / (tfb.ms * 1e-3) / 1e9
        except Exception as e:
            rec.update(status="error", error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300],
                       traceback=traceback.format_exc(limit=6)[-2000:])
            runner._check_context(ctx)
        rec["unit_s"] = time.perf_counter() - t0
        runner._cleanup(dev)
        return rec

    for v in variants:
        if a.only and v.name not in a.only and v.name != "default":
            continue
        if time.perf_counter() + EST_S > t_end:
            doc["rows"].append({"variant": v.name, "what": v.what, "part": v.part, "status": "skipped (budget)"})
            continue
        params = v.params(auto, shape)
        over = {kk: val for kk, val in params.items() if auto.get(kk) != val}
        same = next((r["variant"] for r in doc["rows"] if r.get("over") == over and r["status"] == "ok"), None)
        if same is not None:     # e.g. a launch shape the planner already picks at this size
            doc["rows"].append({"variant": v.name, "what": v.what, "part": v.part, "over": over,
                                "status": f"same kernel as {same}"})
            continue
        doc["rows"].append(measure(v.name, params, v.what, v.part))
        _log(a, f"{name} {doc['rows'][-1]['variant']}: {_brief(doc['rows'][-1])}")

    ok = [r for r in doc["rows"] if r.get("correct") and r.get("fwd_bwd_ms")]
    if name in FWD_KEYS and ok and time.perf_counter() + EST_S <= t_end:
        # the best forward launch with the best backward scheme (separate kernels: their times add)
        best_f = min((r for r in ok if r["part"] in ("fwd", "both")), key=lambda r: r["fwd_ms"], default=None)
        best_b = min((r for r in ok if r["part"] in ("bwd", "both")), key=lambda r: r["bwd_ms"], default=None)
        if best_f and best_b and best_f is not best_b:
            fwd_keys = FWD_KEYS[name]
            params = {**auto, **best_b["over"], **{kk: v for kk, v in best_f["over"].items() if kk in fwd_keys}}
            over = {kk: v for kk, v in params.items() if auto.get(kk) != v}
            if all(r.get("over") != over for r in doc["rows"] if r["status"] == "ok"):   # a new kernel
                doc["rows"].append(measure("combo", params, f"fwd of {best_f['variant']} + bwd of {best_b['variant']}",
                                           "both"))
                _log(a, f"{name} combo: {_brief(doc['rows'][-1])}")

    if a.compile == "yes" or (a.compile == "auto" and cuda and time.perf_counter() + 25 <= t_end):
        doc["compile"] = _peer_compile(fam, shape, sets, a, ctx)
        _log(a, f"{name} torch.compile: {doc['compile']}")
    ok = [r for r in doc["rows"] if r.get("correct") and r.get("fwd_bwd_ms")]
    if ok:
        w = min(ok, key=lambda r: r["fwd_bwd_ms"])
        base = next((r for r in ok if r["variant"] == "default"), None)
        doc["winner"] = {"variant": w["variant"], "over": w["over"], "fwd_bwd_ms": w["fwd_bwd_ms"],
                         "vs_default": (w["fwd_bwd_ms"] / base["fwd_bwd_ms"]) if base else None}
    doc["bad"] = [r["variant"] for r in doc["rows"] if r.get("correct") is False]
    del sets
    runner._cleanup(dev)
    return doc


def _peer_compile(fam, shape, sets, a, ctx) -> dict[str, Any]:
    import torch

    from patchdsl.bench import runner

    try:
        torch._dynamo.reset()
        params = fam.make_params(shape, a.dtype, a.device, runner._gen(a.device, a.seed))
        fn = torch.compile(fam.hf(params, shape), dynamic=False)
        leaves = lambda act: [act[nm] for nm in fam.act_grad] + [params[nm] for nm in fam.param_grad]  # noqa: E731

        def fb(act, dys):
            outs = fn(*[act[nm] for nm in fam.act_names])
            outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
            return torch.autograd.grad(list(outs[:len(dys)]), leaves(act), dys, allow_unused=True)

        t0 = time.perf_counter()
        fb(*sets[0])
        warm = time.perf_counter() - t0
        tf = _time([(lambda s=s: fn(*[s[0][nm] for nm in fam.act_names])) for s in sets], a.device, a.target_ms)
        tfb = _time([(lambda s=s: fb(*s)) for s in sets], a.device, a.target_ms)
        return {"fwd_ms": tf.ms, "fwd_bwd_ms": tfb.ms, "bwd_ms": max(0.0, tfb.ms - tf.ms), "compile_s": warm,
                "method": tfb.method}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}
    finally:
        torch._dynamo.reset()
        runner._cleanup(a.device)


# ----------------------------------------------------------------------------- report
def _brief(r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "") + (": " + r["error"] if r.get("error") else "")
    return (f"fwd {r['fwd_ms'] * 1e3:.1f} us, bwd {r['bwd_ms'] * 1e3:.1f} us, fwd+bwd {r['fwd_bwd_ms'] * 1e3:.1f} us, "
            f"err {r['err']:.1e}{'' if r['correct'] else ' WRONG'}{_worse(r)}")


def _worse(r: dict) -> str:
    w = r.get("worse_than_default")
    return f" (worse than default: {', '.join(w)})" if w else ""


def table(doc: dict) -> str:
    lines = [f"== {doc['op']} {doc['label']} ({doc['rule']}); {doc['rotations']} rotating input set(s)"]
    fl = doc.get("floor_ms")
    if fl:
        lines.append(f"   floor from the op's own read:write mixes: fwd {fl['fwd'] * 1e3:.1f} us, bwd {fl['bwd'] * 1e3:.1f} us, "
                     f"fwd+bwd {fl['fwd_bwd'] * 1e3:.1f} us")
    lines.append(f"   {'variant':26s} {'fwd us':>8s} {'bwd us':>8s} {'f+b us':>8s} {'GB/s':>6s} {'%floor':>6s} {'err':>8s}  what")
    base = next((r for r in doc["rows"] if r["variant"] == "default" and r.get("fwd_bwd_ms")), None)
    for r in doc["rows"]:
        if not r.get("fwd_bwd_ms"):
            lines.append(f"   {r['variant']:26s} {r['status'][:60]}{': ' + r['error'][:80] if r.get('error') else ''}")
            continue
        pf = r.get("pct_of_floor", {}).get("fwd_bwd")
        rel = f" ({r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.3f}x)" if base and r is not base else ""
        lines.append(f"   {r['variant']:26s} {r['fwd_ms'] * 1e3:8.1f} {r['bwd_ms'] * 1e3:8.1f} {r['fwd_bwd_ms'] * 1e3:8.1f} "
                     f"{r['gbps_fwd_bwd']:6.0f} {pf if pf is not None else float('nan'):6.1f} {r['err']:8.1e}"
                     f"{'' if r['correct'] else ' WRONG'}{_worse(r)}  {r['what']}{rel}")
    c = doc.get("compile")
    if c:
        lines.append(f"   {'torch.compile':26s} " + (f"{c['fwd_ms'] * 1e3:8.1f} {c['bwd_ms'] * 1e3:8.1f} {c['fwd_bwd_ms'] * 1e3:8.1f}"
                                                     f"  (compiled in {c['compile_s']:.0f} s)" if "fwd_ms" in c else c["error"]))
    w = doc.get("winner")
    if w:
        vs = f", {w['vs_default']:.3f}x the default" if w.get("vs_default") else ""
        cmp_ = doc.get("compile", {}).get("fwd_bwd_ms")
        vc = f", {w['fwd_bwd_ms'] / cmp_:.3f}x torch.compile" if cmp_ else ""
        lines.append(f"   WINNER {doc['op']}: {w['variant']} {w['over']} at {w['fwd_bwd_ms'] * 1e3:.1f} us{vs}{vc}")
    if doc.get("bad"):
        lines.append(f"   WRONG NUMBERS: {', '.join(doc['bad'])}")
    return "\n".join(lines)


def _log(a, msg: str) -> None:
    if not a.quiet:
        print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


_T0 = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="rmsnorm,geglu,swiglu", help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--only", default="", help="comma-separated variant names (default is always run)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--tiny", action="store_true", help="the families' tiny shapes (CPU smoke test)")
    p.add_argument("--budget-s", type=float, default=80.0, help="stop starting variants after this many seconds")
    p.add_argument("--target-ms", type=float, default=40.0, help="replay time per measurement")
    p.add_argument("--compile", dest="compile", default="auto", choices=("auto", "yes", "no"),
                   help="time torch.compile of the HF function too (auto: on a GPU when the budget leaves 25 s)")
    p.add_argument("--out", default=None, help="folder for kern_sweep.json / .txt (default $PART_OUT or bench/results/kern_sweep)")
    p.add_argument("--no-floors", dest="floors", action="store_false", help="skip the copy/add/rw32 floors")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    global _T0
    _T0 = time.perf_counter()
    t_end = _T0 + a.budget_s

    import torch

    from patchdsl.bench import runner, timing
    from patchdsl.codegen import ensure_triton, target

    ensure_triton()
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.only = {s for s in a.only.split(",") if s}
    ops = [o for o in a.ops.split(",") if o]
    unknown = [o for o in ops if o not in VARIANTS]
    if unknown:
        p.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    ctx = runner.Context(runner.Options(device=a.device, dtype=a.dtype, seed=a.seed, quiet=True))
    cuda = timing.is_cuda(a.device)
    if cuda:
        idx = timing.device_index(a.device)
        torch.cuda.set_device(idx)
        ctx.l2_bytes = int(getattr(torch.cuda.get_device_properties(idx), "L2_cache_size", 0) or (60 << 20))
    out_dir = Path(a.out or os.environ.get("PART_OUT") or ROOT / "bench/results/kern_sweep")
    out_dir.mkdir(parents=True, exist_ok=True)
    from patchdsl.bench.cases import families

    fams = families()
    doc: dict[str, Any] = {"kind": KIND, "env": runner.environment(a.device), "target": target(),
                           "options": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(a).items()},
                           "ops": [], "complete": False}
    if cuda:
        doc["env"]["gpu"] = torch.cuda.get_device_name()
    shapes = {o: (fams[FAMILY.get(o, o)].tiny[0] if a.tiny else SHAPES[o]) for o in ops}
    bad = False
    json_path, txt_path = out_dir / "kern_sweep.json", out_dir / "kern_sweep.txt"
    share = {o: SHARE[o] for o in ops}
    for i, o in enumerate(ops):
        # each op gets its share of what is left (a fast op leaves its rest to the next ones)
        left = t_end - time.perf_counter()
        op_end = time.perf_counter() + left * share[o] / sum(share[x] for x in ops[i:])
        try:
            d = run_op(o, VARIANTS[o], shapes[o], a, ctx, op_end, a.floors)
        except Exception as e:
            d = {"op": o, "error": f"{type(e).__name__}: {e}"[:300], "traceback": traceback.format_exc(limit=8)[-3000:]}
        doc["ops"].append(d)
        bad |= bool(d.get("bad")) or "error" in d
        json_path.write_text(json.dumps(doc, indent=1, default=str))
    doc["complete"] = True
    doc["wall_s"] = time.perf_counter() - _T0
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    head = [f"kern_sweep on {doc['env'].get('gpu', a.device)} ({doc['target']}, torch {doc['env']['torch']}, "
            f"triton {doc['env']['triton']}), {a.dtype}, {doc['wall_s']:.0f} s"]
    for d in doc["ops"]:
        if d.get("floors"):
            head.append(f"floors at {d['op']}'s size (GB/s, bytes read + written): " + ", ".join(
                f"{k} {v['gbps']:.0f}" for k, v in d["floors"].items() if isinstance(v, dict)))
    text = "\n".join(head + [table(d) if "rows" in d else f"== {d['op']}: ERROR {d.get('error')}" for d in doc["ops"]])
    txt_path.write_text(text + "\n")
    print(text)
    print(f"wrote {json_path} and {txt_path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

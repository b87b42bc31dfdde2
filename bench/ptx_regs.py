"""Registers, spills and global-memory instructions of fused_qk_norm_rope's kernels for sm_90, on the CPU.

    python3 bench/ptx_regs.py                                   # shipped kernels and the sweep's block variants, 16/8 heads
    python3 bench/ptx_regs.py --q-heads 32 --variants '{"b": {"bwd_layout": "block", "bwd_warps": 8}}'

What a persistent backward can keep in flight depends on how many of its programs fit on an SM at
once (64K registers per SM), which ptxas decides: this compiles each variant's kernels with
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (with the divisibility-16 hints a real launch
gets for aligned pointers and strides), then runs the triton wheel's ``ptxas -v`` on the PTX (its
``.version`` lowered to what that ptxas reads) and prints, per kernel: registers per thread,
spill bytes, programs that fit per SM (by registers; shared memory is not the limit here) and the
counts of vector / scalar global loads.  No GPU is needed; the numbers in bench/NOTES.md come from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"          # before triton is imported: compile, do not interpret
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

B, F, I = "*bf16", "*fp32", "i32"
FWD_SIG = dict(Q=B, K=B, WQ=B, WK=B, QO=B, KO=B, RSTD_Q=F, RSTD_K=F, COS=B, SIN=B, n_tokens=I, seq_len=I,
               stride_qt=I, stride_qh=I, stride_kt=I, stride_kh=I, stride_cb=I, stride_cs=I)
BWD_SIG = dict(DQO=B, DKO=B, Q=B, K=B, WQ=B, WK=B, RSTD_Q=F, RSTD_K=F, COS=B, SIN=B, DQ=B, DK=B, DWQ_PARTIAL=F,
               DWK_PARTIAL=F, n_tokens=I, seq_len=I, tokens_per_prog=I, stride_gqt=I, stride_gqh=I, stride_gkt=I,
               stride_gkh=I, stride_qt=I, stride_qh=I, stride_kt=I, stride_kh=I, stride_cb=I, stride_cs=I)
DEFAULT_VARIANTS = {
    "shipped": {},
    "bwd_t1_w4": {"bwd_layout": "block", "bwd_tokens": 1, "bwd_warps": 4},
    "bwd_t2_w4": {"bwd_layout": "block", "bwd_tokens": 2, "bwd_warps": 4},
    "bwd_t1_w8_pf": {"bwd_layout": "block", "bwd_tokens": 1, "bwd_warps": 8, "bwd_prefetch": True},
    "fwd_t2_w4": {"fwd_layout": "block", "fwd_tokens": 2, "num_warps": 4},
}
REGS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048


def ptxas_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def fits_per_sm(regs: int, warps: int) -> int:
    """Programs of ``warps`` warps at ``regs`` registers per thread that fit on one SM (allocation in
    units of 8 registers per thread)."""
    per = -(-regs // 8) * 8 * 32 * warps
    return max(0, min(REGS_PER_SM // per, MAX_THREADS_PER_SM // (32 * warps)))


def measure(q_heads: int, kv_heads: int, head_dim: int, variants: dict) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from patchdsl.codegen import KernelKey, load_kernel
    from patchdsl.ops.base import ModuleInfo
    from patchdsl.ops.registry import get_op

    op = get_op("fused_qk_norm_rope")
    facts = {"head_dim": head_dim, "rotary_dim": head_dim, "n_heads": q_heads, "n_kv_heads": kv_heads,
             "fused_qkv": False, "qk_norm": {"eps": 1e-6, "offset": 0.0, "casting": "llama"}}
    auto = op.key_params(ModuleInfo("attn", "Attn", (), {"Attention": facts}), op.default_flags(), "bf16", "cuda")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in variants.items():
            p = {**auto, **over}
            mod = load_kernel(KernelKey.make(op.name, op.template, op.kernel_name(p), p))
            for part, sig, warps in (("fwd", FWD_SIG, p["num_warps"]), ("bwd", BWD_SIG, p["bwd_warps"])):
                fn = getattr(mod, f"qk_norm_rope_{part}_{p['tag']}")
                attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
                ck = triton.compile(ASTSource(fn, sig, constexprs={}, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps})
                ptx = re.sub(r"\.version \d+\.\d+", ".version 8.0", ck.asm["ptx"])
                src = Path(tmp) / "k.ptx"
                src.write_text(ptx)
                r = subprocess.run([ptxas_path(), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                   capture_output=True, text=True)
                m = re.search(r"Used (\d+) registers", r.stderr)
                sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
                row = {"variant": name, "kernel": part, "warps": warps, "over": over,
                       "loads": dict(Counter(re.findall(r"ld\.global[a-z0-9.]*", ptx))),
                       "bar_sync": len(re.findall(r"bar\.sync", ptx))}
                if m is None:
                    row["error"] = (r.stderr or r.stdout).strip()[-500:]
                else:
                    row.update(regs=int(m.group(1)), spill_bytes=int(sp.group(1)) + int(sp.group(2)) if sp else None,
                               fit_per_sm=fits_per_sm(int(m.group(1)), warps))
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--variants", default=None, help="JSON {name: template parameter overrides}")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args(argv)
    rows = measure(a.q_heads, a.kv_heads, a.head_dim, json.loads(a.variants) if a.variants else DEFAULT_VARIANTS)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"fused_qk_norm_rope, {a.q_heads}/{a.kv_heads} heads of {a.head_dim}, bf16, sm_90")
        for r in rows:
            if "error" in r:
                print(f"  {r['variant']:16s} {r['kernel']}  ERROR {r['error']}")
                continue
            print(f"  {r['variant']:16s} {r['kernel']}  {r['warps']:2d} warps {r['regs']:3d} regs  spills {r['spill_bytes']} B  "
                  f"{r['fit_per_sm']} fit/SM  bar.sync {r['bar_sync']:3d}  loads {r['loads']}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile the cuda-target variants of a row-norm op for sm_90 without a GPU.

The Triton interpreter accepts code the GPU compiler rejects (plain Python globals read inside a
kernel, loop-carried values changing type, ...), so the CPU tests also run Triton's own compiler
on the generated cuda kernels (ptxas ships with the triton wheel).  Runs in a subprocess because
TRITON_INTERPRET is fixed when triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from patchdsl.codegen import KernelKey, render
    from patchdsl.model.info import ModuleInfo
    from patchdsl.ops.registry import get_op

    op_name, kind, cases, out = json.loads(sys.argv[1])
    PT = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
    FP32 = {"RSTD", "MEAN", "PARTIAL", "DW_PARTIAL"}
    target = GPUTarget("cuda", 90, 32)
    op = get_op(op_name)
    n = 0
    for facts, dtype in cases:
        info = ModuleInfo("m", "M", (), {kind: facts}, dtype=dtype)
        p = op.key_params(info, op.default_flags(), dtype, "cuda")
        name = op.kernel_name(p)
        path = os.path.join(out, name + ".py")
        open(path, "w").write(render(KernelKey.make(op.name, op.template, name, p)))
        spec = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        for attr, fn in vars(m).items():
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            sig, consts = {}, {}
            for a in fn.arg_names:
                if a in ("BLOCK_P", "BLOCK_C"):
                    sig[a] = "constexpr"
                    consts[a] = p["SUM_BLOCK_P"] if a == "BLOCK_P" else p["SUM_BLOCK_C"]
                elif a.isupper():
                    sig[a] = "*fp32" if a in FP32 else PT[dtype]
                else:
                    sig[a] = "i32"
            warps = p["bwd_warps"] if "_bwd_" in attr else p["num_warps"]
            triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options={"num_warps": warps})
            n += 1
    print("compiled", n)
""")


def compile_for_sm90(tmp_path, op_name: str, kind: str, cases: list) -> int:
    """Compile every @triton.jit function of each (facts, dtype) case; return how many compiled."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([op_name, kind, cases, str(tmp_path)])],
                       env=env, capture_output=True, text=True, timeout=600, cwd=root)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas in this triton installation")
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.split("compiled")[-1].split()[0])

"""Verify a spec mixing generated ops, a Liger-Kernel op and a Hub-style LOCAL kernel repository.

    python bench/mixed_verify.py [--model Qwen/Qwen3-0.6B] [--dtype bf16] [--device cuda]
                                 [--batch 2 --seq 512 --steps 1] [--error 0.0] [--json out.json]

A kernel repository laid out as on the Hub (build/torch-universal/...) is written into a temp
folder (no network), holding an RMSNorm layer (``--error E`` scales its output by 1 + E, to see
verify fail and name the sites).  The spec, written next to it::

    dtype bf16
    *.input_layernorm, *.post_attention_layernorm: RMSNorm -> hub("./hub-rmsnorm", "HubRMSNorm")
    model.norm: RMSNorm -> fused_rmsnorm
    *.self_attn: Attention -> fused_qk_norm_rope
    *.mlp: SwiGLU -> liger.swiglu
    lm_head: Linear -> fused_linear_cross_entropy

is planned (printed) and verified with ``patchdsl verify`` (HF_HUB_OFFLINE=1). Exit 0 on PASS.
Needs liger-kernel and kernels installed (``pip install 'patchdsl[hub,liger]'``) and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


LAYER = '''
import torch


class HubRMSNorm(torch.nn.Module):
    """Qwen3RMSNorm's forward as a Hub kernel layer (reads the module's weight and eps){note}."""

    def forward(self, hidden_states):
        dt = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dt) * {scale}
'''

SPEC = '''dtype {dtype}
*.input_layernorm, *.post_attention_layernorm: RMSNorm -> hub("./hub-rmsnorm", "HubRMSNorm")
model.norm: RMSNorm -> fused_rmsnorm
*.self_attn: Attention -> fused_qk_norm_rope
*.mlp: SwiGLU -> liger.swiglu
lm_head: Linear -> fused_linear_cross_entropy
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--error", type=float, default=0.0, help="relative error built into the Hub layer")
    ap.add_argument("--json", help="also write the verify report as JSON here")
    a = ap.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"          # nothing is downloaded: the kernel repository is local

    from patchdsl.ops.hub import write_kernel_repo

    with tempfile.TemporaryDirectory(prefix="patchdsl-mixed-") as tmp:
        note = "" if a.error == 0 else f", with a deliberate relative error of {a.error:g}"
        write_kernel_repo(Path(tmp) / "hub-rmsnorm", "hub-rmsnorm", LAYER.format(note=note, scale=repr(1.0 + a.error)),
                          backend="cuda" if a.device.startswith("cuda") else "cpu")
        spec = Path(tmp) / "mixed.kpatch"
        spec.write_text(SPEC.format(dtype=a.dtype))
        print(spec.read_text())

        from patchdsl.cli import main as cli

        common = [str(spec), "--model", a.model]
        try:
            cli.main(["plan", *common, "--target", "cuda" if a.device.startswith("cuda") else "interpreter"],
                     standalone_mode=False)
        except SystemExit as e:
            if e.code:
                return int(e.code)
        args = ["verify", *common, "--dtype", a.dtype, "--device", a.device, "--batch", str(a.batch),
                "--seq", str(a.seq), "--steps", str(a.steps), "--progress"]
        if a.json:
            import contextlib
            import io

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = _run(cli, args + ["--json"])
            Path(a.json).write_text(buf.getvalue())
            print(buf.getvalue()[-2000:])
            return code
        return _run(cli, args)


def _run(cli, args) -> int:
    try:
        cli.main(args, standalone_mode=False)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

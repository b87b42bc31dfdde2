#!/usr/bin/env python
"""FSDP2 training of Qwen3-0.6B's architecture, patched with specs/qwen3.kpatch vs unpatched (issue 17).

One process per GPU, NCCL, NVLink multicast off.  Random weights from the shipped config, bf16
compute with fp32 sharded parameters (FSDP2 MixedPrecisionPolicy), AdamW, the same batches for
every variant.  Prints the per-step losses side by side (judged with patchdsl verify's rule against
a float64 run), tokens/s and peak memory per GPU, and writes JSON to --out.

Two H200s (what the lead runs; ~10 minutes, most of it the float64 reference):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2 \\
        bench/fsdp2_two_gpu.py --steps 20 --batch 8 --seq 2048 --out bench/results/fsdp2_two_gpu.json

CPU smoke run (gloo, tiny model; tests/training/test_distributed.py runs this):

    torchrun --standalone --nproc-per-node 2 bench/fsdp2_two_gpu.py --device cpu --tiny --dtype fp32 \\
        --steps 2 --batch 1 --seq 8 --variants unpatched,patched

All options: ``--help`` (the logic is tools/patchdsl_tools/bench/fsdp2.py).
"""

import os
import sys

# NVLink SHARP / multicast stays off (the lent machines do not support it); set before torch loads NCCL
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

if __name__ == "__main__":
    from patchdsl_tools.bench.fsdp2 import main

    sys.exit(main())

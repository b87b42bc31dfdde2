"""Child processes of tests/training/test_distributed.py: ``python -m tests.dist_workers {accelerate,deepspeed} OUT``.

Each trains the same tiny Qwen3 (tied embeddings) unpatched and patched with the same batches and
writes the per-step losses (and what it saw of the LM head's weight) as JSON to OUT from rank 0.
Environment as torchrun sets it: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import sys

# (also imported by tests/training/test_distributed.py: never switch a GPU process over to the interpreter)
import patchdsl  # noqa: E402,F401  (its import switches the interpreter on when there is no GPU)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The qwen3 spec without its attention rule: the fused q/k-norm + RoPE kernel costs seconds per
# step in the Triton interpreter and reads its weights (q_norm, k_norm) the same way the norms do.
SPEC = """
*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm
*.mlp: SwiGLU -> fused_swiglu
lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100)
"""
MODEL = "Qwen/Qwen3-0.6B"


def tiny(seed: int = 0):
    import torch

    from patchdsl.model import load_model

    m = load_model(MODEL, dtype=torch.float32, device="cpu", weights=False, tiny=True, seed=seed,
                   attn_implementation="sdpa", log=None).model
    m.config.use_cache = False
    return m


def patch(model):
    import patchdsl

    h = patchdsl.apply(patchdsl.plan(SPEC, model, dtypes=("fp32",)), model, strict=True)
    return len(h.patched)


def batches(n: int, rank: int, vocab: int, batch: int = 1, seq: int = 8):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


class HeadShapes:
    """Records the lm_head weight shape that the generated fused loss receives."""

    def __init__(self):
        from patchdsl_tools.bench.fsdp2 import HeadRecorder

        self.rec = HeadRecorder()
        self.rec.install()

    @property
    def shapes(self):
        return self.rec.shapes


# ---------------------------------------------------------------- accelerate
def _accelerator(**kw):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kw)


def accelerate_main(out: str) -> None:
    """(1) Accelerator.prepare with no plugin (DDP over gloo on the CPU) and gradient accumulation;
    (2) with the FSDP2 plugin (fsdp_version=2).  accelerate enables FSDP only on accelerators: on the
    CPU it keeps DistributedType.MULTI_CPU and wraps with DDP, ignoring the plugin.  To run its FSDP2
    code (fsdp2_prepare_model: auto-wrap by _no_split_modules, fully_shard, state-dict reload) on the
    CPU the state's distributed_type is set to FSDP after construction."""
    import torch
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    res: dict = {"ddp": {}, "fsdp2": {}}
    rank = int(os.environ["RANK"])
    for variant in ("unpatched", "patched"):
        # -- plain prepare, gradient accumulation over 2 micro-batches, 2 optimizer steps
        acc = _accelerator(gradient_accumulation_steps=2)
        model = tiny()
        n = patch(model) if variant == "patched" else 0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        losses = []
        for ids in batches(4, rank, model.module.config.vocab_size if hasattr(model, "module") else 512):
            with acc.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), reduction="mean").item())
        res["ddp"][variant] = {"losses": losses, "patched": n, "distributed_type": str(acc.distributed_type),
                               "wrapper": type(model).__name__}
        # -- the FSDP2 plugin
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                                auto_wrap_policy="transformer_based_wrap",
                                                cpu_ram_efficient_loading=False)
        acc = _accelerator(fsdp_plugin=plugin)
        native = str(acc.distributed_type)
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        model = tiny()
        n = patch(model) if variant == "patched" else 0
        shapes = HeadShapes() if variant == "patched" else None
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses = []
        for ids in batches(3, rank, model.config.vocab_size):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), reduction="mean").item())
        sharded = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")]
        res["fsdp2"][variant] = {"losses": losses, "patched": n, "native_distributed_type": native,
                                 "fsdp_units": sharded, "vocab_hidden": [model.config.vocab_size, model.config.hidden_size],
                                 "head_weight_shapes": shapes.shapes if shapes else None}
        if shapes:
            shapes.rec.remove()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- deepspeed
def deepspeed_main(out: str) -> None:
    """A ZeRO-3 engine on one CPU process (gloo), every parameter partitioned (persistence threshold 0)."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # the CPU accelerator JIT-builds a shared-memory all-reduce (C++, a minute on two cores) that a
    # one-process gloo group never uses
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    res: dict = {"deepspeed": deepspeed.__version__}
    for variant in ("unpatched", "patched"):
        model = tiny()
        n = patch(model) if variant == "patched" else 0
        shapes = HeadShapes() if variant == "patched" else None
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        w = model.lm_head.weight
        partition = [list(w.shape), list(w.ds_shape), str(w.ds_status)]
        losses = []
        for ids in batches(3, 0, model.config.vocab_size):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        res[variant] = {"losses": losses, "patched": n, "partition_at_rest": partition,
                        "head_weight_shapes": shapes.shapes if shapes else None}
        if shapes:
            shapes.rec.remove()
        engine.destroy()
    with open(out, "w") as f:
        json.dump(res, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    {"accelerate": accelerate_main, "deepspeed": deepspeed_main}[sys.argv[1]](sys.argv[2])

"""Train a tensor-parallel (optionally sequence-parallel) Llama patched with patchdsl's kernels.

    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py            # TP over 2 CPU processes
    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py --sp       # + sequence parallelism
    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py --cuda     # on 2 GPUs (NCCL)

Offline: the model is Llama's architecture shrunk to 2 layers (hidden 64, 4 heads) with random weights,
the batches are random tokens.  The order is the point: parallelise first (parallelize_module, or
from_pretrained(..., tp_plan="auto")), then patchdsl.apply, which reads each site's DTensor placements and
specialises its kernels for what this rank holds.  Each rank prints the layout its sites run on; rank 0
prints the losses (the same on every rank).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from transformers import AutoModelForCausalLM

import patchdsl                                                          # patchdsl (1/2)
from patchdsl.model import config_from_dict, shipped_config_path, tiny_config

ap = argparse.ArgumentParser()
ap.add_argument("--sp", action="store_true", help="sequence parallelism: the norms on Shard(1)")
ap.add_argument("--cuda", action="store_true", help="NCCL on GPUs instead of gloo on the CPU")
ap.add_argument("--steps", type=int, default=3)
a = ap.parse_args()

dist.init_process_group("nccl" if a.cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if a.cuda else torch.device("cpu")
if a.cuda:
    torch.cuda.set_device(device)
mesh = init_device_mesh(device.type, (dist.get_world_size(),))

cfg = tiny_config(config_from_dict(json.loads(shipped_config_path("meta-llama/Llama-3.2-1B").read_text())))
cfg.tie_word_embeddings = False          # the colwise LM head cannot share the replicated embedding
cfg.use_cache = False
torch.manual_seed(0)                     # the same weights on every rank
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device)

# transformers' Llama layout (config.base_model_tp_plan): q/k/v, gate/up colwise; o, down rowwise;
# the LM head colwise.  With --sp the residual stream between the layers is split over the sequence.
out = Shard(1) if a.sp else Replicate()
plan = {"lm_head": ColwiseParallel(input_layouts=out, output_layouts=Replicate())}
for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    plan.update({p + n: ColwiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                    "mlp.gate_proj", "mlp.up_proj")})
    plan.update({p + n: RowwiseParallel(output_layouts=out) for n in ("self_attn.o_proj", "mlp.down_proj")})
    if a.sp:
        plan[p + "input_layernorm"] = SequenceParallel()
        plan[p + "post_attention_layernorm"] = SequenceParallel()
        plan[p + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                   desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
if a.sp:
    plan["model.layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                use_local_output=True)
    plan["model.norm"] = SequenceParallel()
parallelize_module(model, mesh, plan)

handle = patchdsl.apply("llama", model, strict=True)                     # patchdsl (2/2): after parallelising
if rank == 0:
    for site, layout in sorted(handle.placements.items()):
        print(f"{site}: {layout}")

opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(a.steps):
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=g).to(device)   # the same batch on every rank
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step + 1}: loss {loss.item():.4f}")
dist.destroy_process_group()

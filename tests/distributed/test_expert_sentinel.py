"""Expert parallelism's "not on this rank" slots, one process: a rank's experts module (transformers'
convention: ``num_experts`` = its share, slots routed to another rank's experts carry the index
``num_experts`` with weight 0, AllReduceEP's masking) patched with fused_experts gives what the eager loop
gives, forward and every gradient; and the ranks' partial outputs add up to the whole layer's."""

from __future__ import annotations

import copy

import pytest
import torch

from patchdsl.parity.compare import errors
from patchdsl.parity.tensor_parallel import tiny_config
from patchdsl.runtime.patch import patch_module


@pytest.fixture(scope="module")
def whole():
    from patchdsl.model.tiny import build, quiet

    cfg = tiny_config("qwen3_moe")
    with quiet():
        m = build(cfg)
    return m.model.layers[0].mlp.experts, cfg


def rank_share(experts, rank: int, ranks: int):
    """``experts`` as rank ``rank`` of ``ranks`` holds them (MoEParamShard's count and flag)."""
    e = copy.deepcopy(experts)
    n = experts.num_experts // ranks
    sl = slice(rank * n, (rank + 1) * n)
    e.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[sl].clone())
    e.down_proj = torch.nn.Parameter(experts.down_proj.detach()[sl].clone())
    e.num_experts = n
    e._is_expert_parallel = True
    return e


def local_routing(idx, w, rank: int, n: int, sentinel_weight: float):
    off = (idx // n) != rank
    local = torch.where(off, n, idx % n)
    return local, w.masked_fill(off, sentinel_weight)


def run(mod, x, idx, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    for p in mod.parameters():
        p.grad = None
    y = mod(x, idx, w)
    y.backward(dy)
    return [y, x.grad, w.grad, mod.gate_up_proj.grad, mod.down_proj.grad]


@pytest.mark.parametrize("ranks,sentinel_weight", [(2, 0.0), (4, 0.0), (2, 0.37)])
def test_sentinel_slots_add_nothing_as_in_the_eager_loop(whole, ranks, sentinel_weight):
    experts, cfg = whole
    g = torch.Generator().manual_seed(ranks)
    T, k, E = 11, cfg.num_experts_per_tok, cfg.num_experts
    x = torch.randn(T, cfg.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    dy = torch.randn(T, cfg.hidden_size, generator=g)
    total = torch.zeros_like(x)
    for rank in range(ranks):
        share = rank_share(experts, rank, ranks)
        li, lw = local_routing(idx, w, rank, E // ranks, sentinel_weight)
        ref = run(copy.deepcopy(share).double(), x.double(), li, lw.double(), dy.double())
        eager = run(copy.deepcopy(share), x, li, lw, dy)
        fused_mod = copy.deepcopy(share)
        patch_module(fused_mod, "fused_experts")
        fused = run(fused_mod, x, li, lw, dy)
        for name, f, e, r in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), fused, eager, ref):
            ef, ee = errors(f, r), errors(e, r)
            assert ef.rel_fro <= 4 * ee.rel_fro + 1e-5, (rank, name, ef.rel_fro, ee.rel_fro)
        total += fused[0].detach()
    full = experts(x, idx, w)           # the whole layer, every expert: the ranks' outputs add up to it
    assert errors(total, full.detach()).rel_fro <= 1e-5


def test_a_sentinel_that_is_not_skipped_would_be_seen():
    """Must fail: the same slots routed to a real expert (index 0 instead of the sentinel) change the output,
    so the equalities above are not vacuous."""
    from patchdsl.model.tiny import build, quiet

    cfg = tiny_config("qwen3_moe")
    with quiet():
        m = build(cfg)
    share = rank_share(m.model.layers[0].mlp.experts, 0, 2)
    patch_module(share, "fused_experts")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    idx = torch.tensor([[0, 2], [2, 1], [1, 2], [2, 0], [0, 1]])
    w = torch.rand(5, 2, generator=g)
    skipped = share(x, idx, w)
    wrong = share(x, torch.where(idx == 2, 0, idx), w)
    assert errors(wrong, skipped).rel_fro > 1e-2

"""An MLP with dropout: Seed-OSS's ``F.dropout(down_proj(...), p=self.residual_dropout, training=self.training)``
is reproduced by fused_swiglu (the same call at the same place: the same mask under the same seed); a
dropout elsewhere is refused with that reason, not "does not compute down_proj(silu(gate) * up)"."""

from __future__ import annotations


import pytest
import torch

from patchdsl.runtime import PatchError, patch_module

from .helpers import rel_err, tiny_family


def _seed_oss():
    return tiny_family("seed_oss")


@pytest.mark.parametrize("seed", [0, 1])
def test_seed_oss_mlp_dropout_is_reproduced_in_training(seed):
    mlp = _seed_oss().model.layers[0].mlp.train()
    assert mlp.residual_dropout == 0.1
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, mlp.hidden_size, generator=g)
    dy = torch.randn(2, 5, mlp.hidden_size, generator=g)

    def run(m, dt):
        xx = x.to(dt).clone().requires_grad_(True)
        torch.manual_seed(100 + seed)
        y = m(xx)
        y.backward(dy.to(dt))
        return y.detach().double(), xx.grad.double()

    import copy
    ref = run(copy.deepcopy(mlp).double(), torch.float64)
    hf = run(copy.deepcopy(mlp), torch.float32)
    h = patch_module(mlp, "fused_swiglu")
    got = run(mlp, torch.float32)
    h.undo()
    assert torch.equal(got[0] == 0, ref[0] == 0), "the same dropout mask under the same seed"
    for a, b, r in zip(hf, got, ref):
        assert rel_err(b, r) <= max(4 * rel_err(a, r), 1e-6)


def test_dropping_the_dropout_would_be_wrong():
    """The case that must fail: the MLP patched as if it had no output dropout differs in training mode."""
    from patchdsl.ops.swiglu import _NoDropout
    from patchdsl.model.index import build_index
    from patchdsl.ops.registry import get_op

    m = _seed_oss()
    mlp = m.model.layers[0].mlp.train()
    info = build_index(m).get("model.layers.0.mlp")
    op = get_op("fused_swiglu")
    from patchdsl.codegen import load_kernel
    from patchdsl.planning.planner import plan

    p = plan("dtype fp32\nmodel.layers.0.mlp: SwiGLU -> fused_swiglu\n", m)
    kern = load_kernel(p.sites[0].keys[0])
    plain = op.make_forward(_NoDropout(mlp), lambda dt: kern, p.sites[0].flag_dict, info)
    x = torch.randn(2, 5, mlp.hidden_size)
    torch.manual_seed(3)
    want = mlp(x)
    torch.manual_seed(3)
    bad = plain(mlp, x)
    assert not torch.allclose(bad, want, atol=1e-3)


def test_dropout_elsewhere_is_refused_with_the_true_reason():
    from transformers.models.llama.modeling_llama import LlamaMLP

    class DropMidMLP(LlamaMLP):
        def forward(self, x):
            return self.down_proj(torch.nn.functional.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x),
                                                             p=0.2, training=self.training))

    from transformers import LlamaConfig

    mlp = DropMidMLP(LlamaConfig(hidden_size=32, intermediate_size=48))
    with pytest.raises(PatchError, match="random there \(dropout with p > 0"):
        patch_module(mlp, "fused_swiglu")

"""Nemotron's LayerNorm1P (``F.layer_norm(x, ..., weight + 1, bias)``): recognised as a LayerNorm with
offset 1 and patched by fused_layernorm, judged against float64."""

from __future__ import annotations


import pytest
import torch

from patchdsl.model.index import build_index
from patchdsl.runtime import patch_module

from .helpers import assert_no_worse_than_module, tiny_family


def _nemotron(seed=0):
    return tiny_family("nemotron", seed)


def test_layernorm1p_is_a_layernorm_with_offset_1_and_plain_layernorm_has_none():
    m = _nemotron()
    f = build_index(m).get("model.norm").kinds["LayerNorm"]
    assert f["offset"] == 1.0 and f["bias"] is True
    plain = build_index(torch.nn.Sequential(torch.nn.LayerNorm(32))).get("0").kinds["LayerNorm"]
    assert "offset" not in plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_patched_layernorm1p_matches_float64(dtype, seed):
    m = _nemotron()
    norm = m.model.norm
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.3)
        norm.bias.copy_(torch.randn(norm.bias.shape, generator=g) * 0.3)
    x = torch.randn(3, 5, norm.weight.shape[0], generator=g)
    dy = torch.randn(x.shape, generator=g)

    def run(mod, dt):
        mod = mod.to(dt)
        xx = x.to(dt).clone().requires_grad_(True)
        y = mod(xx)
        y.backward(dy.to(dt))
        out = (y.detach().double(), xx.grad.double(), mod.weight.grad.double(), mod.bias.grad.double())
        mod.weight.grad = mod.bias.grad = None
        return out

    import copy
    ref = run(copy.deepcopy(norm), torch.float64)
    hf = run(copy.deepcopy(norm), dtype)
    pn = copy.deepcopy(norm).to(dtype)
    h = patch_module(pn, "fused_layernorm")
    got = run(pn, dtype)
    h.undo()
    assert_no_worse_than_module(("y", "dx", "dw", "db"), ref, hf, got, dtype)


def test_forcing_offset_0_on_layernorm1p_is_wrong():
    """The case that must fail: the plain LayerNorm arithmetic (offset 0) on a LayerNorm1P."""
    m = _nemotron()
    norm = m.model.norm
    x = torch.randn(2, 4, norm.weight.shape[0])
    with torch.no_grad():
        want = norm(x)
        h = patch_module(norm, "fused_layernorm", offset=0.0)
        bad = norm(x)
        h.undo()
        h = patch_module(norm, "fused_layernorm")
        good = norm(x)
        h.undo()
    assert torch.allclose(good, want, atol=1e-5)
    assert not torch.allclose(bad, want, atol=1e-2)

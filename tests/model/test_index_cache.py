"""build_index probes modules alike once (by model.index.structure_key) and records what probing each would.

The cache made DeepSeek-V3's default config indexable in seconds on the meta device (its 58 routers
were probed at their real widths one by one, a minute); it must never give a module another's facts.
"""

from __future__ import annotations

import pytest
import torch

from patchdsl.model.index import build_index, module_info, structure_key

# families whose layers differ by layer type, MoE or not, per-layer rope, linear attention, sliding windows
FAMILIES = ["gemma3_text", "qwen3_5_moe", "deepseek_v3", "smollm3", "gpt_oss", "olmo2"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cached_index_equals_probing_every_module(model_type):
    from transformers import AutoModelForCausalLM

    from patchdsl.model.tiny import quiet, tiny_family_config

    with quiet(), torch.device("meta"):
        m = AutoModelForCausalLM.from_config(tiny_family_config(model_type))
    idx = build_index(m)
    for path, mod in m.named_modules():
        assert idx.infos[path].kinds == module_info(mod, path).kinds, path


def test_modules_that_differ_in_what_a_probe_reads_do_not_share_a_key():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    a, b = LlamaRMSNorm(16, eps=1e-5), LlamaRMSNorm(16, eps=1e-5)
    assert structure_key(a) == structure_key(b)
    assert structure_key(a) != structure_key(LlamaRMSNorm(16, eps=1e-6))        # an attribute
    assert structure_key(a) != structure_key(LlamaRMSNorm(32, eps=1e-5))        # a weight's shape
    assert structure_key(a) != structure_key(LlamaRMSNorm(16, eps=1e-5).to(torch.bfloat16))   # its dtype
    c = LlamaRMSNorm(16, eps=1e-5)
    c.layer_idx = 3
    assert structure_key(a) != structure_key(c)

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    assert structure_key(Wrap(a)) == structure_key(Wrap(b)) != structure_key(Wrap(c))      # children count
    # one model holding both: each gets its own facts
    net = torch.nn.ModuleDict({"a": LlamaRMSNorm(16, eps=1e-5), "b": LlamaRMSNorm(16, eps=1e-6)})
    idx = build_index(net)
    assert idx.infos["a"].kinds["RMSNorm"]["eps"] == 1e-5 and idx.infos["b"].kinds["RMSNorm"]["eps"] == 1e-6

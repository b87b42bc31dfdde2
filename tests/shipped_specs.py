"""Every shipped spec (``specs/*.kpatch``) -> a zero-argument builder of a tiny model of its family (fp32,
CPU, random weights): the one map the tests that run every shipped spec share (the spec x dtype verify
table, tests/planning/test_shipped_specs.py; the default Trainer, tests/training/test_trainer_defaults.py)."""

from __future__ import annotations

from patchdsl.util.resources import specs_dir

from .families import FAMILIES, tiny_model
from .kernels.helpers import tiny_family as family_model
from .model_families.test_family_specs import FAMILY_SPECS
from .model_families.test_vision_language import VLM_SPECS, vlm_model
from .moe_families import MOE_FAMILIES, tiny_moe_model

SHIPPED = sorted(p.stem for p in specs_dir().glob("*.kpatch"))


def _builders() -> dict:
    out = {f: (lambda f=f: tiny_model(f)) for f in FAMILIES}
    out.update({spec: (lambda f=f: tiny_moe_model(f)) for f, (_, _, spec) in MOE_FAMILIES.items() if spec})
    out.update({spec: (lambda t=t: family_model(t)) for spec, t in FAMILY_SPECS.items()})
    # the multimodal specs on their ...ForConditionalGeneration (gemma3 keeps its text model above: the
    # spec covers both, and tests/model_families/test_vision_language.py runs it on the multimodal one)
    out.update({spec: (lambda t=t: vlm_model(t)) for spec, t in VLM_SPECS.items() if spec not in out})
    return out


BUILDERS = _builders()

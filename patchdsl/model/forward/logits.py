"""The scalings a causal LM's forward applies to its logits, from the CausalLM facts (and a loss op's
``softcap`` flag): a divisor (Granite's logits_scaling), a multiplier (Cohere's logit_scale, Falcon-H1's
lm_head_multiplier), a softcap (Gemma's final_logit_softcapping)."""

from __future__ import annotations

from typing import Any, Mapping


def resolve_scaling(facts: Mapping[str, Any]) -> float | None:
    """The divisor of the logits the forward applies (Granite's logits_scaling); None when absent or 1."""
    v = facts.get("logits_scaling") if facts else None
    if v is None or float(v) == 1.0:
        return None
    return float(v)


def resolve_multiplier(facts: Mapping[str, Any]) -> float | None:
    """The multiplier of the logits the forward applies (Cohere's logit_scale, Falcon-H1's
    lm_head_multiplier); None when absent or 1."""
    v = facts.get("logit_multiplier") if facts else None
    if v is None or float(v) == 1.0:
        return None
    return float(v)


def transforms_logits(facts: Mapping[str, Any]) -> str | None:
    """What the model's forward does to its logits per the CausalLM facts (for the refusals of ops
    that take the logits as they are), or None when nothing."""
    parts = []
    if facts and facts.get("softcap"):
        parts.append(f"softcapping {facts['softcap']:g}")
    if resolve_multiplier(facts):
        parts.append(f"a multiplier {facts['logit_multiplier']:g}")
    if resolve_scaling(facts):
        parts.append(f"a divisor {facts['logits_scaling']:g}")
    return " and ".join(parts) or None


def resolve_softcap(flags: Mapping[str, Any], facts: Mapping[str, Any]) -> float | None:
    """softcap flag: auto = the config's final_logit_softcapping, none = off, a number = that."""
    v = flags.get("softcap", "auto")
    if v == "auto":
        v = facts.get("softcap") if facts else None
    if v is None or v == 0:
        return None
    return float(v)

"""Integrations that sit on top of the pipeline (they only call its public stages)."""

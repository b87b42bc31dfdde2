"""Tensor, sequence and expert parallelism (PyTorch DTensor): the one place that knows about them.

A patched model under ``parallelize_module`` (ColwiseParallel / RowwiseParallel / SequenceParallel),
transformers' ``tp_plan`` layouts or FSDP2 + TP on a 2-D mesh holds DTensor parameters.  At apply
time (never per call) :func:`site_layout` reads the placements of a site's parameters and names the
layout the site will see (:data:`PLACEMENTS`); every op declares the layouts it accepts
(``Op.placements``), and :func:`placement_reason` refuses the others with the reason.  An accepted
site's facts are made local (:func:`localise`: the heads, the intermediate width this rank holds),
so its kernels are specialised for what the rank computes, and :func:`wrap_installs` adds what the
layout needs around the op's forward (local tensors in and out, gradient all-reduces).  The
vocabulary-parallel fused loss is :func:`vocab_parallel_linear_cross_entropy`.

Nothing here runs on a model without DTensor parameters: apply asks :func:`has_dtensors` once.
"""

from .layout import PLACEMENTS, SiteLayout, has_dtensors, localise, placement_reason, site_layout
from .local import wrap_installs
from .vocab import vocab_parallel_linear_cross_entropy

__all__ = ["PLACEMENTS", "SiteLayout", "has_dtensors", "localise", "placement_reason", "site_layout",
           "wrap_installs", "vocab_parallel_linear_cross_entropy"]

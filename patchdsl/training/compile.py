"""torch.compile of patched models: the whole model (:func:`compile_model`) or each decoder layer
(:func:`compile_layers`, regional compile as torchtitan does).

Why not plain ``torch.compile(model)``: patchdsl's ops are opaque custom ops with fake impls
(``kernel_support/custom_ops.py``), and the graph around them is what eager runs, with one exception that
is not patchdsl's: transformers' attention-mask decisions.  Two of them read tensor data
(``find_packed_sequence_indices``: do the positions restart?; ``_ignore_causal_mask_sdpa``: is the
padding mask all ones?), so under Dynamo they answer "build a mask" (transformers 5.17-5.24 with
torch < 2.14).  The compiled model then builds a full (batch, 1, seq, seq) mask and calls SDPA with
it and ``is_causal=False``: no flash / cuDNN causal kernel, and no GQA inside SDPA, so every layer
materialises K and V repeated to all query heads (``repeat_kv``: a clone each) and saves them for
backward.  That, not the patched ops, is where the compiled step lost (bench/NOTES.md, round five);
on the CPU ``tests/training/test_compile_perf.py`` pins it.

* :func:`compile_layers` compiles each decoder layer (``layer.compile(**kw)``): the mask is built
  eagerly, outside the compiled regions, exactly as in eager; the embedding, the final norm and the
  loss head stay eager (patchdsl kernels already).  Identical layers share one compiled graph
  (parameters are graph inputs), so warm-up is one layer's compile, not the model's.
* :func:`compile_model` compiles the whole model and makes those two mask decisions give eager's
  answers inside the compiled call where they read no data: with no ``position_ids`` given, the
  positions are the model's own ``arange`` (never packed); with no padding mask, the causal skip
  depends on shapes only.  A call with a padding mask or its own positions keeps transformers'
  answer (a mask: correct, slower).  The replacements are module-level functions installed for the
  duration of each call (Dynamo guards on them, so they are the same objects every call) and
  removed after it: eager calls never see them.  Not thread-safe across concurrent calls.

Both refuse a CUDA-graph mode (``mode="reduce-overhead"`` / ``"max-autotune"``) only where it would
meet :func:`patchdsl.graph_step`, which is the CUDA graph of the whole step: ``graph_step`` checks
:func:`cudagraph_conflict` and says what to use instead.
"""

from __future__ import annotations

from typing import Any

from .eager_mask import eager_mask_decisions

COMPILE_ATTR = "_patchdsl_compile"       # on the model (and each compiled layer): how it was compiled
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


class CompileError(ValueError):
    """A compile request patchdsl cannot honour; the message says what to do instead."""


def _torch():
    import torch

    return torch


# ------------------------------------------------------------------ what to compile
def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a transformers causal LM: the ``ModuleList`` whose modules are named
    ``*DecoderLayer`` / ``*Block`` (``model.model.layers`` for Llama/Qwen/Gemma/Mistral/Phi)."""
    torch = _torch()
    best: list[Any] = []
    for _, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best):
            names = {type(x).__name__ for x in m}
            if len(names) == 1 and next(iter(names)).endswith(("DecoderLayer", "Block", "Layer")):
                best = list(m)
    return best


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    if "fullgraph" in kwargs and not isinstance(kwargs["fullgraph"], bool):
        raise CompileError(f"fullgraph must be True or False, got {kwargs['fullgraph']!r}")
    mode = kwargs.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise CompileError(f"mode must be a string or None, got {mode!r}")


def compile_layers(model: Any, **kwargs: Any) -> int:
    """Regional compile: ``layer.compile(**kwargs)`` for every decoder layer of ``model`` (in place;
    ``fullgraph=True`` by default: patchdsl's ops never break a graph).  Returns how many layers.
    The attention mask, embedding, final norm and loss head run eagerly (patchdsl kernels where the
    spec patched them).  Raises :class:`CompileError` when the model has no decoder layers."""
    _check_kwargs(kwargs)
    layers = decoder_layers(model)
    if not layers:
        raise CompileError(f"{type(model).__name__} has no ModuleList of decoder layers to compile one by one; "
                           f"compile the whole model with patchdsl.compile_model(model)")
    kwargs.setdefault("fullgraph", True)
    for layer in layers:
        layer.compile(**kwargs)
        layer.__dict__[COMPILE_ATTR] = {"regional": True, **kwargs}
    model.__dict__[COMPILE_ATTR] = {"regional": True, "layers": len(layers), **kwargs}
    return len(layers)


def compile_model(model: Any, **kwargs: Any) -> Any:
    """``torch.compile(model, **kwargs)`` with transformers' mask decisions as in eager inside each
    call (see the module docstring).  Returns the compiled module (train it, pass it to the Trainer
    or to graph_step as you would ``torch.compile``'s)."""
    _check_kwargs(kwargs)
    torch = _torch()
    compiled = torch.compile(model, **kwargs)
    dynamo_forward = compiled.forward

    def forward(*args: Any, **kw: Any) -> Any:
        with eager_mask_decisions(own_positions=kw.get("position_ids") is None):
            return dynamo_forward(*args, **kw)

    forward.__wrapped__ = dynamo_forward
    compiled.forward = forward
    info = {"regional": False, **kwargs}
    compiled.__dict__[COMPILE_ATTR] = info
    model.__dict__[COMPILE_ATTR] = info
    return compiled


def cudagraph_conflict(model: Any) -> str | None:
    """Why ``graph_step`` cannot capture ``model``'s step, if it was compiled with CUDA graphs of its
    own (a compile mode that records CUDA graphs, or Inductor's cudagraphs switch on), else None."""
    infos = [m.__dict__[COMPILE_ATTR] for m in model.modules() if COMPILE_ATTR in m.__dict__]
    modes = {i.get("mode") for i in infos} - {None}
    bad = sorted(m for m in modes if m in CUDAGRAPH_MODES)
    try:
        inductor_graphs = bool(_torch()._inductor.config.triton.cudagraphs)
    except Exception:
        inductor_graphs = False
    if not bad and not inductor_graphs:
        return None
    what = f"mode={bad[0]!r}" if bad else "torch._inductor.config.triton.cudagraphs = True"
    return (f"the model is compiled with CUDA graphs of its own ({what}); graph_step records the whole step as "
            f"one CUDA graph and cannot capture a step that replays Inductor's graphs. Compile with the default "
            f"mode or mode='max-autotune-no-cudagraphs' (patchdsl.compile_layers(model) is the tested way), or "
            f"drop graph_step and let {what} graph the model")

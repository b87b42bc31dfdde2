"""The float64 reference of ``patchdsl verify`` without a float64 copy of the whole model.

A float64 copy of an 8B model's weights and gradients is 128 GB, more than one H200 holds next
to the model under test.  This module computes the same reference one decoder layer at a time:

* **The skeleton**: a float64 copy of the causal LM *without* its decoder layers (embeddings,
  final norm, LM head, rotary tables: for an 8B model ~1 B parameters).  Its decoder-layer list
  holds proxies.
* **Streamed layers**: a proxy, called by the model's own ``forward`` like the layer it stands
  for, makes a float64 copy of that layer (from the source model), runs it under the float64
  mode without autograd, keeps only the float64 *input* of the layer and frees the copy.  In the
  backward it makes the copy again, recomputes the layer's forward from the saved input with
  autograd on, backpropagates the incoming gradient, hands each parameter's float64 gradient to
  a callback (verify compares it at once with the run under test and keeps only the numbers)
  and frees the copy: activation checkpointing where the weights too are materialised on demand.
  Gradients flow backwards layer by layer, so at most one layer's float64 copy (and its
  gradients) is alive besides the skeleton.  Nothing here depends on what a layer contains: a
  dense layer, a mixture-of-experts layer or any other module whose main input and output are
  the hidden states streams the same way.
* **Per-site references**: a float64 copy of one site's host module, made, run on the inputs
  captured (from the streamed float64 run, exactly as the whole-model path captures them) and
  freed before the next site.

:func:`choose` picks the whole-model reference when it fits (estimated from the parameter
counts, the batch and the free memory of the device), else this one.  :class:`Float64Tally`
counts the float64 parameters alive at once (both paths): the report's
``reference.float64_params_peak``.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .hooks import Capture, base_model_of, first_tensor
from ..model.memory import free_memory  # noqa: F401  (re-exported: tests patch it here)
from ..model.modules import decoder_layers
from ..util.vocab import DTYPE_BYTES
from .reference import float64_mode

MODES = ("auto", "whole", "streamed")


class VerifyError(ValueError):
    """verify cannot run as asked (bad input for this model or machine): the CLI exits 2."""


class VerifyOutOfMemory(VerifyError):
    """The device (or the host) ran out of memory during verify: the CLI exits 2 with this message."""


# ---------------------------------------------------------------- the decoder layers
def truncate_layers(model: Any, n: int):
    """Keep ``n`` decoder layers (``verify --layers N``), at least one of each layer type the model has
    (:mod:`patchdsl.model.layers`); the config follows.  Returns the
    :class:`~patchdsl.model.layers.KeptLayers` record (which original layers were kept)."""
    from ..model.layers import LayersError, keep

    try:
        return keep(model, n)
    except LayersError as e:
        raise VerifyError(str(e)) from None


# ---------------------------------------------------------------- counting float64 parameters
class Float64Tally:
    """How many float64 parameter elements are alive at once (the reference's own weights).

    ``track(module)`` registers each float64 parameter of a copy with ``weakref.finalize``; the
    count goes down when the copy is freed.  ``peak`` is the most alive at once."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _drop(self, key: int, n: int) -> None:
        self.alive -= n
        self._seen.discard(key)

    def track(self, module: Any) -> None:
        import torch

        for p in module.parameters():
            if p.dtype != torch.float64 or id(p) in self._seen:
                continue
            n = p.numel()
            self._seen.add(id(p))
            self.alive += n
            weakref.finalize(p, self._drop, id(p), n)
        self.peak = max(self.peak, self.alive)


def f64_copy(module: Any, device: Any, tally: Float64Tally | None) -> Any:
    """A float64 copy of ``module`` on ``device`` (gradients are not copied; dropout stays as set)."""
    import torch

    from .moe import eager_experts

    c = copy.deepcopy(module)
    c.to(device=device, dtype=torch.float64)
    eager_experts(c)            # MoE: a float64 copy must not go through grouped_mm (see .moe)
    for p in c.parameters():
        p.grad = None
    if tally is not None:
        tally.track(c)
    return c


# ---------------------------------------------------------------- the memory estimate
@dataclass
class Estimate:
    params: int                  # parameters of the model (tied ones once)
    layer_params: int            # of the largest decoder layer
    other_params: int            # outside the decoder layers (embeddings, head, final norm)
    n_layers: int
    whole_bytes: int             # what the whole-model reference path adds on the device
    streamed_bytes: int          # what the streamed path adds
    free_bytes: int | None       # free memory of the device (None: unknown)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        gib = 2 ** 30
        return {"params": self.params, "layer_params": self.layer_params, "other_params": self.other_params,
                "n_layers": self.n_layers, "whole_gib": round(self.whole_bytes / gib, 2),
                "streamed_gib": round(self.streamed_bytes / gib, 2),
                "free_gib": None if self.free_bytes is None else round(self.free_bytes / gib, 2)}


def _cfg_int(cfg: Any, *names: str, default: int = 0) -> int:
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return default


def estimate(model: Any, dtype_bytes: int, batch: int, seq: int, device: Any,
             base_on_device: bool = True, steps: int = 0) -> Estimate:
    """Bytes each reference path adds to the device besides the model as it sits (works on a
    meta-device model too; ``base_on_device=False``: the model is not on the device yet).
    Deliberately rough and on the safe side: weights and gradients exactly, activations from the
    config's widths.

    whole:    float64 weights + gradients of every parameter, every layer's float64
              activations, the run dtype's second copy (weights + gradients) and the patched
              copy's gradients; with ``steps``, AdamW's two states per parameter for all three
              copies (float64 for the reference: 16 bytes a parameter, as much again as its weights).
    streamed: the two copies' weights in the run dtype; then the larger of (one copy's
              gradients and activations) and (the float64 skeleton's weights and gradients,
              two float64 layers with gradients, one layer's float64 activations, the
              captured site inputs).  On a CUDA device the gradients of the runs under test
              wait on the host.
    """
    found = decoder_layers(model)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    n_layers, layer_p, in_layers = 0, 0, 0
    if found is not None:
        _, layers = found
        n_layers = len(layers)
        for lay in layers:
            k = sum(p.numel() for p in lay.parameters())
            layer_p = max(layer_p, k)
            in_layers += k
    other = max(0, total - in_layers)
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "get_text_config"):          # a vision-language model: its language tower's widths
        cfg = cfg.get_text_config()
    hidden = _cfg_int(cfg, "hidden_size", "n_embd", "d_model", default=1024)
    inter = _cfg_int(cfg, "intermediate_size", "moe_intermediate_size", "n_inner", default=4 * hidden)
    heads = _cfg_int(cfg, "num_attention_heads", "n_head", default=16)
    vocab = _cfg_int(cfg, "vocab_size", default=32000)
    tokens = batch * seq
    # float64 activations of one layer kept for its backward (eager attention's probabilities included)
    act_layer = 8 * (tokens * (24 * hidden + 6 * inter) + batch * heads * seq * seq * 3)
    act_dt = act_layer // 8 * dtype_bytes
    logits = 8 * tokens * vocab * 3 + dtype_bytes * tokens * vocab * 6
    weights = dtype_bytes * total * (1 if base_on_device else 2)   # the unpatched copy (+ the patched one)
    grads = dtype_bytes * total
    act_all = act_dt * max(1, n_layers)
    adam = (16 + 2 * 2 * dtype_bytes) * total if steps else 0        # exp_avg + exp_avg_sq of the three copies
    whole = 16 * total + act_layer * max(1, n_layers) + weights + 2 * grads + act_all + logits + adam
    # streamed: the runs under test one after the other, their gradients moved off a CUDA device
    # (to the host) as soon as they are computed; then the float64 skeleton and one layer at a time
    captures = 8 * tokens * hidden * 8 * max(1, n_layers)
    kept_grads = 0 if str(device).startswith("cuda") else 2 * grads
    streamed = weights + kept_grads + max(grads + act_all + logits // 2,
                                          16 * other + 2 * 16 * layer_p + act_layer + logits + captures)
    return Estimate(total, layer_p, other, n_layers, int(whole), int(streamed), free_memory(device))


def choose(mode: str, est: Estimate, steps: int, layers_ok: bool) -> tuple[str, str]:
    """(mode, why) for ``reference=mode`` ("auto", "whole" or "streamed")."""
    if mode not in MODES:
        raise VerifyError(f"reference must be one of {', '.join(MODES)}, got {mode!r}")
    gib = 2 ** 30
    if mode == "streamed":
        if not layers_ok:
            raise VerifyError("the streamed float64 reference needs a list of decoder layers (an nn.ModuleList); "
                              "this model has none: use the whole-model reference")
        if steps > 1:
            raise VerifyError(_STEPS_MSG)
        return "streamed", "asked for"
    if mode == "whole":
        return "whole", "asked for"
    budget = None if est.free_bytes is None else int(est.free_bytes * 0.85)
    if budget is None or est.whole_bytes <= budget or not layers_ok:
        why = ("the whole float64 model fits" if budget is not None
               else "free memory unknown") + f" (estimated {est.whole_bytes / gib:.1f} GiB)"
        return "whole", why
    if steps > 1:     # only the whole reference can train; the estimate errs on the safe side: try it
        return "whole", (f"{steps} training steps need the whole float64 model, although it may not fit "
                         f"(estimated {est.whole_bytes / gib:.0f} GiB, {budget / gib:.0f} GiB free)")
    return "streamed", (f"the whole float64 model needs ~{est.whole_bytes / gib:.0f} GiB, {budget / gib:.0f} GiB "
                        f"free; streamed needs ~{est.streamed_bytes / gib:.1f} GiB")


_STEPS_MSG = ("training steps beyond the first need the whole float64 model (its weights must train too); "
              "use --steps 0 or 1, or --layers N to verify fewer decoder layers with the whole reference")


# ---------------------------------------------------------------- the streamed reference
class _LayerFn:
    """Built lazily (torch is imported on first use): see :func:`_layer_fn`."""


def _layer_fn():
    import torch

    if getattr(_LayerFn, "fn", None) is not None:
        return _LayerFn.fn

    class StreamedLayer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, stream, idx, call):
            ctx.stream, ctx.idx, ctx.call = stream, idx, call
            ctx.save_for_backward(x)
            with torch.no_grad():
                out = stream.run_layer(idx, x, call, grad=False)
            return out

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            gx = ctx.stream.backward_layer(ctx.idx, x, ctx.call, g)
            return gx, None, None, None

    _LayerFn.fn = StreamedLayer
    return StreamedLayer


def _layer_proxy_class():
    import torch

    if getattr(_LayerFn, "proxy", None) is not None:
        return _LayerFn.proxy

    class LayerProxy(torch.nn.Module):
        """Stands in the skeleton for decoder layer ``idx``; attributes it lacks (``attention_type``,
        ``layer_idx``...) are read from the layer it stands for."""

        def __init__(self, stream, idx, src):
            super().__init__()
            object.__setattr__(self, "_stream", stream)
            object.__setattr__(self, "_src", src)
            self.idx = idx

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                src = self.__dict__.get("_src")
                if src is None:
                    raise
                return getattr(src, name)

        def forward(self, *args, **kwargs):
            loc = None
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    loc = ("arg", i)
                    break
            if loc is None and isinstance(kwargs.get("hidden_states"), torch.Tensor):
                loc = ("kw", "hidden_states")
            if loc is None:
                raise RuntimeError(f"decoder layer {self.idx} was called without hidden states")
            x = args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]]
            call = _Call(args, kwargs, loc)
            y = _layer_fn().apply(x, self.__dict__["_stream"], self.idx, call)
            if call.rest is None:
                return y
            return type(call.rest)((y, *call.rest[1:]))

    _LayerFn.proxy = LayerProxy
    return LayerProxy


@dataclass
class _Call:
    args: tuple
    kwargs: dict
    loc: tuple
    rest: Any = None          # a tuple output's structure (its first element is the hidden state)

    def with_input(self, x: Any) -> tuple[tuple, dict]:
        args, kwargs = list(self.args), dict(self.kwargs)
        if self.loc[0] == "arg":
            args[self.loc[1]] = x
        else:
            kwargs[self.loc[1]] = x
        return tuple(args), kwargs


class StreamedReference:
    """The float64 reference of a causal LM, one decoder layer at a time (see the module doc).

    ``source``: the unpatched model holding the weights the reference evaluates (any dtype; not
    modified).  ``hosts``: patched host paths -> is-causal-LM, whose inputs are captured during
    the first streamed forward (into ``self.capture.calls``, as :class:`Capture` does).
    ``on_grad(name, grad)``: called with each parameter's float64 gradient as it is computed
    (decoder layers in reverse order during the backward, the rest after it)."""

    def __init__(self, source: Any, device: Any, hosts: dict[str, bool], tally: Float64Tally,
                 log: Callable[[str], None] | None = None):
        import torch

        found = decoder_layers(source)
        if found is None:
            raise VerifyError(f"{type(source).__name__} has no list of decoder layers: it cannot be streamed")
        self.source, self.device, self.tally = source, torch.device(device), tally
        self.layers_path, self.src_layers = found
        self.say = log or (lambda m: None)
        self.on_grad: Callable[[str, Any], None] = lambda n, g: None
        for h in hosts:
            if h and (h == self.layers_path or self.layers_path.startswith(h + ".")):
                raise VerifyError(f"the patched site hosted by {h} contains every decoder layer: "
                                  f"it cannot be streamed; use the whole-model reference")
        # the skeleton: a float64 copy of everything but the decoder layers
        holder_path, _, attr = self.layers_path.rpartition(".")
        holder = source.get_submodule(holder_path) if holder_path else source
        orig = holder._modules[attr]
        holder._modules[attr] = torch.nn.ModuleList()
        try:
            self.skeleton = f64_copy(source, self.device, tally)
        finally:
            holder._modules[attr] = orig
        sk_holder = self.skeleton.get_submodule(holder_path) if holder_path else self.skeleton
        proxy = _layer_proxy_class()
        sk_holder._modules[attr] = torch.nn.ModuleList(
            [proxy(self, i, lay) for i, lay in enumerate(self.src_layers)])
        # capture: hosts outside the layers on the skeleton now, the others on each layer's copy
        prefix = self.layers_path + "."
        self.layer_hosts: dict[int, list[tuple[str, str]]] = {}
        outside = {}
        for h, is_lm in hosts.items():
            if h.startswith(prefix):
                idx_s, _, rel = h[len(prefix):].partition(".")
                self.layer_hosts.setdefault(int(idx_s), []).append((h, rel))
            else:
                outside[h] = is_lm
        self.capture = Capture(self.skeleton, outside)
        self.capturing = True
        self.layer_copies = 0

    # ---- layers
    def _layer(self, idx: int) -> Any:
        self.layer_copies += 1
        return f64_copy(self.src_layers[idx], self.device, self.tally)

    def run_layer(self, idx: int, x: Any, call: _Call, grad: bool) -> Any:
        import torch

        layer = self._layer(idx)
        handles = []
        if self.capturing:
            for full, rel in self.layer_hosts.get(idx, ()):
                if full not in self.capture.calls:
                    mod = layer.get_submodule(rel) if rel else layer
                    handles.append(mod.register_forward_pre_hook(self.capture._pre(full), with_kwargs=True))
        try:
            args, kwargs = call.with_input(x)
            with torch.set_grad_enabled(grad), float64_mode():
                out = layer(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        if isinstance(out, tuple) and not isinstance(out, torch.Tensor):
            call.rest = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out)
            out = out[0]
        del layer
        return out.detach() if not grad else out

    def backward_layer(self, idx: int, x: Any, call: _Call, g: Any) -> Any:
        import torch

        layer = self._layer(idx)
        xx = x.detach().requires_grad_(True)
        args, kwargs = call.with_input(xx)
        with torch.enable_grad(), float64_mode():
            out = layer(*args, **kwargs)
        main = out if isinstance(out, torch.Tensor) else first_tensor(out)
        named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(main, [xx] + [p for _, p in named], g, allow_unused=True)
        del out, main
        for (n, _), gr in zip(named, grads[1:]):
            self.on_grad(f"{self.layers_path}.{idx}.{n}", gr)
        gx = grads[0]
        del grads, named, layer, args, kwargs
        return gx if gx is not None else torch.zeros_like(x)

    # ---- whole-model runs
    def forward_backward(self, batch: dict[str, Any]) -> tuple[Any, Any]:
        """(loss, logits or None), float64; parameter gradients go to ``on_grad``."""
        for p in self.skeleton.parameters():
            p.grad = None
        with float64_mode():
            out = self.skeleton(**batch)
        self.capturing = False
        self.capture.remove()
        loss = out.loss if hasattr(out, "loss") else out[0]
        logits = getattr(out, "logits", None)
        logits = logits.detach() if logits is not None else None
        del out
        loss.backward()
        seen: set[int] = set()
        for n, p in self.skeleton.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            self.on_grad(n, p.grad)
            p.grad = None
        return loss.detach(), logits

    def loss(self, batch: dict[str, Any]) -> Any:
        """The float64 loss of a batch (no backward)."""
        import torch

        with torch.no_grad(), float64_mode():
            out = self.skeleton(**batch)
        return (out.loss if hasattr(out, "loss") else out[0]).detach()

    # ---- per-site copies
    @contextlib.contextmanager
    def host(self, host_path: str):
        """The float64 host module of a site: the skeleton's own (outside the layers, or the causal
        LM, whose base model run_site replaces by a stub), else a fresh copy freed on exit."""
        prefix = self.layers_path + "."
        if not host_path.startswith(prefix):
            yield (self.skeleton.get_submodule(host_path) if host_path else self.skeleton), host_path
            return
        c = f64_copy(self.source.get_submodule(host_path), self.device, self.tally)
        try:
            yield c, host_path
        finally:
            del c

    def close(self) -> None:
        self.capture.remove()
        self.skeleton = None


def build_dtype(meta_model: Any, dtype: str, batch: int, seq: int, steps: int, device: Any, reference: str,
                layers: int | None) -> str:
    """The dtype to build a model in for verify on ``device`` (the CLI's choice, from the
    meta-device model): "fp32" when the whole-model reference will be used (as on the CPU), else
    ``dtype`` (the streamed reference then evaluates the weights under test themselves, and no
    fp32 copy of an 8B model is kept beside them).  Raises VerifyError as :func:`choose` does."""
    if layers is not None:
        truncate_layers(meta_model, layers)
    size = DTYPE_BYTES[dtype]
    total = sum(p.numel() for p in {id(p): p for p in meta_model.parameters()}.values())
    est = estimate(meta_model, size, batch, seq, device, base_on_device=False, steps=steps)
    est.whole_bytes += 4 * total            # the fp32 model itself, built on the device
    mode, _ = choose(reference, est, steps, decoder_layers(meta_model) is not None)
    return "fp32" if mode == "whole" else dtype


def cpu_need(meta_model: Any, batch: int, seq: int, steps: int, reference: str, layers: int | None) -> tuple[int, str]:
    """(bytes, how) verify at full size on the CPU is estimated to take: the fp32 model it builds and
    the float64 reference :func:`choose` would pick with the memory there is (``meta_model`` is
    truncated to ``layers`` first, as :func:`build_dtype` does)."""
    if layers is not None:
        truncate_layers(meta_model, layers)
    total = sum(p.numel() for p in {id(p): p for p in meta_model.parameters()}.values())
    est = estimate(meta_model, DTYPE_BYTES["fp32"], batch, seq, "cpu", base_on_device=True, steps=steps)
    try:
        mode, _ = choose(reference, est, steps, decoder_layers(meta_model) is not None)
    except VerifyError:
        mode = "whole"
    need = 4 * total + (est.whole_bytes if mode == "whole" else est.streamed_bytes)
    return need, f"the fp32 model and the {mode} float64 reference"

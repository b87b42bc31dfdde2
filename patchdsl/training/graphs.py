"""CUDA-graph capture of a whole training step: ``patchdsl.graph_step``.

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    step = patchdsl.graph_step(model, opt, example_batch)      # warm-up + capture (a few seconds)
    for batch in loader:
        loss = step(batch)         # copy the batch in, replay forward + backward + AdamW as one graph

Why: at small batches the CPU issues a patched Qwen3-0.6B step (a few thousand kernel launches,
autograd bookkeeping, the optimizer's Python) more slowly than the GPU runs it (bench/NOTES.md:
1 x 2048 takes 60 ms per step of which the host needs 55 ms).  A replayed CUDA graph costs the host
tens of microseconds, so the step becomes GPU-bound.

What is captured, and why this design (rather than ``torch.cuda.make_graphed_callables`` for the
forward and backward with an eager optimizer): the optimizer step of a 0.6B model is itself ~300
parameters of host work (fused AdamW: one launch per dtype/device group, but Python bookkeeping per
parameter group and per call), and the eager autograd engine that ``make_graphed_callables`` keeps
around the graphed region still walks a node per parameter to accumulate gradients.  Capturing
forward, backward, optional gradient clipping and ``optimizer.step()`` in one graph removes all of
it; ``optimizer_step=False`` captures forward and backward only, for loops that must step the
optimizer themselves (the gradients are then in ``param.grad``, overwritten by every call).

How (PyTorch's "whole network capture" recipe, plus checks):

1. Static input buffers shaped like ``example_batch``; every call copies the new batch into them.
2. Warm-up iterations on a side stream (Triton compilation, cuBLAS workspaces, the optimizer's
   lazily created state).  The last one (the steady state that gets captured; one-time set-up of
   the first call is not) runs under ``torch.cuda.set_sync_debug_mode("error")``:
   an operation that synchronises with the host (``.item()``, ``nonzero``, ``if tensor:``, a
   device-to-host copy) cannot be captured, so it is refused here with the op's name and the line
   that called it, instead of failing inside the capture or, worse, capturing a value read once.
3. With ``preserve_state`` (default) the parameters, buffers, optimizer state and CUDA RNG state
   are restored after the warm-up, so the warm-up does not train the model: the graphed run's
   losses are the eager run's losses, step for step.
4. Gradients are set to ``None`` before the capture, so the captured backward writes fresh
   gradients (``zero_grad`` is part of every replay) into buffers owned by the graph; they are
   re-attached to ``param.grad`` after each call.

Refusals (:class:`GraphStepError`, each with the reason and the fix): no CUDA device or a model
not on one; an optimizer that was not built with ``capturable=True`` (its step would read its step
count on the host); an optimizer hyperparameter (``lr``...) changed after the capture (a float is
baked into the graph: use a tensor ``lr``, which LR schedulers update in place), or a tensor one
replaced by another object; gradient
checkpointing; a host synchronisation inside the step; a batch whose shapes, dtypes or keys differ
from the captured one (``on_shape_change``: ``"error"``, ``"recapture"`` or ``"eager"``); a call
that would drop the previous call's gradients (``optimizer_step=False`` accumulates nothing
across calls: accumulate inside one graph with ``micro_batch``); calling ``optimizer.step()``
yourself while the graph steps it; the model switched between train and eval mode after capture.
A model with no patchdsl patch is graphed too, with a warning (:class:`UnpatchedModelWarning`).

docs/cuda-graphs.md is the user documentation.
"""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping


# the checks before a capture and the capture's eager-like decisions live beside this module (each its own
# job); the step itself, its replay and its refusals at call time are here
from .graph_checks import (CAPTURE_ERROR_MODES, GraphStepError, SHAPE_POLICIES, UnpatchedModelWarning, _SyncSpy,
                           _batch_hint, _check_model, _check_optimizer, _check_options, _cuda_device, _hyper_change,
                           _hyper_snapshot, _is_sync_error, _op_words, _torch, _unknown_state_message, _user_frame,
                           _zero_initial_state, batch_signature, describe_signature_change, micro_slices)  # noqa: F401  (re-exported)
from .eager_mask import as_if_capturing, mask_as_in_eager


@dataclass
class _Captured:
    graph: Any
    static: dict[str, Any]            # the input buffers (tensors), or the constant values
    loss: Any
    grad_norm: Any
    grads: list[Any]                  # param.grad after the capture, in self._params order


@dataclass
class _State:
    params: list[Any]
    buffers: list[Any]
    opt: dict[int, dict[str, Any]]
    rng: Any


class GraphedStep:
    """A training step replayed from a CUDA graph; build it with :func:`graph_step`.

    ``step(batch)`` copies ``batch`` into the graph's input buffers, replays forward + backward
    (+ gradient clipping + ``optimizer.step()``), re-attaches the graph's gradient buffers to
    ``param.grad`` and returns the loss (a new 0-d tensor: keeping it across calls is safe).
    ``step.grad_norm`` is the total gradient norm of the last call when ``clip_grad_norm`` is set.
    ``step.close()`` releases the graphs and their memory and removes the optimizer hook.
    """

    def __init__(self, model: Any, optimizer: Any, example_batch: Mapping[str, Any], *, loss_fn: Callable | None,
                 optimizer_step: bool, micro_batch: int | None, clip_grad_norm: float | None, on_shape_change: str,
                 max_graphs: int, warmup: int, check_syncs: bool, preserve_state: bool,
                 capture_error_mode: str = "global"):
        self.model = model
        self.capture_error_mode = capture_error_mode
        self.optimizer = optimizer
        self.loss_fn = loss_fn or _model_loss
        self.optimizer_step = optimizer_step
        self.micro_batch = micro_batch
        self.clip_grad_norm = clip_grad_norm
        self.on_shape_change = on_shape_change
        self.max_graphs = max_graphs
        self.warmup = warmup
        self.check_syncs = check_syncs
        self.preserve_state = preserve_state
        self.device = _cuda_device(model)
        self._params = list(model.parameters())
        self._trainable = [p for p in self._params if p.requires_grad]
        self._ptrs = [p.data_ptr() for p in self._params]
        self._graphs: collections.OrderedDict[tuple, _Captured] = collections.OrderedDict()
        # hyperparameters baked into the graph: only when the graph steps the optimizer
        self._hyper = _hyper_snapshot(optimizer) if optimizer is not None and optimizer_step else None
        self._training = model.training
        self._inside = False               # our own optimizer.step() (warm-up, capture, eager fallback)
        self._pending = False              # optimizer_step=False: gradients of the last call not yet stepped
        self._grad_norm = None
        self._hooks: list[Any] = []
        self.captures = 0                  # how many graphs were captured (recaptures included)
        self.eager_calls = 0               # calls run eagerly (on_shape_change="eager")
        self.patched_sites = _patched_sites(model)
        self._signature = batch_signature(example_batch)
        self._closed = False
        self._capture(self._signature, example_batch)
        # after the capture: a refused capture leaves no hook on the optimizer
        if optimizer is not None:
            if optimizer_step:
                self._hooks.append(optimizer.register_step_pre_hook(self._outside_step_hook))
            else:
                self._hooks.append(optimizer.register_step_post_hook(self._stepped_hook))

    # -- hooks --------------------------------------------------------------------------------------
    def _outside_step_hook(self, opt, args, kwargs):
        if not self._inside:
            raise GraphStepError("optimizer.step() is part of the graphed step (graph_step(..., optimizer_step=True)): "
                                 "calling it yourself would apply a second update with the same gradients. Call "
                                 "only step(batch), or build the step with optimizer_step=False")

    def _stepped_hook(self, opt, args, kwargs):
        self._pending = False

    # -- the step -----------------------------------------------------------------------------------
    def _run(self, batch: Mapping[str, Any]) -> tuple[Any, Any]:
        """Forward, backward (over the micro-batches), clipping, optimizer step: what is captured."""
        torch = _torch()
        rows = _rows(batch)
        total = None
        for a, b in micro_slices(rows, self.micro_batch):
            sub = batch if (a, b) == (0, rows) else {k: _slice(v, a, b, rows) for k, v in batch.items()}
            loss = self.loss_fn(self.model, sub)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise GraphStepError(f"the loss must be a 0-d tensor, got "
                                     f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
            if (a, b) != (0, rows):
                loss = loss * ((b - a) / rows)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        gn = None
        if self.clip_grad_norm is not None:
            params = [p for p in self._trainable if p.grad is not None]
            gn = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm, foreach=True, error_if_nonfinite=False)
        if self.optimizer_step:
            self._inside = True
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*capturable=True.*")
                    self.optimizer.step()
            finally:
                self._inside = False
        return total, gn

    def _eager_masks(self) -> Any:
        """The attention masks of an eager step inside the capture (see :func:`mask_as_in_eager`); the
        positions are the model's own when the default loss calls ``model(**batch)`` (batches with
        ``position_ids`` are refused)."""
        return mask_as_in_eager(model_positions=self.loss_fn is _model_loss)

    def _set_grads_none(self) -> None:
        for p in self._params:
            p.grad = None

    def _capture(self, sig: tuple, batch: Mapping[str, Any]) -> _Captured:
        torch = _torch()
        static: dict[str, Any] = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                if v.device.type not in ("cuda", "cpu"):
                    raise GraphStepError(f"batch[{k!r}] is on {v.device}; give CUDA (or CPU) tensors")
                buf = torch.empty(v.shape, dtype=v.dtype, device=self.device)
                buf.copy_(v)
                static[k] = buf
            else:
                static[k] = v
        _rows(static)                                       # batch dimension agrees across tensors
        if self.preserve_state and self.optimizer_step and not _zero_initial_state(self.optimizer) and \
                any(p not in self.optimizer.state for g in self.optimizer.param_groups for p in g["params"]):
            raise GraphStepError(_unknown_state_message(self.optimizer))      # before the warm-up trains anything
        snap = self._snapshot() if self.preserve_state else None
        self._set_grads_none()
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        try:
            with torch.cuda.stream(side):
                for i in range(self.warmup):
                    if i == self.warmup - 1 and self.check_syncs:     # the steady state, as captured
                        self._checked_run(static)
                    else:
                        self._run(static)
                    self._set_grads_none()
            cur.wait_stream(side)
            torch.cuda.synchronize(self.device)
        except BaseException:
            torch.cuda.synchronize(self.device)
            self._set_grads_none()
            if snap is not None:
                self._restore(snap)
            raise
        if snap is not None:
            self._restore(snap)
        self._set_grads_none()
        try:
            g, loss, gn = self._record(static)
        except GraphStepError:
            raise
        except Exception as e:
            self._set_grads_none()
            hint = _batch_hint(static)
            why = ("The warm-up ran without a host synchronisation, so an operation that CUDA graphs do not allow "
                   if self.check_syncs else
                   "The sync check was off (check_syncs=False): a host synchronisation (.item(), nonzero, a copy to "
                   "the CPU), or an operation that CUDA graphs do not allow ")
            raise GraphStepError(f"capturing the step failed: {type(e).__name__}: {str(e).strip()[:600]}. {why}"
                                 f"(a copy from pageable host memory, a new CUDA stream or event, a CPU tensor moved "
                                 f"to the GPU inside the step) is the likely cause{hint}") from e
        cap = _Captured(g, static, loss, gn, [p.grad for p in self._params])
        self._graphs[sig] = cap
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return cap

    def _record(self, static: dict[str, Any]) -> tuple[Any, Any, Any]:
        """The capture itself (nothing runs on the GPU here): (graph, static loss, static grad norm).
        The one place that talks to ``torch.cuda.graph``; the CPU tests replace it with a stand-in."""
        torch = _torch()
        g = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            with self._eager_masks(), torch.cuda.graph(g, capture_error_mode=self.capture_error_mode):
                loss, gn = self._run(static)
        return g, loss, gn

    def _checked_run(self, static: dict[str, Any]) -> None:
        """The last warm-up iteration, with host synchronisations turned into errors; a sync is
        reported with the op that asked for it (found by running the iteration again under a
        dispatch mode that watches every op) and the line of code that called it."""
        torch = _torch()
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with as_if_capturing(), self._eager_masks():
                self._run(static)
            return
        except RuntimeError as e:
            if not _is_sync_error(e):
                raise
            where = _user_frame(e.__traceback__)
            first = e
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        op = None
        torch.cuda.synchronize(self.device)
        self._set_grads_none()
        spy = _SyncSpy()                  # the same iteration again (the caller restores the state after)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with spy, as_if_capturing(), self._eager_masks():
                self._run(static)
        except RuntimeError as e2:
            if _is_sync_error(e2):
                op = spy.op
                where = _user_frame(e2.__traceback__) or where
        except Exception:
            pass
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize(self.device)
        self._set_grads_none()
        what = _op_words(op) if op else "an operation (not an ATen op: e.g. torch.cuda.synchronize() or a CUDA event wait)"
        raise GraphStepError(
            f"the step synchronises with the host, so it cannot be captured in a CUDA graph: {what} "
            f"at {where or 'an unknown place (the backward pass or C++ code)'}. A captured graph would replay the value "
            f"read once at capture time. Remove the synchronisation from the step (keep values on the GPU){_batch_hint(static)}"
        ) from first

    # -- state --------------------------------------------------------------------------------------
    def _snapshot(self) -> _State:
        torch = _torch()
        with torch.no_grad():
            params = [p.detach().clone() for p in self._params]
            buffers = [b.detach().clone() for b in self.model.buffers()]
            opt: dict[int, dict[str, Any]] = {}
            if self.optimizer is not None:
                for p, st in self.optimizer.state.items():
                    opt[id(p)] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        return _State(params, buffers, opt, torch.cuda.get_rng_state(self.device))

    def _restore(self, s: _State) -> None:
        torch = _torch()
        with torch.no_grad():
            for p, v in zip(self._params, s.params):
                p.copy_(v)
            for b, v in zip(self.model.buffers(), s.buffers):
                b.copy_(v)
            if self.optimizer is not None:
                fresh = _zero_initial_state(self.optimizer)
                for p, st in self.optimizer.state.items():
                    old = s.opt.get(id(p))
                    if old is None:             # created by the warm-up: back to its initial value
                        if not fresh:
                            raise GraphStepError(_unknown_state_message(self.optimizer))
                        for k, v in st.items():
                            if isinstance(v, torch.Tensor):
                                v.zero_()
                            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                                st[k] = type(v)(0)
                        continue
                    for k, v in st.items():
                        if k not in old:
                            continue
                        if isinstance(v, torch.Tensor) and isinstance(old[k], torch.Tensor):
                            v.copy_(old[k])
                        else:
                            st[k] = old[k]
        torch.cuda.set_rng_state(s.rng, self.device)

    # -- calls --------------------------------------------------------------------------------------
    def __call__(self, batch: Mapping[str, Any]) -> Any:
        torch = _torch()
        if self.model.training != self._training:
            raise GraphStepError(f"the model was captured in {'train' if self._training else 'eval'} mode and is now in "
                                 f"{'train' if self.model.training else 'eval'} mode; the graph would replay the "
                                 f"captured mode. Switch back, or build a new step")
        if self._closed:
            raise GraphStepError("this graphed step was closed (step.close()); build a new one with graph_step")
        if self._hyper is not None and _hyper_snapshot(self.optimizer) != self._hyper:
            raise GraphStepError(_hyper_change(self._hyper, _hyper_snapshot(self.optimizer)))
        if [p.data_ptr() for p in self._params] != self._ptrs:
            raise GraphStepError("a parameter of the model was replaced or moved since the capture (load_state_dict("
                                 "assign=True), .to(), a resharding): the graph reads and writes the old memory. Build "
                                 "a new step (graph_step) after changing the model; load_state_dict without assign "
                                 "copies in place and is fine")
        if self._pending:
            raise GraphStepError("the gradients of the previous call were not used by an optimizer step: every call "
                                 "writes fresh gradients (the graph does not add to param.grad), so accumulating "
                                 "over calls would silently keep only the last one. Accumulate inside one graph with "
                                 "graph_step(..., micro_batch=N) on the whole batch, or step the optimizer after "
                                 "every call")
        sig = batch_signature(batch)
        cap = self._graphs.get(sig)
        if cap is None:
            change = describe_signature_change(self._signature, sig)
            if self.on_shape_change == "error":
                raise GraphStepError(f"this batch differs from the captured one ({change}); a CUDA graph replays fixed "
                                     f"shapes. Pad or drop the odd batch (e.g. DataLoader(drop_last=True), padding to a "
                                     f"fixed length), or build the step with on_shape_change='recapture' (a graph per "
                                     f"shape, up to max_graphs, each with its own activation memory) or 'eager' (run "
                                     f"such batches without a graph)")
            if self.on_shape_change == "eager":
                return self._eager(batch)
            cap = self._capture(sig, batch)
        else:
            self._graphs.move_to_end(sig)
        for k, v in batch.items():
            buf = cap.static[k]
            if isinstance(buf, torch.Tensor):
                buf.copy_(v, non_blocking=True)
        cap.graph.replay()
        for p, g in zip(self._params, cap.grads):
            if p.grad is not g:
                p.grad = g
        self._grad_norm = cap.grad_norm
        if not self.optimizer_step and self.optimizer is not None:
            self._pending = True
        return cap.loss.clone()

    def _eager(self, batch: Mapping[str, Any]) -> Any:
        torch = _torch()
        self._set_grads_none()
        moved = {k: (v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            loss, gn = self._run(moved)
        self._grad_norm = gn
        self.eager_calls += 1
        if not self.optimizer_step and self.optimizer is not None:
            self._pending = True
        return loss.clone()

    @property
    def grad_norm(self) -> Any:
        """The total gradient norm (before clipping) of the last call, with ``clip_grad_norm`` set; else None."""
        return None if self._grad_norm is None else self._grad_norm.clone()

    def memory(self) -> dict[str, int]:
        """Bytes of the graphs' private memory pools (``torch.cuda.memory_snapshot``):
        ``pool_reserved_bytes`` (all their segments) and ``pool_free_bytes`` (blocks the caching
        allocator counts as free, which every replay writes: the activations).  Between replays
        ``torch.cuda.memory_allocated`` does not count the latter, so a graphed step's real peak is
        about ``max_memory_allocated() + pool_free_bytes``."""
        torch = _torch()
        ids = {tuple(c.graph.pool()) for c in self._graphs.values()}
        reserved = free = 0
        for seg in torch.cuda.memory_snapshot():
            if tuple(seg.get("segment_pool_id", ())) in ids:
                reserved += int(seg["total_size"])
                free += sum(int(b["size"]) for b in seg.get("blocks", []) if b.get("state") != "active_allocated")
        return {"pool_reserved_bytes": reserved, "pool_free_bytes": free}

    @property
    def signatures(self) -> list[tuple]:
        """The batch signatures with a captured graph, least recently used first."""
        return list(self._graphs)

    def close(self) -> None:
        """Release the graphs (and their memory pools) and remove the optimizer hook."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._graphs.clear()
        self._set_grads_none()
        self._closed = True


# ----------------------------------------------------------------------------- helpers
def _model_loss(model: Any, batch: Mapping[str, Any]) -> Any:
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise GraphStepError("the model returned no loss: put the labels in the batch (e.g. 'labels'), or pass "
                             "loss_fn=lambda model, batch: ... returning a 0-d tensor")
    return loss


def _rows(batch: Mapping[str, Any]) -> int:
    torch = _torch()
    rows = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not rows:
        raise GraphStepError("the batch has no tensor with a batch dimension")
    n = max(rows.values())
    return n


def _slice(v: Any, a: int, b: int, rows: int) -> Any:
    torch = _torch()
    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
        return v[a:b]
    return v


def _patched_sites(model: Any) -> int:
    from ..runtime.patch import SITE_ATTR

    return sum(1 for m in model.modules() if SITE_ATTR in m.__dict__)


# ----------------------------------------------------------------------------- the public entry
def graph_step(model: Any, optimizer: Any, example_batch: Mapping[str, Any], *, loss_fn: Callable | None = None,
               optimizer_step: bool = True, micro_batch: int | None = None, clip_grad_norm: float | None = None,
               on_shape_change: str = "error", max_graphs: int = 2, warmup: int = 3, check_syncs: bool = True,
               preserve_state: bool = True, capture_error_mode: str = "global") -> GraphedStep:
    """Capture one training step of ``model`` as a CUDA graph; returns a :class:`GraphedStep`.

    ``step = graph_step(model, optimizer, example_batch)``, then ``loss = step(batch)`` per batch.

    * ``example_batch``: the keyword arguments of ``model(**batch)`` (e.g. ``input_ids`` and
      ``labels``), tensors shaped like every batch to come.  Leave ``attention_mask`` out for
      unpadded batches: transformers checks a mask on the host, which is refused.
    * ``optimizer``: built with ``capturable=True`` (``torch.optim.AdamW(..., fused=True,
      capturable=True)`` is the fast one); a learning rate that changes (an LR scheduler) must be a
      tensor.  ``optimizer_step=False`` captures forward and backward only: you step it yourself.
    * ``loss_fn(model, batch) -> 0-d tensor``: default ``model(**batch).loss``.
    * ``micro_batch``: split the batch into micro-batches of this many rows inside the graph and
      accumulate their gradients (loss = mean over micro-batches weighted by rows).
    * ``clip_grad_norm``: clip the gradients' total norm to this value inside the graph
      (``clip_grad_norm_(foreach=True)``, no host sync); ``step.grad_norm`` is the norm.
    * ``on_shape_change``: a batch with other shapes/dtypes/keys than the captured one is refused
      (``"error"``, default), captured anew (``"recapture"``: a graph per shape, the
      ``max_graphs`` most recent kept, each with its own activation memory), or run without a graph
      (``"eager"``).
    * ``warmup``: eager iterations on a side stream before the capture (>= 1); ``check_syncs``
      runs the last under ``torch.cuda.set_sync_debug_mode("error")``.
    * ``preserve_state``: restore parameters, buffers, optimizer state and the CUDA RNG after the
      warm-up, so the warm-up does not train the model (costs a copy of them in GPU memory while
      capturing).
    * ``capture_error_mode``: passed to ``torch.cuda.graph``; ``"global"`` (default) fails the
      capture when another thread makes an unsafe CUDA call meanwhile (e.g. a DataLoader's
      pin-memory thread); ``"thread_local"`` watches this thread only.

    Raises :class:`GraphStepError` with the reason when the step cannot be captured safely.
    """
    _check_options(on_shape_change, micro_batch, warmup, clip_grad_norm, max_graphs, capture_error_mode)
    for name, v in (("optimizer_step", optimizer_step), ("check_syncs", check_syncs),
                    ("preserve_state", preserve_state)):
        if not isinstance(v, bool):
            raise GraphStepError(f"{name} must be True or False, got {v!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise GraphStepError(f"loss_fn must be callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    batch_signature(example_batch)
    _check_optimizer(optimizer, optimizer_step)
    _check_model(model)
    _cuda_device(model)
    if _patched_sites(model) == 0:
        warnings.warn("graph_step: the model carries no patchdsl patch; its step is graphed as it is (this works, "
                      "but none of patchdsl's kernels are in it: apply a plan first with patchdsl.apply)",
                      UnpatchedModelWarning, stacklevel=2)
    return GraphedStep(model, optimizer, example_batch, loss_fn=loss_fn, optimizer_step=optimizer_step,
                       micro_batch=micro_batch, clip_grad_norm=clip_grad_norm, on_shape_change=on_shape_change,
                       max_graphs=max_graphs, warmup=warmup, check_syncs=check_syncs, preserve_state=preserve_state,
                       capture_error_mode=capture_error_mode)

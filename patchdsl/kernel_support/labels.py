"""Class labels of the generated loss kernels (cross entropy, linear cross entropy, linear log-probs).

What Hugging Face's unpatched loss (``torch.nn.functional.cross_entropy``) does, the kernels do:

* a label dtype other than int64 (``Long``) or uint8 (``Byte``) is refused, as torch refuses it
  (``RuntimeError: expected target dtype to be Long or Byte ...``): float and int32 labels are
  mistakes upstream that a silent cast would hide;
* a label that is neither ``ignore_index`` nor a class in ``[0, vocab)`` is an error:
  ``IndexError("Target N is out of bounds ...")`` on the CPU (the Triton interpreter), as torch
  raises there, and a device-side assert on the GPU, as torch's CUDA kernel does there.

The range check costs no host synchronisation on the GPU: the kernel that reads each label anyway
clears a one-element int32 flag (``new_flag``: 1) when it meets an out-of-range label, and
:func:`check_flag` hands the flag to ``torch._assert_async``, which asserts on the device, in
stream order (the process's CUDA context is then unusable, as after torch's own assert; the error
surfaces at the next synchronisation).  ``tl.device_assert`` is not used: Triton compiles it out
unless ``TRITON_DEBUG=1`` (or ``debug=True``, which also turns on Triton's integer-overflow checks
in every kernel of the launch).  The flag costs one one-element fill and one one-thread kernel per
call; ``check_labels=false`` on the op removes both (and the branch in the kernel) to measure that
(``patchdsl bench ops --ops linear_cross_entropy,linear_cross_entropy_nocheck``).
"""

from __future__ import annotations

from typing import Any

LABEL_DTYPES_DOC = "int64 (Long) or uint8 (Byte)"


def as_labels(labels: Any, device: Any, where: str) -> Any:
    """``labels`` flattened to a contiguous int64 tensor on ``device``; RuntimeError for a dtype
    torch's cross_entropy refuses (anything but int64 / uint8)."""
    import torch

    if labels.dtype not in (torch.int64, torch.uint8):
        name = str(labels.dtype).replace("torch.", "")
        raise RuntimeError(f"{where}: expected target dtype to be Long or Byte (as torch's cross_entropy), "
                           f"but got {name} labels; pass class indices as int64")
    y = labels.reshape(-1).to(device=device, dtype=torch.int64)
    return y if y.is_contiguous() else y.contiguous()


def new_flag(device: Any) -> Any:
    """The flag a label-checking kernel clears (stores 0 into) on an out-of-range label."""
    import torch

    return torch.ones((1,), dtype=torch.int32, device=device)


def first_bad(labels: Any, vocab: int, ignore_index: int) -> int | None:
    """The first label that is neither ``ignore_index`` nor in ``[0, vocab)`` (host side), or None."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    idx = bad.nonzero()
    return int(labels.reshape(-1)[idx[0, 0]].item()) if idx.numel() else None


def out_of_bounds(value: int, vocab: int, ignore_index: int, where: str) -> IndexError:
    return IndexError(f"Target {value} is out of bounds: {where} takes labels in [0, {vocab}) or "
                      f"ignore_index={ignore_index} (as torch's cross_entropy)")


def check_flag(flag: Any, labels: Any, vocab: int, ignore_index: int, where: str) -> None:
    """Raise (CPU) or assert on the device (GPU, no sync) when the kernel cleared ``flag``."""
    import torch

    if flag.device.type == "cpu":
        if not int(flag.item()):
            v = first_bad(labels, vocab, ignore_index)
            if v is None:       # the kernel disagrees with the host about which labels are bad
                raise IndexError(f"{where}: the kernel found a label out of bounds that the host check does not "
                                 f"(labels in [0, {vocab}) or ignore_index={ignore_index}): the kernel is wrong")
            raise out_of_bounds(v, vocab, ignore_index, where)
        return
    torch._assert_async(flag, f"{where}: a label is out of bounds (neither ignore_index={ignore_index} "
                              f"nor in [0, {vocab}))")

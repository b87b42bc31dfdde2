"""fused_rmsnorm: RMSNorm with the offset and cast order of the module it replaces."""

from __future__ import annotations

from typing import Any, Mapping

from .base import FlagSpec, Op, BLOCK_MAX
from ..model.info import ModuleInfo
from .common import next_pow2, resolve_auto, row_block, row_warps
from .registry import register

def rows_per_tile(block: int, single_pass: bool, target: str) -> int:
    """Rows one program normalises at once (a [ROWS, BLOCK] tile) in the one-pass kernels.

    Short rows leave most of a program idle, so several are processed together; the
    interpreter also runs faster on bigger tiles (fewer Python-level steps).
    """
    if not single_pass:
        return 1
    if target == "interpreter":
        return max(1, min(8, 4096 // block))
    return max(1, min(16, 4096 // block))


def row_launch(hidden: int, block: int, single_pass: bool, target: str) -> dict[str, int]:
    """Launch shape of the row-norm kernels (forward tile rows and warps, backward the same plus
    programs per SM for the persistent dW-partial scheme)."""
    rows = rows_per_tile(block, single_pass, target)
    # Measured on an H200 (RMSNorm 16384x1024 bf16): forward warps sized to the whole
    # [ROWS, BLOCK] tile (4 rows x 1024 -> 4 warps: 19.2 us vs 20.3 us with 2), backward warps to
    # one row (2 warps, 4 programs per SM: 36.5 us, the best of the configurations tried).
    return {"ROWS": rows, "num_warps": row_warps(rows * block), "BWD_ROWS": rows, "bwd_warps": row_warps(block),
            "bwd_programs_per_sm": 4, **partial_sum_launch(hidden, target)}


def partial_sum_launch(hidden: int, target: str) -> dict[str, int]:
    """Tile of the kernel adding up per-program fp32 partial rows (dW, dB): enough column blocks
    that a few dozen programs share the (programs x hidden) reads on the GPU."""
    hidden_p2 = next_pow2(hidden)
    if target == "interpreter":
        return {"SUM_BLOCK_C": min(hidden_p2, 1024), "SUM_BLOCK_P": 8}
    # 1024 -> 16 columns, 64 programs (H200: 3 us less than 32 columns, 32 programs)
    return {"SUM_BLOCK_C": max(16, min(256, hidden_p2 // 64)), "SUM_BLOCK_P": 64}


# Launch/scheme choices of fused_rmsnorm's one-pass kernels that the kernel sweep of bench/NOTES.md timed against
# each other (template parameters, not user flags; the defaults are the measured best so far):
#   dw_reduce     kernel: per-program fp32 partial dW rows + a second kernel adding them (deterministic);
#                 atomic: fp32 atomics into one row, the last program (atomic ticket) casts it (one launch;
#                 falls back to "kernel" under torch.use_deterministic_algorithms)
#   dw_zero       atomic only -- fill: a zeroed accumulator per backward call (one fill launch);
#                 forward: the forward zeroes it (saved after rstd), the backward's last program re-zeroes it
#   evict         evict_first on the streamed x / dy loads, evict_last on the weight
#   bwd_stages    > 0: the backward row loop is tl.range(..., num_stages=bwd_stages)
#   bwd_prefetch  the backward loads the next step's rows before this step's arithmetic
RMS_TUNING = {"dw_reduce": "kernel", "dw_zero": "fill", "evict": False, "bwd_stages": 0, "bwd_prefetch": False}


RMS_FLAGS = (
    FlagSpec("eps", "float", "auto", "epsilon added to the mean square; auto = the module's own", auto_ok=True, min=0.0),
    FlagSpec("offset", "float", "auto", "scale is (offset + w); auto = probed (0 Llama/Qwen, 1 Gemma)", auto_ok=True),
    FlagSpec("casting", "choice", "auto", "llama: cast then scale; gemma: scale in fp32 then cast; auto = probed",
             choices=("llama", "gemma"), auto_ok=True),
    FlagSpec("block", "int", "auto", "block size in elements (power of two); auto = by hidden size",
             auto_ok=True, min=16, max=BLOCK_MAX),
)


def rms_key_params(facts: Mapping[str, Any], flags: Mapping[str, Any], dtype: str, w_dtype: str | None,
                   target: str) -> dict[str, Any]:
    """Kernel parameters shared by every RMSNorm-family op (fused_rmsnorm, fused_add_rmsnorm)."""
    hidden = int(facts["hidden"])
    eps = float(resolve_auto(flags, "eps", facts["eps"]))
    offset = float(resolve_auto(flags, "offset", facts["offset"]))
    casting = resolve_auto(flags, "casting", facts["casting"])
    if casting == "unknown":
        casting = "llama"
    block, single = row_block(hidden, target)
    if flags.get("block", "auto") != "auto":
        block = next_pow2(int(flags["block"]))
        single = block >= hidden
    return {
        "dtype": dtype, "w_dtype": w_dtype or dtype, "hidden": hidden, "eps": eps, "offset": offset,
        "casting": casting, "BLOCK": block, "single_pass": single, "n_tiles": -(-hidden // block),
        **row_launch(hidden, block, single, target), "target": target, "tag": f"h{hidden}",
    }


def rms_kernel_name(op_name: str, params: Mapping[str, Any]) -> str:
    off = f"_off{params['offset']:g}" if params["offset"] else ""
    return f"{op_name}_{params['dtype']}_h{params['hidden']}_{params['casting']}{off}_{params['target']}"


class FusedRMSNorm(Op):
    name = "fused_rmsnorm"
    kinds = ("RMSNorm",)
    placements = ("replicated",)
    template = "fused_rmsnorm.py.j2"
    doc = "RMSNorm forward and backward in one kernel each; dW reduced on the device."
    flags = RMS_FLAGS

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        return {**rms_key_params(info.facts("RMSNorm"), flags, dtype, info.dtype, target), **RMS_TUNING}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return rms_kernel_name(self.name, params)

    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        f = info.facts("RMSNorm")
        if not f:
            return "not an RMSNorm (needs a 1-D weight, an eps attribute and an RMS-normalising forward)"
        if f["casting"] == "unknown" and flags.get("casting", "auto") == "auto":
            return "its forward matches neither the Llama nor the Gemma cast order; set casting= explicitly"
        return None

    def make_forward(self, module, kernels, flags, info):
        def forward(self, hidden_states, *args, **kwargs):
            return kernels(hidden_states.dtype).rmsnorm(hidden_states, self.weight)

        return forward


register(FusedRMSNorm())

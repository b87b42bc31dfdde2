#!/usr/bin/env bash
# Every GPU check and benchmark in ONE device call (<= 600 s wall), by priority, each part under its
# own time limit, the whole script under TOTAL seconds (default 580: the call's 600 s less a margin).
#
#   bash bench/gpu_all.sh                              # every part, in this order
#   PARTS="e2e_qwen3,verify" bash bench/gpu_all.sh     # some parts (or: bash bench/gpu_all.sh e2e_qwen3 verify)
#   T_E2E_QWEN3=300 TOTAL=560 PARTS=e2e_qwen3 bash bench/gpu_all.sh
#
# part           limit (s)  what
# tests            45  (a) GPU smoke: every test marked `gpu` (tests/, whatever other helpers added), then the
#                          bf16 kernel tests at real sizes, -x, pytest-xdist with TEST_WORKERS (4) workers
# e2e_qwen3       170  (b) Qwen3-0.6B 16x2048, 10 steps: patchdsl, liger, patchdsl+compile, compile, hf (hf last:
#                          it ran out of memory at 16; no OOM retry here)
# e2e_llama        50  (c) Llama-3.2-1B 8x2048: patchdsl vs liger
# e2e_gemma        50  (c) Gemma-3-1B 8x2048: patchdsl vs liger
# e2e_small        55  (d) Qwen3-0.6B 1x2048 and 4x2048: patchdsl, patchdsl+graphs (the step as one CUDA graph,
#                          patchdsl.graph_step) and liger (the host-bound regime), in one process (--in-process,
#                          Liger last): six worker start-ups would not fit
# verify           65  (e) patchdsl verify specs/qwen3.kpatch, full Qwen3-0.6B, bf16, 4x1024, 2 steps
# compile_check    20  (f) bench/compile_check.py, when the file exists
# mixed_verify     15  (f) bench/mixed_verify.py, when the file exists
# posttrain        60  (f) bench/posttrain_bench.py --budget (limit - 5) when it exists, else `bench ops` of the post-training op
#                          families (logprobs / jsd / dpo / grpo) when bench/cases.py has them
# ops              40  (g) bench ops GeGLU 16384x6912 + RMSNorm 16384x1024 vs torch.compile and Liger, then
#                          the host time to issue one forward of every other op (patchdsl alone)
# e2e_specs        40      Qwen3-0.6B 16x2048: specs/qwen3 vs bench/specs/qwen3_addnorm (ship the faster)
# (limits sum to 610; a part never gets more than what is left of TOTAL minus 12 s for the summary)
# By name only (not in "all"): spec_verify (570 s; bench/spec_verify.py: `patchdsl verify` of EVERY shipped spec, listed
# from specs/, on transformers' default config of its family, --layers 2 --dtype bf16, each spec in its own process under
# T_SPEC (150 s); one line per spec (spec, model type, verdict, seconds) in spec_verify.txt; SPEC_VERIFY=glm4,olmo2 picks
# specs (the 26 do not fit one call: run it in a few calls), SPEC_VERIFY_ARGS="--device cpu --dtype fp32 --extra=--tiny"
# is its CPU dry run), e2e_8b (300 s; Llama-3.1-8B-shaped 4x2048 (B8; MB8 sets a micro-batch: on an 80 GB card MB8=1), built on the GPU: patchdsl with the
# llama spec and with bench/specs/llama_fp8.kpatch (E8B_SPECS replaces these --spec arguments), Liger, HF; each in its own process; LLAMA_SPECS="--spec llama
# --spec bench/specs/llama_fp8.kpatch" gives e2e_llama the fp8 row too), compile_perf (200 s; Qwen3-0.6B 16x2048: patchdsl eager vs patchdsl.compile_layers
# (regional) vs patchdsl.compile_model (whole) vs plain torch.compile of the patched model, each in its own process;
# COMPILE_VARIANTS picks rows, e.g. COMPILE_VARIANTS=compile T_COMPILE_PERF=300 T_VARIANT=280 for torch.compile alone),
# rope_layouts (90 s; tests/kernels/test_rope_layouts.py on the GPU: the rotary layouts of issue 25 at real sizes;
# pass = "N passed", no failure), moe (150 s; bench/moe_bench.py: experts fwd+bwd at the Qwen3-30B-A3B layer shape, patchdsl vs
# grouped_mm / batched_mm / Liger / matmul floor, then a 4-layer Qwen3-30B-A3B-shaped model 4x2048 default vs patchdsl vs Liger,
# each in its own process; moe.json / moe.txt),
# fp8_ops (90 s; bench/fp8_bench.py: fp8_linear(recipe=rowwise) against bf16, kernel by kernel, for the seven projections
# of a Llama-3.1-8B layer at 4x2048 tokens and a Llama-3.2-1B layer at 8x2048: each quantisation kernel (GB/s), each
# _scaled_mm and bf16 GEMM (TFLOP/s), the whole projection through autograd; fp8.json / fp8.txt),
# mlp (90 s; bench/mlp_bench.py: fused_mlp on StarCoder2-3B's and Minitron-4B's plain MLPs, bf16, 8x2048 tokens: fwd+bwd
# time and bytes saved for backward, eager vs fused_mlp vs recompute=false, errors against fp32; mlp.json / mlp.txt),
# moe_block (300 s; bench/moe_block_bench.py: one MoE block, router + experts, fwd+bwd at the Qwen3-30B-A3B, Mixtral-8x7B,
# gpt-oss-20b and DeepSeek-V3 layer shapes at 16k tokens and the Qwen3 shape from 4k to 64k tokens: default (grouped_mm),
# patchdsl, Liger, SonicMoE (when importable) and the matmul floor, each in its own process; moe_block.json / .txt),
# moe_router (60 s; bench/moe_router_bench.py: Qwen3-30B-A3B's router, 16384 tokens, hidden 2048, 128 experts, top 8,
# bf16, fwd+bwd: fused_router vs the module vs torch.compile vs the matmul floor, norm_topk_prob on and off;
# moe_router.json / moe_router.txt; verdict `moe_router: PAYS|DOES NOT PAY ...`),
# verify_scale (300 s; bench/verify_scale.py: `patchdsl verify` of Phi-3-mini, Mistral-7B, Llama-3.1-8B- and Qwen3-8B-shaped
# models in bf16, batch 1 x 512, 1 step, built on the GPU, streamed float64 reference; time and peak memory per model),
# vlm_verify (270 s; bench/verify_scale.py --models vlm: `patchdsl verify` of specs/qwen2_5_vl, specs/qwen3_vl and
# specs/gemma3 on Qwen2.5-VL-7B-, Qwen3-VL-8B- and Gemma-3-4b-it-shaped ...ForConditionalGeneration models built on the GPU,
# random weights, bf16, batch 1 x 512, 1 step, text only, streamed float64 reference; vlm_verify/verify_<model>.json;
# VLM_ARGS adds arguments: VLM_ARGS="--tiny --device cpu --dtype fp32 --seq 16" is its CPU dry run),
# convergence (120 s; bench/convergence.py: Liger-style 32-step convergence test of mini Llama / Qwen3 / Gemma 3 on
# real text, patchdsl vs unpatched vs Liger), convergence_fp8 (240 s; bench/convergence.py --fp8 FP8_RECIPE (rowwise) --size full:
# Llama-3.2-1B- and Qwen3-0.6B-shaped, bf16, FP8_STEPS (100) steps of 8 x 512, the spec with fp8 projections against
# the spec alone, and the unpatched bf16 model as a control (its per-step drift from the bf16 run, reported next
# to fp8's, not judged; FP8_CONTROL= leaves it out); verdict `convergence_fp8: PASS|FAIL`; the fp8 experts of issue 37:
# FP8_ON=experts FP8_FAMILIES=qwen3_moe FP8_SIZE=mini (the Qwen3-MoE mini model, fused_experts(fp8=FP8_RECIPE))),
# label_check (90 s; linear CE with the label check on and off, chunked and fused modes,
# 16384x1024x151936 bf16, patchdsl rows, then bench/label_check_verdict.py's line), sweep (300 s; bench ops
# --sweep-only), specialise (120 s; bench specialise), host_breakdown (80 s; bench/host_breakdown.py, plus --root .old
# and a comparison when .old/ is carried); SWEEP_ARGS / SPEC_ARGS add arguments.  The one-off investigations of the
# first rounds (kernel variant sweeps, PTX registers, profiler tables, linear CE tiles, graph profiles, host probes)
# are answered in bench/NOTES.md, their results committed under bench/results/; their scripts were removed.
#
# Limits: T_<PART> (upper case), e.g. T_TESTS=60.  Variants and specs: QWEN3_VARIANTS, SPECS_VARIANTS,
# E2E_STEPS (10).  DRY=1 writes the commands into bench.log instead of running them.  Hook scripts (f) run as `python3 bench/X.py` with PART_OUT set to a folder whose files
# are packed into results.tar; they print their verdict last.
#
# Under $OUT (default bench/results/run-<date>), at most 5 files:
#   summary.txt  (the compact summary, also printed LAST)   bench.log  (everything every part printed)
#   tests.log    (pytest)   bench.png  (ops + e2e Qwen3 16x2048)
#   results.tar  (every JSON, table and PNG: e2e_*.json/.txt/.png, ops*.json, verify.json, hooks' files;
#                 rewritten after each part, so a run stopped early keeps what finished)
# The wheels in .whl/ travel with the call (carry ".whl"); see bench/README.md.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/bench/results/run-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/patchdsl-gpu-all.XXXXXX)
LOG=$OUT/bench.log
: >"$LOG"
T0=$(date +%s)
TOTAL=${TOTAL:-580}
RESERVE=12
STEPS=${E2E_STEPS:-10}
ALL="tests e2e_qwen3 e2e_llama e2e_gemma e2e_small verify compile_check mixed_verify posttrain ops e2e_specs"
EXTRA="spec_verify e2e_8b fp8_ops moe moe_block moe_router mlp rope_layouts compile_perf verify_scale vlm_verify convergence convergence_fp8 label_check sweep specialise host_breakdown"     # not in "all": other parts, by name only
PARTS=${PARTS:-${*:-all}}
PARTS=${PARTS//,/ }
case " $PARTS " in *" all "*) PARTS=$ALL ;; esac

export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PATCHDSL_CACHE=${PATCHDSL_CACHE:-/tmp/patchdsl-kernels}
# NVLink multicast stays off (workplace rule for multi-GPU machines; harmless on one GPU).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

say() { echo "== $*" | tee -a "$LOG"; }
X() { if [ "${DRY:-0}" = 1 ]; then echo "DRY: $*" >>"$LOG"; return 0; fi; "$@"; }   # DRY=1: say, do not run
now() { date +%s; }
left() { echo $(( T0 + TOTAL - RESERVE - $(now) )); }
pack() { tar -cf "$OUT/results.tar.tmp" -C "$WORK" . 2>>"$LOG" && mv -f "$OUT/results.tar.tmp" "$OUT/results.tar"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && say "installed $(ls .whl | tr '\n' ' ')" || say "WARNING: wheel install failed (see bench.log)"
else
  say "WARNING: no .whl/ folder: lark, liger-kernel, cut-cross-entropy, trl, kernels will be missing"
fi
export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi -L 2>&1 | tee -a "$LOG"
timeout 60 python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib
for m in ("torch", "triton", "transformers", "lark", "liger_kernel", "cut_cross_entropy", "trl", "datasets",
          "kernels", "matplotlib", "xdist"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')}", end="; ")
    except Exception as e:
        print(f"{m} MISSING ({type(e).__name__})", end="; ")
import torch
print(f"cuda {torch.version.cuda}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU'}")
EOF

status=()
# limit NAME DEFAULT: the part's limit, cut to what is left of TOTAL
limit() {
  local var="T_$(echo "$1" | tr '[:lower:]' '[:upper:]')" l
  l=${!var:-$2}
  local r; r=$(left)
  [ "$r" -lt "$l" ] && l=$r
  echo "$l"
}
# run_part NAME LIMIT command...: output into bench.log, never stops the script
run_part() {
  local name=$1 secs=$2; shift 2
  local t0; t0=$(now)
  say "$name (limit ${secs}s): $*"
  X timeout -k 5 "$secs" "$@" >>"$LOG" 2>&1
  local rc=$?
  local what="rc $rc"
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && what="TIMED OUT at ${secs}s (partial results kept)"
  say "$name: $what after $(( $(now) - t0 ))s"
  status+=("$name: $what")
}
e2e() {  # e2e NAME LIMIT args...: bench e2e with its own budget inside the part's limit
  local name=$1 lim=$2; shift 2
  run_part "$name" "$lim" python3 -m patchdsl.cli bench e2e --out "$WORK" --name "$name" \
    --budget $(( lim > 20 ? lim - 8 : lim - 3 )) "$@"
  [ -f "$WORK/$name.txt" ] && cat "$WORK/$name.txt" >>"$WORK/summary.parts"
}

for part in $PARTS; do
  case " $ALL $EXTRA " in *" $part "*) ;; *) say "unknown part '$part' (known: $ALL $EXTRA)"; continue ;; esac
  case $part in
    tests)   lim=$(limit tests 45) ;;
    e2e_qwen3) lim=$(limit e2e_qwen3 170) ;;
    e2e_llama) lim=$(limit e2e_llama 50) ;;
    e2e_8b) lim=$(limit e2e_8b 300) ;;
    e2e_gemma) lim=$(limit e2e_gemma 50) ;;
    e2e_small) lim=$(limit e2e_small 55) ;;
    verify)  lim=$(limit verify 65) ;;
    compile_check) lim=$(limit compile_check 20) ;;
    mixed_verify) lim=$(limit mixed_verify 15) ;;
    posttrain) lim=$(limit posttrain 60) ;;
    ops)     lim=$(limit ops 40) ;;
    e2e_specs) lim=$(limit e2e_specs 40) ;;
    sweep)   lim=$(limit sweep 300) ;;
    specialise) lim=$(limit specialise 120) ;;
    host_breakdown) lim=$(limit host_breakdown 80) ;;
    label_check) lim=$(limit label_check 90) ;;
    compile_perf) lim=$(limit compile_perf 200) ;;
    verify_scale) lim=$(limit verify_scale 300) ;;
    vlm_verify) lim=$(limit vlm_verify 270) ;;
    convergence) lim=$(limit convergence 120) ;;
    convergence_fp8) lim=$(limit convergence_fp8 240) ;;
    moe) lim=$(limit moe 150) ;;
    mlp) lim=$(limit mlp 90) ;;
    fp8_ops) lim=$(limit fp8_ops 90) ;;
    moe_router) lim=$(limit moe_router 60) ;;
    moe_block) lim=$(limit moe_block 300) ;;
    rope_layouts) lim=$(limit rope_layouts 90) ;;
    spec_verify) lim=$(limit spec_verify 570) ;;
  esac
  if [ "$lim" -lt 10 ]; then
    say "$part: SKIPPED (${lim}s left of TOTAL=${TOTAL}s)"; status+=("$part: skipped, no time left"); continue
  fi
  case $part in
    tests)   # (a) gpu-marked tests first (new GPU checks of other helpers), then bf16 kernel tests at real sizes
      t0=$(now)
      xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n ${TEST_WORKERS:-4}"
      to=""; python3 -c "import pytest_timeout" 2>/dev/null && to="--timeout 120"
      l1=$(( lim * ${GPU_TESTS_PCT:-55} / 100 ))
      say "tests (limit ${lim}s): pytest ${GPU_TESTS:-tests} -m gpu -v $xd (${l1}s), then tests/kernels -k '${TEST_K:-bf16}' -x $xd"
      # -v, no -x: every gpu-marked test's verdict is in tests.log as it finishes, even when the limit cuts the run
      X timeout -k 5 "$l1" python3 -m pytest ${GPU_TESTS:-tests} -m gpu -v -rfEs --tb=short --durations=8 $xd $to -p no:cacheprovider \
        >"$OUT/tests.log" 2>&1
      rc1=$?
      l2=$(( lim - ($(now) - t0) )); [ "$l2" -lt 5 ] && l2=5
      echo "---------------- kernel tests (${l2}s) ----------------" >>"$OUT/tests.log"
      X timeout -k 5 "$l2" python3 -m pytest tests/kernels -k "${TEST_K:-bf16}" -x -q -rfE --tb=short --durations=8 $xd $to \
        -p no:cacheprovider --deselect tests/kernels/test_cuda_compile.py >>"$OUT/tests.log" 2>&1
      rc2=$?
      res=$(grep -E "^[=]* ?[0-9]+ (passed|failed)|[0-9]+ (passed|failed|error)" "$OUT/tests.log" | sed 's/=//g' | tr '\n' '|')
      what="gpu-marked rc $rc1, kernels rc $rc2"
      { [ $rc1 -eq 124 ] || [ $rc2 -eq 124 ]; } && what="$what (124 = cut by its limit)"
      say "tests: $what after $(( $(now) - t0 ))s: $res"
      status+=("tests: $what: $res")
      grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -n 20 | tee -a "$LOG"
      ;;
    e2e_qwen3)   # (b) the key measurement
      e2e e2e_qwen3 "$lim" --model Qwen/Qwen3-0.6B --batch 16 --seq 2048 --steps "$STEPS" --warmup 2 \
        --variants "${QWEN3_VARIANTS:-patchdsl,liger,patchdsl+compile,compile,hf}" --no-oom-retry \
        --variant-timeout "${T_VARIANT:-110}"
      ;;
    e2e_llama)
      e2e e2e_llama "$lim" --model meta-llama/Llama-3.2-1B --batch 8 --seq 2048 --steps "$STEPS" --warmup 2 \
        --variants "${LLAMA_VARIANTS:-patchdsl,liger}" --no-oom-retry ${LLAMA_SPECS:-}
      ;;
    e2e_8b)   # issue 26 item 3: Llama-3.1-8B-shaped, built on the GPU, bf16 AdamW: patchdsl (bf16 and fp8 projections) vs Liger vs HF
      e2e e2e_8b "$lim" --model meta-llama/Llama-3.1-8B --batch "${B8:-4}" --seq 2048 --steps "${STEPS_8B:-4}" --warmup 2 \
        --variants "${E8B_VARIANTS:-patchdsl,liger,hf}" ${E8B_SPECS:---spec llama --spec bench/specs/llama_fp8.kpatch} \
        --variant-timeout "${T_VARIANT:-110}" ${MB8:+--micro-batch "$MB8"}
      ;;
    e2e_gemma)
      e2e e2e_gemma "$lim" --model google/gemma-3-1b-pt --batch 8 --seq 2048 --steps "$STEPS" --warmup 2 \
        --variants "${GEMMA_VARIANTS:-patchdsl,liger}" --no-oom-retry
      ;;
    e2e_small)   # (d) batch 1 and 4: is the step bound by the host? (host ms vs step ms in the table)
      e2e e2e_small "$lim" --model Qwen/Qwen3-0.6B --batch 1,4 --seq 2048 --steps 20 --warmup 3 \
        --variants "${SMALL_VARIANTS:-patchdsl,patchdsl+graphs,liger}" --no-oom-retry ${SMALL_ISOLATION---in-process}
      ;;
    verify)  # (e) gradient parity of the shipped Qwen3 spec on the full Qwen3-0.6B architecture, bf16
      run_part verify "$lim" sh -c "python3 -m patchdsl.cli verify specs/qwen3.kpatch --model Qwen/Qwen3-0.6B \
        --device cuda --dtype bf16 --batch 4 --seq 1024 --steps 2 --full --json --progress >'$WORK/verify.json'"
      v=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('verdict')); [print('  FAIL', s.get('path'), s.get('op'), s.get('max_rel_err')) for s in d.get('sites', []) if not s.get('passed')]" \
        "$WORK/verify.json" 2>/dev/null | head -n 12)
      say "verify verdict: ${v:-none (no complete JSON)}"
      status+=("verify: $(echo "${v:-no verdict}" | head -n 1)")
      ;;
    compile_check|mixed_verify)   # (f) hooks written by other helpers: run only when present
      f=bench/$part.py
      if [ -f "$f" ]; then
        mkdir -p "$WORK/$part"
        PART_OUT="$WORK/$part" run_part "$part" "$lim" python3 "$f"
      else
        say "$part: $f not present, skipped"; status+=("$part: not present")
      fi
      ;;
    posttrain)
      if [ -f bench/posttrain_bench.py ]; then
        mkdir -p "$WORK/posttrain"
        t0p=$(now); lp=$(( lim * 70 / 100 ))
        PART_OUT="$WORK/posttrain" run_part posttrain "$lp" python3 bench/posttrain_bench.py --budget $(( lp - 5 ))
        [ -f "$WORK/posttrain/posttrain.txt" ] && cat "$WORK/posttrain/posttrain.txt" >>"$WORK/summary.parts"
        lj=$(( lim - ($(now) - t0p) ))
        if [ "$lj" -ge 15 ]; then   # the distillation op (no chunked-loss script covers it): vs PyTorch and Liger's fused JSD
          run_part posttrain_jsd "$lj" python3 -m patchdsl.cli bench ops --ops linear_jsd --no-sweep \
            --impls patchdsl,hf,liger --json-out "$WORK/ops_jsd.json" --no-png --budget $(( lj - 8 )) --target-ms 30
        fi
      else
        fams=$(timeout 60 python3 -c "from patchdsl_tools.bench.cases import families; print(','.join(n for n in families() if any(k in n for k in ('logprob', 'jsd', 'dpo', 'grpo', 'kl'))))" 2>>"$LOG")
        if [ -n "$fams" ]; then
          run_part posttrain "$lim" python3 -m patchdsl.cli bench ops --ops "$fams" --no-sweep --impls patchdsl,hf,liger \
            --json-out "$WORK/ops_posttrain.json" --no-png --budget $(( lim - 12 )) --target-ms 30
        else
          say "posttrain: no bench/posttrain_bench.py and no post-training op family in bench/cases.py, skipped"
          status+=("posttrain: not present")
        fi
      fi
      ;;
    ops)     # (g) GeGLU and RMSNorm vs torch.compile and Liger; then host time per forward of every op
      t0=$(now)
      l1=$(( lim * 65 / 100 ))
      run_part ops "$l1" python3 -m patchdsl.cli bench ops --ops geglu,rmsnorm --impls patchdsl,compile,liger --no-sweep \
        --json-out "$WORK/ops.json" --no-png --budget $(( l1 - 10 )) --target-ms 50
      l2=$(( lim - ($(now) - t0) ))
      if [ "$l2" -ge 10 ]; then
        run_part ops_host "$l2" python3 -m patchdsl.cli bench ops --impls patchdsl --no-sweep --target-ms 20 \
          --ops "${HOST_OPS:-swiglu,rope,qk_norm_rope,add_rmsnorm,cross_entropy,linear_cross_entropy}" \
          --json-out "$WORK/ops_host.json" --no-png --budget $(( l2 - 8 ))
      fi
      ;;
    compile_perf)   # issue 26 item 1: does compile pay? tokens/s, peak, warm-up, graph breaks, loss vs eager patchdsl
      e2e compile_perf "$lim" --model Qwen/Qwen3-0.6B --batch 16 --seq 2048 --steps "${COMPILE_STEPS:-8}" --warmup 2 \
        --compile-warmup "${COMPILE_WARMUP:-3}" --no-oom-retry --variant-timeout "${T_VARIANT:-110}" \
        --variants "${COMPILE_VARIANTS:-patchdsl,patchdsl+regional,patchdsl+compile,patchdsl+plain_compile}"
      v=$(python3 bench/compile_verdict.py "$WORK/compile_perf.json" 2>>"$LOG")
      say "${v:-compile_perf verdict: none (no JSON)}"
      echo "${v:-compile_perf verdict: none}" >>"$WORK/summary.parts"
      status+=("$(echo "${v:-compile_perf: no verdict}" | tail -n 1)")
      ;;
    label_check)   # the label range check's cost (issue 22): linear CE with check_labels on and off, same run,
      # patchdsl rows only (the comparison is patchdsl with itself), then a one-line verdict per mode
      run_part label_check "$lim" python3 -m patchdsl.cli bench ops --no-sweep --no-png --impls patchdsl \
        --ops linear_cross_entropy,linear_cross_entropy_nocheck,linear_cross_entropy_fused,linear_cross_entropy_fused_nocheck \
        --json-out "$WORK/ops_label_check.json" --budget $(( lim - 10 ))
      if [ -f "$WORK/ops_label_check.json" ]; then
        python3 bench/label_check_verdict.py "$WORK/ops_label_check.json" 2>&1 | tee -a "$LOG" >>"$WORK/summary.parts"
      elif [ "${DRY:-0}" = 1 ]; then
        echo "DRY: python3 bench/label_check_verdict.py $WORK/ops_label_check.json" >>"$LOG"
      else
        say "label_check: FAIL: no ops_label_check.json (see bench.log)"; status+=("label_check: no JSON")
      fi
      ;;
    e2e_specs)   # which spec to ship: the add+norm fusion against the shipped spec, same run
      e2e e2e_specs "$lim" --model Qwen/Qwen3-0.6B --batch 16 --seq 2048 --steps "$STEPS" --warmup 2 \
        --variants "${SPECS_VARIANTS:-patchdsl}" --spec qwen3 --spec qwen3_addnorm --no-oom-retry
      ;;
    sweep)   # every op at the sweep shapes against its peers
      run_part sweep "$lim" python3 -m patchdsl.cli bench ops --sweep-only --json-out "$WORK/ops_sweep.json" --no-png \
        --budget $(( lim - 30 )) ${SWEEP_ARGS:-}
      ;;
    specialise)   # specialised kernel vs the generic (looped/masked) variant of each op
      run_part specialise "$lim" python3 -m patchdsl.cli bench specialise --json-out "$WORK/specialise.json" \
        --budget $(( lim - 25 )) ${SPEC_ARGS:-}
      ;;
    host_breakdown)   # where one forward's host time goes (bench/host_breakdown.py); with an older checkout
                      # extracted under .old/ (git archive, carried), that version's host code first, then a comparison
      if [ -d .old/patchdsl ]; then
        run_part host_breakdown_old $(( lim / 2 )) python3 bench/host_breakdown.py --root .old --json "$WORK/host_breakdown_old.json"
      fi
      run_part host_breakdown $(( lim / 2 )) python3 bench/host_breakdown.py --json "$WORK/host_breakdown.json"
      { sed -n '/^host us per forward (one process/,/^== /p' "$LOG" | grep -v "^== "
        [ -f "$WORK/host_breakdown_old.json" ] && python3 bench/host_breakdown.py --compare "$WORK/host_breakdown_old.json" \
          "$WORK/host_breakdown.json"; } >"$WORK/host_breakdown.txt" 2>>"$LOG"
      cat "$WORK/host_breakdown.txt" | tee -a "$LOG" >>"$WORK/summary.parts"
      ;;
    verify_scale|convergence)   # verify of 4-8B models (streamed float64 reference); Liger-style convergence test
      mkdir -p "$WORK/$part"
      PART_OUT="$WORK/$part" run_part "$part" "$lim" python3 "bench/$part.py" --budget $(( lim - 10 ))
      [ -f "$WORK/$part/$part.txt" ] && cat "$WORK/$part/$part.txt" >>"$WORK/summary.parts"
      v=$(grep -E "^$part: " "$LOG" | tail -n 1)
      status+=("${v:-$part: no verdict line}")
      ;;
    convergence_fp8)   # issue 26 item 2: fp8 projections against bf16 over real text (Llama-3.2-1B and Qwen3-0.6B widths)
      mkdir -p "$WORK/convergence_fp8"
      PART_OUT="$WORK/convergence_fp8" run_part convergence_fp8 "$lim" python3 bench/convergence.py --fp8 "${FP8_RECIPE:-rowwise}" \
        --families "${FP8_FAMILIES:-llama,qwen3}" --size "${FP8_SIZE:-full}" --fp8-on "${FP8_ON:-projections}" \
        --steps "${FP8_STEPS:-100}" --batch 8 --seq 512 --budget $(( lim - 10 )) ${FP8_CONTROL---fp8-control}
      [ -f "$WORK/convergence_fp8/convergence_fp8.txt" ] && cat "$WORK/convergence_fp8/convergence_fp8.txt" >>"$WORK/summary.parts"
      v=$(grep -E "^convergence_fp8: " "$LOG" | tail -n 1)
      status+=("${v:-convergence_fp8: no verdict line}")
      ;;
    spec_verify)   # issue 38: every shipped spec (listed from specs/) verified at its family's default widths,
      # --layers 2 (one layer of each type at least, only those built), bf16; SPEC_VERIFY=a,b picks specs, T_SPEC the
      # per-spec limit (150 s), SPEC_VERIFY_ARGS more arguments (CPU dry run: "--device cpu --dtype fp32 --extra=--tiny")
      mkdir -p "$WORK/spec_verify"
      PART_OUT="$WORK/spec_verify" run_part spec_verify "$lim" python3 bench/spec_verify.py --budget $(( lim - 8 )) \
        --specs "${SPEC_VERIFY:-all}" ${SPEC_VERIFY_ARGS:-}
      [ -f "$WORK/spec_verify/spec_verify.txt" ] && cat "$WORK/spec_verify/spec_verify.txt" >>"$WORK/summary.parts"
      v=$(grep -E "^spec_verify: " "$LOG" | tail -n 1)
      status+=("${v:-spec_verify: no verdict line}")
      ;;
    vlm_verify)   # issue 25: the multimodal specs on full-size vision-language models (language tower + loss)
      mkdir -p "$WORK/vlm_verify"
      PART_OUT="$WORK/vlm_verify" run_part vlm_verify "$lim" python3 bench/verify_scale.py --models vlm --name vlm_verify \
        --reference streamed --no-train-step --budget $(( lim - 10 )) ${VLM_ARGS:-}
      [ -f "$WORK/vlm_verify/vlm_verify.txt" ] && cat "$WORK/vlm_verify/vlm_verify.txt" >>"$WORK/summary.parts"
      v=$(grep -E "^vlm_verify: " "$LOG" | tail -n 1)
      status+=("${v:-vlm_verify: no verdict line}")
      ;;
    rope_layouts)   # issue 25: fused_rope's rotary layouts (rotate_half, interleaved, GLM's half-width cos), full and
      # partial rotary, fwd + bwd vs float64 at GLM-4-9B / Command-R / StableLM sizes, compiled for this GPU
      mkdir -p "$WORK/rope_layouts"
      run_part rope_layouts "$lim" python3 -m pytest tests/kernels/test_rope_layouts.py -q -rfE --tb=short \
        -p no:cacheprovider --junitxml "$WORK/rope_layouts/junit.xml"
      status+=("rope_layouts: $(grep -E '[0-9]+ (passed|failed|error)' "$LOG" | tail -n 1)")
      ;;
    moe)   # mixture of experts (issue 24): the experts op and a 4-layer Qwen3-30B-A3B-shaped model
      mkdir -p "$WORK/moe"
      run_part moe "$lim" python3 bench/moe_bench.py --out "$WORK/moe" --budget $(( lim - 10 )) ${MOE_ARGS:-}
      [ -f "$WORK/moe/moe.txt" ] && cat "$WORK/moe/moe.txt" >>"$WORK/summary.parts"
      status+=("moe: $(grep -E '^moe: ' "$LOG" | tail -n 1)")
      ;;
    mlp)   # plain (non-gated) MLP op (issue 25): StarCoder2-3B and Minitron-4B MLP shapes
      mkdir -p "$WORK/mlp"
      run_part mlp "$lim" python3 bench/mlp_bench.py --out "$WORK/mlp" --budget $(( lim - 30 ))
      [ -f "$WORK/mlp/mlp.txt" ] && cat "$WORK/mlp/mlp.txt" >>"$WORK/summary.parts"
      status+=("mlp: $(grep -E '^mlp: ' "$LOG" | tail -n 1 | cut -c1-400)")
      ;;
    fp8_ops)   # issue 26 item 2/3: where an fp8 projection's time goes (quantisation kernels vs _scaled_mm vs bf16)
      mkdir -p "$WORK/fp8_ops"
      run_part fp8_ops "$lim" python3 bench/fp8_bench.py --out "$WORK/fp8_ops" --budget $(( lim - 30 ))
      [ -f "$WORK/fp8_ops/fp8.txt" ] && cat "$WORK/fp8_ops/fp8.txt" >>"$WORK/summary.parts"
      status+=("fp8_ops: $(grep -E '^fp8 \(' "$LOG" | tail -n 1 | cut -c1-600)")
      ;;
    moe_block)    # one MoE block (router + experts) at four layer shapes and a token sweep, each variant in its own process
      mkdir -p "$WORK/moe_block"
      run_part moe_block "$lim" python3 bench/moe_block_bench.py --out "$WORK/moe_block" --budget $(( lim - 15 ))
      [ -f "$WORK/moe_block/moe_block.txt" ] && cat "$WORK/moe_block/moe_block.txt" >>"$WORK/summary.parts"
      status+=("$(grep -E '^moe_block: ' "$LOG" | tail -n 1)")
      ;;
    moe_router)   # does the fused router pay? (issue 24) fused_router vs the module at the Qwen3-30B-A3B shape
      mkdir -p "$WORK/moe_router"
      run_part moe_router "$lim" python3 bench/moe_router_bench.py --out "$WORK/moe_router" --budget $(( lim - 10 ))
      [ -f "$WORK/moe_router/moe_router.txt" ] && cat "$WORK/moe_router/moe_router.txt" >>"$WORK/summary.parts"
      v=$(grep -E '^moe_router: ' "$LOG" | tail -n 1)
      status+=("${v:-moe_router: no verdict line}")
      ;;
  esac
  pack
done

# ---------------------------------------------------------------- summary (printed last)
ops_files=(); for f in ops.json ops_host.json ops_posttrain.json ops_sweep.json; do [ -f "$WORK/$f" ] && ops_files+=("$WORK/$f"); done
plot_files=("${ops_files[@]+"${ops_files[@]}"}"); [ -f "$WORK/e2e_qwen3.json" ] && plot_files+=("$WORK/e2e_qwen3.json")
if [ ${#plot_files[@]} -gt 0 ]; then
  timeout 30 python3 -m patchdsl.cli bench plot "${plot_files[@]}" --png "$OUT/bench.png" >>"$LOG" 2>&1
fi
{
  echo "=============================== SUMMARY ($(( $(now) - T0 ))s of TOTAL=${TOTAL}s) ==============================="
  grep -E "^(NVIDIA|GPU )|^torch " "$LOG" | head -n 3
  printf '%s\n' ${status[@]+"${status[@]}"}
  [ -f "$OUT/tests.log" ] && grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 8
  [ -f "$WORK/summary.parts" ] && cat "$WORK/summary.parts"
  if [ ${#ops_files[@]} -gt 0 ]; then
    timeout 30 python3 -m patchdsl.cli bench summary "${ops_files[@]}" 2>>"$LOG"
  fi
  echo "files: $(cd "$OUT" && ls | tr '\n' ' '); results.tar: $(tar -tf "$OUT/results.tar" 2>/dev/null | grep -v '/$' | sed 's|^\./||' | tr '\n' ' ')"
} >"$OUT/summary.txt" 2>&1
cp "$OUT/summary.txt" "$WORK/summary.txt" 2>/dev/null
pack
rm -rf "$WORK"
cat "$OUT/summary.txt"
exit 0

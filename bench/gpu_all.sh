#!/usr/bin/env bash
# One call on the H200: kernel tests at real sizes, per-op benchmarks, end-to-end training.
#
#   bash bench/gpu_all.sh            # = all: tests, ops (issue shapes, then the sweep), specialise, e2e
#   bash bench/gpu_all.sh ops        # parts, in any combination: tests verify ops issue sweep specialise profile e2e
#   OPS_ARGS="--ops rmsnorm,swiglu" E2E_ARGS="--variants hf,patchdsl,compile" bash bench/gpu_all.sh ops e2e
#
# Each part runs under its own timeout (T_TESTS, T_VERIFY, T_OPS, T_SWEEP, T_SPEC, T_PROF, T_E2E seconds; defaults sum to 9 min),
# never stops the others, and writes under $OUT (default bench/results/run-<date>):
#   bench.log  tests.log  ops.json (ops_sweep.json for the part "sweep")  specialise.json/.txt  e2e.json
#   bench.png  summary.txt
# The compact summary is printed LAST.  The wheels in .whl/ (lark, liger-kernel,
# cut-cross-entropy) must travel with the call (carry ".whl").
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/bench/results/run-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
LOG=$OUT/bench.log
: >"$LOG"
T_TESTS=${T_TESTS:-120}
T_OPS=${T_OPS:-200}
T_E2E=${T_E2E:-120}
T_SPEC=${T_SPEC:-50}
T_VERIFY=${T_VERIFY:-150}
T_PROF=${T_PROF:-80}
PARTS=${*:-all}
case " $PARTS " in *" all "*) PARTS="tests verify ops specialise e2e" ;; esac

export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PATCHDSL_CACHE=${PATCHDSL_CACHE:-/tmp/patchdsl-kernels}
# NVLink multicast stays off (workplace rule for multi-GPU machines; harmless on one GPU).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

say() { echo "== $*" | tee -a "$LOG"; }
t_start=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && say "installed $(ls .whl | tr '\n' ' ')" || say "WARNING: wheel install failed (see bench.log)"
else
  say "WARNING: no .whl/ folder: lark, liger-kernel and cut-cross-entropy will be missing"
fi
export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi -L 2>&1 | tee -a "$LOG"
python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib
for m in ("torch", "triton", "transformers", "lark", "liger_kernel", "cut_cross_entropy", "matplotlib"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')}", end="; ")
    except Exception as e:
        print(f"{m} MISSING ({type(e).__name__})", end="; ")
import torch
print(f"cuda {torch.version.cuda}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO GPU'}")
EOF

status=()
run_part() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  say "$name (limit ${secs}s): $*"
  timeout -k 10 "$secs" "$@" >>"$LOG" 2>&1
  local rc=$?
  local what="rc $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="TIMED OUT (partial results kept)"
  say "$name: $what after $(( $(date +%s) - t0 ))s"
  status+=("$name: $what")
}

for part in $PARTS; do
  case $part in
    tests)
      t0=$(date +%s)
      # 12 workers when pytest-xdist is there (the image has it); the sm_90 compile-only checks ran in CI already
      xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n ${TEST_WORKERS:-12}"
      say "tests (limit ${T_TESTS}s): pytest ${TEST_ARGS:-tests/kernels} -v $xd"
      timeout -k 10 "$T_TESTS" python3 -m pytest ${TEST_ARGS:-tests/kernels} -v -rfE --tb=short --durations=15 $xd -p no:cacheprovider \
        --deselect tests/kernels/test_cuda_compile.py >"$OUT/tests.log" 2>&1
      rc=$?
      what="rc $rc"; { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && what="TIMED OUT"
      say "tests: $what after $(( $(date +%s) - t0 ))s: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1)"
      status+=("tests: $what: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1)")
      grep -E "(FAILED|ERROR) " "$OUT/tests.log" | head -n 20 | tee -a "$LOG"
      ;;
    ops|issue|sweep)
      sel=""; name=ops; lim=$T_OPS; args=${OPS_ARGS:-}
      [ "$part" = issue ] && sel="--no-sweep"
      [ "$part" = sweep ] && sel="--sweep-only" && name=ops_sweep && lim=${T_SWEEP:-$T_OPS} && args=${SWEEP_ARGS:-$args}
      run_part "$part" "$lim" python3 -m patchdsl.cli bench ops --json "$OUT/$name.json" --no-png \
        --budget $(( lim - 45 )) $sel $args
      ;;
    verify)   # gradient parity of the shipped Qwen3 spec on the full Qwen3-0.6B architecture, bf16
      run_part verify "$T_VERIFY" sh -c "python3 -m patchdsl.cli verify specs/qwen3.kpatch --model Qwen/Qwen3-0.6B \
        --full --device cuda --dtype bf16 --batch 4 --seq 1024 --steps 2 --json --progress >'$OUT/verify.json'"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['verdict']); [print('  FAIL', s['path'], s['op'], s['max_rel_err']) for s in d['sites'] if not s['passed']]" \
        "$OUT/verify.json" 2>&1 | tee -a "$LOG" | tail -n 12 >/tmp/patchdsl-verify.txt
      status+=("verify: $(head -n 1 /tmp/patchdsl-verify.txt 2>/dev/null)")
      ;;
    specialise)   # specialised kernel vs the generic (looped/masked) variant of each op
      run_part specialise "$T_SPEC" python3 -m patchdsl.cli bench specialise --json "$OUT/specialise.json" \
        --budget $(( T_SPEC - 25 )) ${SPEC_ARGS:-}
      ;;
    profile)   # torch.profiler kernel tables (qk_norm_rope, linear CE, one e2e training step), into bench.log
      run_part profile "$T_PROF" python3 bench/profile_gpu.py ${PROF_ARGS:-}
      ;;
    e2e)
      run_part e2e "$T_E2E" python3 -m patchdsl.cli bench e2e --json "$OUT/e2e.json" --no-png \
        --budget $(( T_E2E - 35 )) ${E2E_ARGS:-}
      ;;
    *) say "unknown part '$part' (use: all tests verify ops issue sweep specialise profile e2e)" ;;
  esac
done

files=()
[ -f "$OUT/ops.json" ] && files+=("$OUT/ops.json")
[ -f "$OUT/ops_sweep.json" ] && files+=("$OUT/ops_sweep.json")
[ -f "$OUT/e2e.json" ] && files+=("$OUT/e2e.json")
if [ ${#files[@]} -gt 0 ]; then
  python3 -m patchdsl.cli bench plot "${files[@]}" --png "$OUT/bench.png" >>"$LOG" 2>&1
  python3 -m patchdsl.cli bench summary "${files[@]}" >"$OUT/summary.txt" 2>>"$LOG"
fi
rm -f "$OUT"/*.tmp
{
  echo
  echo "=============================== SUMMARY ($(( $(date +%s) - t_start ))s) ==============================="
  grep -E "^(NVIDIA|GPU )|^torch " "$LOG" | head -n 3
  printf '%s\n' ${status[@]+"${status[@]}"}
  [ -f "$OUT/tests.log" ] && grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 8
  [ -f "$OUT/summary.txt" ] && cat "$OUT/summary.txt"
  [ -f "$OUT/specialise.txt" ] && cat "$OUT/specialise.txt" && cat "$OUT/specialise.txt" >>"$OUT/summary.txt" \
    && rm -f "$OUT/specialise.txt"    # at most 8 files come back from the device machine
  echo "files: $(cd "$OUT" && ls | tr '\n' ' ')"
} 2>&1
exit 0

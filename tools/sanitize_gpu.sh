#!/usr/bin/env bash
# compute-sanitizer over the tree-verify attention kernels (issue 19: memcheck and racecheck clean), on
# the H200: memcheck, racecheck and synccheck, each over tools/sanitize_attention.py (versions 5 to 13,
# the wgmma kernels, at 8 heads x 9 and x 65 queries over a 1,000-token prefix, the prefix alone, a
# workspace call and a ragged batch of 3 with trees of 1 to 65 rows; one version 3 call; every output
# checked against the float64 reference). Run from the repo root:
#
#   device call:  OUT=$OUT KDLIB_COMMIT=<sha> bash tools/sanitize_gpu.sh
#       KDLIB_SANITIZE_TOOLS: the tools, in order (default "memcheck racecheck synccheck"; initcheck
#       is also summarized); KDLIB_SANITIZE_FLAGS: extra compute-sanitizer options for every tool;
#       KDLIB_SANITIZE_CASES: the driver's cases by name prefix (e.g. "v7" or "v6,v7"; default all);
#       KDLIB_SANITIZE_BUDGET_S: the seconds a caller's own time limit leaves this script: every step is
#       cut to what is left of them less 20 s, so that the summary is written before the caller stops it.
#       v7's checking build (bar.sync handoffs, every lane arriving: the forms racecheck follows,
#       tools/racecheck_patterns.py): KDLIB_NVRTC_OPTIONS="-DTV7_RACECHECK=1 -lineinfo" KDLIB_SANITIZE_CASES=v7.
#
# First the driver runs once without a sanitizer (warm: NVRTC compiles the kernels into CuPy's disk
# cache and the cases are checked), then once under each tool, each step under its own time limit
# (~9 min at most in all, or KDLIB_SANITIZE_BUDGET_S). $OUT gets nvidia-smi.txt, warm.log / warm.json,
# <tool>.log (sanitizer and driver output), <tool>.json (the driver's cases), <tool>.rc, summary.txt and
# sanitize.json (per tool: exit code, findings, cases passed, kernels covered; `clean`). Exit code 0 when
# every tool is clean.
set -u
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTORCH_NO_CUDA_MEMORY_CACHING=1
DRIVER=tools/sanitize_attention.py

CS=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
  /usr/local/cuda-*/bin/compute-sanitizer; do
  [ -z "$CS" ] && [ -x "$c" ] && CS=$c
done
if [ -z "$CS" ]; then
  echo "compute-sanitizer not found (PATH, /usr/local/cuda*/bin): nothing run" | tee -a "$OUT/summary.txt"
  exit 2
fi
"$CS" --version 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"

# A TERM or INT (a caller's own time limit) reaches the running step too: its `timeout` is in a process group of
# its own, which the caller's signal would miss, leaving the sanitizer on the GPU under the next step.
CHILD=
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; exit 143' TERM
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; exit 130' INT
BUDGET=${KDLIB_SANITIZE_BUDGET_S:-100000}
BUDGET=${BUDGET%%.*}  # whole seconds: bash counts in integers
DEADLINE=$(( $(date +%s) + ${BUDGET:-0} - 20 ))  # the summary's 20 s kept back
step() {  # step NAME SECONDS COMMAND...: output in $OUT/NAME.log, exit code in $OUT/NAME.rc
  local name=$1 secs=$2 start rc
  shift 2
  start=$(date +%s)
  if (( DEADLINE - start < secs )); then secs=$(( DEADLINE - start )); fi
  if (( secs <= 0 )); then  # no time left: recorded as a timeout, the summary still written
    echo 124 >"$OUT/$name.rc"
    echo "no time left in KDLIB_SANITIZE_BUDGET_S" >"$OUT/$name.log"
    printf '%-10s rc=124   0s  (no time left)\n' "$name" | tee -a "$OUT/summary.txt"
    return
  fi
  timeout --kill-after=5 "$secs" "$@" >"$OUT/$name.log" 2>&1 &
  CHILD=$!
  wait "$CHILD"  # in the background: a trapped signal interrupts `wait`, not a foreground job it would wait for
  rc=$?
  CHILD=
  echo "$rc" >"$OUT/$name.rc"
  printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$*" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log"
}

limit() {  # seconds a tool gets: racecheck instruments every shared-memory access and is the slowest
  case $1 in racecheck) echo 200 ;; memcheck) echo 150 ;; *) echo 120 ;; esac
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  >"$OUT/nvidia-smi.txt" 2>&1
step warm 90 python3 $DRIVER run --json "$OUT/warm.json"
if [ "$(cat "$OUT/warm.rc")" != 0 ]; then
  echo "the driver fails without a sanitizer: no tool run (see warm.log)" | tee -a "$OUT/summary.txt"
  exit 1
fi
for tool in ${KDLIB_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  # shellcheck disable=SC2086  # KDLIB_SANITIZE_FLAGS is a list of options
  step "$tool" "$(limit "$tool")" "$CS" --tool "$tool" --error-exitcode 9 ${KDLIB_SANITIZE_FLAGS:-} \
    python3 $DRIVER run --json "$OUT/$tool.json"
done
python3 $DRIVER summarize "$OUT" | tee -a "$OUT/summary.txt"
exit "${PIPESTATUS[0]}"

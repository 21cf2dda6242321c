#!/usr/bin/env bash
# The verify attention's levers (issue 19) measured in device calls on the H200, each step under its own time
# limit. Run from the repo root:
#
#   OUT=$OUT KDLIB_COMMIT=<sha> [KDLIB_AB=... [KDLIB_AB_VERSION=N]] bash tools/attention_levers_gpu.sh [STEP ...]
#                                                              (no STEP: tests timeline phases)
#
#   tests      the GPU tests of the plan's kernel and host paths (test_cuda_attention.py: plan_kernel, own_plan,
#              reuse_plan) and of the traced build (test_attention_timeline.py)
#   ab         each switch of KDLIB_AB (SUITE:NAME=VALUE[,NAME=VALUE...], space-separated; required for this
#              step) against this tree's default build: tools/kernel_ab.py run --version KDLIB_AB_VERSION
#              (default 10) --define (one per NAME=VALUE, the switches together), one process, arms
#              alternating, outputs compared bit for bit; add kernel_ab_aa:AB_NO_SWITCH=1 (a macro no source
#              reads) for an A/A beside them: the spread of the call's arms
#              -> r/<SUITE>.<gpu>.json
#   timeline   the attention_timeline suite (the consumers' pair in SM clocks at the 8 x 65 and 8 x 9 points)
#   phases     the plan kernel's phases (tools/plan_phases.py phases)
#   v11        the GPU tests of version 11 (its cluster kernel: test_cuda_attention.py -k v11, the constants) and of
#              the cluster primitives it shares (test_cluster_exchange.py)
#   v12        the GPU tests of version 12 (v7's consumers, the rows past 64 in the producer: test_cuda_attention.py
#              -k v12, the constants)
#   v13        the GPU tests of version 13 (its cluster pairs that merge a row block's two jobs: test_cuda_attention.py
#              -k v13, the constants)
#   duel       the attention suite over KDLIB_ATTENTION_IMPLS (default wgmma_v13,wgmma_v10: the first is the one
#              the duels time) with FlashInfer, from .carry/attention_site.tar.xz (carry [".carry"]; made here by
#              `bash tools/attention_gpu.sh fetch-wheels`) -> r/duel/attention.<gpu>.json
#   probe      tools/v11_probe.py at the two 8 x 9 points: each kernel's device time a verify for versions 10, 11
#              and 12 (--also wgmma_v12), and each build of KDLIB_PROBE_DEFINES (IMPL:NAME=VALUE, space-separated;
#              none by default); no forced cluster counts -> r/attention_v11_probe.<gpu>.json
#   suite      the attention suite over KDLIB_ATTENTION_IMPLS (default wgmma_v10,wgmma_v12: the default first, as
#              the headline), no FlashInfer -> r/attention.<gpu>.json
#   sanitize   compute-sanitizer memcheck and synccheck over the driver's cases of KDLIB_SANITIZE_CASES (default
#              v11,v12: the one-pass kernels; tools/sanitize_gpu.sh), then racecheck over the same cases in the
#              checking build (-DTV7_RACECHECK=1) -> r/san, r/san_check
#   rows       tools/rows_sweep.py: the default verify at 8 heads and 1 to 9 queries over 200k and over 8 x 32k,
#              with the consumers-alone probe and, where version 7's consumers run, the gathers-alone
#              -> r/attention_rows.<gpu>.json
#   rate       the wgmma_rate suite (each warpgroup MMA shape of the attend kernels alone on every SM)
#              -> r/wgmma_rate.<gpu>.json
#   shard1, shard2
#              the whole GPU suite in two shares of equal test counts (tests/conftest.py's --shard), each test's
#              seconds in r/shardK.xml (what a split by time would read)
#   ncu        Nsight Compute's source counters (PC sampling: the warps' stall reasons per SASS instruction)
#              and speed-of-light and memory sections of KDLIB_NCU_IMPL's attend kernel (default wgmma_v10: v7's
#              consumers) built with -lineinfo, at 8 x Q x 200k for each Q of KDLIB_NCU_QUERIES (default
#              "65 9"): the report, its source page (SASS, CSV) and its details page (CSV)
#              -> r/ncu_src.[vN.]<point>.{ncu-rep,csv,details.csv} (vN. for an impl other than wgmma_v10),
#              which tools/ncu_source.py maps to source lines here
#
# Each step's time limit is below a device call's 600 s; r/summary.txt records the seconds each took.
# Everything lands in $OUT/r, packed into $OUT/r.tgz after each step (a device call returns at most 8 files);
# r/summary.txt has a line per step (its exit code and seconds).
set -u
: "${OUT:?set OUT to the output folder}"
R="$OUT/r"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
AB=${KDLIB_AB:-}
AB_VERSION=${KDLIB_AB_VERSION:-10}
NCU_IMPL=${KDLIB_NCU_IMPL:-wgmma_v10}
NCU_QUERIES=${KDLIB_NCU_QUERIES:-65 9}
STEPS=${*:-tests timeline phases}
for step in $STEPS; do
  case $step in
    tests | v11 | v12 | v13 | duel | probe | suite | sanitize | rows | rate | shard1 | shard2 | timeline | phases \
      | ncu) ;;
    ab) [ -n "$AB" ] || { echo "step ab needs KDLIB_AB (SUITE:NAME=VALUE[,NAME=VALUE...] ...)" >&2; exit 2; } ;;
    *) echo "unknown step $step (tests v11 v12 v13 duel probe suite sanitize rows rate shard1 shard2 ab timeline" \
         "phases ncu)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$R"
T0=$(date +%s)

pack() { tar czf "$OUT/r.tgz.tmp" -C "$OUT" r && mv "$OUT/r.tgz.tmp" "$OUT/r.tgz"; }
run() {  # run NAME SECONDS COMMAND...: output in r/NAME.log; a line in r/summary.txt; r.tgz repacked
  local name=$1 secs=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=5 "$secs" "$@" >"$R/$name.log" 2>&1
  rc=$?
  printf '%-22s rc=%-3s %4ss (at +%ss)  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$((start - T0))" \
    "$*" | tee -a "$R/summary.txt"
  tail -n 4 "$R/$name.log"
  pack
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  >"$R/nvidia-smi.txt" 2>&1
git rev-parse --short HEAD >"$R/commit.txt" 2>/dev/null || echo "${KDLIB_COMMIT:-unknown}" >"$R/commit.txt"
for step in $STEPS; do
  case $step in
    tests)
      run tests 240 python3 -m pytest -m gpu tests/test_cuda_attention.py tests/test_attention_timeline.py \
        -q -p no:cacheprovider -k "plan_kernel or own_plan or reuse or traced_build" \
        --junitxml="$R/tests.xml" ;;
    v11)
      run v11 240 python3 -m pytest -m gpu tests/test_cuda_attention.py tests/test_kernel_constants.py \
        tests/test_cluster_exchange.py -q -p no:cacheprovider -k "v11 or cluster or wgmma_constants" \
        --junitxml="$R/v11.xml" ;;
    v12)
      run v12 240 python3 -m pytest -m gpu tests/test_cuda_attention.py tests/test_kernel_constants.py \
        -q -p no:cacheprovider -k "v12 or wgmma_constants" --junitxml="$R/v12.xml" ;;
    v13)
      run v13 240 python3 -m pytest -m gpu tests/test_cuda_attention.py tests/test_kernel_constants.py \
        -q -p no:cacheprovider -k "v13 or wgmma_constants" --junitxml="$R/v13.xml" ;;
    duel)
      if [ -f .carry/attention_site.tar.xz ]; then
        mkdir -p /tmp/site && tar -xJf .carry/attention_site.tar.xz -C /tmp/site
      else
        echo "duel: no .carry/attention_site.tar.xz, no FlashInfer arm" | tee -a "$R/summary.txt"
      fi
      run duel 300 env PYTHONPATH="/tmp/site:$PYTHONPATH" \
        KDLIB_ATTENTION_IMPLS="${KDLIB_ATTENTION_IMPLS:-wgmma_v13,wgmma_v10}" \
        python3 -m kdlib.perf.run --suite attention --out "$R/duel" ;;
    probe)
      defs=()
      for d in ${KDLIB_PROBE_DEFINES:-}; do defs+=(--define "$d"); done
      run probe 200 python3 tools/v11_probe.py --out "$R" --also wgmma_v12 "${defs[@]}" --clusters ;;
    suite)
      run suite 300 env KDLIB_ATTENTION_IMPLS="${KDLIB_ATTENTION_IMPLS:-wgmma_v10,wgmma_v12}" \
        python3 -m kdlib.perf.run --suite attention --out "$R" ;;
    sanitize)
      cases=${KDLIB_SANITIZE_CASES:-v11,v12}
      run sanitize 280 env OUT="$R/san" KDLIB_SANITIZE_CASES="$cases" KDLIB_SANITIZE_TOOLS="memcheck synccheck" \
        KDLIB_SANITIZE_BUDGET_S=275 bash tools/sanitize_gpu.sh
      run sanitize_check 260 env OUT="$R/san_check" KDLIB_SANITIZE_CASES="$cases" KDLIB_SANITIZE_TOOLS=racecheck \
        KDLIB_SANITIZE_BUDGET_S=255 KDLIB_NVRTC_OPTIONS="-DTV7_RACECHECK=1 -lineinfo" bash tools/sanitize_gpu.sh ;;
    rows)
      run rows 420 python3 tools/rows_sweep.py --out "$R" ;;
    rate)
      run rate 150 python3 -m kdlib.perf.run --suite wgmma_rate --out "$R" ;;
    shard1 | shard2)
      run "$step" 540 python3 -m pytest -m gpu tests --shard "${step#shard}/2" -q -p no:cacheprovider \
        --junitxml="$R/$step.xml" ;;
    ab)
      for pair in $AB; do
        IFS=, read -r -a parts <<<"${pair#*:}"
        defs=()
        for d in "${parts[@]}"; do defs+=(--define "$d"); done
        run "${pair%%:*}" 150 python3 tools/kernel_ab.py run --version "$AB_VERSION" "${defs[@]}" \
          --suite "${pair%%:*}" --out "$R"
      done ;;
    timeline)
      run timeline 240 python3 -m kdlib.perf.run --suite attention_timeline --out "$R" ;;
    phases)
      run phases 90 python3 tools/plan_phases.py phases --out "$R" ;;
    ncu)  # up to 8 requests version 10's attend kernel makes its own plan: tree_verify_v10_attend_own
      v=${NCU_IMPL#wgmma_v}
      tag=v$v.
      [ "$v" = 10 ] && tag=
      for nq in $NCU_QUERIES; do
        name=ncu_src.${tag}8x${nq}x200k
        run "$name" 100 env KDLIB_NVRTC_OPTIONS=-lineinfo ncu --clock-control none \
          --kernel-name "regex:^tree_verify_v${v}_attend(_own)?$" --launch-skip 1 --launch-count 1 \
          --section SourceCounters --section WarpStateStats --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --import-source yes -f -o "$R/$name" \
          python3 tools/ncu_verify.py --impl "$NCU_IMPL" --heads 8 --queries "$nq" --prefix 200000
        run "$name.export" 40 ncu --import "$R/$name.ncu-rep" --page source --csv --print-source sass
        mv "$R/$name.export.log" "$R/$name.csv"
        run "$name.details" 40 ncu --import "$R/$name.ncu-rep" --page details --csv
        mv "$R/$name.details.log" "$R/$name.details.csv"
      done ;;
  esac
done
echo "total $(($(date +%s) - T0))s" | tee -a "$R/summary.txt"
pack

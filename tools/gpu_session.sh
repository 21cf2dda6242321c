#!/usr/bin/env bash
# One core GPU session: GPU tests (the tree kernels' v4 and golden cases; the attention tests are
# tools/attention_levers_gpu.sh's), sanitizers over the tree kernels and the benchmark suites ceilings, kernels,
# moe, moe_stream, engine, diagnosis, fragmentation and tp (the attention suites: attention_record_gpu.sh and
# attention_levers_gpu.sh; the rank: k2_rank_gpu.sh), each step under its own time limit, so a slow or failing
# step costs only itself. Run from the repo root on the GPU machine:
#
#   OUT=/some/dir KDLIB_COMMIT=<sha> bash tools/gpu_session.sh
#
# Results: $OUT/r/<suite>.<gpu>.json (with provenance), one log per step, summary.txt; the whole
# folder is re-packed into $OUT/session.tgz after every step (the device tool returns <= 8 files).
set -u
: "${OUT:?set OUT to the output folder}"
R="$OUT/r"
mkdir -p "$R"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)

step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (limit ${secs}s, at +$((start - T0))s)"
  timeout --kill-after=5 "$secs" "$@" >"$R/$name.log" 2>&1
  rc=$?
  printf '%-22s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$*" | tee -a "$R/summary.txt"
  tail -n 3 "$R/$name.log"
  tar czf "$OUT/session.tgz.tmp" -C "$OUT" r && mv "$OUT/session.tgz.tmp" "$OUT/session.tgz"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$R/nvidia-smi.txt" 2>&1
step ceilings        45 python3 -m kdlib.perf.run --suite ceilings --out "$R"
step test_tree_v4    75 python3 -m pytest -m gpu tests/test_cuda_tree.py "-k=-4] or golden" -q -p no:cacheprovider
step tests_gpu      140 python3 -m pytest -m gpu tests -q -p no:cacheprovider --ignore=tests/test_cuda_attention.py \
                          --ignore=tests/test_cuda_tree.py \
                          --junitxml="$R/tests_gpu.xml"
step kernels         80 env KDLIB_TREE_VERSIONS=3,4 KDLIB_KERNELS_ATTENTION=quick \
                          python3 -m kdlib.perf.run --suite kernels --out "$R"
step moe            100 python3 -m kdlib.perf.run --suite moe --out "$R"
step moe_stream      90 python3 -m kdlib.perf.run --suite moe_stream --out "$R"
step engine        420 taskset -c 2 python3 -m kdlib.perf.run --suite engine --out "$R"   # full: ~290 s
step diag_frag       60 python3 -m kdlib.perf.run --suite diagnosis --suite fragmentation --quick --out "$R"
step sanitize_v4     20 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu \
                          tests/test_cuda_tree.py "-k=test_build_random_bit_exact and -4]" -q -p no:cacheprovider
step racecheck      110 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m kdlib.cuda.pipeline --no-pool
# several GPUs only (exits at once on one): NCCL checks, TP step time, all-reduce sweeps; ~95 s on 2 GPUs
step tp             240 taskset -c 2-9 python3 -m kdlib.perf.run --suite tp --out "$R"
echo "total $(($(date +%s) - T0))s"

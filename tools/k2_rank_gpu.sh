#!/usr/bin/env bash
# One TP8 rank of Kimi-K2.6 on one H200 (issue 18): the rank's GPU tests, then the k2_rank suite
# (memory check, then the step grid in priority order, the JSON rewritten after every row), then a
# short table. K2_RANK_TOTAL_S seconds in all (default 340); the grid stops itself after K2_RANK_BUDGET_S
# seconds (default: what is left of the total after the tests, less 70 s) and lists the rows it cut;
# the suite's other K2_RANK_* settings pass through (kdlib/perf/suites/k2_rank.py). Run from the repo
# root on the GPU machine:
#
#   OUT=/some/dir KDLIB_COMMIT=<sha> [K2_RANK_TOTAL_S=560] [K2_RANK_RESUME=earlier.json] bash tools/k2_rank_gpu.sh
#
# Results: $OUT/k2_rank.<gpu>.json (provenance inside), $OUT/tests.log, $OUT/suite.log.
set -u
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv >"$OUT/nvidia-smi.txt" 2>&1
timeout --kill-after=5 200 python3 -m pytest -m gpu tests/test_k2_rank.py -x -q -p no:cacheprovider >"$OUT/tests.log" 2>&1
echo "tests rc=$? ($(($(date +%s) - T0)) s)"; tail -n 4 "$OUT/tests.log"
TOTAL=${K2_RANK_TOTAL_S:-340}
export K2_RANK_BUDGET_S=${K2_RANK_BUDGET_S:-$((TOTAL - 70 - ($(date +%s) - T0)))}
timeout --kill-after=5 $((TOTAL - ($(date +%s) - T0))) python3 -m kdlib.perf.run --suite k2_rank --out "$OUT" >"$OUT/suite.log" 2>&1
echo "suite rc=$? ($(($(date +%s) - T0)) s)"; tail -n 6 "$OUT/suite.log"
for f in "$OUT"/k2_rank.*.json; do [ -f "$f" ] && python3 -m kdlib.perf.suites.k2_rank "$f"; done
echo "total $(($(date +%s) - T0)) s"

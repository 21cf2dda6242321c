#!/usr/bin/env bash
# One device call: every GPU test, then racecheck over versions 8, 9 and 10 in their checking build
# (-DTV7_RACECHECK=1, tools/sanitize_gpu.sh; packed as sanitize_check.tgz). The serving wheels, installed into
# /tmp/site beforehand (pip --no-index --target /tmp/site <wheels>), let the serving tests run. From the repo root:
#   bash tools/gpu_tests_racecheck.sh <commit>     (files under $OUT)
# Exit code: the worst step's (0 when the tests pass and racecheck is clean).
set -uo pipefail
export KDLIB_COMMIT=${1:?sha} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site
T0=$(date +%s)
worst=0
t() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
keep() { [ "$1" -gt "$worst" ] && worst=$1; echo "rc $1"; }
t tests
timeout 430 python3 -m pytest -m gpu tests -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tail -15
keep $?
t racecheck
OUT=/tmp/san/check KDLIB_NVRTC_OPTIONS="-DTV7_RACECHECK=1 -lineinfo" KDLIB_SANITIZE_CASES=v8,v9,v10 KDLIB_SANITIZE_TOOLS=racecheck KDLIB_SANITIZE_BUDGET_S=145 timeout 150 bash tools/sanitize_gpu.sh >/tmp/san_check.log 2>&1
keep $?
cat /tmp/san/check/summary.txt
tar -czf "$OUT/sanitize_check.tgz" -C /tmp san san_check.log
t done
exit "$worst"

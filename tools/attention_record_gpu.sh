#!/usr/bin/env bash
# One device call that records the verify attention (issue 19), run from the repo root on the H200 with the
# FlashInfer site packed as .carry/attention_site.tar.xz (tools/attention_gpu.sh fetch-wheels makes it):
#   bash tools/attention_record_gpu.sh <commit>     (files under $OUT)
# the attention suite (the wgmma versions, mma_v3, FlashInfer, PyTorch), attention_bounds, attention_gate (version
# 10's two deals), ncu reports of the default's attend kernels at 8 heads x 1 query x 200k (version 9's consumers)
# and at 8 x 65 x 200k (version 7's), compute-sanitizer memcheck and synccheck over versions 8, 9 and 10
# (tools/sanitize_gpu.sh, packed as sanitize_default.tgz). Exit code: the worst step's.
set -uo pipefail
export KDLIB_COMMIT=${1:?sha} PYTHONUNBUFFERED=1
mkdir -p /tmp/site && tar -xJf .carry/attention_site.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site
T0=$(date +%s)
worst=0
t() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
keep() { [ "$1" -gt "$worst" ] && worst=$1; echo "rc $1"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t attention
KDLIB_ATTENTION_IMPLS=wgmma_v10,wgmma_v9,wgmma_v8,wgmma_v7,wgmma_v6,wgmma,mma_v3 timeout 220 python3 -m kdlib.perf.run --suite attention --out "$OUT" 2>&1 | tail -30
keep $?
t attention_bounds
timeout 130 python3 -m kdlib.perf.run --suite attention_bounds --out "$OUT" 2>&1 | tail -8
keep $?
t attention_gate
timeout 90 python3 -m kdlib.perf.run --suite attention_gate --out "$OUT" 2>&1 | tail -4
keep $?
t ncu
# the attend kernels as the default launches them (the plan made in the attend kernel: the _own names)
timeout 90 bash tools/ncu_attend.sh "^tree_verify_v10_attend_t(_own)?$" "$OUT/ncu_v10_attend_t.8x1x200k.txt" \
  --impl wgmma_v10 --queries 1; keep $?
grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)" "$OUT/ncu_v10_attend_t.8x1x200k.txt" | head
timeout 60 bash tools/ncu_attend.sh "^tree_verify_v10_attend(_own)?$" "$OUT/ncu_v10_attend.8x65x200k.txt" \
  --impl wgmma_v10 --queries 65; keep $?
t sanitize
OUT=/tmp/san/default KDLIB_SANITIZE_CASES=v8,v9,v10 KDLIB_SANITIZE_TOOLS="memcheck synccheck" KDLIB_SANITIZE_BUDGET_S=255 timeout 260 bash tools/sanitize_gpu.sh >/tmp/san_default.log 2>&1
keep $?
cat /tmp/san/default/summary.txt
tar -czf "$OUT/sanitize_default.tgz" -C /tmp san san_default.log
t done
exit "$worst"

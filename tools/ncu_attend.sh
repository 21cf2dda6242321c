#!/usr/bin/env bash
# Nsight Compute's report of one verify attend kernel with the sections notebook 02b reads (section 13), on the GPU
# machine from the repo root:
#   bash tools/ncu_attend.sh KERNEL_REGEX REPORT [tools/ncu_verify.py's options]
# The second launch of a kernel whose name matches KERNEL_REGEX (the first compiles and warms), clocks unlocked;
# REPORT gets ncu's text. Exit: 1 where ncu profiled no kernel (a regex that names none: the step once profiled
# nothing and said success), else ncu's code.
set -uo pipefail
regex=${1:?kernel name regex} report=${2:?report file}
shift 2
ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
  python3 "$(dirname "$0")/ncu_verify.py" "$@" >"$report" 2>&1
rc=$?
if grep -q "No kernels were profiled" "$report"; then
  echo "no kernel profiled: $report" >&2
  exit 1
fi
exit "$rc"

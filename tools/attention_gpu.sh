#!/usr/bin/env bash
# Issue 19 in one device call on the H200: GPU tests of the attention kernels, the attention suite
# (the wgmma versions vs the previous default vs PyTorch vs FlashInfer), and ncu reports of
# tree_verify_v6_attend and tree_verify_v7_attend (the default and its successor when this script was
# written; tools/attention_record_gpu.sh records today's default) at 8 heads x 65 queries x 200k prefix. Each step runs under its own time limit (~9 min at most in all).
#
#   here, once (needs PyPI):  bash tools/attention_gpu.sh fetch-wheels
#       -> .whl/attention/ (git-ignored): flashinfer-python 0.7.2.post1 without the sources of kernels other
#          than the Hopper MLA one (30 MB of the 62) + apache-tvm-ffi 0.1.15.post2, for Python 3.12, and the
#          two unpacked as .carry/attention_site.tar.xz (git-ignored, ~15 MB: the wheels and the tree together
#          pass the 64 MiB a device call carries)
#   device call (carry [".carry"]):  OUT=$OUT KDLIB_COMMIT=<sha> bash tools/attention_gpu.sh
#       KDLIB_FLASHINFER=0 skips FlashInfer (its MLA kernel JIT-compiles with nvcc on first use, ~20-35 s);
#       KDLIB_NCU=0 skips the ncu reports, KDLIB_NCU_IMPLS=v7 keeps one; KDLIB_ATTENTION_TESTS=0 the GPU tests of step (a).
#
# $OUT gets attention.<gpu>.json (provenance stamped), tests.xml, smoke.log, smoke_v7.log, tests.log,
# bench.log, ncu_v6.txt, ncu_v7.txt (tools/ncu_attend.sh's reports) with ncu_v6.log and ncu_v7.log, nvidia-smi.txt
# and summary.txt: 13 files.
set -u

if [ "${1:-}" = fetch-wheels ]; then
  set -e
  W=.whl/attention
  mkdir -p $W/dl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d $W/dl flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
  mv $W/dl/apache_tvm_ffi-*.whl $W/
  # flashinfer's JIT sources for every other kernel (csrc subfolders and .cu files) stay behind
  python3 - $W/dl/flashinfer_python-0.7.2.post1-py3-none-any.whl $W/ <<'PY'
import os, sys, zipfile
src, out = sys.argv[1], os.path.join(sys.argv[2], os.path.basename(sys.argv[1]))
def keep(name):
    pre = "flashinfer/data/csrc/"
    if not name.startswith(pre):
        return True
    rest = name[len(pre):]
    return "/" not in rest and (not rest.endswith(".cu") or rest.startswith("batch_mla_sm90_"))
zin = zipfile.ZipFile(src)
kept = [i for i in zin.infolist() if keep(i.filename)]
names = {i.filename for i in kept}
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for i in kept:
        data = zin.read(i.filename)
        if i.filename.endswith(".dist-info/RECORD"):
            data = "".join(l + "\n" for l in data.decode().splitlines() if l.split(",")[0] in names).encode()
        zout.writestr(i, data)
print(f"{out}: {len(kept)} of {len(zin.infolist())} files, {os.path.getsize(out) / 1e6:.1f} MB")
PY
  rm -rf $W/dl
  site=$(mktemp -d)
  for w in $W/*.whl; do python3 -m zipfile -e "$w" "$site"; done
  mkdir -p .carry
  tar -C "$site" -cf - . | xz -9 -T0 >.carry/attention_site.tar.xz
  rm -rf "$site"
  du -sh $W .carry/attention_site.tar.xz
  exit 0
fi

: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
step() {  # step NAME SECONDS COMMAND...: its output in $OUT/NAME.log
  local name=$1 secs=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=5 "$secs" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '%-8s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$*" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  >"$OUT/nvidia-smi.txt" 2>&1
if [ "${KDLIB_FLASHINFER:-1}" != 0 ] && [ -f .carry/attention_site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .carry/attention_site.tar.xz -C /tmp/site \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "unpack failed: no FlashInfer arm" | tee -a "$OUT/summary.txt"
elif [ "${KDLIB_FLASHINFER:-1}" != 0 ] && ls .whl/attention/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/attention/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || echo "wheel install failed: no FlashInfer arm" | tee -a "$OUT/summary.txt"
fi

# (0) smoke: the wgmma kernels compile, run, terminate and match float64 on a ragged batch, versions 7
#     and 8 (v7's attend kernel) on their own; what fails is left out of the rest (no time spent on a
#     broken or hanging kernel)
passed() { grep -q " passed" "$1" && ! grep -q -E "failed|error" "$1"; }
step smoke 60 python3 -m pytest -m gpu tests/test_cuda_attention.py -x -q -p no:cacheprovider \
  -k "wgmma_plan_kernel or (wgmma_bit_reproducible and not wgmma_v7 and not wgmma_v8)"
step smoke_v7 60 python3 -m pytest -m gpu tests/test_cuda_attention.py -x -q -p no:cacheprovider \
  -k "(wgmma_bit_reproducible and (wgmma_v7 or wgmma_v8)) or v8_combine_of_every_width"
NCU_IMPLS=""
if passed "$OUT/smoke.log" && passed "$OUT/smoke_v7.log"; then
  TEST_MMA=wgmma_v8,wgmma_v7,wgmma_v6,wgmma
  NCU_IMPLS="v6 v7"
elif passed "$OUT/smoke.log"; then
  TEST_MMA=wgmma_v6,wgmma
  NCU_IMPLS=v6
  export KDLIB_ATTENTION_IMPLS=${KDLIB_ATTENTION_IMPLS:-wgmma_v6,wgmma,mma_v3}
  echo "version 7 / 8 smoke failed: tests and suite without them" | tee -a "$OUT/summary.txt"
else
  TEST_MMA=mma_v3
  export KDLIB_ATTENTION_IMPLS=mma_v3
  echo "smoke failed: tests and suite without wgmma" | tee -a "$OUT/summary.txt"
fi
# (a) the GPU tests of the attention kernels; the tensor-core random sweeps on the new kernel alone
#     (KDLIB_TEST_MMA), the long-prefix, golden and merge tests on every version
#     (KDLIB_ATTENTION_TESTS=0 skips them, for a call that runs the whole GPU test suite first)
if [ "${KDLIB_ATTENTION_TESTS:-1}" != 0 ]; then
  step tests 150 env KDLIB_TEST_MMA=$TEST_MMA python3 -m pytest -m gpu tests/test_cuda_attention.py -x -q \
    -p no:cacheprovider --junitxml="$OUT/tests.xml"
fi
# (b) the attention suite: no new point starts past KDLIB_ATTENTION_BUDGET_S
step bench 170 env KDLIB_ATTENTION_BUDGET_S=110 python3 -m kdlib.perf.run --suite attention --out "$OUT"
# (c) ncu of the default and of v7 at the issue's first row (second call: the first compiles and warms); up to 8
#     requests version 10's attend kernel makes its own plan and is named tree_verify_v10_attend_own
[ "${KDLIB_NCU:-1}" = 0 ] && NCU_IMPLS=""
if [ -n "${KDLIB_NCU_IMPLS:-}" ]; then  # e.g. "v7": those of them that passed the smoke
  NCU_IMPLS=$(for v in $NCU_IMPLS; do case " $KDLIB_NCU_IMPLS " in *" $v "*) echo "$v" ;; esac; done)
fi
for v in $NCU_IMPLS; do
  step ncu_$v 50 env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" bash tools/ncu_attend.sh \
    "^tree_verify_${v}_attend(_own)?$" "$OUT/ncu_$v.txt" --impl wgmma_$v
done
echo "total $(($(date +%s) - T0))s" | tee -a "$OUT/summary.txt"
ls "$OUT"

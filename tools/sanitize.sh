#!/usr/bin/env bash
# compute-sanitizer over every forced kernel path, forward and backward, the
# fused epilogue, every dtype and both layouts (the GPU tests that force
# them): memcheck, racecheck, synccheck and initcheck. Each tool's log goes
# to $OUT/sanitize-<tool>.log (default: gpu-logs/); the last lines printed
# are each tool's summary. Exit status 1 if any tool reports an error.
#   bash tools/sanitize.sh [tool ...]      (default: all four)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
# the forced forward and backward paths, the instantiations only forcing
# reaches, the backward tilings and stream
# kernels, and the epilogue on every forced path
SELECTION='forced_paths or instantiations_no_other or backward_tilings or backward_stream_kernel or backward_stream_channels_last_kernel or covers_both_merges or ring_of_partials'
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck initcheck)
python3 -c "import groupnorm_inline" || exit 1  # build outside the sanitizer
status=0
for tool in "${tools[@]}"; do
  # torch's own allocations are not ours to check: leak reports off, and
  # the caching allocator's memory left uninitialised by design (initcheck);
  # racecheck only in our kernels: it flags torch's warp-synchronous
  # reductions (the tests' float64 references), and instrumenting them all
  # takes it past ten minutes
  "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 20 \
      $( [ "$tool" = memcheck ] && echo --leak-check no ) \
      $( [ "$tool" = racecheck ] && echo --kernel-name kns=groupnorm ) \
      python3 -m pytest -q -x -p no:cacheprovider test_groupnorm.py -k "$SELECTION" \
      > "$OUT/sanitize-$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize-$tool.log" | tail -2 | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
done
exit $status

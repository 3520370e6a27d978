#!/usr/bin/env bash
# One GPU session's worth of evidence: build, the full test suite, the
# self-check and the benchmark, each logged under $OUT (default: gpu-logs/).
#   bash benchmarks/run_gpu.sh [tests] [selfcheck] [bench] [training] [quick]
#   (default: tests selfcheck bench)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps="${*:-tests selfcheck bench}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python3 -c "import groupnorm_inline" 2>&1 | tee "$OUT/build.log" || exit 1
status=0
for step in $steps; do
  case $step in
    tests) python3 -m pytest -q -rfE --tb=short test_groupnorm.py 2>&1 | tee "$OUT/tests.log" || status=1 ;;
    selfcheck) python3 groupnorm_inline.py 2>&1 | tee "$OUT/selfcheck.log" || status=1 ;;
    bench) python3 benchmarks/bench_groupnorm.py --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
             --png "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" || status=1 ;;
    training) python3 benchmarks/bench_groupnorm.py --training --json "$OUT/training.json" \
             --markdown "$OUT/training.md" 2>&1 | tee "$OUT/training.log" || status=1 ;;
    quick) python3 benchmarks/bench_groupnorm.py --quick --markdown "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" || status=1 ;;
  esac
done
exit $status

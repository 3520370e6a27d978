#!/usr/bin/env bash
# One GPU session's worth of evidence: build, the full test suite, the
# self-check and the benchmarks, each logged under $OUT (default: gpu-logs/).
#   bash benchmarks/run_gpu.sh [tests] [selfcheck] [bench] [training] [quick] [host] [models]
#                              [ab] [epilogue] [sanitize] [coverage] [soak] [-k EXPR]
#   (default: tests selfcheck bench training; -k passes a test selection to pytest;
#   host: host_overhead.py; models: models.py; ab: ab_compare.py against the
#   checkout at $AB_BASE; epilogue: bench_epilogue.py; sanitize: tools/sanitize.sh; coverage: the GPU tests
#   under tools/kernel_coverage.py, which fails on a built kernel never launched;
#   soak: tools/soak.py, 60 s of random calls with every option)
# At most eight files, so every one comes back from a remote run: env.txt
# (card, versions, build), tests.log, selfcheck.log, bench.{json,md,png},
# training.{json,md}. Tables also go to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=()
select=()
while [ $# -gt 0 ]; do
  case $1 in
    -k) select=(-k "$2"); shift 2 ;;
    *) steps+=("$1"); shift ;;
  esac
done
[ ${#steps[@]} -eq 0 ] && steps=(tests selfcheck bench training)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c "import groupnorm_inline" 2>&1 | tee -a "$OUT/env.txt" || exit 1
status=0
for step in "${steps[@]}"; do
  case $step in
    tests) python3 -m pytest -q -rfEs --tb=short ${select[@]+"${select[@]}"} test_*.py 2>&1 | tee "$OUT/tests.log" || status=1 ;;
    selfcheck) python3 groupnorm_inline.py 2>&1 | tee "$OUT/selfcheck.log" || status=1 ;;
    bench) python3 benchmarks/bench_groupnorm.py --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
             --png "$OUT/bench.png" || status=1 ;;
    training) python3 benchmarks/bench_groupnorm.py --training --json "$OUT/training.json" \
             --markdown "$OUT/training.md" || status=1 ;;
    quick) python3 benchmarks/bench_groupnorm.py --quick --markdown "$OUT/bench.md" || status=1 ;;
    host) python3 benchmarks/host_overhead.py --json "$OUT/host.json" || status=1 ;;
    models) python3 benchmarks/models.py --json "$OUT/models.json" --markdown "$OUT/models.md" \
             || status=1 ;;
    ab) python3 benchmarks/ab_compare.py "${AB_BASE:?set AB_BASE to the checkout to compare with}" . \
             --rounds 5 --json "$OUT/ab.json" || status=1 ;;
    epilogue) python3 benchmarks/bench_epilogue.py --json "$OUT/epilogue.json" || status=1 ;;
    sanitize) OUT="$OUT" bash tools/sanitize.sh || status=1 ;;
    soak) python3 tools/soak.py --seconds 60 --json "$OUT/soak.json" || status=1 ;;
    coverage) python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -p tools.kernel_coverage \
             --kernel-coverage "$OUT/coverage.json" -k "gpu and not kernelbench_92_bundle" \
             test_groupnorm.py test_reliability.py test_properties.py 2>&1 | tee "$OUT/coverage.log" \
             || status=1 ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
exit $status

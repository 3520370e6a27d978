#!/usr/bin/env bash
# The kernel sources stand on their own, without the loader: every header
# guards itself and compiles alone (it includes what it uses), and
# kernels/extension.cu builds as one translation unit with plain nvcc and
# torch's include paths. Needs CUDA_HOME and a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/../kernels"
nvcc="${CUDA_HOME:?set CUDA_HOME to the CUDA toolkit}/bin/nvcc"
read -r -a includes <<<"$(python3 -c "
import sysconfig, torch.utils.cpp_extension as c
print(' '.join('-I' + p for p in c.include_paths(device_type='cuda') + [sysconfig.get_paths()['include']]))")"
abi=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
arch=${TORCH_CUDA_ARCH_LIST:-9.0}
arch=${arch%%[ ;]*}
arch=${arch//./}
arch=${arch%+PTX}
flags=(-std=c++20 -O3 -Xcompiler -fPIC "${includes[@]}" -I. -D_GLIBCXX_USE_CXX11_ABI="$abi"
       --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       -gencode="arch=compute_$arch,code=sm_$arch")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for header in *.h *.cuh; do
  if [ "$(grep -c '^#pragma once$' "$header")" != 1 ]; then
    echo "check_sources: $header lacks exactly one '#pragma once'" >&2
    exit 1
  fi
done

# Each header alone, twice (the guard), 4 at a time.
for header in *.h *.cuh; do
  printf '#include "%s"\n#include "%s"\n' "$header" "$header" >"$work/${header//./_}.cu"
done
ls "$work"/*.cu | xargs -P 4 -I{} sh -c \
  '"$0" "$@" -c {} -o {}.o || { echo "check_sources: {} does not compile alone" >&2; exit 255; }' \
  "$nvcc" "${flags[@]}"
echo "check_sources: every header guards itself and compiles alone"

start=$(date +%s)
"$nvcc" "${flags[@]}" -c extension.cu -o "$work/extension.o"
echo "check_sources: extension.cu builds as one translation unit ($(( $(date +%s) - start )) s)"

# The KernelBench level-2 #92 solution's own translation units (not part of
# the library's build).
start=$(date +%s)
for unit in kernelbench_92.cpp kernelbench_92.cu; do
  "$nvcc" "${flags[@]}" -c "$unit" -o "$work/$unit.o"
done
echo "check_sources: kernelbench_92.cpp and .cu build ($(( $(date +%s) - start )) s)"

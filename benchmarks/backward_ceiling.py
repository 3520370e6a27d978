"""How fast the stream backward's access pattern can go on this card, against
groupnorm_inline's backward itself (issue #4's "backward >= 80 % of its
floor"). Synthetic kernels (backward_ceiling.cu) move the backward's bytes
with none or part of its work:

    one            each tile read once, dx written (the floor's own pattern)
    two            the stream order (a first read, a second `lag` tiles later,
                   L2 hints), static item assignment, no synchronisation
    two no-hint    the same without L2 hints
    two 2xlag      the same at twice the lag
    two+tickets    the stream order claimed from an atomic ticket
    two+sync       two+tickets plus block sums, relaxed arrivals per `unit`
                   tiles (64) and waits
    real           groupnorm_inline's backward (dx, dweight, dbias), auto plan

Lags are the real plan's. % of the floor (read x and dy, write dx once at the
copy bandwidth measured in the same run), best of 3 interleaved rounds.

    python3 benchmarks/backward_ceiling.py [--units 8,64,256] [case indices]

--units replaces the columns by two+tickets at the plan's lag, plus half a
grid and plus a grid, and two+sync for each unit size at three lags: the
larger of the plan's lag and the unit, a unit plus half a grid, and a unit
plus a grid.
"""
import argparse
import math
import os
import sys

import torch
from torch.utils.cpp_extension import load_inline

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_groupnorm as bench  # noqa: E402
import groupnorm_inline as gn  # noqa: E402

CASES = [((112, 64, 512, 512), 8, torch.float32), ((32, 64, 512, 512), 8, torch.float32),
         ((16, 256, 16000), 16, torch.float32), ((1, 128, 512, 512), 32, torch.bfloat16),
         ((4, 512, 128, 128), 32, torch.bfloat16), ((2, 512, 16, 64, 64), 32, torch.bfloat16),
         ((128, 64, 126, 126), 16, torch.float32)]
ONE, TWO_STATIC, TWO_TICKETS, TWO_SYNCED = range(4)


def load_patterns():
    with open(os.path.join(HERE, "backward_ceiling.cu")) as f:
        source = f.read()
    declaration = ("void run_pattern(torch::Tensor dy, torch::Tensor x, torch::Tensor dx, "
                   "int64_t mode, int64_t lag, int64_t unit, bool hints, int64_t grid);")
    return load_inline("groupnorm_backward_ceiling", declaration, cuda_sources=source,
                       functions=["run_pattern"], extra_cuda_cflags=["-O3"],
                       extra_include_paths=[os.path.join(os.path.dirname(HERE), "kernels")])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="?", help="comma-separated indices into CASES")
    parser.add_argument("--units", help="comma-separated unit sizes (tiles) for two+sync")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("backward_ceiling.py: needs a CUDA device, and none is visible")
    patterns = load_patterns()
    ext = gn.load()
    copy_bw = bench.copy_bandwidth()
    grid = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    for shape, groups, dtype in cases:
        one = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        weight = torch.randn(shape[1], device="cuda", dtype=dtype)
        xs = bench.make_inputs(shape, dtype, "contiguous", 12 * 2**30 // 3)
        sets = []
        for x in xs:
            _, mean, rstd = ext.forward(x, weight, None, groups, 1e-5, "auto", 0, 0)
            sets.append((torch.randn_like(x), x, mean, rstd, torch.empty_like(x)))
        del xs
        plan = gn.plan(sets[0][1], groups, backward=True)
        lag = plan.get("lag", grid)  # the stream kernel's; the passes have none

        def pattern(mode, lag, hints=True, unit=64):
            def call(inputs):
                dy, x, _, _, dx = inputs
                patterns.run_pattern(dy, x, dx, mode, lag, unit, hints, grid)
            return bench.rotating(call, sets)

        def backward(inputs):
            dy, x, mean, rstd, _ = inputs
            ext.backward(dy, x, mean, rstd, weight, groups, True, True, "auto", 0)

        if args.units:
            runs = {"two+tickets": pattern(TWO_TICKETS, lag),
                    "+g/2": pattern(TWO_TICKETS, lag + grid // 2),
                    "+g": pattern(TWO_TICKETS, lag + grid)}
            for unit in map(int, args.units.split(",")):
                for unit_lag in (max(lag, unit), unit + grid // 2, unit + grid):
                    runs[f"sync u{unit}@{unit_lag}"] = pattern(TWO_SYNCED, unit_lag, unit=unit)
        else:
            runs = {"one": pattern(ONE, 0), "two": pattern(TWO_STATIC, lag),
                    "two no-hint": pattern(TWO_STATIC, lag, hints=False),
                    "two 2xlag": pattern(TWO_STATIC, 2 * lag),
                    "two+tickets": pattern(TWO_TICKETS, lag), "two+sync": pattern(TWO_SYNCED, lag)}
        runs["real"] = bench.rotating(backward, sets)
        times = {name: [] for name in runs}
        for _ in range(3):
            for name, call in runs.items():
                times[name].append(bench.median_ms(call))
        floor_ms = 3 * one / copy_bw * 1e3
        print(f"{str(shape):22s} {str(dtype)[6:]:8s} lag {lag:5d} | " +
              " | ".join(f"{name} {100 * floor_ms / min(t):4.1f}" for name, t in times.items()),
              flush=True)
        del sets


if __name__ == "__main__":
    main()

"""The stream kernel's lag on this card: the default (the larger of a group's
pieces and the resident CTAs, plus a quarter of the latter; read at run time)
against other lags, on the contiguous shapes that take the stream kernel.
Forced `kernel="stream"` with `lag` in pieces; P = pieces per group, R =
resident CTAs; % of the one-read-one-write floor at the copy bandwidth
measured in the same run.

    python3 benchmarks/sweep_lag.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_groupnorm as bench  # noqa: E402
import groupnorm_inline as gn  # noqa: E402

CASES = [((112, 64, 512, 512), 8, torch.float32),  # KernelBench L1-35 itself
         ((8, 64, 512, 512), 8, torch.float32), ((16, 256, 16000), 16, torch.float32),
         ((1, 128, 512, 512), 32, torch.bfloat16), ((2, 512, 16, 64, 64), 32, torch.bfloat16)]


def main():
    if not torch.cuda.is_available():
        sys.exit("sweep_lag.py: needs a CUDA device, and none is visible")
    copy_bw = bench.copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    for shape, groups, dtype in CASES:
        inputs = bench.make_inputs(shape, dtype, "contiguous", 8 * 2**30)
        x = inputs[0]
        floor_ms = 2 * x.numel() * x.element_size() / copy_bw * 1e3
        plan = gn.plan(x, groups, kernel="stream")
        pieces, resident = plan["pieces"], plan["grid"]
        piece_bytes = plan["piece"] * plan["vec"] * x.element_size()
        print(f"{shape} G={groups} {dtype}: {plan}")
        lags = {"default": plan["lag"], "max(P,R)": max(pieces, resident),
                "P+R/4": pieces + resident // 4, "max+R/2": max(pieces, resident) + resident // 2,
                "P+R": pieces + resident, "P+2R": pieces + 2 * resident,
                "P+L2/4": pieces + l2 // 4 // piece_bytes}
        for name, lag in lags.items():
            ms = bench.median_ms(bench.rotating(
                lambda t: gn.groupnorm_cuda(t, None, None, groups, kernel="stream", lag=lag), inputs))
            print(f"  lag {name:8s} {lag:6d}  {ms:.4f} ms  {100 * floor_ms / ms:5.1f} % of floor")
        del inputs, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

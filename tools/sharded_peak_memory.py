"""Peak memory of one sharded GroupNorm call (process_group=), forward and
forward + backward, in units of the input's size.

    python tools/sharded_peak_memory.py [--device cuda]

One rank (world size 1: the same code path as any other, the collectives
trivial), gloo on the CPU or NCCL on a GPU, a 1x64x256x256 input in
bfloat16 and float32. The peak beyond what the call started with: on the
CPU the running sum of the profiler's allocation events, on a GPU the
caching allocator's peak statistic. Numbers in docs/DESIGN.md ("Spatially
sharded GroupNorm").
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402


def peak_bytes(fn, device):
    """The largest number of bytes fn holds at once beyond what it started with."""
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    device = parser.parse_args().device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    group = dist.group.WORLD
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, 64, 256, 256).to(device, dtype)
        weight, bias = (torch.randn(64).to(device, dtype) for _ in range(2))
        size = x.numel() * x.element_size()
        with torch.no_grad():
            forward = peak_bytes(lambda: gn.group_norm(x, 32, weight, bias, process_group=group),
                                 device)
        leaf, dy = x.clone().requires_grad_(), torch.randn_like(x)
        both = peak_bytes(lambda: gn.group_norm(leaf, 32, weight, bias,
                                                process_group=group).backward(dy), device)
        print(f"{str(dtype)[6:]}: forward {forward / size:.1f}x the input, "
              f"forward + backward {both / size:.1f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

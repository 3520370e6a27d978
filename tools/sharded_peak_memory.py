"""Peak CPU memory of one sharded GroupNorm call (process_group=), forward
and forward + backward, in units of the input's size.

    python tools/sharded_peak_memory.py

One gloo rank (world size 1: the same code path as any other, the
collectives trivial), a 1x64x256x256 input in bfloat16 and float32, the
peak of the running sum of the profiler's allocation events during the
call. Numbers in docs/DESIGN.md ("Spatially sharded GroupNorm").
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402


def peak_bytes(fn):
    """The largest number of bytes fn holds at once beyond what it started with."""
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
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.group.WORLD
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, 64, 256, 256).to(dtype)
        weight, bias = torch.randn(64, dtype=dtype), torch.randn(64, dtype=dtype)
        size = x.numel() * x.element_size()
        with torch.no_grad():
            forward = peak_bytes(lambda: gn.group_norm(x, 32, weight, bias, process_group=group))
        leaf, dy = x.clone().requires_grad_(), torch.randn_like(x)
        both = peak_bytes(lambda: gn.group_norm(leaf, 32, weight, bias,
                                                process_group=group).backward(dy))
        print(f"{str(dtype)[6:]}: forward {forward / size:.1f}x the input, "
              f"forward + backward {both / size:.1f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

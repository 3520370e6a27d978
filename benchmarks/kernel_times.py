"""GPU time of each kernel of the backward on small shapes, where a kernel's
fixed costs (its launch, cold instruction fetches) show: torch.profiler
over 300 calls of the extension's backward, the median per kernel.

    python3 benchmarks/kernel_times.py [CHECKOUT]

CHECKOUT (default: this one) is the tree whose module is imported, so two
checkouts are compared by running this once for each, on the same card.
Its profiler helpers serve the other benchmarks too.
"""
import collections
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

CASES = [((4, 32, 8, 8), 8, torch.float32, False), ((2, 320, 64, 64), 32, torch.float16, False),
         ((2, 320, 64, 64), 32, torch.float16, True), ((2, 1280, 16, 16), 32, torch.float16, False)]
CALLS = 300


def kernel_name(event_name):
    """'void groupnorm::groupnorm_backward_dx_contiguous_kernel<float, 4>(...)'
    -> 'groupnorm_backward_dx_contiguous_kernel'."""
    return event_name.split("<")[0].split("(")[0].split("::")[-1]


def ran_our_kernels(fn):
    """Whether one call of fn launched any of this module's CUDA kernels."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any("groupnorm::" in e.name for e in prof.events())


def profile_kernels(fn, calls, warmup=50):
    """{kernel name: [GPU µs of each launch]} over `calls` calls of fn()."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[kernel_name(event.name)].append(event.device_time)
    return times


def main():
    checkout = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                               os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not torch.cuda.is_available():
        sys.exit("kernel_times.py: needs a CUDA device, and none is visible")
    sys.path.insert(0, checkout)
    import groupnorm_inline as gn

    extension = gn.load()
    print(f"{torch.cuda.get_device_name()}, {checkout}")
    for shape, groups, dtype, channels_last in CASES:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        w = torch.randn(shape[1], device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        _, mean, rstd = extension.forward(x, w, w, groups, 1e-5, "auto", 0, 0)

        def backward():
            return extension.backward(dy, x, mean, rstd, w, groups, True, True, "auto", 0)

        times = profile_kernels(backward, CALLS)
        layout = "channels_last" if channels_last else "contiguous"
        print(f"{'×'.join(map(str, shape))} {str(dtype)[6:]} {layout}: " +
              ", ".join(f"{name} {statistics.median(t):.2f} µs" for name, t in times.items()))


if __name__ == "__main__":
    main()

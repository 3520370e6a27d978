"""The cost of a spatially sharded GroupNorm: each rank's call with
process_group= (as called, and its forward replayed from a CUDA graph,
which removes the host's cost of its many small ops) against GroupNorm of
the same slab alone (no collective) and against the whole tensor's
GroupNorm on one GPU.

    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py [--rounds 5] [--json PATH]

SD VAE decoder shapes, bfloat16, split along H into equal slabs, one GPU a
rank, NCCL. Per row the contenders alternate for --rounds rounds; each time
is the median of 50 calls timed with CUDA events after a warm-up, forward
only and forward + backward. Rank 0 prints the table and writes the JSON.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402

# (name, shape, groups): the SD VAE decoder's GroupNorm inputs at 512² and 1024²
ROWS = [
    ("VAE 512² mid", (1, 512, 64, 64), 32),
    ("VAE 512² up", (1, 256, 256, 256), 32),
    ("VAE 512² out", (1, 128, 512, 512), 32),
    ("VAE 1024² out", (1, 128, 1024, 1024), 32),
]


def median_ms(fn, calls=50):
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(forward):
    """forward captured in a CUDA graph (NCCL's collectives can be): its
    replay, without the host's cost per op. Every rank captures at once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def contenders(slab, whole, weight, bias, groups, backward):
    """{name: a call}: sharded (a collective), this slab alone, the whole tensor on one GPU."""
    def call(x, **kwargs):
        if not backward:
            def forward():
                with torch.no_grad():
                    return gn.group_norm(x, groups, weight, bias, **kwargs)
            return forward
        leaf = x.detach().requires_grad_()
        dy = torch.randn_like(x)
        return lambda: gn.group_norm(leaf, groups, weight, bias, **kwargs).backward(dy)

    fns = {"sharded": call(slab, process_group=dist.group.WORLD), "slab alone": call(slab)}
    if not backward:
        fns["sharded, CUDA graph"] = graphed(fns["sharded"])
    if whole is not None:
        fns["whole, one GPU"] = call(whole)
    return fns


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="rank 0 writes the rows here")
    args = parser.parse_args(argv)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # torchrun sets it
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for name, shape, groups in ROWS:
        torch.manual_seed(0)
        whole = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        slab = whole.tensor_split(world, dim=2)[rank].contiguous()
        weight, bias = (torch.randn(shape[1], device="cuda", dtype=torch.bfloat16) for _ in range(2))
        row = {"name": name, "shape": list(shape), "groups": groups, "ranks": world}
        for mode in ("forward", "forward+backward"):
            fns = contenders(slab, whole if rank == 0 else None, weight, bias, groups,
                             mode != "forward")
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for key in ("sharded", "sharded, CUDA graph", "slab alone", "whole, one GPU"):
                    if key in fns:  # the whole tensor: rank 0 alone
                        times[key].append(median_ms(fns[key]))
                    dist.barrier()  # every rank, after each contender: the next starts together
            row[mode] = {k: statistics.median(v) for k, v in times.items()}
        rows.append(row)
        del whole, slab
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"{'row':<16} {'mode':<17} {'sharded ms':>11} {'graphed':>9} {'slab alone':>11} "
              f"{'whole, 1 GPU':>13}")
        for row in rows:
            for mode in ("forward", "forward+backward"):
                ms = row[mode]
                graph = f"{ms['sharded, CUDA graph']:9.4f}" if "sharded, CUDA graph" in ms else " " * 9
                print(f"{row['name']:<16} {mode:<17} {ms['sharded']:11.4f} {graph} "
                      f"{ms['slab alone']:11.4f} {ms['whole, one GPU']:13.4f}")
        if args.json:
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "rounds": args.rounds, "ranks": world}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

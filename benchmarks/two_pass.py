"""What a forward that reads x twice costs on this card, against our forward
and a clone of the same input, all in one process (issue 26's yardstick).
two_pass.cu's two launches: the statistics (one read of x), then the
normalise (a read and a write), walking the tiles in reverse so that its
first reads hit what the first launch left in L2.

    python3 benchmarks/two_pass.py [--json PATH] [--rounds 7]

Contenders, each a CUDA graph of back-to-back calls, alternating over the
rounds, medians: clone, ours (`group_norm`, automatic plan), two_pass,
two_pass with evict-last hints on the first read, with one sweep a
normalise tile, with two and eight statistics CTAs an SM, and each of its
launches alone (statistics; normalise from the coefficients of an earlier
call). Errors: the largest difference from float64 `F.group_norm`, on the
input and on 1000 + the input. Rows whose groups two_pass.cu cannot split
into 16-byte vectors are reported and skipped.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import groupnorm_inline as gn  # noqa: E402

ROWS = [
    ((1, 128, 512, 512), 32, torch.bfloat16),
    ((4, 512, 128, 128), 32, torch.bfloat16),
    ((2, 512, 16, 64, 64), 32, torch.bfloat16),
    ((2, 640, 128, 128), 32, torch.float16),
    ((2, 1280, 64, 64), 32, torch.float16),
    ((1, 128, 8, 256, 256), 32, torch.bfloat16),
    ((2, 32, 128, 128, 128), 32, torch.bfloat16),
    ((16, 256, 16000), 16, torch.float32),
    ((128, 64, 126, 126), 16, torch.float32),
    ((112, 64, 512, 512), 8, torch.float32),
]
LARGE_BYTES = 1e9  # beyond it, fewer contenders: each graph holds its outputs


def graph_of(fn, calls):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def medians(contenders, calls, rounds):
    graphs = {name: graph_of(fn, calls) for name, fn in contenders.items()}
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, graph in graphs.items():
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def layouts(shape):
    if len(shape) == 4:
        return [("contiguous", None), ("channels_last", torch.channels_last)]
    if len(shape) == 5:
        return [("contiguous", None), ("channels_last", torch.channels_last_3d)]
    return [("contiguous", None)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    two = load("groupnorm_two_pass", [os.path.join(HERE, "two_pass.cu")],
               extra_cuda_cflags=["-O3", "-std=c++20"], extra_cflags=["-std=c++20"])
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape, G, dtype in ROWS:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        for layout, memory_format in layouts(shape):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            if memory_format is not None:
                x = x.to(memory_format=memory_format)
            C = shape[1]
            w = torch.randn(C, device="cuda", dtype=dtype)
            b = torch.randn(C, device="cuda", dtype=dtype)
            none = torch.empty(0, device="cuda")
            run = lambda t, blocks=0, keep=False, sweeps=4, stats=False, norm=False, coeff=none: (  # noqa: E731
                two.forward(t, w, b, G, 1e-5, blocks, keep, sweeps, stats, norm, coeff))
            row = {"shape": list(shape), "G": G, "dtype": str(dtype).replace("torch.", ""),
                   "layout": layout, "mb": nbytes / 1e6,
                   "plan": {k: v for k, v in gn.plan(x, G).items() if k != "reason"}}
            try:
                coefficients = run(x)[3]
            except RuntimeError as error:
                row["refused"] = str(error).splitlines()[0]
                print(f"{shape} {layout}: refused ({row['refused']})", flush=True)
                rows.append(row)
                continue
            for name, t in (("randn", x), ("shifted", x + 1000)):
                ref = F.group_norm(t.double(), G, w.double(), b.double(), 1e-5)
                row[f"error_two_pass_{name}"] = (run(t)[0].double() - ref).abs().max().item()
                row[f"error_ours_{name}"] = (gn.group_norm(t, G, w, b).double() - ref).abs().max().item()
            contenders = {
                "clone": lambda: x.clone(),
                "ours": lambda: gn.group_norm(x, G, w, b),
                "two_pass": lambda: run(x),
                "statistics": lambda: run(x, stats=True),
                "normalise": lambda: run(x, norm=True, coeff=coefficients),
            }
            if nbytes < LARGE_BYTES:
                contenders.update({
                    "two_pass_keep": lambda: run(x, keep=True),
                    "two_pass_one_sweep": lambda: run(x, sweeps=1),
                    "two_pass_2_an_sm": lambda: run(x, blocks=2 * sms),
                    "two_pass_8_an_sm": lambda: run(x, blocks=8 * sms),
                })
            calls = 5 if nbytes > LARGE_BYTES else 20 if nbytes > 2e8 else 50
            ms = medians(contenders, calls, args.rounds)
            row["ms"] = ms
            row["over_clone"] = {k: v / ms["clone"] for k, v in ms.items()}
            print(f"{shape} {row['dtype']} {layout} ({row['plan']['kernel']}): "
                  + " ".join(f"{k} {v:.4f} ({row['over_clone'][k]:.2f})" for k, v in ms.items()),
                  flush=True)
            rows.append(row)
            del x, coefficients
            torch.cuda.empty_cache()
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "command": " ".join(sys.argv)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

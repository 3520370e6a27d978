"""Which forward kernel serves a call fastest: per shape, our plain
forward (automatic plan) against the plain forward through each kernel
forced (registers, the team kernel of the input's layout, stream), SiLU
through each kernel forced (the registers kernel alone and in clusters of
2, 3, 4 and 8, the team kernel, the stream kernel) and the automatic plan,
and the (N, C) add with SiLU through the registers and team kernels. Each
time over the plain forward's.

    python benchmarks/sweep_fused_kernels.py [--rounds 3] [--quick] [--shape SPEC ...] [--json PATH]

One process, one GPU; the contenders alternate for --rounds rounds, each
time a median of CUDA-graph replays (ab_compare.graph_ms) for rows whose
plain forward takes under 0.05 ms, else of do_bench. A kernel that refuses
a shape is left out of its row. The rows are the small shapes where the
registers kernel and the team kernels compete, or the --shape rows alone
(NxCxHxW/G/dtype/layout, as bench_epilogue.py takes them). --quick leaves
out the forced clusters and the add.
"""

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import groupnorm_inline as gn  # noqa: E402
from bench_epilogue import row_timer, shape_row  # noqa: E402
from bench_groupnorm import make_inputs, rotating  # noqa: E402

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
ROWS = [  # (shape, groups, dtype, layout)
    ((2, 320, 64, 64), 32, F16, "contiguous"), ((2, 320, 64, 64), 32, F16, "channels_last"),
    ((2, 1280, 16, 16), 32, F16, "contiguous"), ((2, 1280, 16, 16), 32, F16, "channels_last"),
    ((8, 1280, 8, 8), 32, BF16, "contiguous"), ((8, 1280, 8, 8), 32, BF16, "channels_last"),
    ((1, 64, 32, 32), 32, F16, "contiguous"), ((4, 32, 8, 8), 8, F32, "contiguous"),
    ((2, 640, 32, 32), 32, F16, "contiguous"), ((2, 640, 32, 32), 32, F16, "channels_last"),
    ((4, 512, 64, 64), 32, F16, "contiguous"),
    ((512, 1280, 8, 8), 32, BF16, "contiguous"), ((64, 1280, 8, 8), 32, F16, "channels_last"),
]


def contenders(layout, temb, quick):
    """{name: groupnorm_cuda keyword arguments}."""
    team = layout  # the team kernel of the input's layout
    silu = dict(activation="silu")
    kernels = {"plain": {}, "plain registers": dict(kernel="registers"),
               "plain team": dict(kernel=team), "plain stream": dict(kernel="stream"),
               "silu auto": silu, "silu registers": dict(silu, kernel="registers"),
               "silu team": dict(silu, kernel=team), "silu stream": dict(silu, kernel="stream")}
    if quick:
        return kernels
    return {**kernels,
            **{f"silu registers r{ranks}": dict(silu, kernel="registers", team=ranks)
               for ranks in (2, 3, 4, 8)},
            "add_silu registers": dict(silu, add=temb, kernel="registers"),
            "add_silu team": dict(silu, add=temb, kernel=team)}


def run_row(shape, groups, dtype, layout, rounds, budget, quick=False):
    inputs = make_inputs(shape, dtype, layout, budget)
    C, N = shape[1], shape[0]
    w, b = (torch.randn(C, device="cuda", dtype=dtype) for _ in range(2))
    temb = torch.randn(N, C, device="cuda", dtype=dtype)
    usable = {}
    for name, kw in contenders(layout, temb, quick).items():
        try:
            gn.groupnorm_cuda(inputs[0], w, b, groups, **kw)
        except (ValueError, RuntimeError):  # the kernel refuses this shape
            continue
        usable[name] = kw
    timer = row_timer(rotating(lambda t: gn.groupnorm_cuda(t, w, b, groups), inputs))
    times = {}
    with torch.no_grad():
        for _ in range(rounds):
            for name, kw in usable.items():
                fn = rotating(lambda t, kw=kw: gn.groupnorm_cuda(t, w, b, groups, **kw), inputs)
                times.setdefault(name, []).append(timer(fn))
    plans = {name: gn.plan(inputs[0], groups, kernel=kw.get("kernel", "auto"), team=kw.get("team", 0),
                           fused=not name.startswith("plain"))
             for name, kw in usable.items()}
    return {"shape": list(shape), "G": groups, "dtype": str(dtype)[6:], "layout": layout,
            "ms": {k: statistics.median(v) for k, v in times.items()}, "rounds": times, "plans": plans}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="no forced clusters, no add")
    parser.add_argument("--shape", action="append", default=[], type=shape_row,
                        help="a row instead of the built-in ones: NxCxHxW/G/dtype/layout")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    budget = torch.cuda.get_device_properties(0).total_memory // 4
    rows = []
    given = [(shape, groups, dtype, layout) for _, shape, groups, dtype, layout in args.shape]
    for shape, groups, dtype, layout in given or ROWS:
        row = run_row(shape, groups, dtype, layout, args.rounds, budget, args.quick)
        rows.append(row)
        ms = row["ms"]
        print(f"{'x'.join(map(str, shape))} {row['dtype']} {layout}: plain {ms['plain']:.4f} ms | " +
              " ".join(f"{k}={v / ms['plain']:.3f}" for k, v in ms.items() if k != "plain"), flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "rounds": args.rounds, "quick": args.quick}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

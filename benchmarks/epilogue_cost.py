"""What a fused forward costs over the plain one, taken apart: the fused
instantiation with no activation (a zero scale), ReLU (inline, no SFU
instruction), SiLU (inline) and sigmoid (a called chain), each over the
plain forward of the same process, for one checkout. Run two checkouts'
processes in turn to compare them.

    python3 benchmarks/epilogue_cost.py [CHECKOUT] [--rounds 3] [--no-called] [--json PATH]

CHECKOUT: the tree whose groupnorm_inline is timed (default: this one).
--no-called leaves sigmoid out (for a tree built without the called
chain). Rows: the SD VAE, a 3-D-sized channels-last stream row, the SD
UNet and SDXL; the contenders alternate for --rounds rounds, medians; timed
by CUDA-graph replays under 0.05 ms, else do_bench (bench_epilogue.py's
rule).
"""

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

ROWS = [  # (shape, groups, dtype name, layout)
    ((1, 128, 512, 512), 32, "bfloat16", "channels_last"),
    ((4, 512, 128, 128), 32, "bfloat16", "channels_last"),
    ((1, 128, 512, 512), 32, "bfloat16", "contiguous"),
    ((1, 256, 256, 256), 32, "bfloat16", "channels_last"),
    ((2, 320, 64, 64), 32, "float16", "contiguous"),
    ((2, 640, 128, 128), 32, "float16", "channels_last"),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", default=os.path.dirname(HERE))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-called", action="store_true", help="leave sigmoid out")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.checkout))
    sys.path.insert(0, HERE)
    import torch

    import groupnorm_inline as gn  # the checkout's module
    from bench_epilogue import row_timer
    from bench_groupnorm import make_inputs, rotating

    budget = torch.cuda.get_device_properties(0).total_memory // 4
    rows = []
    for shape, groups, dtype_name, layout in ROWS:
        dtype = getattr(torch, dtype_name)
        inputs = make_inputs(shape, dtype, layout, budget)
        N, C = shape[:2]
        w, b = (torch.randn(C, device="cuda", dtype=dtype) for _ in range(2))
        zero = torch.zeros(N, C, device="cuda", dtype=dtype)
        fns = {"plain": lambda t: gn.groupnorm_cuda(t, w, b, groups),
               "fused_noact": lambda t: gn.groupnorm_cuda(t, w, b, groups, scale=zero),
               "relu": lambda t: gn.groupnorm_cuda(t, w, b, groups, activation="relu"),
               "silu": lambda t: gn.groupnorm_cuda(t, w, b, groups, activation="silu"),
               "sigmoid": lambda t: gn.groupnorm_cuda(t, w, b, groups, activation="sigmoid")}
        if args.no_called:
            del fns["sigmoid"]
        times = {}
        with torch.no_grad():
            fns = {k: rotating(f, inputs) for k, f in fns.items()}
            time_ms = row_timer(fns["plain"])
            for _ in range(args.rounds):
                for key, fn in fns.items():
                    times.setdefault(key, []).append(time_ms(fn))
        ms = {k: statistics.median(v) for k, v in times.items()}
        plan = gn.plan(inputs[0], groups, activation="silu")
        fields = ("kernel", "vec", "team", "threads", "grid", "store")
        rows.append({"shape": list(shape), "dtype": dtype_name, "layout": layout, "ms": ms,
                     "plan": {k: plan.get(k) for k in fields}})
        ratios = " ".join(f"{k} {v / ms['plain']:.3f}" for k, v in ms.items() if k != "plain")
        print(f"{'x'.join(map(str, shape))} {dtype_name} {layout} ({plan['kernel']}): "
              f"plain {ms['plain']:.4f} ms, {ratios}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rounds": args.rounds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The forward epilogue's cost: our GroupNorm with an epilogue against our
plain GroupNorm on the same input, and against torch.compile of the unfused
torch sequence (GroupNorm then the activation), which Inductor fuses itself.

    python benchmarks/bench_epilogue.py [--quick] [--rows NAME,...] [--shape SPEC ...]
                                        [--rounds 3] [--no-compile]
                                        [--backward | --sum | --residual]
                                        [--json PATH]

One process, one GPU, the benchmark suite's forward rows (--quick: its
quick rows; --rows: the rows of those names), and any --shape
NxCxHxW/G/dtype/layout (e.g. 512x1280x8x8/32/bfloat16/contiguous). Per row the
contenders alternate for --rounds rounds; each time is a median of
triton.testing.do_bench, or, for every contender of a row whose plain
forward takes under 0.05 ms, of CUDA-graph replays (ab_compare.graph_ms:
do_bench's steps of about a microsecond are several percent there).
Reported: each contender's median over rounds, each epilogue's time over
plain (the issue's line: at most 1.05 for an activation, 1.08 for
scale-shift-SiLU and for an (N, C) add before the norm with SiLU after),
and torch.compile's SiLU time over ours (above 1 is ours faster).

--backward times the backward alone instead (gradients of the input,
weight, bias, and of scale and shift where a form takes them), as
bench_groupnorm.py --training does: each input's backward captured in a
CUDA graph and replayed; the issue's line: at most 1.10 of the plain
backward on the same input.

--sum times the full-shape add with return_sum instead: group_norm(x,
add=a, return_sum=True), which reads x and a and writes s and y, against
a copy of the same bytes (x.clone() and a.clone(), measured in the same
run; the issue's line: at most 1.15 of it), our plain GroupNorm, and
torch.compile of s = x + a, (F.group_norm(s), s).

--residual times a ResNet block's tail instead: relu(norm(x) + r) with
residual_before_activation=True, against relu(norm(x)) + r (the residual
after), our plain GroupNorm, a copy of the same bytes (x.clone() and
r.clone()) and torch.compile of the unfused sequence.
"""

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton.testing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import groupnorm_inline as gn  # noqa: E402
from ab_compare import graph_ms  # noqa: E402
from bench_groupnorm import QUICK, SUITE, backward_alone_ms, make_inputs, rotating  # noqa: E402

GRAPH_BELOW_MS = 0.05


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def row_timer(plain):
    """The timer of every contender of a row, chosen once from the plain
    forward: chosen per contender, a host-bound one (torch.compile's guards
    on a slow host) would be timed with its host time and the rest without."""
    return graph_ms if bench_ms(plain) < GRAPH_BELOW_MS else bench_ms


def contenders(groups, w, b, scale, shift, compile_too):
    """{name: function of the input}: plain, each epilogue, and compile's."""
    fns = {
        "plain": lambda t: gn.groupnorm_cuda(t, w, b, groups),
        "silu": lambda t: gn.groupnorm_cuda(t, w, b, groups, activation="silu"),
        "gelu": lambda t: gn.groupnorm_cuda(t, w, b, groups, activation="gelu"),
        "tanh,hardswish": lambda t: gn.groupnorm_cuda(t, w, b, groups, activation=("tanh", "hardswish")),
        "scale_shift_silu": lambda t: gn.groupnorm_cuda(t, w, b, groups, scale=scale, shift=shift,
                                                        activation="silu"),
        # diffusers' ResNet block: h + temb[:, :, None, None], then GroupNorm and SiLU
        "add_silu": lambda t: gn.groupnorm_cuda(t, w, b, groups, add=shift, activation="silu"),
    }
    if compile_too:
        torch._dynamo.reset()
        fns["compile_silu"] = torch.compile(lambda t: F.silu(F.group_norm(t, groups, w, b)), dynamic=False)
    return fns


def run_row(name, shape, groups, dtype, layout, rounds, compile_too, budget):
    inputs = make_inputs(shape, dtype, layout, budget)
    C, N = shape[1], shape[0]
    w, b = (torch.randn(C, device="cuda", dtype=dtype) for _ in range(2))
    scale, shift = (0.1 * torch.randn(N, C, device="cuda", dtype=dtype) for _ in range(2))
    times = {}
    with torch.no_grad():
        fns = {k: rotating(f, inputs) for k, f in contenders(groups, w, b, scale, shift, compile_too).items()}
        time_ms = row_timer(fns["plain"])
        for _ in range(rounds):
            for key, fn in fns.items():
                times.setdefault(key, []).append(time_ms(fn))
    del inputs
    torch.cuda.empty_cache()
    ms = {k: statistics.median(v) for k, v in times.items()}
    return {"name": name, "shape": list(shape), "G": groups, "dtype": str(dtype)[6:], "layout": layout,
            "ms": ms, "rounds": times}


def run_backward_row(name, shape, groups, dtype, layout, rounds, budget):
    """The backward alone of plain and each epilogue, alternating for
    `rounds` rounds (each a fresh capture)."""
    inputs = make_inputs(shape, dtype, layout, budget // 3)
    C, N = shape[1], shape[0]
    w, b = (torch.randn(C, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    scale, shift = (0.1 * torch.randn(N, C, device="cuda", dtype=dtype) for _ in range(2))
    scale.requires_grad_(), shift.requires_grad_()
    xs = [t.requires_grad_() for t in inputs]
    dy = torch.randn_like(xs[0])
    fns = contenders(groups, w, b, scale, shift, compile_too=False)
    times = {}
    for _ in range(rounds):
        for key, fn in fns.items():
            times.setdefault(key, []).append(backward_alone_ms(fn, xs, (w, b, scale, shift), dy))
    del inputs, xs
    torch.cuda.empty_cache()
    ms = {k: statistics.median(v) for k, v in times.items()}
    return {"name": name, "shape": list(shape), "G": groups, "dtype": str(dtype)[6:], "layout": layout,
            "pass": "backward", "ms": ms, "rounds": times}


def pair_contenders(kind, groups, w, b, compile_too):
    """{name: function of (x, other)}: for --sum (other: the add) the sum with
    return_sum, for --residual (other: the residual) relu(norm(x) + r) with
    the residual before and after the ReLU; each with our plain GroupNorm, a
    copy of both tensors and torch.compile of the unfused sequence."""
    if kind == "sum":
        def sequence(t, a):
            total = t + a
            return F.group_norm(total, groups, w, b), total
        fns = {"add_sum": lambda p: gn.group_norm(p[0], groups, w, b, add=p[1], return_sum=True)}
    else:
        def sequence(t, r):
            return F.relu(F.group_norm(t, groups, w, b) + r)
        fns = {
            "residual_first": lambda p: gn.group_norm(p[0], groups, w, b, activation="relu",
                                                      residual=p[1],
                                                      residual_before_activation=True),
            "residual_after": lambda p: gn.group_norm(p[0], groups, w, b, activation="relu",
                                                      residual=p[1]),
        }
    fns["plain"] = lambda p: gn.group_norm(p[0], groups, w, b)
    fns["copy"] = lambda p: (p[0].clone(), p[1].clone())
    if compile_too:
        torch._dynamo.reset()
        compiled = torch.compile(sequence, dynamic=False)
        fns["compile_sum" if kind == "sum" else "compile_tail"] = lambda p: compiled(*p)
    return fns


def run_pair_row(kind, name, shape, groups, dtype, layout, rounds, compile_too, budget):
    """The contenders of pair_contenders on fresh (x, other) pairs, alternating."""
    xs = make_inputs(shape, dtype, layout, budget // 2)
    pairs = [(x, torch.randn_like(x)) for x in xs]
    C = shape[1]
    w, b = (torch.randn(C, device="cuda", dtype=dtype) for _ in range(2))
    times = {}
    with torch.no_grad():
        fns = {k: rotating(f, pairs)
               for k, f in pair_contenders(kind, groups, w, b, compile_too).items()}
        time_ms = row_timer(fns["plain"])
        for _ in range(rounds):
            for key, fn in fns.items():
                times.setdefault(key, []).append(time_ms(fn))
    del xs, pairs
    torch.cuda.empty_cache()
    ms = {k: statistics.median(v) for k, v in times.items()}
    return {"name": name, "shape": list(shape), "G": groups, "dtype": str(dtype)[6:],
            "layout": layout, "pass": kind, "ms": ms, "rounds": times}


def shape_row(spec):
    """A --shape row, as the suite's: NxCxHxW/G/dtype/layout."""
    dims, groups, dtype, layout = spec.split("/")
    shape = tuple(int(d) for d in dims.split("x"))
    return (f"shape {dims}", shape, int(groups), getattr(torch, dtype), layout)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the suite's quick rows only")
    parser.add_argument("--rows", help="the suite's rows of these names only (comma-separated)")
    parser.add_argument("--shape", action="append", default=[], type=shape_row,
                        help="one more row: NxCxHxW/G/dtype/layout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile's SiLU")
    parser.add_argument("--backward", action="store_true",
                        help="time the backward alone (no torch.compile contender)")
    parser.add_argument("--sum", action="store_true",
                        help="time the full-shape add with return_sum against a copy of its bytes")
    parser.add_argument("--residual", action="store_true",
                        help="time relu(norm(x) + r) with the residual before the activation")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.backward + args.sum + args.residual > 1:
        parser.error("--backward, --sum and --residual time different things: one of them")
    budget = torch.cuda.get_device_properties(0).total_memory // 4
    names = set(args.rows.split(",")) if args.rows else None
    suite = [case for case in SUITE if (not args.quick or case[0] in QUICK) and
             (names is None or case[0] in names)]
    if args.shape and not (args.quick or names):
        suite = []  # the given shapes alone
    if args.sum or args.residual:
        rows = pair_rows("sum" if args.sum else "residual", suite + args.shape, args.rounds,
                         not args.no_compile, budget)
    else:
        rows = epilogue_rows(suite + args.shape, args, budget)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "rounds": args.rounds,
                "pass": ("backward" if args.backward else "sum" if args.sum else
                         "residual" if args.residual else "forward")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


# per --sum and --residual: our fused contender, torch.compile's, the
# contenders ours is printed over (column titles), and the summary's words
PAIR_COLUMNS = {
    "sum": ("add_sum", "compile_sum", {"copy": "sum/copy", "plain": "sum/plain"},
            "add with return_sum"),
    "residual": ("residual_first", "compile_tail",
                 {"copy": "first/copy", "plain": "first/plain", "residual_after": "first/after"},
                 "residual before relu"),
}


def pair_rows(kind, cases, rounds, compile_too, budget):
    """--sum or --residual: each row's times and ratios printed, the worst
    against the copy last."""
    ours, compiled, over, words = PAIR_COLUMNS[kind]
    print(f"{'row':<58} {'plain ms':>9} " + " ".join(f"{t:>11}" for t in over.values())
          + f" {'compile/ours':>12}")
    rows = []
    for case in cases:
        row = run_pair_row(kind, *case, rounds, compile_too, budget)
        rows.append(row)
        ms = row["ms"]
        key = f"{row['name']} {'x'.join(map(str, row['shape']))} {row['dtype']} {row['layout']}"
        versus = f"{ms[compiled] / ms[ours]:12.2f}" if compiled in ms else ""
        ratios = " ".join(f"{ms[ours] / ms[k]:11.3f}" for k in over)
        print(f"{key:<58} {ms['plain']:9.4f} {ratios} {versus}", flush=True)
    worst = max(r["ms"][ours] / r["ms"]["copy"] for r in rows)
    print(f"{words}: worst {worst:.3f}x a copy of its bytes")
    return rows


def epilogue_rows(cases, args, budget):
    """Each row's epilogues over plain (forward or backward), printed, the
    worst of each and torch.compile's SiLU against ours last."""
    rows = []
    epilogues = ["silu", "gelu", "tanh,hardswish", "scale_shift_silu", "add_silu"]
    print(f"{'row':<58} {'plain ms':>9} " + " ".join(f"{e:>16}" for e in epilogues)
          + f" {'compile/ours':>12}")
    for case in cases:
        row = (run_backward_row(*case, args.rounds, budget) if args.backward else
               run_row(*case, args.rounds, not args.no_compile, budget))
        rows.append(row)
        ms = row["ms"]
        key = f"{row['name']} {'x'.join(map(str, row['shape']))} {row['dtype']} {row['layout']}"
        ratios = " ".join(f"{ms[e] / ms['plain']:16.3f}" for e in epilogues)
        versus = f"{ms['compile_silu'] / ms['silu']:12.2f}" if "compile_silu" in ms else ""
        print(f"{key:<58} {ms['plain']:9.4f} {ratios} {versus}", flush=True)
    for e in epilogues:
        worst = max(r["ms"][e] / r["ms"]["plain"] for r in rows)
        print(f"{e}: worst {worst:.3f}x plain")
    if all("compile_silu" in r["ms"] for r in rows):
        speedups = [r["ms"]["compile_silu"] / r["ms"]["silu"] for r in rows]
        geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
        print(f"silu vs torch.compile: slowest row {min(speedups):.2f}x, geomean {geomean:.2f}x")
    return rows


if __name__ == "__main__":
    sys.exit(main())

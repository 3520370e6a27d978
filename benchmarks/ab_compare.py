"""Our kernels before and after a change, on the same card in one run: each
checkout's groupnorm_inline times the benchmark suite in its own process
(forward, and the backward's kernels through the extension), and the two
alternate for --rounds rounds; per row, the median over rounds of each.

    git worktree add /tmp/before BASE_COMMIT
    python benchmarks/ab_compare.py /tmp/before . [--rounds 3] [--json OUT] [--limit 1.02]
        [--rows "SD VAE decoder,audio 1-D"] [--forward-only]

Rows faster than --graph-below ms by do_bench are timed again as CUDA-graph
replays (graph_ms): do_bench's times of calls that short come in steps of
about a microsecond and move several percent between rounds; a graph of
many calls replayed back to back measures the kernels alone, without launch
gaps. Exits 1 when a row of the second checkout is slower than --limit
times the first. Both checkouts must share groupnorm_cuda(x, w, b, G), load() and the
extension's backward(dy, x, mean, rstd, w, G, need_dx, need_affine, kernel,
lag).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def graph_ms(fn, calls=100, replays=30):
    """Median GPU time per call of `calls` calls of fn captured in a CUDA
    graph, over `replays` replays (after a warm-up replay)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # allocator and caches warm before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def worker(root, out, graph_below, rows, forward_only):
    """Times the suite's cases (those named in `rows`, or all) with `root`'s
    module; writes {case: ms}."""
    sys.path.insert(0, os.path.abspath(root))
    import groupnorm_inline as gn  # the checkout's module
    import torch

    sys.path.insert(0, HERE)
    from bench_groupnorm import case_key, make_inputs, median_ms, rotating, suite_cases

    cases = suite_cases(rows, "ab_compare")
    ext = gn.load()
    budget = torch.cuda.get_device_properties(0).total_memory // 4
    times = {}
    for name, shape, groups, dtype, layout in cases:
        inputs = make_inputs(shape, dtype, layout, budget // 3)
        C = shape[1]
        w = torch.randn(C, device="cuda", dtype=dtype)
        b = torch.randn(C, device="cuda", dtype=dtype)
        key = case_key(name, shape, dtype, layout)
        forward = rotating(lambda t: gn.groupnorm_cuda(t, w, b, groups), inputs)
        times[key + " forward"] = median_ms(forward)
        if times[key + " forward"] < graph_below:
            times[key + " forward"] = graph_ms(forward)
        if forward_only:
            del inputs
            torch.cuda.empty_cache()
            continue
        dy = torch.randn_like(inputs[0])
        saved = []
        for t in inputs:
            try:
                _, mean, rstd = ext.forward(t, w, b, groups, 1e-5, "auto", 0, 0)
            except TypeError:  # a checkout from before the stream lag had its own argument
                _, mean, rstd = ext.forward(t, w, b, groups, 1e-5, "auto", 0)
            saved.append((t, mean, rstd))
        backward = rotating(
            lambda s: ext.backward(dy, s[0], s[1], s[2], w, groups, True, True, "auto", 0), saved)
        times[key + " backward"] = median_ms(backward)
        if times[key + " backward"] < graph_below:
            times[key + " backward"] = graph_ms(backward)
        del inputs, saved, dy
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(times, f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", nargs="?")
    parser.add_argument("after", nargs="?")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write per-round times and medians here")
    parser.add_argument("--limit", type=float, default=1.02, help="allowed after / before")
    parser.add_argument("--graph-below", type=float, default=0.05,
                        help="rows faster than this many ms are timed as CUDA-graph replays")
    parser.add_argument("--rows", default="",
                        help="suite case names, comma-separated (default: every case)")
    parser.add_argument("--forward-only", action="store_true", help="skip the backward's rows")
    parser.add_argument("--worker", nargs=2, metavar=("ROOT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = [n for n in args.rows.split(",") if n]
    if args.worker:
        worker(*args.worker, args.graph_below, rows, args.forward_only)
        return 0
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        for which in ("before", "after"):
            out = f"/tmp/ab_{which}_{r}.json"
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                            getattr(args, which), out, "--graph-below", str(args.graph_below),
                            "--rows", args.rows] + (["--forward-only"] if args.forward_only else []),
                           check=True)
            with open(out) as f:
                runs[which].append(json.load(f))
    medians = {w: {k: statistics.median(run[k] for run in runs[w]) for k in runs[w][0]}
               for w in runs}
    print(f"{'case':<62} {'before ms':>10} {'after ms':>10} {'after/before':>12}")
    slower = 0
    for key, before in medians["before"].items():
        after = medians["after"][key]
        flag = after / before > args.limit
        slower += flag
        print(f"{key:<62} {before:10.4f} {after:10.4f} {after / before:12.3f}{'  SLOWER' if flag else ''}")
    print(f"{slower} row(s) slower than {args.limit}x before ({args.rounds} alternating rounds, medians)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "medians": medians}, f, indent=1)
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())

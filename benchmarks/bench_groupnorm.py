"""GroupNorm benchmark: groupnorm_inline vs torch eager vs torch.compile.

    python benchmarks/bench_groupnorm.py [--quick] [--training] [--json PATH] [--markdown PATH] [--png PATH]

One process, one GPU. For every case: median time of each provider
(triton.testing.do_bench, after warm-up), the bytes a GroupNorm must move
(forward: x read once, y written once), that as GB/s and as % of this
device's copy bandwidth measured in the same run, and the speed-ups; and,
for the forward, a copy of x (x.clone()) timed the same way: the ceiling at
that size, where launch and ramp weigh on small inputs.
--training times forward + backward (dx, dweight, dbias; floor: 5 x the
input's bytes) and, in a second table, the backward alone as GPU time,
replayed from CUDA graphs (floor: read x and dy, write dx). torch.compile
is compiled afresh per case (dynamo reset), so recompile limits never turn
it into eager. Inputs rotate through enough copies to exceed L2 where
memory allows, so small cases are not timed from cache alone. Forward
inputs under 16 MiB are also timed back to back by the wall clock (host and
GPU together): there a provider's host time per call can exceed its GPU
time, and do_bench's GPU timing counts host time only when the host falls
behind its cache flush, which makes such timings vary from run to run.
"""

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time

import torch
import torch._functorch.config  # donated_buffer, for the backward-alone timing
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402
import groupnorm_tools as tools  # noqa: E402
import plot_results  # noqa: E402  (beside this script; matplotlib only when it draws)

# (name, shape, groups, dtype, layout)
SUITE = [
    ("KernelBench L1-35", (112, 64, 512, 512), 8, torch.float32, "contiguous"),
    ("KernelBench L2-92 GN", (128, 64, 126, 126), 16, torch.float32, "contiguous"),
    ("SD UNet", (2, 320, 64, 64), 32, torch.float16, "contiguous"),
    ("SD UNet", (2, 320, 64, 64), 32, torch.float16, "channels_last"),
    ("SD UNet deep", (2, 1280, 16, 16), 32, torch.float16, "contiguous"),
    ("SD UNet deep", (2, 1280, 16, 16), 32, torch.float16, "channels_last"),
    ("SD UNet deepest", (8, 1280, 8, 8), 32, torch.bfloat16, "contiguous"),
    ("SD UNet deepest", (8, 1280, 8, 8), 32, torch.bfloat16, "channels_last"),
    ("SD VAE decoder", (1, 128, 512, 512), 32, torch.bfloat16, "contiguous"),
    ("SD VAE decoder", (1, 128, 512, 512), 32, torch.bfloat16, "channels_last"),
    ("SD VAE decoder", (4, 512, 128, 128), 32, torch.bfloat16, "contiguous"),
    ("SD VAE decoder", (4, 512, 128, 128), 32, torch.bfloat16, "channels_last"),
    ("video 3-D", (2, 512, 16, 64, 64), 32, torch.bfloat16, "contiguous"),
    ("video 3-D", (2, 512, 16, 64, 64), 32, torch.bfloat16, "channels_last"),
    ("audio 1-D", (16, 256, 16000), 16, torch.float32, "contiguous"),
    ("SDXL UNet", (2, 640, 128, 128), 32, torch.float16, "contiguous"),
    ("SDXL UNet", (2, 640, 128, 128), 32, torch.float16, "channels_last"),
    ("SDXL UNet deep", (2, 1280, 64, 64), 32, torch.float16, "contiguous"),
    ("SDXL UNet deep", (2, 1280, 64, 64), 32, torch.float16, "channels_last"),
    ("video VAE 3-D", (1, 128, 8, 256, 256), 32, torch.bfloat16, "channels_last"),
    ("3-D segmentation", (2, 32, 128, 128, 128), 8, torch.bfloat16, "contiguous"),
    ("3-D segmentation", (2, 32, 128, 128, 128), 8, torch.bfloat16, "channels_last"),
    ("batch-1 small", (1, 64, 32, 32), 32, torch.float16, "contiguous"),
    ("tiny", (4, 32, 8, 8), 8, torch.float32, "contiguous"),
]
QUICK = {"SD UNet", "SD VAE decoder", "tiny"}


def suite_cases(names, tool):
    """The SUITE cases named in `names` (all when empty); a name the suite
    lacks stops `tool` (a typo would time or profile nothing)."""
    unknown = sorted(set(names) - {case[0] for case in SUITE})
    if unknown:
        sys.exit(f"{tool}: no suite case named {', '.join(map(repr, unknown))}")
    return [case for case in SUITE if not names or case[0] in names]


def case_key(name, shape, dtype, layout):
    """A case's label in the A/B and profile tools' output."""
    return f"{name} {'x'.join(map(str, shape))} {str(dtype)[6:]} {layout}"


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth():
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(512 * 2**20, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def make_inputs(shape, dtype, layout, budget_bytes):
    """Copies of a fresh random input, enough to overflow L2 (within budget)."""
    one = torch.randn(shape, device="cuda", dtype=dtype)
    if layout == "channels_last":
        one = one.contiguous(memory_format=torch.channels_last if one.dim() == 4
                             else torch.channels_last_3d)
    nbytes = one.numel() * one.element_size()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(1, min(64, math.ceil(4 * l2 / nbytes), budget_bytes // max(nbytes, 1)))
    return [one] + [torch.randn_like(one) for _ in range(copies - 1)]


def rotating(fn, inputs):
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(inputs)
        return fn(inputs[state["i"]])
    return call


# Forward inputs under this many bytes also get the wall-clock timing.
WALL_MAX_BYTES = 16 * 2**20


def wall_us(fn, calls=300, warmup=1):
    """Wall-clock time per call of back-to-back calls, best of three rounds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def python_overhead_us(calls=20000):
    """Host time per call on a tiny input (the GPU finishes each launch faster
    than the host issues the next, so this measures dispatch overhead)."""
    x = torch.randn(4, 32, 8, 8, device="cuda")
    w = torch.randn(32, device="cuda")
    b = torch.randn(32, device="cuda")
    result = {}
    with torch.no_grad():
        for name, fn in (("groupnorm_inline.group_norm", lambda: gn.group_norm(x, 8, w, b)),
                         ("groupnorm_inline.groupnorm_cuda", lambda: gn.groupnorm_cuda(x, w, b, 8)),
                         ("F.group_norm", lambda: F.group_norm(x, 8, w, b))):
            result[name] = wall_us(fn, calls, warmup=1000)
    return result


def extra_memory_bytes(shape, groups, dtype):
    """Peak bytes groupnorm_cuda allocates beyond its output."""
    x = torch.randn(shape, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = gn.groupnorm_cuda(x, None, None, groups)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - y.numel() * y.element_size()


def run_case(name, shape, groups, dtype, layout, copy_bw, budget):
    inputs = make_inputs(shape, dtype, layout, budget)
    C = shape[1]
    w = torch.randn(C, device="cuda", dtype=dtype)
    b = torch.randn(C, device="cuda", dtype=dtype)
    x0 = inputs[0]
    ref = tools.reference_group_norm(x0, groups, w, b, 1e-5) if x0.numel() < 2**28 else None
    with torch.no_grad():
        ours_fn = rotating(lambda t: gn.group_norm(t, groups, w, b), inputs)
        eager_fn = rotating(lambda t: F.group_norm(t, groups, w, b), inputs)
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: F.group_norm(t, groups, w, b), dynamic=False)
        compile_fn = rotating(compiled, inputs)
        err = tools.max_error(gn.group_norm(x0, groups, w, b), ref) if ref is not None else float("nan")
        del ref
        walled = x0.numel() * x0.element_size() < WALL_MAX_BYTES
        # Wall-clock times of ours and eager come before torch.compile's first
        # call: the compile leaves the host busy for a while (a fresh process
        # gave 12 µs per call on 2x320x64x64 where one timed after it gave 27).
        wall = {"groupnorm_inline": wall_us(ours_fn), "eager": wall_us(eager_fn)} if walled else None
        ms = median_ms(ours_fn)
        eager = median_ms(eager_fn)
        comp = median_ms(compile_fn)
        # A copy of x, timed the same way: what one read and one write of
        # this many bytes reach at this size (launch and ramp included), the
        # ceiling no GroupNorm can pass.
        clone = median_ms(rotating(lambda t: t.clone(), inputs))
        ms_again = median_ms(ours_fn)
        if walled:
            wall["compile"] = wall_us(compile_fn)
    nbytes = 2 * x0.numel() * x0.element_size()
    del inputs, x0
    torch.cuda.empty_cache()
    return {
        "name": name, "shape": list(shape), "G": groups, "dtype": str(dtype).replace("torch.", ""),
        "layout": layout, "plan": gn.plan(torch.empty(shape, device="cuda", dtype=dtype)
                                          if layout == "contiguous" else
                                          torch.empty(shape, device="cuda", dtype=dtype).contiguous(
                                              memory_format=torch.channels_last if len(shape) == 4
                                              else torch.channels_last_3d), groups),
        "bytes": nbytes, "floor_ms": nbytes / copy_bw * 1e3,
        "ms": {"groupnorm_inline": ms, "eager": eager, "compile": comp},
        "clone_ms": clone, "ms_repeat": ms_again, "max_abs_err_vs_float64": err, "wall_us": wall,
    }


def backward_alone_ms(fn, xs, wanted, dy):
    """The backward alone of fn (input -> output), as GPU time, over the
    inputs xs (requiring grad) and the tensors `wanted` (gradients taken for
    those fn uses): each input's autograd graph is recorded once (forward on
    a side stream, so that its backward runs there too) and its backward
    captured in a CUDA graph, then the CUDA graphs are replayed. Timed
    through autograd instead, a backward of 0.1 ms came out 0.09-0.14 ms
    from run to run, as the host's autograd call (about 0.2 ms on the H100
    host of run AG) outlasted do_bench's cache flush by more or less."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def grads(t, y):
        return torch.autograd.grad(y, (t, *wanted), dy, retain_graph=True, allow_unused=True)

    try:
        with torch.cuda.stream(side):
            ys = {id(t): fn(t) for t in xs}
            for _ in range(2):  # warm-up outside capture (allocator, lazy init)
                grads(xs[0], ys[id(xs[0])])
        graphs = []
        for t in xs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                grads(t, ys[id(t)])
            graphs.append(graph)
        torch.cuda.current_stream().wait_stream(side)
        return median_ms(rotating(lambda graph: graph.replay(), graphs))
    except RuntimeError as error:  # a provider whose backward cannot be captured: no number
        print(f"backward alone not measurable: {str(error).splitlines()[0]}")
        torch.cuda.synchronize()
        return float("nan")


def run_training_case(name, shape, groups, dtype, layout, copy_bw, budget):
    """Forward + backward (dx, dweight, dbias) per provider. Floor: x read and
    y written by the forward, x and dy read and dx written by the backward."""
    inputs = make_inputs(shape, dtype, layout, budget // 3)
    C = shape[1]
    w = torch.randn(C, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(C, device="cuda", dtype=dtype, requires_grad=True)
    xs = [t.requires_grad_() for t in inputs]
    dy = torch.randn_like(xs[0])

    def step(fn):
        return rotating(lambda t: torch.autograd.grad(fn(t), (t, w, b), dy), xs)

    def backward_only(fn):
        return backward_alone_ms(fn, xs, (w, b), dy)

    def compiled():
        torch._dynamo.reset()
        return torch.compile(lambda t: F.group_norm(t, groups, w, b), dynamic=False)

    providers = {"groupnorm_inline": lambda t: gn.groupnorm_cuda(t, w, b, groups),
                 "eager": lambda t: F.group_norm(t, groups, w, b), "compile": compiled()}
    ms = {k: median_ms(step(fn)) for k, fn in providers.items()}
    bwd = {k: backward_only(fn) for k, fn in providers.items() if k != "compile"}
    # torch.compile hands the saved tensors of a graph to its backward (donated
    # buffers), so that graph cannot be replayed; for the backward alone it
    # compiles again without donation.
    with torch._functorch.config.patch(donated_buffer=False):
        bwd["compile"] = backward_only(compiled())
    # The backward's copy: x and dy read once and dx written once, timed the
    # same way as the forward's clone (issue 26's yardstick for the backward).
    out = torch.empty_like(xs[0])
    with torch.no_grad():
        copy = median_ms(rotating(lambda t: torch.add(t, dy, out=out), [t.detach() for t in xs]))
    element_bytes = xs[0].numel() * xs[0].element_size()
    plan = gn.plan(xs[0].detach(), groups, backward=True)
    del inputs, xs, dy
    torch.cuda.empty_cache()
    return {
        "name": name, "shape": list(shape), "G": groups, "dtype": str(dtype).replace("torch.", ""),
        "layout": layout, "pass": "forward+backward", "bytes": 5 * element_bytes,
        "floor_ms": 5 * element_bytes / copy_bw * 1e3, "ms": ms,
        # backward alone: reads x and dy, writes dx
        "backward_ms": bwd, "backward_floor_ms": 3 * element_bytes / copy_bw * 1e3,
        "backward_copy_ms": copy, "backward_plan": plan,
    }


# Fields of a plan dict that set its kind apart, in the order plan_summary
# prints them; ranks and blocks only where more than 1.
_SUMMARY_FIELDS = ("items", "ranks", "team", "kept", "chunks", "lag", "merge", "blocks")


def plan_summary(plan):
    """A plan dict (gn.plan, forward or backward) in a few words for the
    progress lines, e.g. "stream vec=4 lag=495 merge=each"; the JSON rows
    keep the whole dict."""
    words = [plan["kernel"]] + ([f"vec={plan['vec']}"] if "vec" in plan else [])
    for name in _SUMMARY_FIELDS:
        if name not in plan or (name in ("ranks", "blocks") and plan[name] == 1):
            continue
        value = f"{plan['kept']}/{plan['slice']}" if name == "kept" else plan[name]
        words.append(f"{name}={value}")
    return " ".join(words)


def backward_target(row):
    """Issue 26's bound on the backward over its copy: 1.3 where x takes
    64 MB or more, else 1.6."""
    return 1.3 if row["bytes"] / 5 >= 64e6 else 1.6


def pct(row, provider):
    return 100 * row["floor_ms"] / row["ms"][provider]


def markdown(rows, meta):
    cloned = bool(rows) and all("clone_ms" in r for r in rows)
    lines = [
        f"Card: {meta['device']} · torch {meta['torch']} · CUDA {meta['cuda']} · {meta['date']} · "
        f"copy bandwidth {meta['copy_GBps']:.0f} GB/s (read + write, measured in this run)",
        "",
        f"| case{' (forward + backward)' if rows and rows[0].get('pass') else ''} | shape | G | dtype | layout | ours ms | eager ms | compile ms | ours GB/s | "
        "% of copy BW (ours / eager / compile) |" + (" x.clone() % | ours ÷ clone |" if cloned else "") +
        " × eager | × compile |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if cloned else "") + "---:|---:|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['name']} | {'×'.join(map(str, r['shape']))} | {r['G']} | {r['dtype']} | {r['layout']} | "
            f"{ms['groupnorm_inline']:.4f} | {ms['eager']:.4f} | {ms['compile']:.4f} | "
            f"{r['bytes'] / ms['groupnorm_inline'] / 1e6:.0f} | "
            f"{pct(r, 'groupnorm_inline'):.0f} / {pct(r, 'eager'):.0f} / {pct(r, 'compile'):.0f} | " +
            (f"{100 * r['floor_ms'] / r['clone_ms']:.0f} | {ms['groupnorm_inline'] / r['clone_ms']:.2f} | "
             if cloned else "") +
            f"{ms['eager'] / ms['groupnorm_inline']:.2f} | {ms['compile'] / ms['groupnorm_inline']:.2f} |")
    if cloned:
        lines += ["", "x.clone() %: a copy of x timed the same way, as % of the floor: what one read "
                  "and one write of that many bytes reach at that size, launch included. "
                  "ours ÷ clone: our forward's time over that copy's (issue 26's yardstick)."]
    ge = math.exp(sum(math.log(r["ms"]["eager"] / r["ms"]["groupnorm_inline"]) for r in rows) / len(rows))
    gc = math.exp(sum(math.log(r["ms"]["compile"] / r["ms"]["groupnorm_inline"]) for r in rows) / len(rows))
    lines += ["", f"Geometric mean speed-up: {ge:.2f}× eager, {gc:.2f}× torch.compile ({len(rows)} cases)."]
    over = meta.get("python_overhead_us")
    if over:
        lines.append("Host time per call, tiny input: " +
                     ", ".join(f"{k} {v:.1f} µs" for k, v in over.items()) + ".")
    if "extra_memory_bytes" in meta:
        case = meta.get("extra_memory_case", "KernelBench L1-35 shape")
        lines.append(f"Extra memory beyond the output, {case}: {meta['extra_memory_bytes']} bytes.")
    walled = [r for r in rows if r.get("wall_us")]
    if walled:
        lines += ["", "Back to back, wall clock per call (µs; host and GPU together, inputs under "
                  f"{WALL_MAX_BYTES >> 20} MiB):", "",
                  "| case | shape | dtype | layout | ours µs | eager µs | compile µs | × eager | × compile |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|"]
        for r in walled:
            w = r["wall_us"]
            lines.append(
                f"| {r['name']} | {'×'.join(map(str, r['shape']))} | {r['dtype']} | {r['layout']} | "
                f"{w['groupnorm_inline']:.1f} | {w['eager']:.1f} | {w['compile']:.1f} | "
                f"{w['eager'] / w['groupnorm_inline']:.2f} | {w['compile'] / w['groupnorm_inline']:.2f} |")
    if rows and "backward_ms" in rows[0]:
        lines += ["", "Backward alone (GPU time: each backward captured once in a CUDA graph and "
                  "replayed; floor: read x and dy, write dx; copy: x + dy into dx, timed as the "
                  "forward's clone; target: issue 26's, 1.3 at 64 MB of x and more, else 1.6):", "",
                  "| case | shape | dtype | layout | ours ms | eager ms | compile ms | "
                  "% of floor (ours / eager / compile) | copy ms | ours ÷ copy | target | "
                  "× eager | × compile |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            b = r["backward_ms"]
            f = r["backward_floor_ms"]
            copy = r.get("backward_copy_ms", float("nan"))
            lines.append(
                f"| {r['name']} | {'×'.join(map(str, r['shape']))} | {r['dtype']} | {r['layout']} | "
                f"{b['groupnorm_inline']:.4f} | {b['eager']:.4f} | {b['compile']:.4f} | "
                f"{100 * f / b['groupnorm_inline']:.0f} / {100 * f / b['eager']:.0f} / "
                f"{100 * f / b['compile']:.0f} | {copy:.4f} | {b['groupnorm_inline'] / copy:.2f} | "
                f"{backward_target(r)} | {b['eager'] / b['groupnorm_inline']:.2f} | "
                f"{b['compile'] / b['groupnorm_inline']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few representative cases only")
    parser.add_argument("--json", help="write raw rows here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--png", help="write a chart here (plot_results.py; needs matplotlib)")
    parser.add_argument("--training", action="store_true",
                        help="time forward + backward instead of the forward alone")
    parser.add_argument("--rows", default="",
                        help="comma-separated suite case names (default: every case)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench: no CUDA device visible")
    gn.load()
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        # relative paths only: the record must not depend on the machine it ran on
        "command": " ".join(["python3", "benchmarks/bench_groupnorm.py"] +
                            [shlex.quote(os.path.basename(a) if os.sep in a else a)
                             for a in sys.argv[1:]]),
    }
    copy_bw = copy_bandwidth()
    meta["copy_GBps"] = copy_bw / 1e9
    print(f"{meta['device']}  torch {meta['torch']}  CUDA {meta['cuda']}  copy {copy_bw / 1e9:.0f} GB/s",
          flush=True)
    free, _ = torch.cuda.mem_get_info()
    budget = free // 6
    rows = []
    for case in suite_cases([n for n in args.rows.split(",") if n], "bench_groupnorm.py"):
        if args.quick and case[0] not in QUICK:
            continue
        row = (run_training_case if args.training else run_case)(*case, copy_bw, budget)
        rows.append(row)
        ms = row["ms"]
        if args.training:
            b = row["backward_ms"]
            detail = (f"  backward ours {b['groupnorm_inline']:.4f} eager {b['eager']:.4f} "
                      f"compile {b['compile']:.4f} "
                      f"({100 * row['backward_floor_ms'] / b['groupnorm_inline']:.0f}% of its floor, "
                      f"{b['groupnorm_inline'] / row['backward_copy_ms']:.2f}x its copy)"
                      f"  [{plan_summary(row['backward_plan'])}]")
        else:
            detail = f"  err {row['max_abs_err_vs_float64']:.1e}  [{plan_summary(row['plan'])}]"
        print(f"{row['name']:>20} {'x'.join(map(str, row['shape'])):>16} G={row['G']:<3} {row['dtype']:>8} "
              f"{row['layout']:>13}  {'fwd+bwd' if args.training else 'forward'} "
              f"ours {ms['groupnorm_inline']:8.4f}  eager {ms['eager']:8.4f}  "
              f"compile {ms['compile']:8.4f}  floor {row['floor_ms']:8.4f}  "
              f"{pct(row, 'groupnorm_inline'):5.1f}%{detail}", flush=True)
    if not args.training:
        meta["python_overhead_us"] = python_overhead_us()
        # KernelBench L1-35, or a 64 MB VAE shape for a quick run
        shape, groups, dtype = (((1, 128, 512, 512), 32, torch.bfloat16) if args.quick
                                else ((112, 64, 512, 512), 8, torch.float32))
        meta["extra_memory_bytes"] = extra_memory_bytes(shape, groups, dtype)
        meta["extra_memory_case"] = f"{'×'.join(map(str, shape))} G={groups} {str(dtype)[6:]}"
    table = markdown(rows, meta)
    print()
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.png:
        try:
            plot_results.plot(rows, meta, args.png)
        except ImportError as error:
            print(f"no chart: {error}")


if __name__ == "__main__":
    main()

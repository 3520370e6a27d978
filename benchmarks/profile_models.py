"""Where a compiled model's GPU time goes, torch's GroupNorm against ours
and against the compile pass: the kernels of a few calls under
torch.profiler, summed per kernel.

    python3 benchmarks/profile_models.py [--models vae] [--mode compile] [--calls 5] [--rounds 3]
                                         [--top 12 (0: all)] [--variants torch,ours,pass] [--json PATH]
                                         [--tiny]

--mode eager profiles models.py's eager forward (under torch.no_grad())
of "torch" and "ours", and --mode train its eager training step (forward
and backward), instead ("pass" has nothing to rewrite in eager mode and is
left out). With both of those, every mode prints an
upper bound on the swap's GPU-time speed-up: torch's kernel time over the
time of ours' kernels that are not GroupNorm's.

The same models as models.py (its builders, inputs and variants): "torch"
(as shipped), "ours" (replace_groupnorm) and "pass" (as shipped, compiled
with enable_compile_fusion()). Per variant: wall time per call (the median
of --rounds alternating rounds unprofiled, then profiled), the sum of
its GPU kernels' times per call (their gap is host time the GPU waited
for), the kernels launched per call, and the kernels that take the most
time, GroupNorm's own marked; and the host's side (host_table): launch
and memset calls and our operators' calls, with their CPU time under the
profiler. --tiny: toy sizes on the CPU, the profile of CPU operators (a
smoke test of the script).
"""

import argparse
import collections
import copy
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

# what names GroupNorm's kernels: torch's, Inductor's fused reductions of it, ours
GROUPNORM_MARKS = ("group_norm", "groupnorm", "GroupNorm", "native_group_norm")


def variants(name, mode, tiny, device, wanted):
    """{variant: callable} for one model, each of `wanted` compiled in `mode`."""
    model, args, dtype, cl, call = models.prepare(name, tiny, device)
    built = models.variant_models(model, dtype, cl)
    if mode == "train":  # eager: the compile pass has nothing to rewrite
        return {v: (lambda m=m: models.training_step(m, call, args))
                for v, m in built.items() if v in wanted}
    if mode == "eager":
        return {v: (lambda m=m: torch.no_grad()(call)(m, *args))
                for v, m in built.items() if v in wanted}
    built["pass"] = copy.deepcopy(built["torch"])  # its own copy, as models.py's
    return {v: models.compiled_variant({}, m, models.with_compile_fusion(call) if v == "pass" else call,
                                       args, mode)[0]
            for v, m in built.items() if v in wanted}


def kernel_table(prof, device, calls):
    """(per-call GPU ms, per-call kernel count, {kernel: per-call ms})."""
    totals = collections.Counter()
    count = 0
    for e in prof.events():
        if device.type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = e.device_time
        else:
            if e.cpu_parent is not None:
                continue
            t = e.cpu_time
        totals[e.name] += t / 1e3 / calls
        count += 1
    return sum(totals.values()), count / calls, totals


# the runtime and driver calls that launch kernels (a CUDA graph's replay
# among them) and that set memory, as the profiler names their CPU events
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch")
MEMSET_CALLS = ("cudaMemsetAsync",)


def inside_ours(event, prefix):
    """Whether event or one of its CPU ancestors is a call of our operators."""
    while event is not None:
        if event.name.startswith(prefix):
            return True
        event = event.cpu_parent
    return False


def host_table(prof, calls, namespace):
    """The host's side of a profile, per call: launches and memsets (how
    many, the CPU µs of those runtime calls) and calls of our operators
    (how many, their CPU µs with all they run). Profiled host times run
    slower than unprofiled ones: compare variants, not wall times."""
    table = {"launches": 0, "launch_us": 0.0, "memsets": 0, "memset_us": 0.0,
             "operator_calls": 0, "operator_us": 0.0}
    ours = namespace + "::"
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.name in LAUNCH_CALLS:
            count, us = "launches", "launch_us"
        elif e.name in MEMSET_CALLS:
            count, us = "memsets", "memset_us"
        elif e.name.startswith(ours) and not inside_ours(e.cpu_parent, ours):
            count, us = "operator_calls", "operator_us"  # outermost: the autograd kernel calls it again
        else:
            continue
        table[count] += 1 / calls
        table[us] += e.cpu_time_total / calls
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vae")
    parser.add_argument("--mode", default="compile",
                        choices=("compile", "reduce-overhead", "eager", "train"))
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of --calls unprofiled calls per variant")
    parser.add_argument("--top", type=int, default=12, help="kernels listed a variant; 0: every one")
    parser.add_argument("--json")
    parser.add_argument("--variants", default="torch,ours,pass")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: only --tiny runs on the CPU")
    if args.mode not in ("eager", "train"):  # nothing to compile
        models.warm_inductor(device)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "mode": args.mode,
              "calls": args.calls, "rounds": args.rounds, "models": {}}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def unprofiled_ms(fn):
        sync()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        sync()
        return (time.perf_counter() - start) * 1e3 / args.calls

    for name in args.models.split(","):
        entry = report["models"][name] = {}
        fns = variants(name, args.mode, args.tiny, device, args.variants.split(","))
        # wall times first, alternating, before any profile: a profile leaves
        # CUPTI loaded, which slows every later launch of the process (so one
        # model a process where wall times matter)
        walls = {variant: [] for variant in fns}
        for fn in fns.values():
            fn()  # warm
        for _ in range(args.rounds):
            for variant, fn in fns.items():
                walls[variant].append(unprofiled_ms(fn))
        for variant, fn in fns.items():
            unprofiled = statistics.median(walls[variant])
            sync()
            start = time.perf_counter()
            with profile(activities=activities) as prof:
                for _ in range(args.calls):
                    fn()
                sync()
            wall = (time.perf_counter() - start) * 1e3 / args.calls
            busy, launches, totals = kernel_table(prof, device, args.calls)
            ours = any("groupnorm::" in k for k in totals)
            if device.type == "cuda" and ours != (variant != "torch"):
                raise RuntimeError(f"profile_models.py: the {variant} variant ran "
                                   f"{'some' if ours else 'none'} of groupnorm_inline's kernels")
            top = totals.most_common(args.top or None)
            groupnorm_ms = sum(ms for k, ms in totals.items() if any(m in k for m in GROUPNORM_MARKS))
            host = host_table(prof, args.calls, models.gn._NAMESPACE)
            entry[variant] = {"wall_ms": wall, "wall_unprofiled_ms": unprofiled,
                              "kernel_ms": busy, "kernels": launches,
                              "groupnorm_named_ms": groupnorm_ms, "host": host, "top": top}
            print(f"{name} {variant}: wall {unprofiled:.2f} ms a call ({wall:.2f} profiled), "
                  f"kernels {busy:.2f} ms in {launches:.0f} launches, named GroupNorm "
                  f"{groupnorm_ms:.2f} ms", flush=True)
            print(f"    host, profiled: {host['launches']:.0f} launch calls "
                  f"({host['launch_us']:.0f} us), {host['memsets']:.0f} memsets "
                  f"({host['memset_us']:.0f} us), {host['operator_calls']:.0f} calls of "
                  f"our operators ({host['operator_us']:.0f} us with what they run)")
            for kernel, ms in top:
                mark = " *" if any(m in kernel for m in GROUPNORM_MARKS) else ""
                print(f"    {ms:8.3f} ms  {kernel[:110]}{mark}")
        if {"torch", "ours"} <= entry.keys():
            # ours' GroupNorm kernels are all named (groupnorm::); the rest
            # is the model's other work, which torch's variant does too
            # (with its own activations and layout copies besides)
            rest = entry["ours"]["kernel_ms"] - entry["ours"]["groupnorm_named_ms"]
            entry["bound_without_groupnorm"] = entry["torch"]["kernel_ms"] / rest
            print(f"{name}: torch's kernels over ours' without GroupNorm's: "
                  f"{entry['bound_without_groupnorm']:.2f}x (GPU time, were ours to take none)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

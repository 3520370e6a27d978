"""Host time per GroupNorm call, by the way it is called.

    python benchmarks/host_overhead.py [--rounds 30] [--calls 2000] [--json PATH]

On a tiny input (4x32x8x8 fp32, a few microseconds of GPU work) a stream of
calls is bound by the host: the wall time per call of `--calls` calls back
to back, synchronised only at the end, is the host time of one call. The
contenders alternate, round by round, and each reports its median over the
rounds:
- extension: the extension's own function (what eager calls without
  gradients run);
- extension_team, extension_stream: the same with a team of two CTAs, and
  with the stream kernel, forced: the plans whose CTAs wait on each other
  through counters;
- operator: torch.ops.groupnorm_inline.forward.default, as the code that
  torch.compile generates calls it (kernels registered from C++);
- python_custom_op: the same extension function behind a
  torch.library.custom_op, the way the operator was registered before;
- operator_with_grad: the operator on an input that requires grad (the
  autograd kernel records the graph; forward only);
- compiled: a torch.compile'd function calling group_norm (Dynamo's guards,
  the compiled wrapper, then the operator);
- torch: torch.group_norm (eager), for scale;
- aten_neg_operator: torch.ops.aten.neg.default, an operator of one
  allocation and one launch called the way compiled code calls ours: the
  floor of any operator on this host;
- three_allocations: the caching allocator's share of ours (y, mean, rstd);
- module_train, module_train_silu: a training step's share, our GroupNorm
  module's forward (without, then with its fused SiLU) and backward on an
  input that requires grad, as timm's layers call it; torch_module_train,
  torch_module_train_silu: nn.GroupNorm's (and F.silu's) the same way;
- fused_operator_silu, fused_operator_all: <ns>::forward_fused as the
  compile pass calls it, with SiLU alone (ten arguments) and with an
  (N, C) add, scale, shift, SiLU and a residual (twelve);
- compiled_torch, compiled_torch_silu, compiled_pass_silu: torch.compile
  of F.group_norm (Inductor's own kernels), of it followed by F.silu, and
  of the latter with the compile pass (our fused operator): what one
  GroupNorm costs the host of a compiled model each way, Dynamo's guards
  and the wrapper included.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402
from kernel_times import ran_our_kernels  # noqa: E402


def contenders(x, w, b, groups):
    extension = gn.load()
    op = gn._OPS.forward.default

    @torch.library.custom_op("groupnorm_host_overhead::forward", mutates_args=())
    def python_custom_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, groups: int,
                         eps: float) -> torch.Tensor:
        return extension.forward(x, w, b, groups, eps, "auto", 0, 0)[0]

    compiled = torch.compile(lambda t: gn.group_norm(t, groups, w, b), fullgraph=True)
    x_grad = x.clone().requires_grad_()
    stats = (x.shape[0], groups)  # mean's and rstd's shape
    C = x.shape[1]
    ours, ours_silu = (gn.GroupNorm(groups, C, activation=a).to(x.device) for a in (None, "silu"))
    theirs = torch.nn.GroupNorm(groups, C).to(x.device)
    dy = torch.randn_like(x)

    def train_step(module, activation=lambda t: t):
        # gradients accumulate into x_grad and the parameters, alike for all
        return lambda: activation(module(x_grad)).backward(dy)

    fused = gn._OPS.forward_fused.default
    silu = [gn._ACTIVATION_CODES["silu"]]
    per_channel = torch.randn(x.shape[0], C, *(1,) * (x.dim() - 2), device=x.device)
    residual = torch.randn_like(x)

    def torch_silu(t):
        return F.silu(F.group_norm(t, groups, w, b))

    compiled_torch = torch.compile(lambda t: F.group_norm(t, groups, w, b), fullgraph=True)
    compiled_torch_silu = torch.compile(torch_silu, fullgraph=True)
    compiled_torch_silu(x)
    gn.enable_compile_fusion()  # for this compile alone (compiled on the first call)
    try:
        compiled_pass_silu = torch.compile(lambda t: torch_silu(t), fullgraph=True)
        compiled_pass_silu(x)
    finally:
        gn.disable_compile_fusion()
    return {
        "extension": lambda: extension.forward(x, w, b, groups, 1e-5, "auto", 0, 0),
        "extension_team": lambda: extension.forward(x, w, b, groups, 1e-5, "contiguous", 2, 0),
        "extension_stream": lambda: extension.forward(x, w, b, groups, 1e-5, "stream", 0, 0),
        "operator": lambda: op(x, w, b, groups, 1e-5),
        "python_custom_op": lambda: python_custom_op(x, w, b, groups, 1e-5),
        "operator_with_grad": lambda: op(x_grad, w, b, groups, 1e-5),
        "compiled": lambda: compiled(x),
        "torch": lambda: torch.group_norm(x, groups, w, b, 1e-5),
        "aten_neg_operator": lambda: torch.ops.aten.neg.default(x),
        "three_allocations": lambda: (torch.empty_like(x), torch.empty(stats, device=x.device),
                                      torch.empty(stats, device=x.device)),
        "module_train": train_step(ours),
        "module_train_silu": train_step(ours_silu),
        "torch_module_train": train_step(theirs),
        "torch_module_train_silu": train_step(theirs, F.silu),
        "fused_operator_silu": lambda: fused(x, w, b, groups, 1e-5, None, None, None, silu, 0.01),
        "fused_operator_all": lambda: fused(x, w, b, groups, 1e-5, per_channel, per_channel,
                                            residual, silu, 0.01, per_channel, False),
        "compiled_torch": lambda: compiled_torch(x),
        "compiled_torch_silu": lambda: compiled_torch_silu(x),
        "compiled_pass_silu": lambda: compiled_pass_silu(x),
    }


def per_call_us(call, calls):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json")
    args = parser.parse_args()
    x = torch.randn(4, 32, 8, 8, device="cuda")
    w, b = torch.randn(32, device="cuda"), torch.randn(32, device="cuda")
    calls = contenders(x, w, b, 8)
    for call in calls.values():  # warm-up: compile, caches, allocator
        per_call_us(call, 200)
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            times[name].append(per_call_us(call, args.calls))
    # after the timings: a profile leaves CUPTI loaded, which slows every later launch
    for name, ours_expected in (("compiled", True), ("compiled_torch", False),
                                ("compiled_torch_silu", False), ("compiled_pass_silu", True)):
        if ran_our_kernels(calls[name]) != ours_expected:
            raise RuntimeError(f"host_overhead.py: {name} ran the wrong kernels")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "rounds": args.rounds, "calls": args.calls,
              "median_us": {name: round(statistics.median(t), 2) for name, t in times.items()},
              "spread_us": {name: [round(min(t), 2), round(max(t), 2)] for name, t in times.items()}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

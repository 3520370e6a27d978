"""Where a timm model's eager training step spends its host time.

    python benchmarks/train_host_split.py [MODEL] [ROUNDS] [--json PATH]

MODEL (default efficientnet_b3_gn) as models.py builds it, in train mode,
four variants: torch's model; ours (replace_groupnorm, SiLU fused); ours
with every activation run unfused after our GroupNorm; ours with each of
our GroupNorm outputs made contiguous, as torch's GroupNorm returns them on
CUDA (which picks torch's own depthwise convolution kernel instead of
cuDNN's for channels-last models). Per step: the host time of the forward
and loss (issued, no sync), of backward() (it returns once autograd ran
every node on the host), and the step's wall time (synced); ROUNDS
(default 7) alternating rounds of 3 steps each, medians. Then a cProfile
of ours' forward (Python's share), and a CPU-only torch.profiler table of
three steps of torch's, ours and the contiguous variant, with the CPU time
of the convolutions, GroupNorms and SiLUs by op (profiled after the
timing: a profile slows every later launch of the process).
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import groupnorm_inline as gn  # noqa: E402
import models  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("model", nargs="?", default="efficientnet_b3_gn")
parser.add_argument("rounds", nargs="?", type=int, default=7)
parser.add_argument("--json")
cli = parser.parse_args()
model, args, dtype, cl, call = models.prepare(cli.model, False, torch.device("cuda"))
built = models.variant_models(model, dtype, cl)
for m in built.values():
    m.train()
real_spec = gn._activation_spec
real_forwards = (gn.GroupNorm.forward, gn.GroupNormAct.forward)


def contiguous_output(forward):
    return lambda self, *a, **k: forward(self, *a, **k).contiguous()


def step(m, unfused=False, contiguous=False):
    """(forward host ms, backward host ms, wall ms) of one training step."""
    if unfused:
        gn._activation_spec = lambda module: None
    if contiguous:
        gn.GroupNorm.forward, gn.GroupNormAct.forward = map(contiguous_output, real_forwards)
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = call(m, *args).float().square().mean()
        issued = time.perf_counter()
        loss.backward()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        m.zero_grad(set_to_none=True)
        return (issued - start) * 1e3, (returned - issued) * 1e3, (end - start) * 1e3
    finally:
        gn._activation_spec = real_spec
        gn.GroupNorm.forward, gn.GroupNormAct.forward = real_forwards


contenders = {"torch": lambda: step(built["torch"]), "ours": lambda: step(built["ours"]),
              "ours_unfused": lambda: step(built["ours"], unfused=True),
              "ours_nchw": lambda: step(built["ours"], contiguous=True)}
for contender in contenders.values():
    for _ in range(3):
        contender()
times = {name: [] for name in contenders}
for _ in range(cli.rounds):
    for name, contender in contenders.items():
        for _ in range(3):
            times[name].append(contender())
summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": cli.model, "rounds": cli.rounds, "variants": {}}
for name, t in times.items():
    forward, backward, wall = (statistics.median(s[i] for s in t) for i in range(3))
    summary["variants"][name] = {"forward_host_ms": round(forward, 2),
                                 "backward_host_ms": round(backward, 2), "wall_ms": round(wall, 2)}
    print(f"{cli.model} {name}: forward host {forward:.2f} ms, backward host {backward:.2f} ms, "
          f"wall {wall:.2f} ms", flush=True)

ours = built["ours"]
python_profile = cProfile.Profile()
for _ in range(3):
    python_profile.enable()
    out = call(ours, *args)
    python_profile.disable()
    out.float().square().mean().backward()
    ours.zero_grad(set_to_none=True)
text = io.StringIO()
pstats.Stats(python_profile, stream=text).sort_stats("tottime").print_stats(25)
print(text.getvalue()[:6000])

from torch.profiler import ProfilerActivity, profile  # noqa: E402

summary["cpu_ms_per_step"] = {}
for name in ("torch", "ours", "ours_nchw"):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            contenders[name]()
    print("==", name)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                    max_name_column_width=60))
    ops = summary["cpu_ms_per_step"][name] = {}
    for e in prof.key_averages():
        if any(mark in e.key for mark in ("conv", "group_norm", "groupnorm", "silu")):
            ops[e.key] = {"calls": e.count // 3, "total": round(e.cpu_time_total / 3e3, 3),
                          "self": round(e.self_cpu_time_total / 3e3, 3)}
            print(f"  {e.key[:70]:70s} calls {e.count:5d} cpu_total "
                  f"{e.cpu_time_total / 1e3:8.2f} ms self {e.self_cpu_time_total / 1e3:8.2f} ms")
if cli.json:
    with open(cli.json, "w") as f:
        json.dump(summary, f, indent=1)

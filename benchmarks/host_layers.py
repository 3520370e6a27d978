"""Host time per call of GroupNorm layers as models call them, for one checkout.

    python benchmarks/host_layers.py CHECKOUT [ROUNDS] [--input=timm|unet]

CHECKOUT's groupnorm_inline (a `git worktree` of another commit, or `.`)
times, on an input of the kind a model's layers take, our GroupNormAct
with SiLU (the fused kernel) and our plain GroupNorm with gradients on (the
parameters require grad): on an input that requires grad ("_grad") and on
one that does not ("_nograd"). Under torch.no_grad(), as a model's
inference runs ("_inference"): the same two layers, torch's nn.GroupNorm
alone and followed by F.silu, and the extension's own forward called bare
(the floor a layer's Python path sits on). --input timm (default):
32x144x28x28 bfloat16, channels-last, 8 groups, as efficientnet_b3_gn's
layers; --input unet: 2x320x64x64 float16, contiguous, 32 groups, as the
SD1.5 UNet's first blocks. A call's host time is the wall time of 100
calls issued back to back, before the sync that follows them (the GPU
keeps up: a call's kernel is shorter than its host time), per call; the
median over ROUNDS (default 15) rounds, the contenders alternating. Prints
one JSON line. BEFORE, a checkout of another commit: alternate the
processes.

    for i in 1 2 3; do for t in BEFORE .; do python benchmarks/host_layers.py $t; done; done
"""

import json
import os
import statistics
import sys
import time

args = [a for a in sys.argv[1:] if not a.startswith("--input")]
kind = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--input=")), "timm")
tree = os.path.abspath(args[0])
sys.path.insert(0, tree)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import groupnorm_inline as gn  # noqa: E402

assert os.path.dirname(os.path.abspath(gn.__file__)) == tree, gn.__file__
extension = gn.load()
if kind == "timm":
    shape, dtype, groups, layout = (32, 144, 28, 28), torch.bfloat16, 8, torch.channels_last
elif kind == "unet":
    shape, dtype, groups, layout = (2, 320, 64, 64), torch.float16, 32, torch.contiguous_format
else:
    sys.exit(f"host_layers.py: --input must be timm or unet, got {kind}")
x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=layout)
x_grad = x.clone().requires_grad_()
channels = shape[1]
act = gn.GroupNormAct(groups, channels, act=nn.SiLU()).to("cuda", dtype)
plain = gn.GroupNorm(groups, channels).to("cuda", dtype)
torch_plain = nn.GroupNorm(groups, channels).to("cuda", dtype)
calls = {"act_grad": lambda: act(x_grad), "plain_grad": lambda: plain(x_grad),
         "act_nograd": lambda: act(x), "plain_nograd": lambda: plain(x),
         "act_inference": lambda: act(x), "plain_inference": lambda: plain(x),
         "torch_plain_inference": lambda: torch_plain(x),
         "torch_silu_inference": lambda: F.silu(torch_plain(x)),
         "extension_inference": lambda: extension.forward(x, plain.weight, plain.bias, groups,
                                                          1e-5, "auto", 0, 0)}


def issue_us(call, n=100):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def timed(name, n):
    with torch.set_grad_enabled(not name.endswith("_inference")):
        return issue_us(calls[name], n)


for name in calls:  # warm-up
    timed(name, 20)
times = {name: [] for name in calls}
for _ in range(int(args[1]) if len(args) > 1 else 15):
    for name in calls:
        times[name].append(timed(name, 100))
print(json.dumps({"tree": os.path.basename(tree), "input": kind,
                  **{name: round(statistics.median(t), 2) for name, t in times.items()}}))

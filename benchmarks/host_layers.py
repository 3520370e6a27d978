"""Host time per call of the layers timm's models run, for one checkout.

    python benchmarks/host_layers.py CHECKOUT [ROUNDS]

CHECKOUT's groupnorm_inline (a `git worktree` of another commit, or `.`)
times, on an input of the kind efficientnet_b3_gn's layers take
(32x144x28x28 bfloat16, channels-last, 8 groups): our GroupNormAct with
SiLU (the fused kernel) and our plain GroupNorm, on an input that requires
grad and on one that does not. A call's host time is the wall time of 100
calls issued back to back, before the sync that follows them (the GPU keeps
up: a call's kernel is shorter than its host time), per call; the median
over ROUNDS (default 15) rounds, the contenders alternating. Prints one
JSON line. BEFORE, a checkout of another commit: alternate the processes.

    for i in 1 2 3; do for t in BEFORE .; do python benchmarks/host_layers.py $t; done; done
"""

import json
import os
import statistics
import sys
import time

tree = os.path.abspath(sys.argv[1])
sys.path.insert(0, tree)
import torch  # noqa: E402
from torch import nn  # noqa: E402

import groupnorm_inline as gn  # noqa: E402

assert os.path.dirname(os.path.abspath(gn.__file__)) == tree, gn.__file__
gn.load()
x = torch.randn(32, 144, 28, 28, device="cuda", dtype=torch.bfloat16)
x = x.contiguous(memory_format=torch.channels_last)
x_grad = x.clone().requires_grad_()
act = gn.GroupNormAct(8, 144, act=nn.SiLU()).to("cuda", torch.bfloat16)
plain = gn.GroupNorm(8, 144).to("cuda", torch.bfloat16)
calls = {"act_grad": lambda: act(x_grad), "plain_grad": lambda: plain(x_grad),
         "act_nograd": lambda: act(x), "plain_nograd": lambda: plain(x)}


def issue_us(call, n=100):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


for call in calls.values():  # warm-up
    issue_us(call, 20)
times = {name: [] for name in calls}
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
    for name, call in calls.items():
        times[name].append(issue_us(call))
print(json.dumps({"tree": os.path.basename(tree),
                  **{name: round(statistics.median(t), 2) for name, t in times.items()}}))

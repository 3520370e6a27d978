"""Soak: random forward and backward calls with every option for a while,
each checked call against torch.

    python3 tools/soak.py [--seconds 60] [--check-every 100] [--seed 0] [--json PATH]

Each call draws a shape (rank 2-5, odd and prime sizes), a dtype, a layout,
the groups, weight and bias (each present or not), an epilogue (scale,
shift, activation chain, residual: each present or not), a shift of the
input (0, or 1000 for float32/float64), and whether gradients are wanted;
it runs group_norm on the GPU (this module's kernels) and, with gradients,
the backward (dy zero where the pre-activation lies at a kink of the chain,
within rounding). Every --check-every-th call is checked: output and gradients
against the unfused torch sequence in float64. The bound is twice the error
of the same sequence in the call's dtype plus four ulps of the largest
value (the rule of the GPU epilogue tests), that slack scaled by the square
root of the group's size (sums taken in another order) and by 1 + shift / 10
for shifted inputs. float64 calls, which have no more exact reference: 1e-9
of the larger of the input and the value. Exit status 1 on any failed check
or error; the JSON has the counts and each failure's draw.
"""

import argparse
import json
import math
import os
import random
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402
import groupnorm_tools as tools  # noqa: E402
from test_groupnorm import apply_epilogue, make_input, off_kinks, unfused_group_norm  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 97]
ACTIVATIONS = [None, "silu", "gelu", "gelu_tanh", "relu", ("leaky_relu", 0.2), "tanh", "sigmoid",
               "hardswish", "mish", ("tanh", "hardswish"), ("silu", "relu")]


def draw(rng):
    """One call's arguments, as plain values (for the JSON)."""
    rank = rng.randint(2, 5)
    groups = rng.choice([1, 2, 3, 4, 8, 32])
    C = groups * rng.choice([1, 2, 3, 4, 5, 10, 40])
    N = rng.choice([1, 2, 3, 4, 8])
    spatial = [rng.choice(SIZES) for _ in range(rank - 2)]
    while spatial and N * C * torch.Size(spatial).numel() > (1 << 24):
        spatial[rng.randrange(len(spatial))] = rng.choice(SIZES[:6])
    if C // groups * torch.Size(spatial).numel() < 2:  # a group of one value: torch refuses it
        C *= 2
    dtype = rng.choice(DTYPES)
    return {"shape": [N, C, *spatial], "groups": groups, "dtype": str(dtype)[6:],
            "layout": rng.choice(["contiguous", "channels_last"]) if rank >= 4 else "contiguous",
            "shift": rng.choice([0.0, 1000.0]) if dtype in (torch.float32, torch.float64) else 0.0,
            "weight": rng.random() < 0.8, "bias": rng.random() < 0.8,
            "scale": rng.random() < 0.3, "shift_t": rng.random() < 0.3,
            "activation": rng.choice(ACTIVATIONS), "residual": rng.random() < 0.3,
            "eps": rng.choice([1e-5, 1e-6, 1e-3]), "grad": rng.random() < 0.5}


def tensors(d, seed):
    """x, weight, bias and the epilogue's keyword arguments of a draw, on the GPU."""
    torch.manual_seed(seed)
    dtype = getattr(torch, d["dtype"])
    x = make_input(tuple(d["shape"]), dtype, d["layout"], "cuda", shift=d["shift"])
    N, C = d["shape"][:2]
    w = torch.randn(C, dtype=dtype, device="cuda") if d["weight"] else None
    b = torch.randn(C, dtype=dtype, device="cuda") if d["bias"] else None
    epilogue = {"activation": d["activation"]}
    if d["scale"]:
        epilogue["scale"] = 0.5 * torch.randn(N, C, dtype=dtype, device="cuda")
    if d["shift_t"]:
        epilogue["shift"] = torch.randn(N, C, dtype=dtype, device="cuda")
    if d["residual"]:
        epilogue["residual"] = torch.randn_like(x)
    return x, w, b, epilogue


def run(fn, x, w, b, epilogue, dy, cast):
    """fn's output and, when dy is given, the gradients of every tensor."""
    leaves = {"input": x, "weight": w, "bias": b, **{k: v for k, v in epilogue.items()
                                                      if isinstance(v, torch.Tensor)}}
    leaves = {k: cast(v).detach().requires_grad_(dy is not None)
              for k, v in leaves.items() if v is not None}
    args = {k: leaves.get(k, v) for k, v in epilogue.items()}
    y = fn(leaves["input"], leaves.get("weight"), leaves.get("bias"), args)
    if dy is None:
        return {"y": y.detach()}
    grads = torch.autograd.grad(y, list(leaves.values()), cast(dy))
    return {"y": y.detach(), **{f"d{k}": g for k, g in zip(leaves, grads)}}


def check(d, seed):
    """The names of the values (y, dinput, ...) outside the tolerance."""
    x, w, b, epilogue = tensors(d, seed)
    groups, eps = d["groups"], d["eps"]
    dy = off_kinks(torch.randn_like(x), x, w, b, epilogue, groups, eps) if d["grad"] else None

    def ours(t, weight, bias, args):
        return gn.group_norm(t, groups, weight, bias, eps, **args)

    def torch_sequence(t, weight, bias, args):
        return apply_epilogue(unfused_group_norm(t, groups, weight, bias, eps), **args)

    mine = run(ours, x, w, b, epilogue, dy, lambda v: v)
    exact = run(torch_sequence, x, w, b, epilogue, dy, lambda v: v.double())
    theirs = run(torch_sequence, x, w, b, epilogue, dy, lambda v: v)
    bad = []
    for key, ref in exact.items():
        finite = torch.isfinite(ref)
        if not torch.equal(finite, torch.isfinite(mine[key])):
            bad.append(key)
            continue
        ref, got, other = ref[finite], mine[key][finite].double(), theirs[key][finite].double()
        if ref.numel() == 0:
            continue
        if x.dtype == torch.float64:  # no more exact reference: relative to the input too
            slack = 1e-9 * max(ref.abs().max().item(), x.abs().max().item())
        else:  # sums in another order: rounding grows with the square root of their length
            slack = 4 * torch.finfo(x.dtype).eps * max(ref.abs().max().item(), 1e-30) * math.sqrt(
                x.numel() // x.shape[0] // groups) * (1 + d["shift"] / 10)
        if tools.max_error(got, ref) > 2 * tools.max_error(other, ref) + slack:
            bad.append(key)
    return bad


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the counts and failures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("soak: needs a CUDA GPU", file=sys.stderr)
        return 2
    gn.load()
    rng = random.Random(args.seed)
    calls = checks = 0
    failures = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        d = draw(rng)
        seed = rng.randrange(1 << 31)
        try:
            if calls % args.check_every == 0:
                bad = check(d, seed)
                checks += 1
                if bad:
                    failures.append({"draw": d, "seed": seed, "outside tolerance": bad})
            else:
                x, w, b, epilogue = tensors(d, seed)
                run(lambda t, weight, bias, a: gn.group_norm(t, d["groups"], weight, bias, d["eps"], **a),
                    x, w, b, epilogue, torch.randn_like(x) if d["grad"] else None, lambda v: v)
        except Exception:  # noqa: BLE001 (recorded with its draw; the soak goes on)
            failures.append({"draw": d, "seed": seed, "error": traceback.format_exc(limit=3)})
        calls += 1
    torch.cuda.synchronize()
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "seconds": args.seconds, "seed": args.seed, "calls": calls, "checked": checks,
               "failures": failures}
    print(f"soak: {calls} calls in {args.seconds:.0f} s, {checks} checked against float64, "
          f"{len(failures)} failed")
    for failure in failures[:10]:
        print(json.dumps(failure))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

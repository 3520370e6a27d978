"""KernelBench solutions (`bundle --kernelbench`) against their reference
models: eager, torch.compile'd, and the solution's ModelNew, on the
problem's inputs, one GPU.

    python benchmarks/bench_kernelbench.py [--problems level1-35 level2-92] [--rounds 5]
                                           [--json PATH] [--kernels]

Each problem's bundle is written to a temporary file and run as KernelBench
runs it (exec of its text, which builds its own extension the first time).
The references are the test suite's (the problems' own code; importing
test_groupnorm needs pytest), given random affine parameters and loaded
into ModelNew. The contenders alternate for
--rounds rounds; each time is a median of triton.testing.do_bench; per
contender the median over rounds. Also timed: the level-2 reference's
cuDNN convolution alone (its first step; the solution computes its own).
TF32 stays at torch's defaults (matmul and convolution flags printed).
--kernels: each contender's GPU time per kernel (torch.profiler, the median
over 20 calls).
Before timing, each ModelNew's output is checked against the reference at
KernelBench's tolerance (atol = rtol = 1e-4).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import triton.testing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("GROUPNORM_INLINE_LAZY", "1")  # only the bundles' extensions are used
import groupnorm_tools as tools  # noqa: E402
from kernel_times import profile_kernels  # noqa: E402
# the references as the tests build them (the problems' code)
from test_groupnorm import kernelbench_models, kernelbench_reference_model  # noqa: E402
from test_kernelbench_92 import kernelbench_92_reference_model  # noqa: E402

PROBLEMS = {  # problem: (reference Model, its GroupNorm attribute)
    "level1-35": (kernelbench_reference_model, "gn"),
    "level2-92": (kernelbench_92_reference_model, "group_norm"),
}


def solution(problem, directory):
    """The bundle's namespace: ModelNew, get_inputs, get_init_inputs."""
    path = tools.bundle(os.path.join(directory, f"{problem}.py"), kernelbench=problem)
    namespace = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return namespace


def contenders(problem, namespace):
    """{name: a call with no arguments}, the inputs on the GPU."""
    reference_model, norm = PROBLEMS[problem]
    reference, candidate = kernelbench_models(namespace, reference_model(), norm)
    (x,) = (t.cuda() for t in namespace["get_inputs"]())
    compiled = torch.compile(reference)
    with torch.no_grad():
        torch.testing.assert_close(candidate(x), reference(x), atol=1e-4, rtol=1e-4)
        compiled(x)  # compiled before timing
    fns = {"eager": lambda: reference(x), "torch.compile": lambda: compiled(x),
           "ModelNew": lambda: candidate(x)}
    if hasattr(reference, "conv"):
        fns["conv alone"] = lambda: reference.conv(x)
    return fns


def kernel_breakdown(fn, calls=20):
    """{kernel name: median GPU ms of its launches times launches per call}."""
    return {name: statistics.median(t) * len(t) / calls / 1000
            for name, t in profile_kernels(fn, calls, warmup=1).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--kernels", action="store_true", help="also each contender's time per kernel")
    args = parser.parse_args()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "rounds": args.rounds,
            "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                     "cudnn": torch.backends.cudnn.allow_tf32}}
    print(meta)
    rows = []
    with tempfile.TemporaryDirectory() as directory, torch.no_grad():
        for problem in args.problems:
            fns = contenders(problem, solution(problem, directory))
            times = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times[name].append(triton.testing.do_bench(fn, warmup=25, rep=200,
                                                               return_mode="median"))
            ms = {name: statistics.median(t) for name, t in times.items()}
            rows.append({"problem": problem, "ms": ms})
            if args.kernels:
                rows[-1]["kernels_ms"] = {name: kernel_breakdown(fn) for name, fn in fns.items()}
                for name, kernels in rows[-1]["kernels_ms"].items():
                    print(f"  {name}: " + ", ".join(f"{k} {t:.4f}" for k, t in kernels.items()))
            print(f"{problem}: " + ", ".join(f"{name} {t:.4f} ms" for name, t in ms.items()) +
                  f"; eager / ModelNew {ms['eager'] / ms['ModelNew']:.2f}, "
                  f"torch.compile / ModelNew {ms['torch.compile'] / ms['ModelNew']:.2f}",
                  flush=True)
            del fns
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

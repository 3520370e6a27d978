"""The sharded path (process_group=) before and after a change, on one GPU:
each checkout's groupnorm_inline runs in its own process, one NCCL rank
(world size 1: the code path of any rank, the collective trivial), and the
checkouts alternate for --pairs pairs.

    git worktree add /tmp/before BASE_COMMIT
    python benchmarks/ab_sharded.py /tmp/before . [--pairs 2]

Per shape (bfloat16, 32 groups), ms per call, bench_distributed's medians
of 50 timed by CUDA events: the eager forward, the forward replayed from a
CUDA graph (no host time) and the eager forward + backward. Prints one
line per process.
"""

import argparse
import os
import subprocess
import sys

SHAPES = [(1, 512, 64, 64), (1, 128, 512, 512), (1, 128, 1024, 1024)]


def measure(tree, port):
    """This process: tree's module on cuda:0, one line of times."""
    sys.path.insert(0, os.path.abspath(tree))
    os.environ["GROUPNORM_INLINE_LAZY"] = "1"  # the sharded path needs no build
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import groupnorm_inline as gn
    # after tree's module: bench_distributed's import of it finds that one
    from bench_distributed import graphed, median_ms

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    group = dist.group.WORLD
    cells = []
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        w, b = (torch.randn(shape[1], device="cuda", dtype=torch.bfloat16) for _ in range(2))
        forward = lambda: gn.group_norm(x, 32, w, b, process_group=group)  # noqa: E731
        leaf, dy = x.clone().requires_grad_(), torch.randn_like(x)
        both = lambda: gn.group_norm(leaf, 32, w, b, process_group=group).backward(dy)  # noqa: E731
        cells.append(f"{'x'.join(map(str, shape))}: forward {median_ms(forward):.3f} graphed "
                     f"{median_ms(graphed(forward)):.3f} fwd+bwd {median_ms(both):.3f} ms")
    print(tree, torch.cuda.get_device_name(), "|", " | ".join(cells), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="checkouts to compare, in turn")
    parser.add_argument("--pairs", type=int, default=2, help="rounds of every tree")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.trees[0], args.port)
        return
    for round_ in range(args.pairs):
        for i, tree in enumerate(args.trees):
            port = args.port + round_ * len(args.trees) + i  # a fresh rendezvous each
            subprocess.run([sys.executable, os.path.abspath(__file__), tree, "--measure",
                            "--port", str(port)], check=True, timeout=300)


if __name__ == "__main__":
    main()

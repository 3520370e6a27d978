"""GroupNorm over spatially sharded activations (group_norm's process_group=):
two processes on the CPU with gloo, each holding a slab of the same samples,
against the GroupNorm of the whole tensor in float64, forward and backward.

Also a script for torchrun, which launches it as a job of any size: the
fixed cases (with two ranks) and --cases random ones (rank 3-5, unequal and
empty slabs along a random spatial axis, one slab shifted by 1000), NCCL
with a GPU a rank, else gloo:

    torchrun --standalone --nproc-per-node 2 test_distributed.py [--cases 50] [--seed 0]
"""

import argparse
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import groupnorm_inline as gn

WORLD = 2

# (shape, groups, split axis, each rank's share of it, dtype, shift of rank 0's slab)
CASES = [
    ((2, 8, 10, 7), 4, 2, (3, 7), torch.float32, 0.0),
    ((2, 8, 10, 7), 4, 3, (0, 7), torch.float32, 0.0),      # rank 0 holds nothing
    ((2, 6, 4, 5, 6), 3, 2, (1, 3), torch.float64, 0.0),    # 3-D, another axis
    ((3, 8, 12, 4), 2, 2, (5, 7), torch.float32, 1000.0),   # patches of very different means
    ((2, 8, 9), 8, 2, (4, 5), torch.bfloat16, 0.0),         # 1-D, a channel a group
]


# (case, layout of the slab): the output keeps a contiguous or channels-last
# layout, and comes contiguous from one whose group view is not a view
LAYOUT_CASES = [
    (((2, 8, 10, 7), 4, 2, (3, 7), torch.bfloat16, 0.0), "channels_last"),
    (((3, 8, 12, 4), 2, 3, (1, 3), torch.float32, 1000.0), "channels_last"),
    (((2, 8, 10, 7), 4, 2, (6, 4), torch.float32, 0.0), "spatial dims swapped"),
]


def _laid_out(t, layout):
    if layout == "channels_last":
        return t.to(memory_format=torch.channels_last)
    if layout == "spatial dims swapped":  # dense, W outside H in memory
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    return t


def _slabs(full, axis, shares):
    return torch.split(full, list(shares), dim=axis)


def _worker(rank, store_path, backend="gloo"):
    """Every check on this rank; with NCCL on cuda:<rank> (the float64
    references stay on the CPU)."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=WORLD)
    try:
        for case in CASES:
            _check_case(rank, *case, device=device)
        for case, layout in LAYOUT_CASES:
            _check_case(rank, *case, device=device, layout=layout)
        if device.type == "cuda":
            _check_cuda_graph(rank, device)
        if device.type == "cpu":
            _check_epilogue(rank)
            _check_modules(rank)
            _check_compiled(rank)
            _check_refusals()
    finally:
        dist.destroy_process_group()


def _random_case(rng, world):
    """A case of CASES' form, drawn from rng (the same draw on every rank)."""
    dims = rng.choice([3, 4, 5])
    groups = rng.choice([1, 2, 4])
    shape = [rng.choice([1, 2, 3]), groups * rng.choice([1, 2, 3])] + \
        [rng.randint(1, 9) for _ in range(dims - 2)]
    axis = rng.randrange(2, dims)
    shape[axis] = max(shape[axis], rng.randint(0, 12))
    if shape[1] // groups * torch.Size(shape[2:]).numel() < 2:  # torch refuses a group of one value
        shape[axis] += 2
    cuts = sorted(rng.randint(0, shape[axis]) for _ in range(world - 1))
    shares = tuple(b - a for a, b in zip([0] + cuts, cuts + [shape[axis]]))
    return (tuple(shape), groups, axis, shares, rng.choice([torch.float32, torch.float64]),
            rng.choice([0.0, 1000.0]))


def _check_case(rank, shape, groups, axis, shares, dtype, shift, device, layout="contiguous"):
    generator = torch.Generator().manual_seed(len(shape) * 100 + shape[1])
    full = torch.randn(shape, generator=generator, dtype=torch.float64)
    full.narrow(axis, 0, shares[0]).add_(shift)  # rank 0's slab far from rank 1's
    # the values the ranks hold, exactly: rounding 1000 + randn to float32
    # alone moves a group's output by 3e-5 times its rstd
    full = full.to(dtype).double()
    weight, bias = (torch.randn(shape[1], generator=generator).to(dtype).double() for _ in range(2))
    dy_full = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).double()
    # the reference: the whole tensor on one device, in float64
    x64 = full.clone().requires_grad_()
    w64, b64 = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    ref = F.group_norm(x64, groups, w64, b64, 1e-5)
    ref.backward(dy_full)
    # this rank's slab, in the case's dtype
    x = _laid_out(_slabs(full, axis, shares)[rank].to(device, dtype), layout).requires_grad_()
    w, b = (t.to(device, dtype).requires_grad_() for t in (weight, bias))
    dy = _slabs(dy_full, axis, shares)[rank].to(device, dtype)
    kept = [t.detach().clone() for t in (x, w, b, dy)]
    y = gn.group_norm(x, groups, w, b, 1e-5, process_group=dist.group.WORLD)
    assert y.shape == x.shape and y.dtype == dtype and y.device == device
    kept_layout = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert y.is_contiguous(memory_format=kept_layout), (layout, y.stride())
    y.backward(dy)
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    if x.numel():  # relative to the largest value (at least 1)
        for mine, whole in ((y, ref.detach()), (x.grad, x64.grad)):
            expected = _slabs(whole, axis, shares)[rank]
            error = (mine.double().cpu() - expected).abs().max().item()
            assert error <= tol * max(expected.abs().max().item(), 1.0), (shape, axis, dtype, error)
    # weight's and bias's gradients are each rank's share: their sum is the whole
    for mine, whole in ((w.grad, w64.grad), (b.grad, b64.grad)):
        total = mine.double().clone()
        dist.all_reduce(total)
        assert (total.cpu() - whole).abs().max().item() <= tol * max(whole.abs().max().item(), 1.0)
    # the float temporaries are worked on in place: never the caller's
    # tensors, with or without weight (dy itself is then the first of them);
    # after the checks: this call adds to x.grad
    gn.group_norm(x, groups, process_group=dist.group.WORLD).backward(dy)
    for t, copy in zip((x, w, b, dy), kept):
        assert torch.equal(t.detach(), copy)
    # no double backward, as the kernels' op: refused, not a wrong answer
    y = gn.group_norm(x, groups, w, b, process_group=dist.group.WORLD)
    (dx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    if x.numel():
        try:
            dx.sum().backward()
        except RuntimeError as error:
            assert "double backward (gradients of gradients) is not supported" in str(error), error
        else:
            raise AssertionError("a double backward through the sharded call ran")


def _check_cuda_graph(rank, device):
    # a sharded call captured in a CUDA graph (NCCL's collectives can be
    # captured), replayed on new values of the same input tensor
    full = torch.randn(2, 8, 10, 6, generator=torch.Generator().manual_seed(12))
    x = _slabs(full, 2, (4, 6))[rank].to(device).contiguous()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        gn.group_norm(x, 4, process_group=dist.group.WORLD)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gn.group_norm(x, 4, process_group=dist.group.WORLD)
    for shift in (0.0, 100.0):
        full = full * 2 + shift
        x.copy_(_slabs(full, 2, (4, 6))[rank])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y.cpu(), _slabs(F.group_norm(full, 4), 2, (4, 6))[rank],
                                   rtol=1e-4, atol=1e-4)


def _check_epilogue(rank):
    full = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(7))
    scale = torch.randn(2, 8, generator=torch.Generator().manual_seed(8))
    ref = F.silu(F.group_norm(full, 4) * (1 + scale[:, :, None, None]))
    x = _slabs(full, 3, (2, 4))[rank]
    y = gn.group_norm(x, 4, scale=scale, activation="silu", process_group=dist.group.WORLD)
    torch.testing.assert_close(y, _slabs(ref, 3, (2, 4))[rank], rtol=1e-5, atol=1e-5)


def _check_modules(rank):
    # GroupNorm(process_group=), and replace_groupnorm setting it on a model
    full = torch.randn(2, 8, 6, 5, generator=torch.Generator().manual_seed(9)) + 50
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.GroupNorm(4, 8), torch.nn.SiLU())
    with torch.no_grad():
        model[0].weight.normal_()
        ref = model(full)
    sharded = gn.replace_groupnorm(model, process_group=dist.group.WORLD)
    assert sharded[0].process_group is dist.group.WORLD
    x = _slabs(full, 2, (4, 2))[rank]
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), _slabs(ref, 2, (4, 2))[rank], rtol=1e-5, atol=1e-5)
    layer = gn.GroupNorm(4, 8, process_group=dist.group.WORLD)
    torch.testing.assert_close(layer(x), _slabs(F.group_norm(full, 4), 2, (4, 2))[rank],
                               rtol=1e-5, atol=1e-5)


def _check_compiled(rank):
    # torch.compile with fullgraph=True traces the functional collectives of
    # the forward and of the backward: the same slab values and gradients,
    # also where one rank's slab is empty (its backward must still run the
    # collective the other rank waits in)
    generator = torch.Generator().manual_seed(11)
    full = torch.randn(2, 8, 10, 6, generator=generator, dtype=torch.float64)
    full[:, :, :3] += 100  # rank 0's slab far from rank 1's
    weight, bias, dy = (torch.randn(*shape, generator=generator, dtype=torch.float64)
                        for shape in ((8,), (8,), full.shape))
    w64, b64 = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    x64 = full.clone().requires_grad_()
    ref = F.silu(F.group_norm(x64, 4, w64, b64))
    ref.backward(dy)
    for shares in ((3, 7), (0, 10)):
        x = _slabs(full, 2, shares)[rank].clone().requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        compiled = torch.compile(lambda t: gn.group_norm(t, 4, w, b, activation="silu",
                                                         process_group=dist.group.WORLD),
                                 fullgraph=True)
        y = compiled(x)
        y.backward(_slabs(dy, 2, shares)[rank])
        torch.testing.assert_close(y, _slabs(ref.detach(), 2, shares)[rank], rtol=1e-10,
                                   atol=1e-10)
        torch.testing.assert_close(x.grad, _slabs(x64.grad, 2, shares)[rank], rtol=1e-9,
                                   atol=1e-9)
        for mine, whole in ((w.grad, w64.grad), (b.grad, b64.grad)):  # each rank's share
            total = mine.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, whole, rtol=1e-9, atol=1e-9)


def _check_refusals():
    x = torch.randn(2, 8, 4)
    with pytest.raises(TypeError, match="ProcessGroup"):
        gn.group_norm(x, 4, process_group="world")


def test_sharded_group_norm_matches_the_whole_tensor_on_two_cpu_processes(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    os.environ.setdefault("GROUPNORM_INLINE_LAZY", "1")  # the children import the module
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                    reason="needs two GPUs")
def test_gpu_sharded_group_norm_matches_the_whole_tensor_on_two_gpus(tmp_path):
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed without NCCL")
    mp.spawn(_worker, args=(str(tmp_path / "store"), "nccl"), nprocs=WORLD, join=True)


def _patch_worker(rank, store_path):
    # examples/patch_parallel.py's pieces on two gloo processes: diffusers'
    # VAE up-blocks on slabs of rows equal the whole model's output
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", "patch_parallel.py")
    spec = importlib.util.spec_from_file_location("patch_parallel", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = example.decoder_stack(16, 2, groups=4)
        image = torch.randn(1, 16, 10, 9) + torch.linspace(0, 30, 10)[:, None]  # rows far apart
        shares = example.row_slabs(10, WORLD)
        sharded = example.patch_parallel(__import__("copy").deepcopy(model), dist.group.WORLD)
        assert sum(isinstance(m, example.HaloConv2d) for m in sharded.modules()) == 10
        with torch.no_grad():
            out = sharded(torch.split(image, shares, dim=2)[rank])
            whole = model(image)
        expected = torch.split(whole, [4 * s for s in shares], dim=2)[rank]
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


def test_patch_parallel_example_matches_one_device_on_two_cpu_processes(tmp_path):
    pytest.importorskip("diffusers")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    os.environ.setdefault("GROUPNORM_INLINE_LAZY", "1")
    mp.spawn(_patch_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


def _check_under_torchrun(backend, cases):
    """This file under torchrun with two ranks: both report every case matched."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(WORLD), os.path.abspath(__file__), "--cases", str(cases), "--backend", backend]
    env = {**os.environ, "GROUPNORM_INLINE_LAZY": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("cases match the whole tensor") == WORLD, done.stdout


def test_random_splits_under_torchrun_on_two_cpu_processes():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _check_under_torchrun("gloo", 20)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                    reason="needs two GPUs")
def test_gpu_random_splits_under_torchrun_on_two_gpus():
    _check_under_torchrun("nccl", 50)


def test_process_group_needs_torch_distributed():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(gn.GroupNormError, match="init_process_group"):
        gn.group_norm(torch.randn(2, 8, 4), 4, process_group=object())


def main(argv=None):
    parser = argparse.ArgumentParser(description="sharded GroupNorm against the whole tensor")
    parser.add_argument("--cases", type=int, default=50, help="random cases after the fixed ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["nccl", "gloo"],
                        help="default: NCCL when every rank has a GPU, else gloo")
    args = parser.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"])
    backend = args.backend or ("nccl" if torch.cuda.device_count() >= world else "gloo")
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rng = random.Random(args.seed)
    cases = (CASES if world == WORLD else []) + [_random_case(rng, world) for _ in range(args.cases)]
    try:
        for case in cases:
            _check_case(rank, *case, device=device)
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}/{world} ({backend}): {len(cases)} cases match the whole tensor", flush=True)


if __name__ == "__main__":
    main()

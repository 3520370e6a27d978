"""GroupNorm over spatially sharded activations (group_norm's process_group=):
two processes on the CPU with gloo, each holding a slab of the same samples,
against the GroupNorm of the whole tensor in float64, forward and backward.
"""

import os

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
        if device.type == "cpu":
            _check_epilogue(rank)
            _check_modules(rank)
            _check_compiled(rank)
            _check_refusals()
    finally:
        dist.destroy_process_group()


def _check_case(rank, shape, groups, axis, shares, dtype, shift, device):
    generator = torch.Generator().manual_seed(len(shape) * 100 + shape[1])
    full = torch.randn(shape, generator=generator, dtype=torch.float64)
    full.narrow(axis, 0, shares[0]).add_(shift)  # rank 0's slab far from rank 1's
    weight = torch.randn(shape[1], generator=generator, dtype=torch.float64)
    bias = torch.randn(shape[1], generator=generator, dtype=torch.float64)
    dy_full = torch.randn(shape, generator=generator, dtype=torch.float64)
    # the reference: the whole tensor on one device, in float64
    x64 = full.clone().requires_grad_()
    w64, b64 = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    ref = F.group_norm(x64, groups, w64, b64, 1e-5)
    ref.backward(dy_full)
    # this rank's slab, in the case's dtype
    x = _slabs(full, axis, shares)[rank].to(device, dtype).requires_grad_()
    w, b = (t.to(device, dtype).requires_grad_() for t in (weight, bias))
    y = gn.group_norm(x, groups, w, b, 1e-5, process_group=dist.group.WORLD)
    assert y.shape == x.shape and y.dtype == dtype and y.device == device
    y.backward(_slabs(dy_full, axis, shares)[rank].to(device, dtype))
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
    # the forward and of the backward: the same slab values and gradients
    generator = torch.Generator().manual_seed(11)
    full = torch.randn(2, 8, 10, 6, generator=generator, dtype=torch.float64)
    full[:, :, :3] += 100  # rank 0's slab far from rank 1's
    weight, bias, dy = (torch.randn(*shape, generator=generator, dtype=torch.float64)
                        for shape in ((8,), (8,), full.shape))
    x64 = full.clone().requires_grad_()
    ref = F.silu(F.group_norm(x64, 4, weight, bias))
    ref.backward(dy)
    x = _slabs(full, 2, (3, 7))[rank].clone().requires_grad_()
    compiled = torch.compile(lambda t: gn.group_norm(t, 4, weight, bias, activation="silu",
                                                     process_group=dist.group.WORLD),
                             fullgraph=True)
    y = compiled(x)
    y.backward(_slabs(dy, 2, (3, 7))[rank])
    torch.testing.assert_close(y, _slabs(ref.detach(), 2, (3, 7))[rank], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, _slabs(x64.grad, 2, (3, 7))[rank], rtol=1e-9, atol=1e-9)


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


def test_process_group_needs_torch_distributed():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(gn.GroupNormError, match="init_process_group"):
        gn.group_norm(torch.randn(2, 8, 4), 4, process_group=object())

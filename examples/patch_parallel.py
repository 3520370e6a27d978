"""Patch-parallel decoding: a stack of diffusers' VAE up-blocks (conv ->
GroupNorm -> SiLU, nearest upsampling) split along the image's height across
the ranks of a process group, each rank holding a slab of rows.
Convolutions trade their halo rows with the neighbouring ranks (HaloConv2d);
every GroupNorm takes exact statistics over the whole image
(groupnorm_inline's process_group). Each rank's output is its slab of the
single-device model's output.

    torchrun --nproc-per-node 2 examples/patch_parallel.py [--size 256] [--channels 128]
                                                           [--blocks 2] [--dtype bfloat16]

On GPUs (NCCL) each rank takes cuda:<local rank>; without them, the CPU and
gloo. Prints each rank's time and peak memory, the same for the whole
image on one device (every rank runs it, after its slab, for the
comparison), and the largest difference between the two. Inference only:
the halo exchange records no gradient.
"""

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402


class HaloConv2d(nn.Module):
    """A stride-1 Conv2d with 'same' zero padding, on a slab of rows: the
    k // 2 rows above and below come from the neighbouring ranks (one
    all-gather of every rank's edge rows), zeros at the image's edges."""

    def __init__(self, conv, group):
        super().__init__()
        self.conv, self.group, self.halo = conv, group, conv.kernel_size[0] // 2

    @staticmethod
    def serves(conv):
        k = conv.kernel_size
        return (k[0] == k[1] and k[0] % 2 == 1 and k[0] > 1 and conv.stride == (1, 1)
                and conv.dilation == (1, 1) and conv.padding == (k[0] // 2, k[1] // 2)
                and conv.padding_mode == "zeros")

    def forward(self, x):
        k, rank = self.halo, dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        if x.shape[2] < k:
            raise ValueError(f"HaloConv2d: each slab needs at least {k} rows, got {x.shape[2]}")
        edges = torch.cat([x[:, :, :k], x[:, :, x.shape[2] - k:]], dim=2).contiguous()
        gathered = [torch.empty_like(edges) for _ in range(world)]
        dist.all_gather(gathered, edges, group=self.group)
        zeros = torch.zeros_like(edges[:, :, :k])
        above = gathered[rank - 1][:, :, k:] if rank > 0 else zeros
        below = gathered[rank + 1][:, :, :k] if rank < world - 1 else zeros
        conv = self.conv
        return F.conv2d(torch.cat([above, x, below], dim=2), conv.weight, conv.bias, 1,
                        (0, conv.padding[1]), 1, conv.groups)


def patch_parallel(model, group):
    """model, in place, for slabs of rows on each rank of `group`: its
    'same' convolutions trade halos, its GroupNorms share statistics."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d) and HaloConv2d.serves(child):
                setattr(parent, name, HaloConv2d(child, group))
    return gn.replace_groupnorm(model, strict=True, process_group=group)


def decoder_stack(channels, blocks, groups=32):
    """diffusers' VAE decoder up-blocks (UpDecoderBlock2D: two ResnetBlock2D,
    then 2x nearest upsampling and a conv), `blocks` of them."""
    from diffusers.models.unets.unet_2d_blocks import UpDecoderBlock2D

    return nn.Sequential(*(UpDecoderBlock2D(in_channels=channels, out_channels=channels,
                                            num_layers=2, resnet_groups=groups, add_upsample=True)
                           for _ in range(blocks))).eval()


def row_slabs(rows, world):
    """Rows per rank: as equal as they come, the first ranks one more."""
    return [rows // world + (r < rows % world) for r in range(world)]


def timed(model, x, cuda):
    """model(x) after a warm-up call: the output, seconds, and the peak of
    allocated memory during the call in MiB (nan on the CPU)."""
    with torch.no_grad():
        model(x)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = model(x)
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return out, seconds, torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256, help="input height and width")
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    torch.manual_seed(0)
    model = decoder_stack(args.channels, args.blocks).to(device, dtype)

    def whole_image():  # the same on every rank
        torch.manual_seed(1)
        return torch.randn(1, args.channels, args.size, args.size, device=device, dtype=dtype)

    shares = row_slabs(args.size, world)
    slab = torch.split(whole_image(), shares, dim=2)[rank].clone()  # the rank's rows alone
    sharded = patch_parallel(copy.deepcopy(model), dist.group.WORLD)
    out, seconds, peak = timed(sharded, slab, cuda)
    # printed before the whole image is tried, which may fail or take long
    print(f"rank {rank}/{world}: rows {shares[rank]} of {args.size}, {seconds * 1e3:.1f} ms, "
          f"peak {peak:.0f} MiB", flush=True)
    del sharded  # its copy of the weights, and the slab's cached blocks, for the whole image
    if cuda:
        torch.cuda.empty_cache()
    try:
        whole, whole_seconds, whole_peak = timed(model, whole_image(), cuda)
    except torch.cuda.OutOfMemoryError:  # the reason to split the image
        print(f"rank {rank}/{world}: the whole image does not fit one device", flush=True)
    else:
        scale = whole.shape[2] // args.size
        expected = torch.split(whole, [s * scale for s in shares], dim=2)[rank]
        error = (out.float() - expected.float()).abs().max().item()
        print(f"rank {rank}/{world}: the whole image on one device {whole_seconds * 1e3:.1f} ms, "
              f"peak {whole_peak:.0f} MiB; largest difference {error:.3e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Tests for the KernelBench level-2 #92 solution (`bundle --kernelbench
level2-92`): its contract on the CPU (the extension stood in for), and on the
GPU its kernels (kernels/kernelbench_92.cu) against the reference model and a
float64 reference, on the problem's shape and on awkward ones.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupnorm_inline as gn
import groupnorm_tools as tools
from test_groupnorm import PretendCuda

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def kernelbench_92_reference_model():
    class Model(nn.Module):
        def __init__(self, in_channels, out_channels, kernel_size, groups, eps=1e-5):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
            self.group_norm = nn.GroupNorm(groups, out_channels, eps=eps)
            self.tanh = nn.Tanh()
            self.hard_swish = nn.Hardswish()

        def forward(self, x):
            x_conv = self.conv(x)
            x_norm = self.group_norm(x_conv)
            x_res = x_conv + self.hard_swish(self.tanh(x_norm))
            return torch.logsumexp(x_res, dim=1, keepdim=True)
    return Model


def reference(x, conv_weight, conv_bias, gamma, beta, groups, eps=1e-5, dtype=torch.float64):
    """The problem's sequence in `dtype` (float64: the reference answer)."""
    x_conv = F.conv2d(x.to(dtype), conv_weight.to(dtype), conv_bias.to(dtype))
    y = torch.tanh(F.group_norm(x_conv, groups, gamma.to(dtype), beta.to(dtype), eps))
    return torch.logsumexp(x_conv + F.hardswish(y), dim=1, keepdim=True)


def test_kernelbench_92_solution_contract_on_cpu(monkeypatch):
    # Seeded construction gives the reference's weights and state_dict keys;
    # CPU input runs torch's ops (the reference's answer); the CUDA branch
    # hands the extension the conv and GroupNorm parameters (checked on a
    # PretendCuda tensor, the extension stood in for by torch).
    from torch.utils import cpp_extension
    calls = []

    class Extension:
        def conv_groupnorm_logsumexp(self, x, conv_weight, conv_bias, gamma, beta, groups, eps):
            calls.append((conv_weight, conv_bias, gamma, beta, groups, eps))
            return reference(torch.Tensor(x), conv_weight, conv_bias, gamma, beta, groups, eps,
                             dtype=torch.float32)

    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kwargs: Extension())
    kb = {}
    exec(compile(tools.kernelbench_source("level2-92"), "kb92.py", "exec"), kb)
    init = kb["get_init_inputs"]()
    assert init == [8, 64, 3, 16]
    shapes = []
    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", lambda *shape, **kwargs: shapes.append(shape) or torch.empty(0))
        kb["get_inputs"]()
    assert shapes == [(128, 8, 128, 128)]
    Model = kernelbench_92_reference_model()
    torch.manual_seed(0)
    model = Model(*init)
    torch.manual_seed(0)
    candidate = kb["ModelNew"](*init)
    assert list(candidate.state_dict()) == ["conv.weight", "conv.bias", "group_norm.weight",
                                            "group_norm.bias"] == list(model.state_dict())
    for (name, mine), theirs in zip(candidate.state_dict().items(), model.state_dict().values()):
        assert torch.equal(mine, theirs), name
    model.group_norm.weight.data.normal_()
    model.group_norm.bias.data.normal_()
    candidate.load_state_dict(model.state_dict())
    for _ in range(5):  # KernelBench's trials, at its tolerance
        x = torch.rand(2, 8, 20, 18)
        with torch.no_grad():
            torch.testing.assert_close(candidate(x), model(x), atol=1e-4, rtol=1e-4)
    assert calls == []
    x = torch.rand(2, 8, 12, 12)
    with torch.no_grad():
        y = candidate(x.as_subclass(PretendCuda))
        torch.testing.assert_close(torch.Tensor(y), model(x), atol=1e-5, rtol=1e-5)
    (call,) = calls
    assert call[:4] == (candidate.conv.weight, candidate.conv.bias, candidate.group_norm.weight,
                        candidate.group_norm.bias) and call[4:] == (16, 1e-5)
    # the stand-in takes what the solution's header declares
    declared = re.search(r"conv_groupnorm_logsumexp\(([^;]*)\);",
                         gn._read_source("kernelbench_92.h")).group(1)
    assert declared.count(",") + 1 == 7
    # nn.GroupNorm's check, at construction
    with pytest.raises(ValueError, match="divisible"):
        kb["ModelNew"](8, 64, 3, 5)


def test_kernelbench_92_bundle_is_its_own_kernels_only():
    # the solution compiles kernels/kernelbench_92.* and nothing of the library
    text = tools.kernelbench_source("level2-92")
    assert tools.kernelbench_problems(text) == []
    assert "conv_partials_kernel" in text and "groupnorm_forward" not in text.lower()
    assert "#include \"" not in text  # every local header inlined


# ---------------------------------------------------------------------------
# GPU: the solution's kernels
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    path = tools.bundle(str(tmp_path_factory.mktemp("kb92") / "level2_92.py"), kernelbench="level2-92")
    kb = {}
    with open(path) as f:
        exec(compile(f.read(), "<string>", "exec"), kb)
    return kb


def parameters(C_in, C, K, device="cuda"):
    conv = nn.Conv2d(C_in, C, K).to(device)
    gamma = torch.randn(C, device=device)
    beta = torch.randn(C, device=device)
    return conv.weight.detach(), conv.bias.detach(), gamma, beta


def run(kb, x, weight, bias, gamma, beta, groups, eps=1e-5):
    """The extension's call with its output's memory poisoned first (NaN
    bytes where the output will land); checks that it landed there."""
    N, _, H, W = x.shape
    K = weight.shape[-1]
    nbytes = N * (H - K + 1) * (W - K + 1) * 4
    bait = torch.full((max(nbytes, 1),), 0xFF, dtype=torch.uint8, device=x.device)
    address = bait.data_ptr()
    del bait
    out = kb["_extension"].conv_groupnorm_logsumexp(x, weight, bias, gamma, beta, groups, eps)
    assert nbytes == 0 or out.data_ptr() == address, "the output did not land on the poisoned block"
    return out


def assert_as_close_as_torch(out, x, weight, bias, gamma, beta, groups, eps=1e-5):
    """Against float64: no worse than twice torch's own float32 sequence (TF32
    off), and at most 1e-5 of the output's scale on well-scaled data."""
    ref = reference(x, weight, bias, gamma, beta, groups, eps)
    assert out.shape == ref.shape and out.dtype == torch.float32
    with torch.backends.cudnn.flags(allow_tf32=False):
        torch_err = (reference(x, weight, bias, gamma, beta, groups, eps, torch.float32).double() -
                     ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    assert err <= max(2 * torch_err, 1e-5 * scale), (err, torch_err)


@cuda
@pytest.mark.parametrize("tf32", [True, False])
def test_gpu_kernelbench_92_matches_the_reference_model(solution, tf32):
    # KernelBench's check: 5 trials at atol = rtol = 1e-4 on the problem's
    # inputs, the reference at torch's default TF32 setting for cuDNN (on)
    # and with TF32 off; the solution's convolution is float32 either way.
    Model = kernelbench_92_reference_model()
    init = solution["get_init_inputs"]()
    model = Model(*init).cuda()
    model.group_norm.weight.data.normal_()
    model.group_norm.bias.data.normal_()
    candidate = solution["ModelNew"](*init).cuda()
    candidate.load_state_dict(model.state_dict())
    with torch.backends.cudnn.flags(allow_tf32=tf32), torch.no_grad():
        for _ in range(5):
            (x,) = solution["get_inputs"]()
            x = x.cuda()
            torch.testing.assert_close(candidate(x), model(x), atol=1e-4, rtol=1e-4)
            del x


@cuda
@pytest.mark.parametrize("shape, C, K, groups", [
    ((2, 8, 20, 18), 64, 3, 16),       # the problem's channels, small image
    ((4, 8, 128, 128), 64, 3, 16),     # the problem at batch 4
    ((3, 3, 17, 300), 24, 5, 6),       # 3 column tiles, half a channel block, odd rows
    ((2, 5, 9, 11), 40, 1, 8),         # K = 1, H'xW' odd: the scalar logsumexp
    ((1, 4, 33, 140), 128, 7, 32),     # K = 7, two channel blocks, H'xW' not a multiple of 4
    ((2, 1, 3, 3), 16, 3, 1),          # one output pixel, G = 1
    ((1, 8, 10, 10), 1000, 3, 1000),   # G = C, 16 channel blocks
    ((8, 3, 40, 300), 200, 5, 8),      # CTAs walk several items and reload weights
])
def test_gpu_kernelbench_92_matches_float64(solution, shape, C, K, groups):
    x = torch.rand(shape, device="cuda")
    params = parameters(shape[1], C, K)
    before = [t.clone() for t in (x, *params)]
    out = run(solution, x, *params, groups)
    assert_as_close_as_torch(out, x, *params, groups)
    for t, saved in zip((x, *params), before):
        assert torch.equal(t, saved), "an input was modified"


@cuda
def test_gpu_kernelbench_92_shifted_input(solution):
    # 1000 + rand: a conv output far from zero against its spread; the
    # statistics are centred per tile, so they keep float32's digits
    x = 1000 + torch.rand(2, 8, 64, 64, device="cuda")
    params = parameters(8, 64, 3)
    assert_as_close_as_torch(run(solution, x, *params, 16), x, *params, 16)


@cuda
@pytest.mark.parametrize("shape, pixel, value, C, K, groups", [
    # NaN: its sample's statistics, so all its outputs, are NaN in the reference
    ((2, 8, 30, 140), (0, 3, 17, 131), float("nan"), 64, 3, 16),
    # inf, one channel a group: that channel's variance is NaN, so its sample is
    ((2, 4, 9, 140), (0, 1, 8, 139), float("inf"), 16, 1, 16),
])
def test_gpu_kernelbench_92_non_finite_input_spreads_as_in_the_reference(solution, shape, pixel,
                                                                          value, C, K, groups):
    x = torch.rand(shape, device="cuda")
    x[pixel] = value
    params = parameters(shape[1], C, K)
    out = run(solution, x, *params, groups)
    ref = reference(x, *params, groups)
    assert ref[0].isnan().all() and out[0].isnan().all()
    assert_as_close_as_torch(out[1:], x[1:], *params, groups)  # the other sample untouched


@cuda
def test_gpu_kernelbench_92_layouts_and_graphs(solution):
    # channels-last input gives the contiguous input's answer; the call
    # captures into a CUDA graph (current stream, no host synchronisation)
    x = torch.rand(2, 8, 40, 36, device="cuda")
    params = parameters(8, 64, 3)
    expected = run(solution, x, *params, 16)
    assert torch.equal(run(solution, x.to(memory_format=torch.channels_last), *params, 16), expected)
    static = x.clone()
    call = solution["_extension"].conv_groupnorm_logsumexp
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call(static, *params, 16, 1e-5)  # warm-up off the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = call(static, *params, 16, 1e-5)
    fresh = torch.rand_like(x)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, run(solution, fresh, *params, 16))


@cuda
def test_gpu_kernelbench_92_empty_batch(solution):
    x = torch.rand(0, 8, 10, 10, device="cuda")
    out = solution["_extension"].conv_groupnorm_logsumexp(x, *parameters(8, 64, 3), 16, 1e-5)
    assert out.shape == (0, 1, 8, 8)


@cuda
@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "x": a["x"].double()}, "x must be a float32 CUDA tensor"),
    (lambda a: {**a, "conv_weight": a["conv_weight"].cpu()}, "conv_weight must be a float32 CUDA"),
    (lambda a: {**a, "x": a["x"][0]}, r"x must be \[N, C_in, H, W\]"),
    (lambda a: {**a, "conv_weight": a["conv_weight"][..., :2, :2].contiguous()}, "K 1, 3, 5 or 7"),
    (lambda a: {**a, "x": a["x"][:, :4]}, "x has 4 channels but conv_weight expects 8"),
    (lambda a: {**a, "gamma": a["gamma"][:10]}, r"gamma must be \[64\]"),
    (lambda a: {**a, "groups": 5}, r"num_groups \(5\) must divide the 64 channels"),
    (lambda a: {**a, "x": a["x"][..., :2, :]}, "smaller than the 3 x 3 kernel"),
    (lambda a: {**a, "x": torch.rand(1, 40, 8, 8, device="cuda"),
                "conv_weight": torch.rand(64, 40, 7, 7, device="cuda")},
     "40 input channels with a 7 x 7 kernel need .* bytes of shared memory"),
])
def test_gpu_kernelbench_92_refuses_bad_input_by_name(solution, change, message):
    weight, bias, gamma, beta = parameters(8, 64, 3)
    args = dict(x=torch.rand(2, 8, 10, 10, device="cuda"), conv_weight=weight, conv_bias=bias,
                gamma=gamma, beta=beta, groups=16)
    args = change(args)
    with pytest.raises(RuntimeError, match=message):
        solution["_extension"].conv_groupnorm_logsumexp(*args.values(), 1e-5)

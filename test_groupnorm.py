"""Tests for groupnorm_inline.

CPU tests run everywhere (API, validation, CPU path, bundles, state_dict).
GPU tests skip without CUDA; they call groupnorm_cuda (never a fallback),
compare with a float64 reference on fresh random data, and poison the memory
the output will occupy before every call.
"""

import contextlib
import copy
import errno
import importlib.util
import inspect
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupnorm_inline as gn
import groupnorm_tools as tools

HERE = os.path.dirname(os.path.abspath(__file__))
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def make_input(shape, dtype, layout, device, shift=0.0, scale=1.0):
    """Fresh random (N, C, *) input in the requested memory layout. For 16-bit
    dtypes the noise is at least 8 of the dtype's steps at |shift|, so that a
    shifted input keeps a spread after rounding (bfloat16 holds 1000 + randn
    as 996, 1000 or 1004 only)."""
    if dtype in (torch.float16, torch.bfloat16) and shift != 0:
        step = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(shift)))
        scale = max(scale, 8 * step)
    x = torch.randn(shape, dtype=torch.float32, device=device) * scale + shift
    x = x.to(dtype)
    if layout == "channels_last" and x.dim() >= 3:
        # N, *, C in memory: permute a (N, *, C) tensor back to (N, C, *).
        order = [0] + list(range(2, x.dim())) + [1]
        inverse = [order.index(i) for i in range(x.dim())]
        x = x.permute(order).contiguous().permute(inverse)
    return x


def channels_last_like(x):
    """(N, C, *) stored as N, *, C without gaps."""
    return x.dim() >= 3 and x.permute(0, *range(2, x.dim()), 1).is_contiguous()


def affine(C, dtype, device, kind):
    w = torch.randn(C, dtype=dtype, device=device) if kind in ("both", "weight") else None
    b = torch.randn(C, dtype=dtype, device=device) if kind in ("both", "bias") else None
    return w, b


def poisoned(fn, x, blocks=1, attempts=3):
    """Runs fn() after filling `blocks` blocks of x's size, which its output
    will reuse, with NaN bytes, and checks that the output did land within
    them: unwritten elements show up. Two blocks where fn allocates a copy of
    x before its output. The blocks are whole allocator blocks (512 bytes),
    so that freed neighbours merge into poisoned memory only; up to
    `attempts` times, as free blocks of earlier tests can still be chosen."""
    nbytes = x.numel() * x.element_size()
    if nbytes == 0:
        return fn(), True
    size = -(-nbytes // 512) * 512
    for _ in range(attempts):
        baits = [torch.full((size,), 0xFF, dtype=torch.uint8, device=x.device)
                 for _ in range(blocks)]
        spans = sorted((b.data_ptr(), b.data_ptr() + size) for b in baits)
        del baits
        merged = [list(spans[0])]
        for start, end in spans[1:]:
            if start == merged[-1][1]:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        out = fn()
        first = out.data_ptr()
        if any(start <= first and first + nbytes <= end for start, end in merged):
            return out, True
    return out, False


def tolerance(x, ref, dtype, torch_err, weight):
    """The bound on the error against the float64 reference. float16/bfloat16:
    torch's own error on the same input, give or take half an output ulp at
    the largest output. float32/64 with torch's error measured: four times
    it plus four ulps of the largest output, tight enough that a dropped eps,
    an unbiased variance or an rstd off by 1e-4 fail
    (test_tolerances_catch_wrong_kernels); without it (torch_err None): 1e-5
    (1e-12) plus the rounding of x - mean at x's magnitude."""
    eps = torch.finfo(dtype).eps
    largest = ref.abs().max().item()
    if dtype in (torch.float32, torch.float64):
        if torch_err is not None:
            return 4 * torch_err + 4 * eps * largest
        gmax = weight.abs().max().item() if weight is not None else 1.0
        base = 1e-5 if dtype == torch.float32 else 1e-12
        return base + 8 * eps * (x.abs().max().item() + largest) * max(gmax, 1.0)
    return 1.1 * torch_err + 0.5 * eps * largest


def copies(*values):
    """Clones of the tensors among values (None for the rest), for
    assert_unchanged."""
    return [v.clone() if isinstance(v, torch.Tensor) else None for v in values]


def assert_unchanged(copied, *values):
    """Each tensor among values bitwise as copied, NaN included: nothing
    wrote to it (meta tensors hold no values)."""
    for before, after in zip(copied, values):
        if before is not None and not after.is_meta:
            torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True,
                                       msg="an input was modified")


class PretendCuda(torch.Tensor):
    """A CPU tensor that says it is on a GPU: CPU tests reach the Python side
    of the CUDA path with it (the extension stood in for, or never reached)."""

    @property
    def is_cuda(self):
        return True


def forbid_torch_group_norm(monkeypatch):
    """Makes F.group_norm, this module's only way to torch's GroupNorm, raise:
    a test that calls it afterwards passes only through this module's kernels."""
    def refuse(*args, **kwargs):
        raise AssertionError("fell back to torch.nn.functional.group_norm")
    monkeypatch.setattr(F, "group_norm", refuse)


def raise_each(cases):
    """Each (call, exception type, message fragment): the call raises it."""
    for call, exc, fragment in cases:
        with pytest.raises(exc) as info:
            call()
        assert fragment in str(info.value), str(info.value)


def describe_mismatch(out, ref, tol):
    diff = (out.double() - ref).abs()
    bad = (diff > tol) | diff.isnan()
    idx = bad.nonzero()[:5].tolist()
    vals = [(i, out[tuple(i)].item(), ref[tuple(i)].item()) for i in idx]
    return f"{int(bad.sum())} of {out.numel()} elements differ (tol {tol:.2e}); first: {vals}"


def check_against_reference(x, groups, w, b, eps=1e-5, **force):
    ref = tools.reference_group_norm(x, groups, w, b, eps)
    dense = x.is_contiguous() or channels_last_like(x)
    # A dense input is read in place, so the output is the first allocation;
    # others are copied first, and the copy takes one poisoned block.
    y, landed = poisoned(lambda: gn.groupnorm_cuda(x, w, b, groups, eps, **force), x,
                         blocks=1 if dense else 2)
    assert landed, "output did not reuse a poisoned block"
    assert y.shape == x.shape and y.dtype == x.dtype
    if dense:
        assert y.stride() == x.stride(), f"memory format not kept: {y.stride()} vs {x.stride()}"
    else:
        assert y.is_contiguous()
    if x.numel() == 0:
        return y
    torch_err = tools.max_error(tools.torch_group_norm(x, groups, w, b, eps), ref)
    tol = tolerance(x, ref, x.dtype, torch_err, w)
    err = tools.max_error(y, ref)
    assert not y.isnan().any(), describe_mismatch(y, ref, tol)
    assert err <= tol, describe_mismatch(y, ref, tol)
    return y


# ---------------------------------------------------------------------------
# CPU-side tests: run everywhere
# ---------------------------------------------------------------------------

def wrong_group_norm(x, groups, weight, bias, eps, mistake):
    """GroupNorm in float64 with one of the mistakes a kernel could make,
    rounded to x's dtype as a kernel's output is."""
    N, C = x.shape[:2]
    flat = x.double().reshape(N, groups, -1)
    mean = flat.mean(-1, keepdim=True)
    var = flat.var(-1, keepdim=True, correction=1 if mistake == "unbiased variance" else 0)
    rstd = (var + (0.0 if mistake == "dropped eps" else eps)).rsqrt()
    if mistake == "rstd off by 1e-4":
        rstd = rstd * (1 + 1e-4)
    if mistake == "mean off by 1e-4 of the spread":
        mean = mean + 1e-4 * var.sqrt()
    per_channel = (1, C) + (1,) * (x.dim() - 2)
    y = ((flat - mean) * rstd).reshape(x.shape) * weight.double().reshape(per_channel)
    return (y + bias.double().reshape(per_channel)).to(x.dtype)


@pytest.mark.parametrize("inputs", ["randn", "variance 1e-6", "4x64x32x32", "1000 + randn"])
def test_tolerances_catch_wrong_kernels(inputs):
    # the float32 bound of the GPU tests, fed torch's own error on the same
    # input, holds torch's output and fails kernels with plausible mistakes;
    # on shifted inputs torch's error is itself 1e-4 of the spread, so only
    # the unbiased variance stands out there
    torch.manual_seed(0)
    shape = (4, 64, 32, 32) if inputs == "4x64x32x32" else (2, 32, 9, 7)
    x = {"variance 1e-6": 1e-3, "1000 + randn": 1.0}.get(inputs, 1.0) * torch.randn(shape)
    x = x + (1000 if inputs == "1000 + randn" else 0)
    w, b = torch.randn(shape[1]), torch.randn(shape[1])
    ref = tools.reference_group_norm(x, 8, w, b, 1e-5)
    torch_err = tools.max_error(F.group_norm(x, 8, w, b, 1e-5), ref)
    tol = tolerance(x, ref, x.dtype, torch_err, w)
    assert torch_err <= tol
    mistakes = ["unbiased variance"] if inputs == "1000 + randn" else \
        ["dropped eps", "unbiased variance", "rstd off by 1e-4", "mean off by 1e-4 of the spread"]
    for mistake in mistakes:
        err = tools.max_error(wrong_group_norm(x, 8, w, b, 1e-5, mistake), ref)
        assert err > tol, (mistake, err, tol)
    # the gradients' bound (check_backward's) the same way
    dy = torch.randn_like(x)

    def grads(fn, cast, mistake=None):
        leaves = [cast(t).requires_grad_() for t in (x, w, b)]
        y = fn(*leaves) if mistake is None else wrong_group_norm(*leaves[:1], 8, *leaves[1:], 1e-5, mistake)
        return torch.autograd.grad(y, leaves, cast(dy))

    exact = grads(lambda *t: tools.reference_group_norm(t[0], 8, t[1], t[2], 1e-5), torch.Tensor.double)
    theirs = grads(lambda *t: F.group_norm(t[0], 8, t[1], t[2], 1e-5), lambda t: t.clone())
    bounds = [gradient_tolerance(x.dtype, tools.max_error(t, r), r.abs().max().item())
              for t, r in zip(theirs, exact)]
    assert all(tools.max_error(t, r) <= tol for t, r, tol in zip(theirs, exact, bounds))
    for mistake in mistakes:
        wrong = [g.float() for g in grads(None, torch.Tensor.double, mistake)]
        errors = [tools.max_error(g, r) for g, r in zip(wrong, exact)]
        assert any(e > tol for e, tol in zip(errors, bounds)), (mistake, errors, bounds)


CPU_SHAPES = [((2, 6, 5, 7), 3), ((3, 60, 31), 5), ((4, 8), 2), ((2, 24, 3, 5, 7), 4),
              ((2, 4, 1, 1), 4), ((0, 8, 4), 2)]


@pytest.mark.parametrize("shape,groups", CPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_group_norm_equals_torch(shape, groups, dtype):
    x = make_input(shape, dtype, "contiguous", "cpu", shift=3.0)
    w, b = affine(shape[1], dtype, "cpu", "both")
    torch.testing.assert_close(gn.group_norm(x, groups, w, b, 1e-4), F.group_norm(x, groups, w, b, 1e-4),
                               rtol=0, atol=0)


def test_zero_dim_tensors_as_num_groups_and_eps():
    x = torch.randn(3, 6, 5)
    for groups in (torch.tensor(2), torch.tensor(3, dtype=torch.int32), torch.tensor(2, dtype=torch.uint8)):
        torch.testing.assert_close(gn.group_norm(x, groups), F.group_norm(x, groups), rtol=0, atol=0)
    eps = torch.tensor(1e-2)
    torch.testing.assert_close(gn.group_norm(x, 2, eps=eps), F.group_norm(x, 2, eps=eps), rtol=0, atol=0)
    layer = gn.GroupNorm(torch.tensor(3), 6)
    assert type(layer.num_groups) is int
    torch.testing.assert_close(layer(x), nn.GroupNorm(torch.tensor(3), 6)(x), rtol=0, atol=0)


def test_cpu_one_value_per_group_channel_block_matches_torch():
    # torch refuses only when N * C / G * prod(spatial) == 1
    for shape, groups in (((1, 64, 1, 1), 32), ((1, 64), 32), ((1, 8, 1), 8)):
        x = torch.randn(shape)
        try:
            expected = F.group_norm(x, groups)
        except ValueError:
            with pytest.raises(ValueError, match="more than 1 value"):
                gn.group_norm(x, groups)
        else:
            torch.testing.assert_close(gn.group_norm(x, groups), expected, rtol=0, atol=0)


def test_numpy_scalars_are_taken_like_nn_groupnorm():
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 6, 5)
    expected = nn.GroupNorm(2, 6, eps=1e-3)(x)
    torch.testing.assert_close(gn.GroupNorm(np.int64(2), 6, eps=np.float32(1e-3))(x), expected)
    torch.testing.assert_close(gn.group_norm(x, np.int32(2), eps=np.float64(1e-3)), expected)
    layer = gn.GroupNorm(np.int64(2), 6, eps=np.float32(1e-3))
    assert type(layer.num_groups) is int and type(layer.eps) is float
    torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), expected)
    with pytest.raises(TypeError, match="group_norm: num_groups must be an int"):
        gn.group_norm(x, True)
    with pytest.raises(TypeError, match="group_norm: eps must be a float"):
        gn.group_norm(x, 2, eps="1e-5")


def test_forcing_arguments_reach_the_extension(monkeypatch):
    # kernel, team (team kernels) and lag (stream kernels) go to the
    # extension's forward, plan and backward_plan, each in its own place
    calls = []

    class Extension:
        def forward(self, x, weight, bias, groups, eps, kernel, team, lag):
            calls.append(("forward", kernel, team, lag))
            return x.clone(), None, None

        def plan(self, x, groups, kernel, team, lag, epilogue, activations):
            calls.append(("plan", kernel, team, lag, epilogue, activations))
            return {"kernel": "contiguous"}

        def backward_plan(self, x, groups, kernel, lag, epilogue, activations):
            calls.append(("backward_plan", kernel, lag, epilogue, activations))
            return {"kernel": "stream"}

    monkeypatch.setattr(gn, "load", Extension)
    x = torch.randn(2, 8, 4).as_subclass(PretendCuda)
    gn.groupnorm_cuda(x, None, None, 2)
    gn.groupnorm_cuda(x, None, None, 2, kernel="contiguous", team=3)
    gn.groupnorm_cuda(x, None, None, 2, kernel="stream", lag=5)
    assert gn.plan(x, 2, kernel="channels_last", team=4) == {"kernel": "contiguous"}
    assert gn.plan(x, 2, kernel="stream", lag=7, backward=True) == {"kernel": "stream"}
    gn.plan(x, 2, kernel="registers", backward=True, activation="gelu")
    gn.plan(x, 2, fused=True)
    gn.plan(x, 2, activation=("silu", ("leaky_relu", 0.1)))
    silu, leaky = (gn._ACTIVATION_CODES[name] for name in ("silu", "leaky_relu"))
    assert calls == [("forward", "auto", 0, 0), ("forward", "contiguous", 3, 0),
                     ("forward", "stream", 0, 5), ("plan", "channels_last", 4, 0, False, []),
                     ("backward_plan", "stream", 7, False, []),
                     ("backward_plan", "registers", 0, False, [gn._ACTIVATION_CODES["gelu"]]),
                     ("plan", "auto", 0, 0, True, []),
                     ("plan", "auto", 0, 0, False, [silu, leaky])]
    with pytest.raises(ValueError, match="the backward has no teams"):
        gn.plan(x, 2, team=2, backward=True)
    with pytest.raises(ValueError, match="no gradients"):
        gn.groupnorm_cuda(x.detach().requires_grad_(), None, None, 2, kernel="stream", lag=5)


def test_module_matches_nn_groupnorm():
    ours, theirs = gn.GroupNorm(4, 12, eps=1e-3), nn.GroupNorm(4, 12, eps=1e-3)
    assert isinstance(ours, nn.GroupNorm)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert repr(ours) == "groupnorm_inline." + repr(theirs)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
    no_affine = gn.GroupNorm(4, 12, affine=False)
    assert no_affine.weight is None and list(no_affine.state_dict()) == []
    # state_dict both ways, with non-default values
    theirs.weight.data.normal_()
    theirs.bias.data.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 12, 5)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    ours.weight.data.normal_()
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_module_takes_every_nn_groupnorm_argument():
    theirs = inspect.signature(nn.GroupNorm.__init__).parameters
    ours = inspect.signature(gn.GroupNorm.__init__).parameters
    for name, parameter in theirs.items():
        assert name in ours, name
        assert (ours[name].kind, ours[name].default) == (parameter.kind, parameter.default), name


TORCH_TAKES_BIAS = gn._TORCH_GROUPNORM_TAKES_BIAS


def nn_groupnorm_without_bias(groups, channels):
    """nn.GroupNorm(..., bias=False), also on a torch from before that argument."""
    if TORCH_TAKES_BIAS:
        return nn.GroupNorm(groups, channels, bias=False)
    module = nn.GroupNorm(groups, channels)
    module.register_parameter("bias", None)
    return module


@pytest.mark.parametrize("torch_takes_bias", [True, False], ids=["torch-bias", "older-torch"])
def test_module_without_bias(torch_takes_bias, monkeypatch):
    # older torch (no bias argument): GroupNorm drops the parameter itself
    if torch_takes_bias and not TORCH_TAKES_BIAS:
        pytest.skip(f"torch {torch.__version__}'s nn.GroupNorm has no bias argument")
    monkeypatch.setattr(gn, "_TORCH_GROUPNORM_TAKES_BIAS", torch_takes_bias)
    ours, theirs = gn.GroupNorm(3, 6, bias=False), nn_groupnorm_without_bias(3, 6)
    assert ours.bias is None and list(ours.state_dict()) == ["weight"]
    assert "bias=False" in repr(ours)
    if TORCH_TAKES_BIAS:
        assert repr(ours) == "groupnorm_inline." + repr(theirs)
    x = torch.randn(2, 6, 5)
    theirs.weight.data.normal_()
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    ours.weight.data.normal_()
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="bias"):  # as nn.GroupNorm: the keys must match
        ours.load_state_dict(nn.GroupNorm(3, 6).state_dict())
    assert gn.GroupNorm(3, 6, affine=False, bias=False).weight is None


def test_module_dtype_and_device_arguments():
    m = gn.GroupNorm(2, 4, dtype=torch.float64)
    assert m.weight.dtype == torch.float64
    m = gn.GroupNorm(2, 4, device="meta")
    assert m.weight.device.type == "meta"


def test_replace_groupnorm_keeps_parameters():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8),
                          nn.Sequential(nn.ReLU(), nn.GroupNorm(4, 8, affine=False)),
                          nn_groupnorm_without_bias(2, 8))
    model[1].weight.data.normal_()
    weight = model[1].weight
    x = torch.randn(2, 3, 9, 9)
    expected = model(x)
    replaced = gn.replace_groupnorm(model)
    assert replaced is model
    assert type(model[1]) is gn.GroupNorm and type(model[2][1]) is gn.GroupNorm
    assert model[1].weight is weight
    assert model[2][1].weight is None
    assert type(model[3]) is gn.GroupNorm and model[3].bias is None and model[3].weight is not None
    assert list(model[3].state_dict()) == ["weight"] and "bias=False" in repr(model[3])
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    single = gn.replace_groupnorm(nn.GroupNorm(2, 4))
    assert type(single) is gn.GroupNorm
    assert "(1): groupnorm_inline.GroupNorm(2, 8" in repr(model)


def _timm_stand_ins():
    """Stand-ins for timm.layers' GroupNorm classes (timm 1.0, fast norm off):
    their names, constructors (channels first, none for the *1 classes' groups,
    drop and act made from layer classes) and forwards, so that the swap's
    logic is tested without timm. The fake_timm fixture installs them where
    timm's live."""
    def norm(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def norm_act(self, x):
        x = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        x = self.drop(x)
        x = self.act(x)
        return x

    class GroupNorm(nn.GroupNorm):
        __module__, __qualname__, forward = "timm.layers.norm", "GroupNorm", norm

        def __init__(self, num_channels, num_groups=32, eps=1e-5, affine=True, **kwargs):
            super().__init__(num_groups, num_channels, eps=eps, affine=affine, **kwargs)
            self._fast_norm = False

    class GroupNorm1(nn.GroupNorm):
        __module__, __qualname__ = "timm.layers.norm", "GroupNorm1"

        def __init__(self, num_channels, **kwargs):
            super().__init__(1, num_channels, **kwargs)
            self._fast_norm = False

        def forward(self, x):  # a function of its own, as in timm
            return norm(self, x)

    class GroupNormAct(nn.GroupNorm):
        __module__, __qualname__, forward = "timm.layers.norm_act", "GroupNormAct", norm_act

        def __init__(self, num_channels, num_groups=32, eps=1e-5, affine=True, act_layer=nn.ReLU,
                     drop_layer=None):
            super().__init__(num_groups, num_channels, eps=eps, affine=affine)
            self.drop = drop_layer() if drop_layer is not None else nn.Identity()
            self.act = act_layer() if act_layer is not None else nn.Identity()
            self._fast_norm = False

    class GroupNorm1Act(GroupNormAct):
        __module__, __qualname__ = "timm.layers.norm_act", "GroupNorm1Act"

        def __init__(self, num_channels, eps=1e-5, affine=True, act_layer=nn.ReLU,
                     drop_layer=None):
            super().__init__(num_channels, 1, eps, affine, act_layer, drop_layer)

        def forward(self, x):
            return norm_act(self, x)

    return GroupNorm, GroupNorm1, GroupNormAct, GroupNorm1Act


TIMM_STAND_INS = _timm_stand_ins()


@pytest.fixture
def fake_timm(monkeypatch):
    """timm.layers.norm and timm.layers.norm_act holding the stand-ins; returns
    them by name."""
    classes = {cls.__qualname__: cls for cls in TIMM_STAND_INS}
    for module_name in ("timm.layers.norm", "timm.layers.norm_act"):
        module = type(sys)(module_name)
        vars(module).update((name, cls) for name, cls in classes.items()
                            if cls.__module__ == module_name)
        monkeypatch.setitem(sys.modules, module_name, module)
    return types.SimpleNamespace(**classes)


class _InheritsForward(nn.GroupNorm):
    """A subclass with another constructor and an extra buffer, nn.GroupNorm's forward."""

    def __init__(self, num_channels):
        super().__init__(4, num_channels)
        self.register_buffer("seen", torch.zeros(()))


class _CustomForward(nn.GroupNorm):
    def forward(self, x):
        return super().forward(x) * 2


def timm_like_model(timm):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), timm.GroupNorm(8, 4), timm.GroupNorm1(8),
        timm.GroupNormAct(8, 2, act_layer=nn.SiLU, drop_layer=lambda: nn.Dropout(0.5)),
        timm.GroupNorm1Act(8, act_layer=lambda: nn.LeakyReLU(0.2)), _InheritsForward(8),
        nn.GroupNorm(2, 8))


def randomized(model):
    for parameter in model.parameters():
        parameter.data.normal_()
    return model


def test_replace_groupnorm_swaps_subclasses_it_can_serve(fake_timm, capsys):
    model = randomized(timm_like_model(fake_timm)).double()
    parameters = dict(model.named_parameters())
    children = model[3].drop, model[3].act, model[4].act
    calls = []
    handle = model[1].register_forward_hook(lambda module, args, output: calls.append(module))
    keys = list(model.state_dict())
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    expected = model.eval()(x)
    model.train()
    model[3].drop.eval()  # modes are kept module by module
    calls.clear()
    assert gn.replace_groupnorm(model, verbose=True) is model
    assert capsys.readouterr().out == (
        "replace_groupnorm: replaced 6 GroupNorm layers: 1 timm GroupNorm, 1 timm GroupNorm1, "
        "1 timm GroupNormAct, 1 timm GroupNorm1Act, 1 test_groupnorm._InheritsForward, "
        "1 nn.GroupNorm; left 0\n")
    assert [type(m) for m in model[1:]] == [gn.GroupNorm, gn.GroupNorm, gn.GroupNormAct,
                                            gn.GroupNormAct, gn.GroupNorm, gn.GroupNorm]
    assert model[2].num_groups == 1 and model[4].num_groups == 1 and model[3].num_groups == 2
    assert all(p is parameters[name] for name, p in model.named_parameters())
    assert len(dict(model.named_parameters())) == len(parameters)
    assert (model[3].drop, model[3].act, model[4].act) == children
    assert (model[3].activation, model[4].activation) == ("silu", "leaky_relu(0.2)")
    assert list(model.state_dict()) == keys and "5.seen" in keys
    assert model[1].weight.dtype == torch.float64
    assert model.training and model[3].training and not model[3].drop.training
    model.eval()
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # the dropout was off
    assert calls == [model[1]]  # hooks carried over; their handles still work
    handle.remove()
    model(x)
    assert len(calls) == 1
    assert "groupnorm_inline.GroupNormAct(" in repr(model) and "(drop): Dropout" in repr(model)


def test_replace_groupnorm_state_dict_both_ways(fake_timm):
    theirs = timm_like_model(fake_timm).eval()
    ours = gn.replace_groupnorm(randomized(timm_like_model(fake_timm)).eval(), strict=True)
    x = torch.randn(2, 3, 7, 7)
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=0)
    randomized(theirs)
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(theirs(x), ours(x), rtol=0, atol=0)


def test_replace_groupnorm_model_is_a_groupnorm(fake_timm):
    theirs = fake_timm.GroupNormAct(6, 3, act_layer=nn.GELU)
    ours = gn.replace_groupnorm(theirs)
    assert type(ours) is gn.GroupNormAct and ours.weight is theirs.weight
    assert ours.act is theirs.act and ours.activation == "gelu"
    assert gn.replace_groupnorm(ours) is ours  # already ours: nothing to do
    inherits = type("Inherits", (fake_timm.GroupNormAct,), {})(6, 3)  # timm's forward
    assert type(gn.replace_groupnorm(inherits, strict=True)) is gn.GroupNormAct
    overrides = type("Overrides", (fake_timm.GroupNormAct,), {"forward": lambda self, x: x})(6, 3)
    with pytest.raises(TypeError, match="its forward .*Overrides"):
        gn.replace_groupnorm(overrides, strict=True)


def test_replace_groupnorm_leaves_what_it_cannot_serve(fake_timm):
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, weight):
            return weight * 2

    fast = fake_timm.GroupNorm(8, 4)
    fast._fast_norm = True  # timm: runs in the autocast dtype
    replaced_forward = nn.GroupNorm(2, 8)
    replaced_forward.forward = lambda x: x
    parametrized = nn.GroupNorm(2, 8)
    parametrize.register_parametrization(parametrized, "weight", Doubled())
    model = nn.Sequential(nn.GroupNorm(2, 8), nn.Sequential(_CustomForward(2, 8)), fast,
                          replaced_forward, parametrized)
    with pytest.raises(gn.GroupNormError) as raised:
        gn.replace_groupnorm(model, strict=True)
    assert isinstance(raised.value, TypeError)
    message = str(raised.value)
    assert message.startswith("replace_groupnorm: left 4 GroupNorm layers alone: ")
    assert "1.0 (test_groupnorm._CustomForward): its forward (from test_groupnorm._CustomForward)" \
           " is neither nn.GroupNorm's nor a timm GroupNorm's" in message
    assert "2 (timm GroupNorm): timm's fast norm is on" in message
    assert "3 (nn.GroupNorm): its forward was replaced on the instance" in message
    assert "4 (torch.nn.utils.parametrize.ParametrizedGroupNorm): its weight or bias" in message
    assert type(model[0]) is nn.GroupNorm  # strict: nothing swapped
    with pytest.warns(UserWarning, match=r"left 4 GroupNorm layers alone: .*strict=True"):
        assert gn.replace_groupnorm(model) is model
    assert type(model[0]) is gn.GroupNorm
    assert [type(m) for m in model[1:]] == [nn.Sequential, fake_timm.GroupNorm, nn.GroupNorm,
                                            type(parametrized)]
    custom = _CustomForward(2, 8)
    with pytest.warns(UserWarning, match="left 1 GroupNorm layer alone: the model "):
        assert gn.replace_groupnorm(custom) is custom


def test_replace_groupnorm_records_activation_pairs():
    model = nn.Sequential(
        nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU()),
        nn.Sequential(nn.GroupNorm(2, 8), nn.LeakyReLU(0.1), nn.GroupNorm(2, 8), nn.GELU("tanh")),
        nn.Sequential(nn.GroupNorm(2, 8), type("MySiLU", (nn.SiLU,), {})()),  # may differ
        nn.Sequential(nn.GroupNorm(2, 8), nn.Dropout(), nn.ReLU()), nn.GroupNorm(2, 8), nn.ReLU())
    keys, x = list(randomized(model).eval().state_dict()), torch.randn(2, 8, 5)
    expected = model(x)
    gn.replace_groupnorm(model)
    assert list(model.state_dict()) == keys
    assert [m.next_activation for m in model.modules() if isinstance(m, gn.GroupNorm)] == [
        "silu", "leaky_relu(0.1)", "gelu_tanh", None, None, "relu"]
    assert [type(m) for m in model[0]] == [gn.GroupNorm, nn.SiLU]  # structure unchanged
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name, layers", [("resnet50_gn", 53), ("efficientnet_b0_gn", 49)])
def test_replace_groupnorm_timm_models(name, layers, capsys):
    timm = pytest.importorskip("timm")
    theirs = timm.create_model(name, pretrained=False).eval()
    ours = timm.create_model(name, pretrained=False).eval()
    ours.load_state_dict(theirs.state_dict())
    gn.replace_groupnorm(ours, strict=True, verbose=True)
    assert f"replaced {layers} GroupNorm layers: " in capsys.readouterr().out
    assert sum(isinstance(m, gn.GroupNorm) for m in ours.modules()) == layers
    assert not any(isinstance(m, nn.GroupNorm) and not isinstance(m, gn.GroupNorm)
                   for m in ours.modules())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    randomized(ours)
    theirs.load_state_dict(ours.state_dict())  # and back: the keys are the same
    ours.load_state_dict(theirs.state_dict())


def test_replace_groupnorm_timm_layers():
    timm = pytest.importorskip("timm")
    from timm.layers import GroupNorm1Act, GroupNormAct, set_fast_norm
    acts = ["silu", "gelu", "gelu_tanh", "relu", "tanh", "sigmoid", "hard_swish", "mish", "swish"]
    model = nn.Sequential(*[GroupNormAct(8, 2, act_layer=act) for act in acts],
                          GroupNorm1Act(8, act_layer="leaky_relu"),
                          GroupNormAct(8, 2, apply_act=False))
    gn.replace_groupnorm(model, strict=True)
    assert [m.activation for m in model] == ["silu", "gelu", "gelu_tanh", "relu", "tanh",
                                             "sigmoid", "hardswish", "mish", "silu",
                                             "leaky_relu(0.01)", None]
    assert type(gn.replace_groupnorm(timm.layers.GroupNorm1(8))) is gn.GroupNorm
    set_fast_norm(True)
    try:
        fast = timm.layers.GroupNorm(8, 2)
    finally:
        set_fast_norm(False)
    with pytest.raises(TypeError, match="fast norm"):
        gn.replace_groupnorm(fast, strict=True)


def test_groupnorm_act_fuses_its_activation_unless_drop_or_hooks_come_between(monkeypatch):
    timm = pytest.importorskip("timm")
    calls = []
    original = gn.group_norm
    monkeypatch.setattr(gn, "group_norm", lambda *a, **k: calls.append(k.get("activation")) or original(*a, **k))
    x = torch.randn(2, 8, 5, 5)
    for act, spec in (("relu", "relu"), ("silu", "silu"), ("leaky_relu", ("leaky_relu", 0.01)),
                      ("gelu_tanh", "gelu_tanh")):
        theirs = timm.layers.GroupNormAct(8, 2, act_layer=act)
        ours = gn.replace_groupnorm(copy.deepcopy(theirs), strict=True)
        calls.clear()
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
        assert calls == [spec], (act, calls)
    # a drop layer between, or a hook on the activation: unfused
    theirs = timm.layers.GroupNormAct(8, 2, act_layer="relu", drop_layer=nn.Dropout)
    ours = gn.replace_groupnorm(copy.deepcopy(theirs), strict=True).eval()
    calls.clear()
    torch.testing.assert_close(ours(x), theirs.eval()(x), rtol=0, atol=0)
    assert calls == [None]
    ours = gn.replace_groupnorm(timm.layers.GroupNormAct(8, 2, act_layer="relu"), strict=True)
    seen = []
    ours.act.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    calls.clear()
    ours(x)
    assert calls == [None] and seen == [x.shape]
    # a backward hook on act, or a global module hook: unfused too (GELU: an
    # inplace ReLU under a backward hook is an error of torch's own)
    for register in (lambda layer: layer.act.register_full_backward_hook(lambda *args: None),
                     lambda layer: nn.modules.module.register_module_forward_hook(lambda *args: None)):
        layer = gn.replace_groupnorm(timm.layers.GroupNormAct(8, 2, act_layer="gelu"), strict=True)
        handle = register(layer)
        calls.clear()
        layer(x)
        handle.remove()
        assert calls == [None]


def kernelbench_reference_model():
    class Model(nn.Module):
        def __init__(self, num_features, num_groups):
            super().__init__()
            self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=num_features)

        def forward(self, x):
            return self.gn(x)
    return Model


def test_kernelbench_solution_contract_on_cpu(monkeypatch):
    # The solution file run with load_inline stood in for by torch's
    # group_norm behind the extension's forward signature: the problem's
    # inputs, the reference Model's state_dict, and the forward's arguments.
    from torch.utils import cpp_extension
    calls = []

    class Extension:
        def forward(self, x, weight, bias, groups, eps, kernel, team, lag):
            calls.append((kernel, team, lag))
            return F.group_norm(x, groups, weight, bias, eps), None, None

    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kwargs: Extension())
    kb = {}
    exec(compile(tools.kernelbench_source("level1-35"), "kb35.py", "exec"), kb)
    assert kb["get_init_inputs"]() == [64, 8]
    shapes = []
    with monkeypatch.context() as patch:  # get_inputs() is KernelBench's to call: 7.5 GB
        patch.setattr(torch, "rand", lambda *shape, **kwargs: shapes.append(shape) or torch.empty(0))
        kb["get_inputs"]()
    assert shapes == [(112, 64, 512, 512)]
    Model = kernelbench_reference_model()
    ref = Model(*kb["get_init_inputs"]())
    ref.gn.weight.data.normal_()
    ref.gn.bias.data.normal_()
    new = kb["ModelNew"](*kb["get_init_inputs"]())
    new.load_state_dict(ref.state_dict())
    assert list(new.state_dict()) == list(ref.state_dict())
    x = torch.rand(2, 64, 8, 8)
    torch.testing.assert_close(new(x), ref(x), rtol=0, atol=0)
    assert calls == [("auto", 0, 0)]


def test_library_namespace_is_the_api():
    for name in ("batch_size", "features", "num_groups", "dim1", "dim2", "get_inputs",
                 "get_init_inputs", "ModelNew", "bundle", "bundle_source", "kernelbench_source",
                 "self_check", "main"):
        assert not hasattr(gn, name), name
    assert set(gn.__all__) >= {"GroupNorm", "group_norm", "groupnorm_cuda", "replace_groupnorm",
                               "plan", "load"}
    namespace = {}
    exec("from groupnorm_inline import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(gn.__all__)


def test_extension_name_tracks_sources(monkeypatch):
    before = gn.extension_name("9.0")
    assert before == gn.extension_name("9.0")
    assert before != gn.extension_name("8.0")
    files = {name: gn._read_source(name) for name in gn._kernel_files()}
    files["reduce.cuh"] += "\n// edited\n"
    monkeypatch.setattr(gn, "_EMBEDDED_SOURCES", files)
    assert gn.extension_name("9.0") != before


def test_build_covers_every_visible_device(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    capabilities = [(9, 0), (8, 0), (9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capabilities[d])
    assert gn._arch_list() == "8.0;9.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert gn._arch_list() == "8.6"


def test_sources_inline_every_local_include():
    cpp, cuda = gn.sources()
    assert '#include "' not in cuda
    assert cuda.count("struct TeamWorkspace") == 1, "a header was inlined twice"
    assert "__global__" in cuda and "forward(" in cpp


def test_kernel_coverage_lists_every_kernel_the_library_defines():
    # the coverage plugin's list of built kernels (nm) has each __global__
    # kernel of the sources, and reads a profiler's name as nm's
    from tools.kernel_coverage import built_kernels, kernel_key

    if shutil.which("nm") is None:
        pytest.skip("needs nm (binutils)")
    try:
        library = gn.load().__file__
    except gn.ToolchainError as error:
        pytest.skip(f"the extension cannot be built here: {error}")
    families = {key.split("<")[0] for key in built_kernels(library)}
    _, cuda = gn.sources()
    declared = set(re.findall(r"\b(groupnorm_\w+_kernel)\s*\(", cuda))  # definitions, not launches
    assert declared and families == {f"groupnorm::{name}" for name in declared}
    assert kernel_key("void groupnorm::groupnorm_stream_kernel<c10::Half, 4, true, false>"
                      "(c10::Half const*, float*)") == "groupnorm::groupnorm_stream_kernel<c10::Half,4,true,false>"
    assert kernel_key("void groupnorm::groupnorm_stream_kernel<float, 4, true, true, "
                      "(groupnorm::Store)1>(float const*)") == \
        "groupnorm::groupnorm_stream_kernel<float,4,true,true,(groupnorm::Store)1>"
    assert kernel_key("void at::native::vectorized_elementwise_kernel<4>(int)") is None


def test_bundle_imports_without_kernels_dir(tmp_path):
    path = tools.bundle(str(tmp_path / "standalone_gn.py"))
    spec = importlib.util.spec_from_file_location("standalone_gn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.sources() == gn.sources()
    assert module.extension_name("9.0") == gn.extension_name("9.0")
    for name in gn.__all__:
        assert hasattr(module, name), name
    x = torch.randn(2, 8, 3)
    torch.testing.assert_close(module.group_norm(x, 4), F.group_norm(x, 4), rtol=0, atol=0)
    with open(os.path.join(HERE, "groupnorm_tools.py")) as f:
        assert module._EMBEDDED_TOOLS == f.read()
    with open(path) as f:
        assert module._tools().bundle_source() == f.read()  # a bundle bundles itself


def test_operators_are_defined_on_import_with_fake_functions():
    # torch.compile traces them before any build: schemas and fake (meta)
    # functions need no extension; outputs keep a channels-last input's strides
    ops = torch.ops.groupnorm_inline
    x = torch.empty(2, 8, 3, 5, device="meta").to(memory_format=torch.channels_last)
    y, mean, rstd = ops.forward(x, None, None, 4, 1e-5)
    assert y.stride() == x.stride() and mean.shape == rstd.shape == (2, 4)
    dx, dweight, dbias = ops.backward(x, x, mean, rstd, None, 4, True, True)
    assert dx.stride() == x.stride() and dweight.shape == dbias.shape == (8,)
    dx, dweight, _ = ops.backward(x, x, mean, rstd, None, 4, False, False)
    assert dx.numel() == 0 and dweight.numel() == 0


def test_operators_take_any_layout_under_inductor():
    # Inductor copies a custom operator's inputs to the strides they were
    # traced with unless it is tagged flexible_layout; ours take any layout
    # (the fake functions above give outputs the kernels' strides), so the
    # channels-last outputs of compiled convolutions reach them as they are
    for name in gn._SCHEMAS:
        assert torch.Tag.flexible_layout in getattr(gn._OPS, name).default.tags, name


def test_operators_autograd_is_registered_from_cpp():
    # Meta tensors run the C++ autograd kernels without a GPU: the forward
    # records the backward operator, and double backward is refused.
    try:
        gn.load()
    except gn.ToolchainError as error:
        pytest.skip(f"the extension cannot be built here: {error}")
    for key in ("CUDA", "Autograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("groupnorm_inline::forward", key)
    x = torch.empty(2, 8, 3, 5, device="meta", requires_grad=True)
    w = torch.empty(8, device="meta", requires_grad=True)
    y, mean, rstd = torch.ops.groupnorm_inline.forward(x, w, None, 4, 1e-5)
    assert y.grad_fn is not None and not mean.requires_grad and not rstd.requires_grad
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    (dx,) = torch.autograd.grad(torch.ops.groupnorm_inline.forward(x, w, None, 4, 1e-5)[0].sum(),
                                x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()


def test_operators_of_another_version_get_a_namespace_of_their_own(monkeypatch):
    assert gn._namespace() == "groupnorm_inline"  # ours, already defined: shared
    other = dict(gn._SCHEMAS, forward=gn._SCHEMAS["forward"].replace("float eps", "float epsilon"))
    monkeypatch.setattr(gn, "_SCHEMAS", other)
    assert re.fullmatch(r"groupnorm_inline_[0-9a-f]{8}", gn._namespace())


def test_bundle_runs_its_command_line_from_the_embedded_tools(tmp_path):
    # no groupnorm_tools.py and no kernels/ beside the bundle
    path = tools.bundle(str(tmp_path / "my_groupnorm.py"))
    env = {**os.environ, "GROUPNORM_INLINE_LAZY": "1"}

    def run(*args):
        return subprocess.run([sys.executable, path, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True)

    helped = run("--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: my_groupnorm.py"), helped.stdout
    assert "my_groupnorm.py bundle --kernelbench" in helped.stdout
    assert "groupnorm_inline.py" not in helped.stdout
    exported = run("bundle", "--kernelbench", "level1-35", str(tmp_path / "kb35.py"))
    assert exported.returncode == 0, exported.stderr
    with open(tmp_path / "kb35.py") as f:
        assert f.read() == tools.kernelbench_source("level1-35")
    if not torch.cuda.is_available():
        checked = run()
        assert checked.returncode == 0 and "no CUDA device" in checked.stdout, checked.stderr


def test_bundle_works_when_exec_from_string(tmp_path):
    path = tools.bundle(str(tmp_path / "standalone_gn.py"))
    with open(path) as f:
        text = f.read()
    namespace = {}
    exec(compile(text, "<string>", "exec"), namespace)
    assert namespace["sources"]() == gn.sources()
    layer = namespace["GroupNorm"](2, 8)
    layer.weight.data.normal_()
    x = torch.rand(2, 8, 4, 4)
    torch.testing.assert_close(layer(x), F.group_norm(x, 2, layer.weight, layer.bias),
                               rtol=0, atol=0)


def test_kernelbench_bundle_passes_static_checks(tmp_path):
    path = tools.bundle(str(tmp_path / "kb35.py"), kernelbench="level1-35")
    with open(path) as f:
        text = f.read()
    assert tools.kernelbench_problems(text) == []
    assert "__global__" in text and "load_inline" in text
    compile(text, path, "exec")  # valid Python
    for name in ("class ModelNew", "def get_inputs", "def get_init_inputs"):
        assert name in text
    # load_inline builds it under a name of its own: built under the module's
    # name, it would replace the module's cached library with one that has
    # only forward()
    assert gn.extension_name() not in text
    # its one translation unit compiles float32 kernels alone (a shorter build)
    assert text.count("#define GROUPNORM_DTYPES(X) X(float)\n") == 1


@pytest.mark.parametrize("snippet,problem", [
    ("try:\n    x = 1\nexcept Exception:\n    x = 2\n", "try/except"),
    ("class A:\n    pass\n", "pass"),
    ("y = torch.nn.functional.group_norm(x, 2)\n", "functional"),
    ("m = torch.nn.GroupNorm(2, 4)\n", "torch.nn"),
])
def test_static_check_catches_violations(snippet, problem):
    text = "__global__ load_inline\n" + snippet
    assert any(problem in p for p in tools.kernelbench_problems(text))


def test_cli_bundle_and_help(tmp_path):
    out = tmp_path / "cli_bundle.py"
    subprocess.run([sys.executable, os.path.join(HERE, "groupnorm_inline.py"), "bundle", str(out)],
                   check=True, env={**os.environ, "GROUPNORM_INLINE_LAZY": "1"})
    assert out.exists()
    helptext = subprocess.run([sys.executable, os.path.join(HERE, "groupnorm_inline.py"), "bundle", "--help"],
                              check=True, capture_output=True, text=True,
                              env={**os.environ, "GROUPNORM_INLINE_LAZY": "1"}).stdout
    assert "--kernelbench" in helptext and "level1-35" in helptext
    missing = tmp_path / "no" / "such" / "dir" / "x.py"
    result = subprocess.run([sys.executable, os.path.join(HERE, "groupnorm_inline.py"), "bundle",
                             str(missing)], capture_output=True, text=True)
    assert result.returncode == 2 and "cannot write" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_bundle_refuses_to_overwrite_what_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "notes.py"
    mine.write_text("print('mine')\n")
    for args in (["bundle", str(mine)], ["bundle", "--kernelbench", "level1-35", str(mine)]):
        with pytest.raises(SystemExit) as exited:
            tools.main(args)
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and "was not written by `bundle`" in stderr, stderr
        assert "--force" in stderr
        assert mine.read_text() == "print('mine')\n"
    assert tools.main(["bundle", "--force", str(mine)]) == 0
    assert mine.read_text().startswith(tools.BUNDLE_MARKER + "\n")
    assert tools.main(["bundle", "--kernelbench", "level1-35", str(mine)]) == 0  # a bundle now
    assert mine.read_text() == tools.kernelbench_source("level1-35")

    env = {**os.environ, "GROUPNORM_INLINE_LAZY": "1"}

    def run(script, *args):
        return subprocess.run([sys.executable, str(script), *args], cwd=os.path.dirname(script),
                              env=env, capture_output=True, text=True)
    # the module itself, in a copy of the checkout (a failure must not cost
    # the real one), named as the command line names it
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(HERE, "kernels"), checkout / "kernels")
    for name in ("groupnorm_inline.py", "groupnorm_tools.py"):
        shutil.copy(os.path.join(HERE, name), checkout / name)
    module = checkout / "groupnorm_inline.py"
    text = module.read_text()
    refused = run(module, "bundle", "groupnorm_inline.py")
    assert refused.returncode == 2 and "is the module itself" in refused.stderr, refused.stderr
    assert module.read_text() == text
    # a bundle is its own module too; forced, it writes itself again
    standalone = tools.bundle(str(tmp_path / "standalone.py"))
    assert "is the module itself" in run(standalone, "bundle", standalone).stderr
    with open(standalone) as f:
        text = f.read()
    assert run(standalone, "bundle", "--force", standalone).returncode == 0
    with open(standalone) as f:
        assert f.read() == text


def test_build_command_and_version(monkeypatch, capsys):
    # build compiles (load) for the architectures asked for and prints the
    # name of what it built; --version prints the version
    archs = []
    monkeypatch.setattr(gn, "load", lambda: archs.append(os.environ["TORCH_CUDA_ARCH_LIST"]))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5")
    assert tools.main(["build", "--arch", "8.0;9.0"]) == 0
    assert archs == ["8.0;9.0"]
    assert capsys.readouterr().out == gn.extension_name("8.0;9.0") + "\n"
    for argv, code in ((["build", "--arch", "sm_90"], 2), (["build", "--help"], 0), (["--version"], 0)):
        with pytest.raises(SystemExit) as exited:
            tools.main(argv)
        assert exited.value.code == code, argv
    out, err = capsys.readouterr()
    assert "--arch 'sm_90': expected versions such as 9.0" in err
    assert "usage: groupnorm_inline.py build [-h] [--arch ARCHS]" in out
    assert out.endswith(f"groupnorm_inline {gn.__version__}\n")
    assert archs == ["8.0;9.0"]

    def no_nvcc():
        raise gn.ToolchainError("groupnorm_inline: the CUDA compiler (nvcc) was not found")

    monkeypatch.setattr(gn, "load", no_nvcc)
    with pytest.raises(SystemExit) as exited:
        tools.main(["build"])
    assert exited.value.code == 1
    assert capsys.readouterr().err == "groupnorm_inline.py: groupnorm_inline: the CUDA compiler (nvcc) was not found\n"


def without_toolchain(monkeypatch):
    """As on a machine with no CUDA toolkit and nothing in the build cache."""
    from torch.utils import cpp_extension
    monkeypatch.setattr(gn, "_extension", None)
    monkeypatch.setattr(gn, "_toolchain_error", None)
    monkeypatch.setattr(gn, "_load_cached", lambda *args: None)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/nonexistent")


def test_missing_toolchain_falls_back_to_torch_with_one_warning(monkeypatch):
    without_toolchain(monkeypatch)
    x = torch.randn(2, 6, 4).as_subclass(PretendCuda)  # takes the CUDA path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for y in (gn.group_norm(x, 2), gn.group_norm(x, 3), gn.GroupNorm(2, 6)(x)):
            assert isinstance(y, PretendCuda)  # computed by torch, from x itself
        assert torch.equal(gn.group_norm(x, 2), F.group_norm(x, 2))
    messages = [str(w.message) for w in caught if "groupnorm_inline" in str(w.message)]
    assert len(messages) == 1, messages
    assert "nvcc" in messages[0] and "CUDA_HOME" in messages[0]
    assert "group_norm and GroupNorm run torch's GroupNorm" in messages[0]
    with pytest.raises(gn.ToolchainError, match=r"nvcc\) was not found \(CUDA_HOME='/nonexistent'\)"):
        gn.groupnorm_cuda(x, None, None, 2)
    assert issubclass(gn.ToolchainError, RuntimeError)


def test_import_without_toolchain_warns_once_and_falls_back(tmp_path):
    # on a GPU machine the import loads the kernels: without nvcc, one warning
    code = "\n".join([
        "import warnings, torch",
        "warnings.simplefilter('always')",
        "torch.cuda.is_available = lambda: True",
        "import groupnorm_inline as gn",
        "class PretendCuda(torch.Tensor):",
        "    is_cuda = property(lambda self: True)",
        "x = torch.randn(2, 6, 4).as_subclass(PretendCuda)",
        "assert torch.equal(gn.group_norm(x, 2), torch.nn.functional.group_norm(x, 2))",
        "gn.GroupNorm(2, 6)(x)",
        "try:",
        "    gn.groupnorm_cuda(x, None, None, 2)",
        "except gn.ToolchainError as error:",
        "    print('groupnorm_cuda:', error)",
    ])
    env = {**os.environ, "CUDA_HOME": "/nonexistent", "TORCH_EXTENSIONS_DIR": str(tmp_path),
           "TORCH_CUDA_ARCH_LIST": "9.0"}
    env.pop("GROUPNORM_INLINE_LAZY", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("run torch's GroupNorm") == 1, result.stderr
    assert "groupnorm_cuda: groupnorm_inline: the CUDA compiler (nvcc) was not found" in result.stdout


def test_cached_build_loads_silently_without_the_toolchain():
    # a build already in the cache is imported as it is: no compiler, no message
    from torch.utils import cpp_extension
    name = gn.extension_name()
    built = os.path.join(cpp_extension._get_build_directory(name, verbose=False), name + ".so")
    if not os.path.exists(built):
        pytest.skip("the extension is not built in this cache yet")
    env = {**os.environ, "CUDA_HOME": "/nonexistent", "GROUPNORM_INLINE_LAZY": "1"}
    result = subprocess.run([sys.executable, "-c", "import groupnorm_inline as gn; gn.load(); "
                             "print('loaded')"], cwd=HERE, env=env, capture_output=True, text=True)
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr
    assert "groupnorm_inline" not in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_self_check_without_gpu_says_so():
    result = subprocess.run([sys.executable, os.path.join(HERE, "groupnorm_inline.py")],
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert "no CUDA device" in result.stdout


# ---------------------------------------------------------------------------
# The fused epilogue: y * (1 + scale) + shift, activation, + residual
# ---------------------------------------------------------------------------

# torch.nn.functional's activations by the names group_norm takes
ACTIVATIONS = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "relu": F.relu, "leaky_relu": F.leaky_relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "hardswish": F.hardswish, "mish": F.mish,
}


def unfused(x, groups, w, b, eps=1e-5, **epilogue):
    """The sequence the epilogue fuses, written out with torch ops."""
    return apply_epilogue(F.group_norm(x, groups, w, b, eps), **epilogue)


def apply_epilogue(y, scale=None, shift=None, activation=None, residual=None,
                   residual_before_activation=False):
    """The epilogue of y = GroupNorm(x) by torch ops, one after another:
    scale and shift per (sample, channel), any of their accepted shapes; the
    residual last, or before the activations."""
    per_channel = tuple(y.shape[:2]) + (1,) * (y.dim() - 2)
    if scale is not None:
        y = y * (1 + scale.reshape(scale.shape[:2]).expand(y.shape[:2]).reshape(per_channel))
    if shift is not None:
        y = y + shift.reshape(shift.shape[:2]).expand(y.shape[:2]).reshape(per_channel)
    steps = ((activation,) if isinstance(activation, str) or
             (isinstance(activation, tuple) and activation[:1] == ("leaky_relu",) and
              len(activation) == 2 and not isinstance(activation[1], str))
             else activation or ())
    if residual is not None and residual_before_activation:
        y = y + residual
    for step in steps:
        y = F.leaky_relu(y, step[1]) if isinstance(step, tuple) else ACTIVATIONS[step](y)
    if residual is not None and not residual_before_activation:
        y = y + residual
    return y


def pre_norm_sum(x, add=None):
    """x + add by torch's add (rounded to x's dtype), add (N, C) broadcast over
    x's spatial dims: what the fused call normalises; x without an add."""
    if add is None:
        return x
    return x + add.reshape(tuple(x.shape[:2]) + (1,) * (x.dim() - 2))


# (name, options): each option alone, chains, and everything at once
EPILOGUES = [
    ("scale", dict(scale=True)),
    ("shift", dict(shift=True)),
    ("scale-shift", dict(scale=True, shift=True)),
    *((name, dict(activation=name)) for name in ACTIVATIONS),
    ("leaky_relu-0.2", dict(activation=("leaky_relu", 0.2))),
    ("tanh-hardswish", dict(activation=("tanh", "hardswish"))),
    ("residual", dict(residual=True)),
    ("all", dict(scale=True, shift=True, activation=(("leaky_relu", 0.3), "silu", "gelu_tanh"),
                 residual=True)),
    # a ResNet block's tail: act(norm(x) + shortcut)
    ("residual-relu", dict(activation="relu", residual=True, residual_before_activation=True)),
    ("scale-residual-tanh-hardswish", dict(scale=True, activation=("tanh", "hardswish"),
                                           residual=True, residual_before_activation=True)),
]
# every option the registers kernel takes at once: no called chain there
INLINE_ALL = dict(scale=True, shift=True, activation="silu", residual=True)


def inline_chain(activation):
    """SiLU or ReLU alone, or no activation: the chains every fused kernel
    applies inline, the registers kernel's only ones."""
    return activation is None or activation in ("silu", "relu", ("silu",), ("relu",))


def epilogue_tensors(x, options, scale_shape=None):
    """Fresh tensors for the options that take one, x's dtype and device:
    scale and shift (N, C) (or scale_shape), residual x's shape and layout."""
    N, C = x.shape[:2]
    shape = scale_shape or (N, C)
    out = {}
    if options.get("scale"):
        out["scale"] = 0.5 * torch.randn(shape, device=x.device).to(x.dtype)
    if options.get("shift"):
        out["shift"] = torch.randn(shape, device=x.device).to(x.dtype)
    if options.get("residual"):
        out["residual"] = torch.randn_like(x)
    if "activation" in options:
        out["activation"] = options["activation"]
    if options.get("residual_before_activation"):
        out["residual_before_activation"] = True
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("name, options", EPILOGUES, ids=[name for name, _ in EPILOGUES])
def test_cpu_epilogue_equals_the_unfused_sequence(name, options, dtype):
    for shape, groups in (((2, 6, 5, 7), 3), ((3, 8, 11), 4), ((2, 4), 2)):
        x = torch.randn(shape, dtype=dtype)
        w, b = affine(shape[1], dtype, "cpu", "both")
        args = epilogue_tensors(x, options)
        torch.testing.assert_close(gn.group_norm(x, groups, w, b, **args),
                                   unfused(x, groups, w, b, **args), rtol=0, atol=0)


def test_cpu_scale_and_shift_shapes():
    # (N, C), (N, C, 1, ...) and sizes of 1 in N or C: per (sample, channel)
    x = torch.randn(2, 6, 4, 5)
    for shape in ((2, 6), (2, 6, 1, 1), (2, 6, 1), (1, 6, 1, 1), (2, 1), (1, 1, 1, 1)):
        s, t = torch.randn(shape), torch.randn(shape)
        torch.testing.assert_close(gn.group_norm(x, 3, scale=s, shift=t),
                                   unfused(x, 3, None, None, scale=s, shift=t), rtol=0, atol=0)
    for shape in ((6,), (2, 6, 4, 5), (2, 6, 1, 1, 1), (3, 6), (2, 5), (2, 6, 2, 1), (2, 6, 4, 1)):
        with pytest.raises(ValueError, match=re.escape("scale must have shape (N, C) = (2, 6)") +
                           r".*" + re.escape(f"got {list(shape)}")):
            gn.group_norm(x, 3, scale=torch.randn(shape))
    with pytest.raises(ValueError, match=re.escape("shift must have shape (N, C) = (2, 6), or one "
                                                   "that broadcasts like (2, 6, 1, 1), got [6]")):
        gn.group_norm(x, 3, shift=torch.randn(6))
    with pytest.raises(ValueError, match=re.escape("residual must have the input's shape "
                                                   "[2, 6, 4, 5], got [2, 6, 4, 1]")):
        gn.group_norm(x, 3, residual=torch.randn(2, 6, 4, 1))


# add's accepted shapes for an (N, C, *rest) input, and what each adds per element
ADD_FORMS = {
    "per sample and channel": lambda N, C, rest: (N, C),
    "broadcast": lambda N, C, rest: (N, C) + (1,) * len(rest),
    "one sample": lambda N, C, rest: (1, C) + (1,) * len(rest),
    "full": lambda N, C, rest: (N, C, *rest),
}


def broadcast_add(add, x):
    """add as torch broadcasts it against x after the module reads it."""
    return add if add.shape == x.shape else add.reshape(add.shape[:2] + (1,) * (x.dim() - 2))


@pytest.mark.parametrize("return_sum", [False, True], ids=["y", "y and s"])
@pytest.mark.parametrize("form", list(ADD_FORMS))
def test_cpu_add_is_group_norm_of_the_sum(form, return_sum):
    # GroupNorm of x + add, then the epilogue, values and every gradient
    # (add's in its own shape) against torch's autograd of the sequence
    torch.manual_seed(3)
    x = torch.randn(2, 8, 5, 3, dtype=torch.float64) + 3
    add = torch.randn(ADD_FORMS[form](2, 8, (5, 3)), dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    dy, ds = torch.randn_like(x), torch.randn_like(x)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, add, w, b)]
        y, total = fn(*leaves)
        loss = (y * dy).sum() + ((total * ds).sum() if return_sum else 0)
        return [y.detach(), total.detach(), *torch.autograd.grad(loss, leaves)]

    def ours(x, add, w, b):
        out = gn.group_norm(x, 4, w, b, add=add, activation="silu", return_sum=return_sum)
        return out if return_sum else (out, x + broadcast_add(add, x))

    def theirs(x, add, w, b):
        total = x + broadcast_add(add, x)
        return F.silu(F.group_norm(total, 4, w, b)), total

    for name, a, e in zip(("y", "s", "dx", "dadd", "dweight", "dbias"), run(ours), run(theirs)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=name)


def test_cpu_add_refusals_and_the_module():
    x = torch.randn(2, 6, 4, 5)
    for shape in ((6,), (2, 6, 4, 1), (2, 6, 1, 1, 1), (3, 6), (2, 5)):
        with pytest.raises(ValueError, match=re.escape("add must have the input's shape "
                                                       "[2, 6, 4, 5], or (N, C) = (2, 6)")):
            gn.group_norm(x, 3, add=torch.randn(shape))
    with pytest.raises(TypeError, match="add dtype must be the input's"):
        gn.group_norm(x, 3, add=torch.randn(2, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="add must be a torch.Tensor or None, got list"):
        gn.group_norm(x, 3, add=[1.0])
    with pytest.raises(TypeError, match="return_sum must be True or False, got 1"):
        gn.group_norm(x, 3, return_sum=1)
    # the module takes them as keywords; without add, s is the input
    layer = gn.GroupNorm(3, 6)
    temb = torch.randn(2, 6)
    torch.testing.assert_close(layer(x, add=temb), F.group_norm(x + temb[:, :, None, None], 3,
                                                                layer.weight, layer.bias))
    y, total = layer(x, return_sum=True)
    assert total is x and torch.equal(y, layer(x))


def test_cpu_add_under_torch_compile():
    # traced in one graph with the symbolic batch of a dynamic compile
    x, temb = torch.randn(2, 6, 4, 5), torch.randn(2, 6)
    fn = torch.compile(lambda t, a: gn.group_norm(t, 3, add=a, activation="silu", return_sum=True),
                       fullgraph=True, dynamic=True)
    y, total = fn(x, temb)
    torch.testing.assert_close(total, x + temb[:, :, None, None])
    torch.testing.assert_close(y, F.silu(F.group_norm(total, 3)))


def test_cpu_activation_names_and_chains():
    x = torch.randn(2, 6, 5)
    base = F.group_norm(x, 3)
    for name, fn in ACTIVATIONS.items():
        torch.testing.assert_close(gn.group_norm(x, 3, activation=name), fn(base), rtol=0, atol=0)
    torch.testing.assert_close(gn.group_norm(x, 3, activation=("leaky_relu", 0.2)),
                               F.leaky_relu(base, 0.2), rtol=0, atol=0)
    torch.testing.assert_close(gn.group_norm(x, 3, activation=["tanh", "hardswish"]),
                               F.hardswish(torch.tanh(base)), rtol=0, atol=0)
    torch.testing.assert_close(gn.group_norm(x, 3, activation=(("leaky_relu", 0.01), "leaky_relu")),
                               F.leaky_relu(F.leaky_relu(base)), rtol=0, atol=0)
    torch.testing.assert_close(gn.group_norm(x, 3, activation=()), base, rtol=0, atol=0)
    assert gn._activation_steps("f", ("leaky_relu", "tanh")) == (("leaky_relu", 0.01), ("tanh", None))
    assert gn._activation_steps("f", ("leaky_relu", 2)) == (("leaky_relu", 2.0),)
    epilogue = gn._check_epilogue("f", x, None, None, ("silu", ("leaky_relu", 0.5), "mish"), None)
    assert epilogue.codes() == [0, 4, 8] and epilogue.slope() == 0.5


@pytest.mark.parametrize("activation, error, fragment", [
    ("swish", ValueError, "unknown activation 'swish'; the activations are silu, gelu, gelu_tanh, "
                          "relu, leaky_relu, tanh, sigmoid, hardswish, mish"),
    ("SiLU", ValueError, "unknown activation 'SiLU'"),
    (("tanh", "nope"), ValueError, "unknown activation 'nope'"),
    (("silu",) * 5, ValueError, "at most 4 activations in a chain, got 5"),
    ((("leaky_relu", 0.1), ("leaky_relu", 0.2)), ValueError, "one leaky_relu slope per chain"),
    (("leaky_relu", float("nan")), ValueError, "slope must be finite"),
    (("tanh", 0.2), TypeError, "an activation is a name"),
    (nn.SiLU(), TypeError, "activation must be None, a name"),
    (3, TypeError, "activation must be None, a name"),
    (("leaky_relu", True), TypeError, "an activation is a name"),
])
def test_cpu_bad_activation_raises_clear_error(activation, error, fragment):
    x = torch.randn(2, 6, 5)
    with pytest.raises(error, match=re.escape(fragment)) as info:
        gn.group_norm(x, 3, activation=activation)
    assert isinstance(info.value, gn.GroupNormError)
    with pytest.raises(error, match=re.escape(fragment)):
        gn.GroupNorm(3, 6, activation=activation)


def test_cpu_epilogue_dtype_and_device_must_match_the_input():
    x = torch.randn(2, 6, 5)
    with pytest.raises(TypeError, match=re.escape("scale dtype must be the input's (torch.float32), "
                                                  "got torch.float64")):
        gn.group_norm(x, 3, scale=torch.randn(2, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="residual dtype must be the input's"):
        gn.group_norm(x, 3, residual=torch.randn(2, 6, 5).half())
    with pytest.raises(ValueError, match=re.escape("shift must be on the input's device (cpu), got "
                                                   "one on meta")):
        gn.group_norm(x, 3, shift=torch.randn(2, 6, device="meta"))
    with pytest.raises(TypeError, match="scale must be a torch.Tensor or None, got list"):
        gn.group_norm(x, 3, scale=[[1.0] * 6] * 2)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor or None"):
        gn.group_norm(x, 3, residual=1.0)


def test_cpu_epilogue_gradients():
    # CPU runs the torch ops: every input gets its gradient
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64, requires_grad=True)
    w, b = (torch.randn(6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    s, t = (torch.randn(2, 6, 1, 1, dtype=torch.float64, requires_grad=True) for _ in range(2))
    r = torch.randn(2, 6, 3, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda *a: gn.group_norm(a[0], 3, a[1], a[2], scale=a[3], shift=a[4], residual=a[5],  # noqa: E731
                                  activation=("silu", "tanh"))
    assert torch.autograd.gradcheck(fn, (x, w, b, s, t, r))


def test_module_activation_attribute_repr_and_state_dict():
    layer = gn.GroupNorm(3, 6, activation=("tanh", "hardswish"))
    assert layer.activation == ("tanh", "hardswish")
    assert "activation=('tanh', 'hardswish')" in repr(layer)
    assert "activation" not in repr(gn.GroupNorm(3, 6))
    assert gn.GroupNorm(3, 6).activation is None
    theirs = nn.GroupNorm(3, 6)
    randomized(theirs)
    assert list(layer.state_dict()) == list(theirs.state_dict())
    layer.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 6, 7)
    torch.testing.assert_close(layer(x), F.hardswish(torch.tanh(theirs(x))), rtol=0, atol=0)
    layer.activation = "silu"  # a plain attribute
    torch.testing.assert_close(layer(x), F.silu(theirs(x)), rtol=0, atol=0)
    # GroupNormAct's `activation` names its act module, which it applies unfused
    act = gn.GroupNormAct(3, 6, act=nn.ReLU())
    act.load_state_dict(theirs.state_dict())
    assert act.activation == "relu" and "activation=" not in repr(act)
    torch.testing.assert_close(act(x), F.relu(theirs(x)), rtol=0, atol=0)


def fake_fused_extension(monkeypatch):
    """load() and _kernels_available() stood in for: the calls that reach the
    extension's forward and forward_fused, recorded."""
    calls = []

    class Extension:
        def forward(self, x, weight, bias, groups, eps, kernel, team, lag):
            calls.append(("forward", kernel, team, lag))
            return torch.Tensor.clone(x), None, None

        # every argument required, as in load_inline's binding
        def forward_fused(self, x, weight, bias, groups, eps, kernel, team, lag, scale, shift,
                          residual, activations, slope, add, residual_first):
            calls.append(("forward_fused", kernel, team, lag, scale, shift, residual, activations,
                          slope) + ((True,) if residual_first else ()))
            return torch.Tensor.clone(x), None, None

    monkeypatch.setattr(gn, "load", Extension)
    monkeypatch.setattr(gn, "_kernels_available", lambda: True)
    return calls


def test_fused_call_reaches_the_extension_with_codes_and_slope(monkeypatch):
    calls = fake_fused_extension(monkeypatch)
    x = torch.randn(2, 6, 4).as_subclass(PretendCuda)
    s = torch.randn(2, 6, 1)
    r = torch.randn(2, 6, 4)
    gn.group_norm(x, 3, scale=s, activation=(("leaky_relu", 0.25), "hardswish"), residual=r)
    gn.groupnorm_cuda(x, None, None, 3, kernel="contiguous", team=2, activation="gelu")
    gn.groupnorm_cuda(x, None, None, 3, kernel="stream", lag=4)
    gn.group_norm(x, 3)  # no epilogue: the plain forward
    (_, kernel, team, lag, scale, shift, residual, codes, slope), fused, plain, plain2 = calls
    assert (kernel, team, lag, codes, slope) == ("auto", 0, 0, [4, 7], 0.25)
    assert scale.shape == (2, 6) and torch.equal(scale, s.reshape(2, 6)) and shift is None
    assert residual is r
    assert fused[1:4] == ("contiguous", 2, 0) and fused[7:] == ([1], 0.01)
    assert plain == ("forward", "stream", 0, 4) and plain2 == ("forward", "auto", 0, 0)


def test_residual_before_activation_reaches_the_kernels_and_torch(monkeypatch):
    # the flag travels to the extension (and to the operator, below) where
    # an activation follows; without one the two orders are one sum
    calls = fake_fused_extension(monkeypatch)
    x = torch.randn(2, 6, 4).as_subclass(PretendCuda)
    r = torch.randn(2, 6, 4)
    gn.group_norm(x, 3, activation="relu", residual=r, residual_before_activation=True)
    gn.groupnorm_cuda(x, None, None, 3, residual=r, residual_before_activation=True)
    assert calls[0][-1] is True and calls[0][7] == [gn._ACTIVATION_CODES["relu"]]
    assert calls[1][-1] == 0.01  # no flag: no activation
    # CPU tensors: torch's ops in that order, against the sequence written out
    x, w, b = torch.randn(2, 6, 4, 3), torch.randn(6), torch.randn(6)
    r, scale = torch.randn(2, 6, 4, 3), torch.randn(2, 6)
    y = gn.group_norm(x, 3, w, b, scale=scale, activation=("tanh", "relu"), residual=r,
                      residual_before_activation=True)
    z = F.group_norm(x, 3, w, b) * (1 + scale[:, :, None, None]) + r
    torch.testing.assert_close(y, F.relu(torch.tanh(z)))
    # mistakes: no residual to add first, a flag that is not a bool
    with pytest.raises(gn.GroupNormError, match="residual_before_activation=True .* residual is None"):
        gn.group_norm(x, 3, activation="relu", residual_before_activation=True)
    with pytest.raises(TypeError, match="residual_before_activation must be a bool"):
        gn.group_norm(x, 3, activation="relu", residual=r, residual_before_activation=1)


@cuda
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gpu_residual_before_activation_on_stream_input(layout):
    # input that the stream kernels take, which are built without a residual
    # before the activations (a stream launcher would raise): they add it
    # last without the activation, then ATen's activation, planned or
    # forced; the operator refuses the flag without a residual
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    hw = 8 * math.ceil(math.sqrt(2 * l2 / (8 * 64 * 2)) / 8)  # twice L2 in bfloat16
    x = make_input((8, 64, hw, hw), torch.bfloat16, layout, "cuda", shift=1000.0)
    assert gn.plan(x, 8, activation="relu")["kernel"] == "stream"  # rows of 16 bytes
    w, b = affine(64, x.dtype, "cuda", "both")
    args = dict(activation="relu", residual=torch.randn_like(x), residual_before_activation=True)
    check_epilogue(x, 8, w, b, args)
    check_epilogue(x, 8, w, b, dict(args, activation=("tanh", "hardswish")), kernel="stream")
    with pytest.raises(ValueError, match="residual_first adds the residual before the activations"):
        torch.ops.groupnorm_inline.forward_fused(x, w, b, 8, 1e-5, None, None, None, [3], 0.01,
                                                 None, True)


def recorded_operators(monkeypatch):
    """gn._OPS stood in for: each forward_fused call's epilogue arguments
    (scale, shift, residual, codes, slope, add, residual_first) recorded, the
    input returned."""
    ops = []

    class Operators:
        def forward_fused(self, *args):
            ops.append(args[5:])
            return torch.Tensor.clone(args[0]), None, None

    monkeypatch.setattr(gn, "_OPS", Operators())
    return ops


def test_fused_call_with_gradients_takes_the_operator(monkeypatch):
    # gradients wanted: the operator (its C++ autograd); none: the extension
    calls = fake_fused_extension(monkeypatch)
    ops = recorded_operators(monkeypatch)
    x = torch.randn(2, 6, 4).as_subclass(PretendCuda)
    needs = [
        dict(input=x.detach().requires_grad_(), activation="silu"),
        dict(input=x, activation="silu", weight=torch.ones(6, requires_grad=True)),
        dict(input=x, scale=torch.randn(2, 6, requires_grad=True)),
        dict(input=x, residual=torch.randn(2, 6, 4, requires_grad=True)),
    ]
    for kwargs in needs:
        gn.group_norm(num_groups=3, **kwargs)
        with torch.no_grad():
            gn.group_norm(num_groups=3, **kwargs)
    gn.GroupNorm(3, 6, activation="relu")(x)  # its parameters want gradients
    assert len(ops) == len(needs) + 1 and len(calls) == len(needs)
    with pytest.raises(ValueError, match="overrides are for forward-only"):
        gn.groupnorm_cuda(x, None, None, 3, kernel="reference", scale=torch.randn(2, 6, requires_grad=True))


def _group_stats(x, groups):
    view = x.reshape(x.shape[0], groups, -1)
    var, mean = torch.var_mean(view, dim=-1, correction=0)
    return view, mean, var


@pytest.fixture
def operators_on_the_cpu():
    """CPU kernels for the four operators, by torch ops in the input's
    dtype (the CUDA kernels' definitions): the C++ autograd functions then
    run on CPU tensors, numbers included."""
    try:
        gn.load()
    except gn.ToolchainError as error:
        pytest.skip(f"the extension cannot be built here: {error}")
    names = {code: name for name, code in gn._ACTIVATION_CODES.items()}

    def forward(x, weight, bias, groups, eps):
        _, mean, var = _group_stats(x, groups)
        return F.group_norm(x, groups, weight, bias, eps), mean, (var + eps).rsqrt()

    def backward(dy, x, mean, rstd, weight, groups, need_dx, need_affine):
        N, C = x.shape[:2]
        view = x.reshape(N, groups, C // groups, -1)
        xhat = (view - mean[:, :, None, None]) * rstd[:, :, None, None]
        dyv = dy.reshape(view.shape)
        g = dyv if weight is None else dyv * weight.reshape(1, groups, -1, 1)
        mean_g = g.mean((2, 3), keepdim=True)
        mean_gx = (g * xhat).mean((2, 3), keepdim=True)
        dx = ((g - mean_g - xhat * mean_gx) * rstd[:, :, None, None]).reshape(x.shape)
        affine = [(dyv * xhat).sum((0, 3)).reshape(C), dyv.sum((0, 3)).reshape(C)]
        empty = x.new_empty(0)
        return (dx if need_dx else empty, *(affine if need_affine else (empty, empty)))

    def forward_fused(x, weight, bias, groups, eps, scale, shift, residual, activations, slope,
                      add=None, residual_first=False):
        if add is not None:
            x = x + add.reshape(x.shape[:2] + (1,) * (x.dim() - 2))
        y, mean, rstd = forward(x, weight, bias, groups, eps)
        steps = tuple((names[c], slope if names[c] == "leaky_relu" else None) for c in activations)
        epilogue = gn._Epilogue(scale, shift, residual, steps, residual_first=residual_first)
        return gn._torch_epilogue(y, epilogue), mean, rstd

    def backward_fused(dy, x, mean, rstd, weight, bias, groups, scale, shift, activations, slope,
                       add, need_dx, need_affine, need_scale, need_shift, need_add):
        # the kernels' algebra (kernels/backward_epilogue.cuh) in torch ops:
        # g = dy * act'(z) by ATen's formulas, its per-channel sums, dshift,
        # dscale and dadd from them, the plain backward on g * (1 + scale)
        N, C = x.shape[:2]
        per_channel = (N, C) + (1,) * (x.dim() - 2)
        spatial = tuple(range(2, x.dim()))
        total = x if add is None else x + add.reshape(per_channel)
        count = total[0, 0].numel()
        by_group = lambda t: t.repeat_interleave(C // groups, dim=1).reshape(per_channel)
        centred = total - by_group(mean)
        w = weight if weight is not None else x.new_ones(C)
        b = bias if bias is not None else x.new_zeros(C)
        # scale and shift as (N, C): the operator also takes (N, C, 1, ...)
        m = 1 + scale.reshape(N, C) if scale is not None else x.new_ones(N, C)
        t = shift.reshape(N, C) if shift is not None else 0
        a = (by_group(rstd) * (w * m).reshape(per_channel))
        z = centred * a + (b * m + t).reshape(per_channel)
        values = [z]
        for code in activations:
            values.append(ACTIVATION_FORWARD[names[code]](values[-1], slope))
        g = dy
        for i in reversed(range(len(activations))):
            g = ACTIVATION_BACKWARD[names[activations[i]]](g, values[i], values[i + 1], slope)
        sum_g, sum_gx = (t.sum(spatial) if spatial else t for t in (g, g * centred))
        rs = rstd.repeat_interleave(C // groups, dim=1)
        grads = {"dshift": sum_g, "dscale": w * rs * sum_gx + b * sum_g}
        dx, dweight, dbias = backward(g * m.reshape(per_channel), total, mean, rstd, weight,
                                      groups, True, need_affine)
        k1 = rs * (w * m * sum_g).reshape(N, groups, -1).sum(-1).repeat_interleave(
            C // groups, dim=1) / (count * C // groups)
        k2 = rs ** 3 * (w * m * sum_gx).reshape(N, groups, -1).sum(-1).repeat_interleave(
            C // groups, dim=1) / (count * C // groups)
        sum_x = centred.sum(spatial) if spatial else centred
        grads["dadd"] = rs * w * m * sum_g - count * k1 - k2 * sum_x
        empty = x.new_empty(0)
        return (dx if need_dx else empty, dweight, dbias,
                *(grads[k] if wanted and t is not None else empty for k, wanted, t in (
                    ("dscale", need_scale, scale), ("dshift", need_shift, shift),
                    ("dadd", need_add, add))))

    library = torch.library.Library("groupnorm_inline", "IMPL")
    for name, fn in (("forward", forward), ("backward", backward), ("forward_fused", forward_fused),
                     ("backward_fused", backward_fused)):
        library.impl(name, fn, "CPU")
    yield
    library._destroy()


# Each activation and its gradient by ATen's formulas, given (g, z, act(z),
# slope): what the fused backward's kernels compute.
ACTIVATION_FORWARD = {
    "silu": lambda z, slope: F.silu(z), "gelu": lambda z, slope: F.gelu(z),
    "gelu_tanh": lambda z, slope: F.gelu(z, approximate="tanh"),
    "relu": lambda z, slope: F.relu(z), "leaky_relu": lambda z, slope: F.leaky_relu(z, slope),
    "tanh": lambda z, slope: torch.tanh(z), "sigmoid": lambda z, slope: torch.sigmoid(z),
    "hardswish": lambda z, slope: F.hardswish(z), "mish": lambda z, slope: F.mish(z)}
ACTIVATION_BACKWARD = {
    "silu": lambda g, z, out, slope: torch.ops.aten.silu_backward(g, z),
    "gelu": lambda g, z, out, slope: torch.ops.aten.gelu_backward(g, z),
    "gelu_tanh": lambda g, z, out, slope: torch.ops.aten.gelu_backward(g, z, approximate="tanh"),
    "relu": lambda g, z, out, slope: torch.ops.aten.threshold_backward(g, out, 0),
    "leaky_relu": lambda g, z, out, slope: torch.ops.aten.leaky_relu_backward(g, z, slope, False),
    "tanh": lambda g, z, out, slope: torch.ops.aten.tanh_backward(g, out),
    "sigmoid": lambda g, z, out, slope: torch.ops.aten.sigmoid_backward(g, out),
    "hardswish": lambda g, z, out, slope: torch.ops.aten.hardswish_backward(g, z),
    "mish": lambda g, z, out, slope: torch.ops.aten.mish_backward(g, z)}

OPTIONAL_INPUTS = ("weight", "bias", "scale", "shift", "residual", "add")


def unfused_group_norm(x, groups, weight, bias, eps=1e-5):
    """F.group_norm with the bias added apart: torch 2.11's backward fails
    for a bias without a weight."""
    y = F.group_norm(x, groups, weight, None, eps)
    return y if bias is None else y + bias.reshape(-1, *[1] * (x.dim() - 2))


@pytest.mark.parametrize("order", ["residual last", "residual first"])
@pytest.mark.parametrize("chain", [[], ["silu"], ["tanh", "hardswish"], ["leaky_relu", "mish"],
                                   ["gelu_tanh", "sigmoid", "relu"]])
@pytest.mark.parametrize("wanted", ["all", "x", *OPTIONAL_INPUTS, "some absent", "2-D",
                                    "(N, C, 1, 1)"])
def test_fused_backward_equals_torch_autograd_of_the_sequence(operators_on_the_cpu, chain, wanted,
                                                              order):
    # the C++ fused autograd over the backward operator (on the CPU: the
    # kernels' algebra in torch ops) against torch's autograd of the unfused
    # sequence, in float64: each input's gradient alone (a mix-up of edges
    # shows), all at once, with optional inputs absent, and on (N, C) input;
    # the residual after the activations or before them (its backward
    # recomputes the sum by the forward operator, then takes the chain back)
    torch.manual_seed(len(chain))
    shape = (3, 8) if wanted == "2-D" else (3, 8, 5, 4)
    x = torch.randn(shape, dtype=torch.float64) + 2
    values = dict(x=x, weight=torch.randn(8, dtype=torch.float64),
                  bias=torch.randn(8, dtype=torch.float64),
                  scale=0.5 * torch.randn(3, 8, dtype=torch.float64),
                  shift=torch.randn(3, 8, dtype=torch.float64),
                  residual=torch.randn_like(x), add=torch.randn(3, 8, dtype=torch.float64))
    if wanted == "some absent":
        values.update(weight=None, shift=None)
    if wanted == "(N, C, 1, 1)":  # as graphs broadcast them: gradients come back so shaped
        values.update({k: values[k].reshape(3, 8, 1, 1) for k in ("scale", "shift", "add")})
    present = {k for k, v in values.items() if v is not None}
    wants = {"all": present, "some absent": present, "2-D": present,
             "(N, C, 1, 1)": present}.get(wanted, {wanted})
    codes = [gn._ACTIVATION_CODES[name] for name in chain]
    dy = torch.randn_like(x)

    def gradients(run):
        leaves = {k: v.clone().requires_grad_(k in wants) if v is not None else None
                  for k, v in values.items()}
        y = run(**leaves)
        return dict(zip(sorted(wants), torch.autograd.grad(y, [leaves[k] for k in sorted(wants)], dy)))

    first = order == "residual first"
    ours = gradients(lambda x, weight, bias, scale, shift, residual, add: torch.ops.groupnorm_inline.forward_fused(
        x, weight, bias, 4, 1e-5, scale, shift, residual, codes, 0.2, add, first)[0])
    steps = tuple(("leaky_relu", 0.2) if n == "leaky_relu" else n for n in chain)
    theirs = gradients(lambda x, weight, bias, scale, shift, residual, add: apply_epilogue(
        unfused_group_norm(x + add.reshape(add.shape[:2] + (1,) * (x.dim() - 2)), 4, weight, bias),
        scale=scale, shift=shift, residual=residual, activation=steps or None,
        residual_before_activation=first))
    for key in wants:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-9, atol=1e-9, msg=key)


def test_fused_backward_keeps_dynamic_shapes_under_compile(operators_on_the_cpu):
    # the backward's graph traced with a symbolic batch: one graph for four
    # batch sizes (sizes read into constants would make one each)
    from torch._dynamo.utils import counters
    counters.clear()
    torch._dynamo.reset()

    def fn(x, s):
        return torch.ops.groupnorm_inline.forward_fused(x, None, None, 4, 1e-5, s, None, None,
                                                        [gn._ACTIVATION_CODES["silu"]], 0.01)[0]

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True)
    for n in (2, 3, 4, 5):
        x = torch.randn(n, 8, 5, 4, dtype=torch.float64, requires_grad=True)
        s = torch.randn(n, 8, dtype=torch.float64, requires_grad=True)
        compiled(x, s).sum().backward()
        assert x.grad.shape == x.shape and s.grad.shape == s.shape
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_fused_call_under_torch_compile_calls_the_operator(monkeypatch):
    # where torch.compile traces, the epilogue reaches <ns>::forward_fused
    # (automatic kernel, activation codes and slope), not the bare extension
    calls = fake_fused_extension(monkeypatch)
    ops = recorded_operators(monkeypatch)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(2, 6, 4).as_subclass(PretendCuda)
    shift = torch.randn(2, 6)
    gn.group_norm(x, 3, activation=("leaky_relu", 0.2))
    gn.groupnorm_cuda(x, None, None, 3, shift=shift, activation="silu")
    assert calls == []
    assert ops[0] == (None, None, None, [gn._ACTIVATION_CODES["leaky_relu"]], 0.2, None, False)
    assert torch.equal(ops[1][1], shift) and ops[1][3] == [gn._ACTIVATION_CODES["silu"]]


def test_fused_operator_is_defined_with_its_autograd():
    # meta tensors: the fake function without a GPU; with the extension, the
    # C++ autograd kernel records the fused backward: gradients of every
    # input's shape, and double backward refused
    ops = torch.ops.groupnorm_inline
    x = torch.empty(2, 8, 3, 5, device="meta").to(memory_format=torch.channels_last)
    scale = torch.empty(2, 8, device="meta")
    y, mean, rstd = ops.forward_fused(x, None, None, 4, 1e-5, scale, None, None, [0], 0.01)
    assert y.stride() == x.stride() and mean.shape == rstd.shape == (2, 4)
    try:
        gn.load()
    except gn.ToolchainError as error:
        pytest.skip(f"the extension cannot be built here: {error}")
    for key in ("CUDA", "Autograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("groupnorm_inline::forward_fused", key)
    leaves = [x.detach().requires_grad_(), torch.empty(8, device="meta", requires_grad=True),
              torch.empty(8, device="meta", requires_grad=True), scale.requires_grad_(),
              torch.empty(2, 8, device="meta", requires_grad=True),
              torch.empty_like(x).requires_grad_()]
    codes = [gn._ACTIVATION_CODES[name] for name in ("silu", "tanh", "relu")]
    inputs, weight, bias, s, t, residual = leaves
    y = ops.forward_fused(inputs, weight, bias, 4, 1e-5, s, t, residual, codes, 0.01)[0]
    grads = torch.autograd.grad(y.sum(), leaves)
    assert [g.shape for g in grads] == [v.shape for v in leaves]
    # weight only: the others are not asked for
    (dweight,) = torch.autograd.grad(
        ops.forward_fused(inputs.detach(), weight, None, 4, 1e-5, None, None, None, [], 0.01)[0].sum(),
        weight)
    assert dweight.shape == weight.shape
    (dx,) = torch.autograd.grad(ops.forward_fused(inputs, None, None, 4, 1e-5, s, None, None,
                                                  codes, 0.01)[0].sum(), inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()


# ---------------------------------------------------------------------------
# Build and cache faults: a concurrent, killed or damaged build, a read-only
# or full cache. The loader builds a two-file extension in a cache of the
# test's own, so each fault costs seconds; with
# GROUPNORM_INLINE_TEST_REAL_BUILDS=1 they also run on the kernels (minutes).
# ---------------------------------------------------------------------------

TINY_SOURCES = {
    # the Python module, with the one entry point the loader calls
    "tiny_module.cpp": '#include <pybind11/pybind11.h>\n#include <string>\n\n'
                       'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n'
                       '  m.def("register_kernels", [](const std::string&) {});\n}\n',
    # done in a moment while the module takes seconds: a build is midway
    # when this object is there and the library is not
    "tiny_quick.cpp": "int tiny_quick() { return 1; }\n",
}

# torch before its build lock became an OS lock (FileBaton) built under a
# file whose existence blocks: brought back where torch has the new one.
LOCK_FILE_TORCH = """
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton
if not hasattr(cpp_extension, "FileBaton"):
    class LockFile:
        def __init__(self, path):
            self.baton = FileBaton(path)
        def __enter__(self):
            while not self.baton.try_acquire():
                self.baton.wait()
        def __exit__(self, *exc):
            self.baton.release()
    cpp_extension.FileLock = LockFile
"""

real_builds = pytest.mark.skipif(not os.environ.get("GROUPNORM_INLINE_TEST_REAL_BUILDS"),
                                 reason="a build of the kernels takes minutes: set "
                                        "GROUPNORM_INLINE_TEST_REAL_BUILDS=1")


@pytest.fixture(scope="module")
def toolchain():
    try:
        gn._check_toolchain()
    except gn.ToolchainError as error:
        pytest.skip(f"needs the build toolchain: {error}")


@pytest.fixture(params=["tiny", pytest.param("kernels", marks=real_builds)])
def sources(request, toolchain):
    return request.param


def loader(cache, sources, *, torch_lock="os lock", wait=None):
    """A process that loads the extension from `cache` (TORCH_EXTENSIONS_DIR)
    and prints "loaded PATH", or the error's type and message; a new session,
    so that the test can kill it with the compilers it started."""
    code = ["import sys", "import groupnorm_inline as gn"]
    if sources == "tiny":
        code += [f"gn._EMBEDDED_SOURCES = {TINY_SOURCES!r}",
                 "gn._HOST_UNITS = sorted(gn._EMBEDDED_SOURCES)", "gn._KERNEL_UNITS = []"]
    if torch_lock == "lock file":
        code.append(LOCK_FILE_TORCH)
    code += ["try:", "    print('loaded', gn.load().__file__, flush=True)",
             "except Exception as error:",
             "    print(f'{type(error).__name__}: {error}', flush=True)", "    sys.exit(1)"]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "GROUPNORM_INLINE_LAZY": "1",
           "TORCH_CUDA_ARCH_LIST": "9.0"}
    if wait is not None:
        env["GROUPNORM_INLINE_LOCK_TIMEOUT"] = str(wait)
    return subprocess.Popen([sys.executable, "-c", "\n".join(code)], cwd=HERE, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(process, sources):
    """(exit code, stdout, stderr) of a loader; a hang fails the test (a
    build of the kernels took 6-11 min on a busy 2-core machine)."""
    timeout = 300 if sources == "tiny" else 1800
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the loader hung for {timeout} s:\n{err[-3000:]}")
    return process.returncode, out, err


def load_in_process(cache, sources, **options):
    code, out, err = finish(loader(cache, sources, **options), sources)
    return types.SimpleNamespace(code=code, out=out, err=err, builds=err.count("building CUDA"),
                                 library=out.split()[1] if out.startswith("loaded ") else None)


def ninja_runs(build_dir):
    """How many times ninja ran each command, from its log."""
    with open(os.path.join(build_dir, ".ninja_log")) as f:
        outputs = [line.split("\t")[3] for line in f if not line.startswith("#")]
    return {output: outputs.count(output) for output in outputs}


def wait_for_line(process, text, timeout=300):
    """Reads the stderr of a loader up to a line that contains text; a
    loader that prints no such line in time is killed, failing the test."""
    watchdog = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in process.stderr:
            if text in line:
                return
    finally:
        watchdog.cancel()
    pytest.fail(f"the loader printed no {text!r} (in {timeout} s)")


def mount(*args):
    """Runs mount (root only, where it is allowed); False if it could not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def read_only(tmp_path):
    """Makes a directory read-only for the loader: a read-only bind mount as
    root (root writes through permission bits), else no write permission."""
    undo = []

    def make(directory):
        if os.geteuid() != 0:
            for root, dirs, _ in os.walk(directory):
                for d in [root, *(os.path.join(root, d) for d in dirs)]:
                    os.chmod(d, 0o555)
                    undo.append(lambda d=d: os.chmod(d, 0o755))
        elif mount("--bind", str(directory), str(directory)):
            undo.append(lambda: subprocess.run(["umount", str(directory)], check=True))
            if not mount("-o", "remount,bind,ro", str(directory)):
                pytest.skip("cannot remount a bind mount read-only here")
        else:
            pytest.skip("root, and cannot mount: no way to make a read-only directory")

    yield make
    for step in reversed(undo):
        step()


def test_build_fault_two_cold_imports_build_once(tmp_path, sources):
    # Two processes import on a cold cache at once: one builds, the other
    # waits (saying for whom), both load, and ninja compiles each unit once.
    processes = [loader(tmp_path, sources) for _ in range(2)]
    results = [finish(p, sources) for p in processes]
    for code, out, err in results:
        assert code == 0 and out.startswith("loaded "), err
    builds = [err.count("building CUDA") for _, _, err in results]
    assert sorted(builds) == [0, 1], [err for _, _, err in results]
    builder = processes[builds.index(1)]
    waiter_err = results[builds.index(0)][2]
    assert f"waiting for process {builder.pid} on " in waiter_err, waiter_err
    library = results[0][1].split()[1]
    assert results[1][1].split()[1] == library
    runs = ninja_runs(os.path.dirname(library))
    assert set(runs.values()) == {1}, runs


@pytest.mark.parametrize("torch_lock", ["os lock", "lock file"])
@pytest.mark.parametrize("victim", ["process group", "python only"])
def test_build_fault_killed_build_recovers_in_one_build(tmp_path, sources, victim, torch_lock):
    # A build killed by SIGKILL midway (its whole process group, as a job
    # scheduler does, or only Python, as the OOM killer does, leaving its
    # compilers running): the next import builds once and loads, whether
    # torch's own lock is an OS lock or a lock file the kill leaves behind.
    process = loader(tmp_path, sources, torch_lock=torch_lock)
    wait_for_line(process, "groupnorm_inline: [1/")  # one object done
    build_dir = os.path.join(tmp_path, os.listdir(tmp_path)[0])
    assert not any(name.endswith(".so") for name in os.listdir(build_dir)), "not midway"
    if victim == "process group":
        os.killpg(process.pid, signal.SIGKILL)
    else:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    if torch_lock == "lock file":
        assert os.path.exists(os.path.join(build_dir, "lock")), "no stale lock file to recover from"

    again = load_in_process(tmp_path, sources, torch_lock=torch_lock)
    assert again.code == 0 and again.library, again.err
    assert again.builds == 1, again.err
    assert "groupnorm_inline" not in load_in_process(tmp_path, sources).err  # cached: silent


def test_build_fault_lock_wait_is_time_boxed(tmp_path, sources):
    # A process that waits for another's build gives up after
    # GROUPNORM_INLINE_LOCK_TIMEOUT seconds, naming the builder; the
    # builder is not disturbed.
    builder = loader(tmp_path, sources)
    wait_for_line(builder, "building CUDA")
    start = time.monotonic()
    waiter = load_in_process(tmp_path, sources, wait=1)
    assert waiter.code == 1, waiter.err
    assert waiter.out.startswith(f"BuildCacheError: groupnorm_inline: gave up after 1 s waiting "
                                 f"for process {builder.pid} on "), waiter.out
    assert "GROUPNORM_INLINE_LOCK_TIMEOUT" in waiter.out
    assert time.monotonic() - start < 60
    code, out, err = finish(builder, sources)
    assert code == 0 and out.startswith("loaded "), err


@pytest.mark.parametrize("damage", ["truncated", "garbage", "one byte changed", "stamp deleted"])
def test_build_fault_damaged_library_is_rebuilt(tmp_path, sources, damage):
    # A cached library that is not the one its build wrote is never
    # imported: the loader names it and builds it again (ninja relinks).
    first = load_in_process(tmp_path, sources)
    assert first.code == 0 and first.builds == 1, first.err
    with open(first.library, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if damage == "truncated":
            f.truncate(size // 2)
        elif damage == "garbage":
            f.seek(0)
            f.write(os.urandom(size))
        elif damage == "one byte changed":
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    if damage == "stamp deleted":
        os.remove(first.library + ".sha256")

    again = load_in_process(tmp_path, sources)
    assert again.code == 0 and again.library == first.library, again.err
    said = (f"the build that wrote {first.library} did not finish" if damage == "stamp deleted"
            else f"{first.library} is damaged")
    assert f"groupnorm_inline: {said}" in again.err and again.builds == 1, again.err
    runs = ninja_runs(os.path.dirname(first.library))
    assert runs[os.path.basename(first.library)] == 2, runs  # relinked, nothing recompiled
    assert max(count for output, count in runs.items() if output.endswith(".o")) == 1, runs
    assert "groupnorm_inline" not in load_in_process(tmp_path, sources).err


def test_build_fault_read_only_cache(tmp_path, sources, read_only):
    # A read-only cache: a finished build there loads; with none there, or
    # a damaged one, a message names the directory or file and the fix.
    empty, built, damaged = (tmp_path / name for name in ("empty", "built", "damaged"))
    empty.mkdir()
    library = {}
    for cache in (built, damaged):
        first = load_in_process(cache, sources)
        assert first.code == 0, first.err
        library[cache] = first.library
    with open(library[damaged], "r+b") as f:
        f.truncate(1000)
    for cache in (empty, built, damaged):
        read_only(cache)

    result = load_in_process(empty, sources)
    assert result.code == 1 and result.out.startswith(
        "BuildCacheError: groupnorm_inline: cannot build groupnorm_inline_"), result.out
    assert f"{empty} is not writable" in result.out and "TORCH_EXTENSIONS_DIR" in result.out
    assert "Traceback" not in result.err, result.err

    result = load_in_process(built, sources)
    assert result.code == 0 and result.library == library[built], result.err
    assert "groupnorm_inline" not in result.err, result.err

    result = load_in_process(damaged, sources)
    assert result.code == 1, result.err
    assert result.out.startswith(f"BuildCacheError: groupnorm_inline: {library[damaged]} is "
                                 "damaged (1000 bytes"), result.out
    assert f"Delete {library[damaged]} where the cache is writable" in result.out


def test_build_fault_full_disk(tmp_path, sources):
    # A build on a full disk (a tmpfs smaller than the build) fails with a
    # message that says so and names the directory; once there is space,
    # the next import builds and loads.
    cache = tmp_path / "cache"
    cache.mkdir()
    size = "256k" if sources == "tiny" else "2m"  # the build writes 0.6 MB or 22 MB
    if not mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(cache)):
        pytest.skip("needs root and mount to make a small tmpfs")
    try:
        full = load_in_process(cache, sources)
        assert full.code == 1, full.err
        assert full.out.startswith("BuildCacheError: groupnorm_inline: no space left to build "
                                   "groupnorm_inline_"), full.out
        assert f"in {cache}/groupnorm_inline_" in full.out and "No space left on device" in full.out
        assert "TORCH_EXTENSIONS_DIR" in full.out

        assert mount("-o", "remount,size=256m", str(cache))
        again = load_in_process(cache, sources)
        assert again.code == 0 and again.library and again.builds == 1, again.err
    finally:
        subprocess.run(["umount", str(cache)], check=True)


@pytest.mark.skipif(not os.path.isdir("/proc") or gn.fcntl is None, reason="needs Linux")
def test_build_lock_waits_for_what_a_killed_build_left_running(tmp_path, capsys):
    # A killed builder's record stays in the lock file; the next builder
    # waits for the processes of its group still working in the build
    # directory (here one that sleeps 2 s there), not for anyone else's.
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"],
                                cwd=tmp_path, start_new_session=True)
    elsewhere = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                 start_new_session=True)
    try:
        with open(tmp_path / gn._LOCK_FILE, "w") as f:
            f.write(f"pid=1 pgid={leftover.pid} host={socket.gethostname()} since=0\n")
        start = time.monotonic()
        with gn._build_lock(str(tmp_path), "groupnorm_inline_test"):
            assert leftover.poll() is not None, "took the lock while the leftover ran"
        assert time.monotonic() - start < 20
        assert elsewhere.poll() is None
        assert (f"groupnorm_inline: waiting for processes [{leftover.pid}], left running in "
                f"{tmp_path} by a build that was killed") in capsys.readouterr().err
        assert (tmp_path / gn._LOCK_FILE).read_text() == ""  # let go: nothing to wait for
    finally:
        for process in (leftover, elsewhere):
            process.kill()
            process.wait()


def test_full_disk_and_read_only_errors_name_the_fix(tmp_path, monkeypatch):
    # Without root: ninja's report of a full disk, and an unwritable cache,
    # as the loader sees them (the two tests above make them for real).
    from torch.utils import cpp_extension
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(gn, "_extension", None)
    monkeypatch.setattr(gn, "_check_toolchain", lambda: None)

    def full_disk(**kwargs):
        raise RuntimeError("Error building extension 'x': [1/26] c++ ... -o ops.o\nFAILED: ops.o\n"
                           "ops.o: fatal error: error writing to /tmp/ccXY.s: No space left on "
                           "device\ncompilation terminated.\nninja: build stopped")

    monkeypatch.setattr(cpp_extension, "load", full_disk)
    with pytest.raises(gn.BuildCacheError, match=r"no space left to build groupnorm_inline_\w+ in "
                       + re.escape(str(tmp_path)) + r".*\(ops\.o: fatal error: error writing to "
                       r"/tmp/ccXY\.s: No space left on device\)\. Free space there"):
        gn._load_or_build()

    def not_writable(name, verbose):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "locked" / name))

    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(cpp_extension, "_get_build_directory", not_writable)
    with pytest.raises(gn.BuildCacheError, match=r"cannot build groupnorm_inline_\w+: "
                       + re.escape(str(tmp_path / "locked")) + r" is not writable \(Permission denied\)\. "
                       r"Set TORCH_EXTENSIONS_DIR"):
        gn._load_or_build()
    assert issubclass(gn.BuildCacheError, gn.ToolchainError)  # group_norm falls back to torch


# ---------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LAYOUTS = ["contiguous", "channels_last"]
GPU_SHAPES = [  # (shape, groups): awkward on purpose
    ((2, 6, 5, 7), 3),          # odd HxW, C/G = 2
    ((3, 60, 31), 5),           # 1-D, C/G = 12
    ((2, 96, 17, 23), 6),       # C/G = 16, odd HxW
    ((4, 32, 8, 8), 8),
    ((2, 320, 64, 64), 32),     # SD UNet, C/G = 10
    ((1, 64, 1, 1), 64),        # HxW = 1, G = C
    ((2, 64, 9, 9), 1),         # G = 1
    ((3, 16), 4),               # no trailing dims
    ((2, 24, 3, 5, 7), 4),      # 3-D trailing dims
    ((0, 32, 4, 4), 8),         # N = 0
    ((2, 40, 0, 4), 4),         # empty spatial
    ((5, 1280, 8, 8), 32),      # float32 channels-last: 16-byte columns to fit a block
    ((2, 2560, 4, 4), 32),
    ((1, 128, 129, 67), 32),
    ((1, 64, 256, 256), 4),     # large groups: several CTAs per group, or the stream
    ((2, 512, 3, 64, 64), 32),  # video-like 3-D
]


def shape_id(case):
    shape, groups = case
    return "x".join(map(str, shape)) + f"-G{groups}"


EVERY_DTYPE = pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
EVERY_GPU_SHAPE = pytest.mark.parametrize("case", GPU_SHAPES, ids=[shape_id(c) for c in GPU_SHAPES])


@cuda
@EVERY_GPU_SHAPE
@pytest.mark.parametrize("layout", LAYOUTS)
@EVERY_DTYPE
def test_gpu_matches_float64_reference(case, layout, dtype):
    shape, groups = case
    x = make_input(shape, dtype, layout, "cuda")
    before = x.clone()
    # and the fused epilogue: (options, shape of scale and shift) per affine kind
    broadcast = (shape[0], shape[1]) + (1,) * (len(shape) - 2)
    epilogues = {"both": (dict(EPILOGUES)["all"], None),
                 "none": (dict(scale=True, shift=True, activation="silu"), broadcast),
                 "weight": (dict(activation=("tanh", "hardswish"), residual=True), None)}
    for kind, (options, scale_shape) in epilogues.items():
        w, b = affine(shape[1], dtype, "cuda", kind)
        check_against_reference(x, groups, w, b)
        check_epilogue(x, groups, w, b, epilogue_tensors(x, options, scale_shape))
    assert torch.equal(x, before), "input was modified"


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@EVERY_DTYPE
def test_gpu_shifted_inputs_stay_accurate(layout, dtype):
    for shape, groups in [((2, 64, 33, 31), 8), ((1, 32, 128, 128), 2)]:
        x = make_input(shape, dtype, layout, "cuda", shift=1000.0)
        w, b = affine(shape[1], dtype, "cuda", "both")
        check_against_reference(x, groups, w, b)
        check_epilogue(x, groups, w, b, epilogue_tensors(x, dict(EPILOGUES)["all"]))


# The last number of a row forces the team kernels' CTAs per unit (team=) or
# the stream kernels' lag in pieces (lag=); see forcing(). 0: the planner's.
FORCED = [  # (shape, groups, dtype, layout, kernel, team or lag)
    ((2, 6, 5, 7), 3, torch.float32, "contiguous", "reference", 0),
    ((2, 96, 17, 23), 6, torch.bfloat16, "channels_last", "reference", 0),
    ((3, 60, 31), 5, torch.float16, "contiguous", "contiguous", 1),
    ((1, 8, 200, 200), 1, torch.float32, "contiguous", "contiguous", 1),    # one CTA re-reads 1.3 MB
    ((1, 8, 200, 200), 1, torch.float32, "contiguous", "contiguous", 2),    # two CTAs re-read
    ((1, 8, 200, 200), 1, torch.float32, "contiguous", "contiguous", 7),    # kept, awkward team
    ((3, 12, 61, 37), 3, torch.float32, "contiguous", "contiguous", 13),
    ((2, 20, 97, 41), 5, torch.bfloat16, "contiguous", "contiguous", 5),
    ((2, 64, 45, 45), 8, torch.float16, "channels_last", "channels_last", 1),
    ((2, 64, 45, 45), 8, torch.float16, "channels_last", "channels_last", 3),
    ((3, 40, 77, 19), 4, torch.float32, "channels_last", "channels_last", 11),
    ((1, 320, 64, 64), 32, torch.bfloat16, "channels_last", "channels_last", 64),
    ((1, 16, 300, 300), 2, torch.float32, "channels_last", "channels_last", 1),  # re-read
    # channels-last units that are blocks of a sample's groups
    ((3, 1280, 5, 7), 40, torch.float16, "channels_last", "channels_last", 3),  # 20 blocks, teams
    ((2, 768, 9, 11), 24, torch.bfloat16, "channels_last", "channels_last", 0),  # 12 blocks
    ((2, 192, 6, 6), 12, torch.float64, "channels_last", "channels_last", 2),  # 12 blocks, 1-element vectors
    ((2, 21, 17, 19), 3, torch.float32, "channels_last", "channels_last", 3),  # 4-byte async copies
    ((2, 21, 17, 19), 3, torch.float16, "channels_last", "channels_last", 2),  # 2 bytes: plain copies
    ((2, 12, 33, 35), 4, torch.float64, "contiguous", "contiguous", 6),
    # one CTA per group, the group in registers, either layout
    ((8, 1280, 8, 8), 32, torch.bfloat16, "channels_last", "registers", 0),  # SD UNet deepest
    ((8, 1280, 8, 8), 32, torch.bfloat16, "contiguous", "registers", 0),
    ((3, 60, 31), 5, torch.float16, "contiguous", "registers", 0),  # odd HxW: single elements
    ((2, 8, 64, 64), 2, torch.float32, "contiguous", "registers", 0),  # 8 of 16 vectors a thread
    ((2, 16, 64, 64), 2, torch.float32, "contiguous", "registers", 0),  # 8192 vectors: full
    ((1, 512, 32, 32), 16, torch.float32, "channels_last", "registers", 0),  # full, channels-last
    ((1, 256, 64, 64), 32, torch.float16, "channels_last", "registers", 0),  # 16 vectors a thread
    ((2, 12, 33, 35), 4, torch.float64, "contiguous", "registers", 0),
    ((3, 40, 37, 19), 4, torch.float32, "channels_last", "registers", 0),  # 2-element vectors
    ((2, 21, 17, 19), 3, torch.float32, "channels_last", "registers", 0),  # single elements
    ((2, 96, 17, 23), 6, torch.float16, "channels_last", "registers", 0),
    ((3, 40, 100), 8, torch.float32, "channels_last", "registers", 0),  # (N, C, L), C innermost
    ((2, 24, 3, 5, 7), 4, torch.bfloat16, "channels_last", "registers", 0),  # channels_last_3d
    # groups shared by a cluster of CTAs (sm_90+; skipped where there are none)
    ((2, 320, 64, 64), 32, torch.float16, "channels_last", "registers", 0),  # 4-byte vectors
    ((2, 16, 100, 100), 2, torch.float32, "contiguous", "registers", 0),  # ragged last step
    ((1, 32, 128, 129), 4, torch.bfloat16, "contiguous", "registers", 0),
    ((1, 8, 128, 256), 1, torch.float32, "contiguous", "registers", 0),  # 8 ranks of 512: full
    ((2, 64, 40, 50), 2, torch.float32, "channels_last", "registers", 0),
    ((2, 48, 10, 31, 7), 3, torch.float64, "channels_last", "registers", 0),
    # clusters forced (team=) on groups one CTA could hold: the SD UNet's
    # 64 groups over 256 CTAs; one CTA forced; more CTAs than a thread's worth
    ((2, 320, 64, 64), 32, torch.float16, "contiguous", "registers", 4),
    ((2, 320, 64, 64), 32, torch.float16, "contiguous", "registers", 1),
    ((2, 1280, 16, 16), 32, torch.float16, "channels_last", "registers", 2),
    ((3, 60, 31), 5, torch.float16, "contiguous", "registers", 8),
    # the contiguous stream; its normalise items merge their unit's partials
    # themselves ("each") when the lag is short next to the items in flight
    # (test_gpu_forced_stream_covers_both_merges), else wait for one merge
    ((3, 12, 61, 37), 3, torch.float32, "contiguous", "stream", 0),  # ragged last piece, odd HxW
    ((1, 8, 256, 256), 1, torch.bfloat16, "contiguous", "stream", 0),  # many pieces, one unit
    ((2, 12, 33, 35), 4, torch.float64, "contiguous", "stream", 0),
    ((4, 6, 5, 7), 3, torch.float16, "contiguous", "stream", 0),  # one partial piece per unit
    ((16, 64, 64, 64), 8, torch.float32, "contiguous", "stream", 1),  # shortest lag: items wait
    ((5, 40, 50, 50), 5, torch.bfloat16, "contiguous", "stream", 10**9),  # all statistics first
    ((3, 20, 42, 41), 5, torch.float32, "contiguous", "stream", 0),  # 8-byte vectors: no L2 hint
    ((2, 12, 33, 35), 3, torch.float16, "contiguous", "stream", 0),  # single elements
    ((16, 64, 64, 64), 8, torch.float32, "contiguous", "stream", 0),  # more items than resident: once
    ((16, 24, 100, 99), 3, torch.bfloat16, "contiguous", "stream", 10**9),  # ragged pieces, once
    ((2, 4, 1000, 1000), 1, torch.float32, "contiguous", "stream", 0),  # units > resident, ragged: each (once on a 60 MiB L2)
    # the stream kernel over channels-last rows: a sample is the unit
    ((2, 64, 45, 45), 8, torch.float16, "channels_last", "stream", 0),  # ragged last piece
    ((1, 128, 100, 100), 64, torch.float32, "channels_last", "stream", 0),  # 4 blocks, 79 pieces: 2 chunks, last ragged
    ((2, 96, 33, 35), 48, torch.bfloat16, "channels_last", "stream", 0),  # 2-element vectors, idle threads
    ((2, 12, 33, 35), 4, torch.float64, "channels_last", "stream", 0),
    ((16, 64, 32, 32), 8, torch.float32, "channels_last", "stream", 1),  # shortest lag: items wait
    ((5, 40, 30, 30), 5, torch.bfloat16, "channels_last", "stream", 10**9),  # all statistics first
    ((2, 21, 17, 19), 3, torch.float32, "channels_last", "stream", 0),  # single elements
    ((2, 32, 40, 40), 32, torch.float16, "channels_last", "stream", 0),  # one channel per group
    ((3, 40, 1000), 8, torch.float32, "channels_last", "stream", 0),  # (N, C, L), C innermost
    ((2, 512, 33, 35), 32, torch.bfloat16, "channels_last", "stream", 0),  # 8 blocks of 4 groups
    ((3, 384, 20, 21), 6, torch.float32, "channels_last", "stream", 1),  # 6 blocks, shortest lag
    ((1, 256, 45, 47), 16, torch.float16, "channels_last", "stream", 10**9),  # one sample, 4 blocks
]


def forcing(kernel, n):
    """The forcing argument of a FORCED row's last number: the lag (pieces)
    of the stream kernels, the team (CTAs per unit) of the others (0 there
    for the reference kernel; the cluster for the registers kernel)."""
    return {"lag": n} if kernel == "stream" else {"team": n}


def forced_id(case):
    shape, groups, dtype, layout, kernel, n = case
    return f"{shape_id((shape, groups))}-{str(dtype)[6:]}-{layout}-{kernel}-{'L' if kernel == 'stream' else 'T'}{n}"


def forced_input(case):
    """(x, plan, forcing arguments) of a FORCED row, skipped where the
    device cannot run its kernel."""
    shape, groups, dtype, layout, kernel, n = case
    force = forcing(kernel, n)
    x = make_input(shape, dtype, layout, "cuda", shift=2.0)
    if kernel == "registers" and torch.cuda.get_device_capability() < (9, 0):
        try:
            gn.plan(x, groups, kernel=kernel, **force)
        except RuntimeError:
            pytest.skip("a group larger than one CTA needs thread-block clusters (sm_90+)")
    plan = gn.plan(x, groups, kernel=kernel, **force)
    assert plan["kernel"] == kernel, plan
    return x, plan, force


@cuda
@pytest.mark.parametrize("case", FORCED, ids=forced_id)
def test_gpu_forced_paths(case):
    shape, groups, dtype, layout, kernel, n = case
    x, plan, force = forced_input(case)
    if kernel == "stream":  # the lag, kept between pieces per unit and all pieces
        pieces = plan["pieces"]
        units = x.shape[0] * (plan["blocks"] if layout == "channels_last" else groups)
        total = units * pieces
        lag = plan["lag"]
        assert lag == min(total, max(pieces, n)) if n else pieces <= lag <= total, plan
        assert plan["merge"] in ("each", "once"), plan
    elif n:  # the registers kernel's team is its cluster
        assert plan["ranks" if kernel == "registers" else "team"] == n, plan
    for _ in range(2):  # fresh weights each time; the result must not depend on timing
        w, b = affine(shape[1], dtype, "cuda", "both")
        check_against_reference(x, groups, w, b, kernel=kernel, **force)
    check_saved_statistics(x, groups, kernel, **force)


@cuda
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gpu_forced_stream_covers_both_merges(layout):
    # Which merge a stream plan takes depends on the device's resident CTAs
    # (contiguous) or on the unit's partials against a piece's bytes
    # (channels-last); the forced cases must run both on this device.
    merges = set()
    for shape, groups, dtype, case_layout, kernel, lag in FORCED:
        if kernel == "stream" and case_layout == layout:
            x = make_input(shape, dtype, layout, "cuda")
            merges.add(gn.plan(x, groups, kernel="stream", lag=lag)["merge"])
    assert merges == {"each", "once"}, merges


@cuda
@pytest.mark.parametrize("shape, groups, lag, merge", [
    ((128, 64, 32, 32), 32, 1, "each"),  # 4096 units of one piece, shortest lag
    ((128, 64, 32, 32), 32, 0, "once"),  # the same at the default lag
    ((64, 32, 63, 65), 8, 1, "each"),  # 512 units of 8 ragged pieces: 8 readers a slot
])
def test_gpu_stream_ring_of_partials_wraps(shape, groups, lag, merge):
    # The ring of per-piece statistics (about two slots per resident CTA)
    # holds fewer units than there are, so units reuse slots once every
    # reader of the previous unit is done; a wrong slot index or an early
    # reuse gives wrong statistics. (The wait for a slot is rarely reached:
    # it is covered by the ordering argument, not forced here.)
    x = make_input(shape, torch.float32, "contiguous", "cuda", shift=3.0)
    plan = gn.plan(x, groups, kernel="stream", lag=lag)
    assert plan["slots"] < shape[0] * groups, plan
    assert plan["merge"] == merge, plan
    for _ in range(3):
        check_against_reference(x, groups, *affine(shape[1], x.dtype, "cuda", "both"),
                                kernel="stream", lag=lag)
    check_saved_statistics(x, groups, "stream", lag=lag)


@cuda
@pytest.mark.parametrize("shape, groups, dtype, merge", [
    ((2048, 32, 16, 16), 8, torch.float32, "each"),  # 2048 units of one piece
    ((256, 64, 32, 32), 8, torch.float32, "each"),  # two blocks a sample, 4 readers a slot
    ((256, 64, 32, 32), 32, torch.bfloat16, "once"),  # partials too many for each to merge
])
def test_gpu_stream_channels_last_ring_of_partials_wraps(shape, groups, dtype, merge):
    # As test_gpu_stream_ring_of_partials_wraps, over channels-last units
    # (a sample, or a block of its groups), at the shortest lag.
    x = make_input(shape, dtype, "channels_last", "cuda", shift=3.0)
    plan = gn.plan(x, groups, kernel="stream", lag=1)
    blocks = plan["blocks"]
    assert plan["kernel"] == "stream" and plan["layout"] == "channels_last" and \
        plan["merge"] == merge, plan
    assert plan["slots"] < shape[0] * blocks, plan
    for _ in range(3):
        check_against_reference(x, groups, *affine(shape[1], x.dtype, "cuda", "both"),
                                kernel="stream", lag=1)
    check_saved_statistics(x, groups, "stream", lag=1)


@cuda
def test_gpu_stream_channels_last_merges_many_chunks_of_many_pieces():
    # merge=once merges a unit's piece partials chunk by chunk, then the
    # chunks; the forced cases above make at most 2 chunks a unit. Here C =
    # 124 in G = 31 groups of 4 float32 channels (31 is prime, so a sample is
    # one unit): 64-row pieces with 31 partials each, 33 pieces a chunk, and
    # 155 pieces, so 5 chunks with a ragged last one (23 pieces) and a ragged
    # last piece. Values sit at 1000 and drift by 8 along the rows, so the
    # partials' means differ: a merge that drops the between-partial term,
    # adds sums of squares, or miscounts a ragged chunk misses by far more
    # than the tolerance.
    x = make_input((2, 124, 99, 100), torch.float32, "channels_last", "cuda", shift=1000.0)
    x.add_(torch.linspace(0, 8, 99 * 100, device="cuda").view(1, 1, 99, 100))
    plan = gn.plan(x, 31, kernel="stream")
    assert plan["kernel"] == "stream" and plan["layout"] == "channels_last" and \
        plan["merge"] == "once", plan
    pieces = plan["pieces"]
    chunk = plan["chunk"]
    chunks = -(-pieces // chunk)
    assert chunk >= 8 and chunks >= 4 and pieces % chunk != 0, plan
    for _ in range(2):
        check_against_reference(x, 31, *affine(124, x.dtype, "cuda", "both"), kernel="stream")
    # mean and rstd as saved for the backward, on shifted input without the
    # drift: with it, the float32 merges' own rounding comes close to the
    # 2e-5 that check_saved_statistics allows rstd
    check_saved_statistics(make_input(x.shape, x.dtype, "channels_last", "cuda", shift=1000.0), 31,
                           "stream")


def check_saved_statistics(x, groups, kernel="auto", team=0, lag=0):
    """mean and rstd per (sample, group), which the backward reuses, against
    float64, from the extension's forward with kernel, team and lag forced as
    groupnorm_cuda forces them. A forward of NaN input first leaves NaN
    statistics in the blocks the call's mean and rstd will reuse, so
    statistics a kernel fails to write show up instead of an earlier call's."""
    ext = gn.load()
    ext.forward(torch.full_like(x, float("nan")), None, None, groups, 1e-5, kernel, team, lag)
    _, mean, rstd = ext.forward(x, None, None, groups, 1e-5, kernel, team, lag)
    xs = x.double().reshape(x.shape[0], groups, -1)
    ref_mean = xs.mean(-1)
    ref_var = xs.var(-1, unbiased=False)
    # float32 accumulation (float64 for float64 input): a few of its rounding
    # steps at the mean's magnitude, plus a sum's error about the mean
    acc_eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    mean_tol = 16 * acc_eps * ref_mean.abs() + (1e-10 if x.dtype == torch.float64 else 1e-5) * ref_var.sqrt()
    assert ((mean.double() - ref_mean).abs() <= mean_tol + 1e-30).all(), (mean, ref_mean)
    ref_rstd = (ref_var + 1e-5).rsqrt()
    rstd_tol = 1e-10 if x.dtype == torch.float64 else 2e-5
    assert ((rstd.double() - ref_rstd).abs() <= rstd_tol * ref_rstd).all(), (rstd, ref_rstd)


def kept_fraction(plan):
    """The share of a team plan's slice that its CTAs keep on chip."""
    return plan["kept"] / plan["slice"]


# The fields of plan() for each forward kernel, in order: the common ones,
# the kernel's own config, and the reason last (describe() in
# kernels/plan_forward.cpp).
FORWARD_PLAN_COMMON = ["kernel", "layout", "vec", "units", "grid", "threads", "smem", "store"]
FORWARD_PLAN_OWN = {
    "reference": [],
    "registers": ["items", "ranks"],
    "contiguous": ["team", "slice", "kept", "blocks"],
    "channels_last": ["team", "slice", "kept", "blocks"],
    "stream": ["pieces", "piece", "lag", "slots", "merge", "chunk", "blocks"],
}
FORWARD_PLAN_CASES = [  # (shape, groups, dtype, layout, kernel): one per kernel and layout
    ((2, 6, 5, 7), 3, torch.float32, "contiguous", "reference"),
    ((2, 96, 17, 23), 6, torch.bfloat16, "channels_last", "reference"),
    ((2, 8, 64, 64), 2, torch.float32, "contiguous", "registers"),
    ((3, 40, 37, 19), 4, torch.float32, "channels_last", "registers"),
    ((3, 60, 31), 5, torch.float16, "contiguous", "contiguous"),
    ((2, 64, 45, 45), 8, torch.float16, "channels_last", "channels_last"),
    ((3, 12, 61, 37), 3, torch.float32, "contiguous", "stream"),
    ((2, 64, 45, 45), 8, torch.float16, "channels_last", "stream"),
    ((2, 64, 128, 128), 2, torch.float32, "contiguous", "auto"),
]


def check_plan_values(plan):
    """Every field of a plan dict of the type its name promises."""
    for name, value in plan.items():
        if name in ("kernel", "layout", "merge", "store", "reason"):
            assert isinstance(value, str) and value, (name, plan)
        elif name == "warp_rows":
            assert isinstance(value, bool), (name, plan)
        else:
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, (name, plan)


@cuda
def test_gpu_plan_dicts_have_the_documented_fields():
    for shape, groups, dtype, layout, kernel in FORWARD_PLAN_CASES:
        x = make_input(shape, dtype, layout, "cuda")
        plan = gn.plan(x, groups, kernel=kernel)
        assert type(plan) is dict, plan
        if kernel != "auto":
            assert plan["kernel"] == kernel, plan
        assert plan["layout"] == layout, plan
        expected = FORWARD_PLAN_COMMON + FORWARD_PLAN_OWN[plan["kernel"]] + ["reason"]
        assert list(plan) == expected, (expected, plan)
        check_plan_values(plan)
        assert plan["vec"] >= 1 and plan["units"] >= 1 and plan["grid"] >= 1 and plan["threads"] >= 1, plan
        if plan["kernel"] == "stream":
            assert plan["merge"] in ("each", "once"), plan
        assert plan["store"] == "none", plan  # a plain call's kernel stores bare
        if plan["kernel"] in ("contiguous", "channels_last"):
            assert 1 <= plan["team"] and plan["kept"] <= plan["slice"] and plan["blocks"] >= 1, plan
    # the backward: passes, stream and registers, either layout
    common = ["kernel", "layout", "vec", "grid", "threads", "tiles", "chunks", "chunk"]
    for shape, groups, dtype, layout, kernel, own in [
            ((3, 40, 8, 8), 4, torch.bfloat16, "contiguous", "registers", ["smem"]),
            ((2, 2304, 5, 7), 48, torch.float32, "channels_last", "registers", ["smem"]),
            ((3, 40, 8, 8), 4, torch.bfloat16, "contiguous", "passes", ["warp_rows"]),
            ((2, 2304, 5, 7), 48, torch.float32, "channels_last", "passes", ["blocks", "block_cols"]),
            ((2, 8, 64, 64), 2, torch.float32, "contiguous", "stream", ["lag"]),
            ((2, 64, 33, 35), 8, torch.bfloat16, "channels_last", "stream", ["lag", "blocks", "block_cols"])]:
        x = make_input(shape, dtype, layout, "cuda")
        plan = gn.plan(x, groups, kernel=kernel, backward=True)
        assert type(plan) is dict, plan
        assert plan["kernel"] == kernel and plan["layout"] == layout, plan
        assert list(plan) == common + own + ["reason"], (common + own + ["reason"], plan)
        check_plan_values(plan)
    # empty input: no launch, the kernel "none" and why
    empty = torch.empty(0, 8, 4, 4, device="cuda")
    for backward in (False, True):
        plan = gn.plan(empty, 2, backward=backward)
        assert list(plan) == ["kernel", "reason"] and plan["kernel"] == "none", plan


@cuda
def test_gpu_plan_chooses_stream_above_l2_size():
    # contiguous inputs at least as large as L2 take the stream kernel; the
    # one chosen for KernelBench L1-35's groups (8 MiB each), checked on a
    # slice of that shape that is still larger than L2
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    x = make_input((8, 64, 512, 512), torch.float32, "contiguous", "cuda", shift=1000.0)
    assert x.numel() * 4 >= l2
    plan = gn.plan(x, 8)
    assert plan["kernel"] == "stream", plan
    # its lag: the rows' one-front lag on an L2 of 60 MiB or more, else the
    # shorter one (DESIGN, "The lag, contiguous")
    pieces, grid = plan["pieces"], plan["grid"]  # grid = R: 2 · pieces in all exceed it
    l2_pieces = l2 // 4 // (plan["piece"] * plan["vec"] * 4)
    lag = pieces + max(grid, l2_pieces) if l2 >= 60 << 20 else max(pieces, grid) + grid // 4
    assert plan["lag"] == lag and plan["merge"] == ("each" if 4 * (lag - pieces) < 3 * grid
                                                    else "once"), plan
    check_against_reference(x, 8, *affine(64, x.dtype, "cuda", "both"))
    check_saved_statistics(x, 8)
    small = torch.empty(2, 64, 128, 128, device="cuda")
    assert small.numel() * 4 < l2
    assert gn.plan(small, 8)["kernel"] == "contiguous", gn.plan(small, 8)
    # larger than L2 but groups of 5 KiB: the registers kernel reads them once
    tiny_groups = torch.empty(512, 1280, 8, 8, device="cuda", dtype=torch.bfloat16)
    assert tiny_groups.numel() * 2 >= l2
    assert gn.plan(tiny_groups, 32)["kernel"] == "registers", gn.plan(tiny_groups, 32)


def is_row_stream(plan):
    """The stream kernel over channels-last rows."""
    return plan["kernel"] == "stream" and plan["layout"] == "channels_last"


@cuda
def test_gpu_plan_chooses_row_stream_for_large_channels_last():
    # channels-last inputs of at least half of L2 stream over rows
    # (units of 0.5 MiB here: 8 blocks of 4 groups a sample); smaller ones,
    # narrower vectors than 16 bytes (G=256: 4-byte, G=512: single elements)
    # and a single unit keep the registers or team kernels; a single sample
    # streams when it makes several units of at most a quarter of L2
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    x = make_input((16, 512, 64, 64), torch.bfloat16, "channels_last", "cuda", shift=1000.0)
    assert x.numel() * 2 >= l2
    plan = gn.plan(x, 32)
    assert is_row_stream(plan), plan
    check_against_reference(x, 32, *affine(512, x.dtype, "cuda", "both"))
    check_saved_statistics(x, 32)
    assert 2 * x[:8].numel() * 2 >= l2, l2
    assert is_row_stream(gn.plan(x[:8], 32)), gn.plan(x[:8], 32)
    assert 2 * x[:4].numel() * 2 < l2, l2
    assert gn.plan(x[:4], 32)["kernel"] != "stream", gn.plan(x[:4], 32)
    assert gn.plan(x, 256)["kernel"] == "channels_last", gn.plan(x, 256)
    assert gn.plan(x, 512)["kernel"] == "channels_last", gn.plan(x, 512)
    one_sample = torch.empty(1, 512, 256, 256, device="cuda", dtype=torch.bfloat16)
    one_sample = one_sample.contiguous(memory_format=torch.channels_last)
    assert one_sample.numel() * 2 >= l2
    # one sample cut into blocks of groups: units small enough to stream
    plan = gn.plan(one_sample, 32)
    assert is_row_stream(plan) and plan["blocks"] == 8, plan
    single_unit = torch.empty(1, 64, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    single_unit = single_unit.contiguous(memory_format=torch.channels_last)  # rows of 128 B
    assert gn.plan(single_unit, 4)["kernel"] == "channels_last", gn.plan(single_unit, 4)


@cuda
def test_gpu_plan_cuts_small_channels_last_samples_into_blocks():
    # Few samples, groups too large for the registers kernel: the team
    # kernel's units are blocks of whole groups, so that more teams share
    # the grid.
    x = make_input((2, 320, 128, 128), torch.float16, "channels_last", "cuda", shift=1000.0)
    plan = gn.plan(x, 32)
    assert plan["kernel"] == "channels_last" and plan["blocks"] > 1, plan
    w, b = affine(320, torch.float16, "cuda", "both")
    check_against_reference(x, 32, w, b)
    check_saved_statistics(x, 32)
    # A block's row stays at least 128 bytes: 64 bfloat16 channels are not cut.
    one = make_input((1, 64, 128, 128), torch.bfloat16, "channels_last", "cuda")
    plan = gn.plan(one, 8, kernel="channels_last")
    assert plan["blocks"] == 1, plan
    # Enough samples to fill the grid: not cut either.
    many = make_input((300, 1280, 2, 2), torch.float16, "channels_last", "cuda")
    plan = gn.plan(many, 32, kernel="channels_last")
    assert plan["blocks"] == 1, plan


@cuda
def test_gpu_plan_takes_registers_kernel_for_small_groups():
    # Groups of at most 8192 vectors (128 KiB): one CTA per group, contiguous;
    # channels-last groups under 64 KiB where the team kernel is not faster
    # (few units, or rows of 64 bytes and more).
    for shape, groups, dtype, layout in [((8, 1280, 8, 8), 32, torch.bfloat16, "channels_last"),
                                         ((8, 1280, 8, 8), 32, torch.bfloat16, "contiguous"),
                                         ((4, 32, 8, 8), 8, torch.float32, "contiguous"),
                                         ((4, 512, 64, 64), 32, torch.float16, "contiguous"),
                                         ((2, 640, 32, 32), 32, torch.float16, "channels_last"),
                                         ((32, 1280, 16, 16), 32, torch.float16, "channels_last")]:
        x = make_input(shape, dtype, layout, "cuda", shift=1000.0)
        plan = gn.plan(x, groups)
        assert plan["kernel"] == "registers", plan
        assert plan["layout"] == layout, plan
        check_against_reference(x, groups, *affine(shape[1], dtype, "cuda", "both"))
        check_saved_statistics(x, groups)
    # Groups of 2 MiB (more than a cluster holds) of an input under half of
    # L2: a team kernel.
    x = make_input((1, 64, 128, 128), torch.float32, "channels_last", "cuda")
    assert gn.plan(x, 2)["kernel"] == "channels_last", gn.plan(x, 2)
    # 64 KiB groups of an input at least as large as L2: these take a whole
    # SM each (16 vectors a thread), so the stream kernel keeps them.
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    many = torch.empty(32, 256, 64, 64, device="cuda", dtype=torch.float16)
    forced = gn.plan(many, 32, kernel="registers")
    assert many.numel() * 2 >= l2 and forced["items"] == 16, forced
    assert gn.plan(many, 32)["kernel"] != "registers", gn.plan(many, 32)
    # Small groups of a channels-last input at least as large as L2: not
    # this kernel (each CTA would read partial rows).
    big = make_input((512, 1280, 8, 8), torch.bfloat16, "channels_last", "cuda")
    assert big.numel() * 2 >= l2
    assert gn.plan(big, 32)["kernel"] != "registers", gn.plan(big, 32)
    # Channels-last input between half of L2 and L2: the stream kernel where
    # its units have many pieces (16 here), the registers kernel where they
    # have fewer than 8 (2 here: 256 rows a sample, pieces of 200).
    mid = make_input((16, 256, 64, 64), torch.bfloat16, "channels_last", "cuda", shift=4.0)
    assert l2 <= 2 * mid.numel() * 2 < 2 * l2
    assert is_row_stream(gn.plan(mid, 32)), gn.plan(mid, 32)
    check_against_reference(mid, 32, *affine(256, mid.dtype, "cuda", "both"))
    deep = make_input((64, 1280, 16, 16), torch.float16, "channels_last", "cuda")
    assert l2 <= 2 * deep.numel() * 2 < 2 * l2
    assert gn.plan(deep, 32)["kernel"] == "registers", gn.plan(deep, 32)
    # Forced on a group larger than a cluster holds: a clear error.
    big = torch.randn(1, 16, 128, 256, device="cuda")
    with pytest.raises(RuntimeError, match="registers kernel holds at most 8192 vectors per group "
                                           "in one CTA, or 65536 in a cluster"):
        gn.groupnorm_cuda(big, None, None, 1, kernel="registers")


@cuda
def test_gpu_plan_takes_team_kernel_for_narrow_channels_last_rows():
    # Channels-last groups whose rows hold under 16 bytes (timm resnet50_gn's
    # 64 channels in 32 groups: 4 bytes) take the team kernel, which reads
    # whole lines, plain or fused, on at least two units an SM and 2 MiB of
    # input; forced, the registers kernel serves them. Smaller launches keep
    # the registers kernel.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, groups in [((32, 64, 56, 56), 32), ((32, 128, 28, 28), 32), ((32, 64, 8, 8, 8), 32)]:
        assert shape[0] * groups >= 2 * sms and math.prod(shape) * 2 >= 2 << 20
        x = make_input(shape, torch.bfloat16, "channels_last", "cuda", shift=1000.0)
        plan = gn.plan(x, groups)
        assert plan["kernel"] == "channels_last" and "narrower than 16 bytes" in plan["reason"], plan
        assert gn.plan(x, groups, activation="relu")["kernel"] == "channels_last"
        assert gn.plan(x, groups, kernel="registers")["kernel"] == "registers"
        w, b = affine(shape[1], x.dtype, "cuda", "both")
        check_against_reference(x, groups, w, b)
        check_epilogue(x, groups, w, b, dict(add=torch.randn(shape[:2], device="cuda").bfloat16(),
                                             activation="relu"))
    few = make_input((2, 64, 64, 64), torch.float16, "channels_last", "cuda")  # 64 units
    assert gn.plan(few, 32)["kernel"] == "registers", gn.plan(few, 32)
    small = make_input((16, 64, 8, 8, 8), torch.bfloat16, "channels_last", "cuda")  # 1 MiB
    assert gn.plan(small, 32)["kernel"] == "registers", gn.plan(small, 32)
    wide = make_input((32, 256, 14, 14), torch.bfloat16, "channels_last", "cuda")  # 16-byte rows
    assert gn.plan(wide, 32)["kernel"] == "registers", gn.plan(wide, 32)


@cuda
def test_gpu_plan_takes_team_kernel_for_many_or_large_channels_last_groups():
    # Channels-last groups the registers kernel holds but the team kernel
    # serves faster take it, plain or fused; forced, the registers kernel
    # serves them: groups of at least 12 KiB in rows under 64 bytes on six
    # units an SM (timm resnet50_gn's 512 channels at 28x28); groups of 16
    # vectors a thread (one CTA an SM) on more units than SMs; groups of at
    # least 64 KiB (the SD VAE's 512 channels at 64x64, MONAI's 3-D blocks).
    # Groups only a cluster could hold (the SD UNet's 2x320x64x64, 4-byte
    # vectors) take the team kernel as well. Fewer such groups, or wider
    # rows, keep the registers kernel.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, groups, dtype, why in [((32, 512, 28, 28), 32, torch.bfloat16, "12 KiB"),
                                      ((16, 1024, 28, 28), 32, torch.bfloat16, "one wave"),
                                      ((1, 512, 64, 64), 32, torch.bfloat16, "64 KiB"),
                                      ((1, 128, 16, 16, 16), 8, torch.bfloat16, "64 KiB"),
                                      ((2, 320, 64, 64), 32, torch.float16, "")]:
        x = make_input(shape, dtype, "channels_last", "cuda", shift=1000.0)
        plan = gn.plan(x, groups)
        assert plan["kernel"] == "channels_last" and why in plan["reason"], plan
        assert gn.plan(x, groups, activation="silu")["kernel"] == "channels_last"
        if why:  # one CTA a group (the last row needs a cluster)
            assert gn.plan(x, groups, kernel="registers")["kernel"] == "registers"
        w, b = affine(shape[1], dtype, "cuda", "both")
        check_against_reference(x, groups, w, b)
        check_saved_statistics(x, groups)
        check_epilogue(x, groups, w, b, dict(activation="silu"))
    assert 32 * 32 >= 6 * sms > 16 * 32 and 16 * 32 > sms
    for shape, dtype in [((16, 512, 28, 28), torch.bfloat16),  # 3.9 units an SM
                         ((32, 1024, 14, 14), torch.bfloat16),  # rows of 64 bytes
                         ((2, 640, 32, 32), torch.float16)]:  # 40 KiB groups on 64 units
        x = make_input(shape, dtype, "channels_last", "cuda")
        assert gn.plan(x, 32)["kernel"] == "registers", gn.plan(x, 32)
    assert gn.plan(x, 32, activation="silu")["kernel"] == "channels_last"  # 5120 vectors


@cuda
def test_gpu_fused_plan_takes_registers_kernel_for_small_groups():
    # A call with an epilogue takes the registers kernel for groups of at
    # most 4096 vectors a CTA, with threads for one vector each where the
    # units are few (at most two an SM) and the plain call's threads
    # otherwise: in one CTA, or on contiguous input in clusters (below);
    # other groups take the team kernels, and so does any activation chain
    # but SiLU or ReLU alone (no call there).
    deep = make_input((2, 1280, 16, 16), torch.float16, "contiguous", "cuda", shift=1000.0)
    plain = gn.plan(deep, 32)
    for options in (dict(activation="silu"), dict(activation=("relu",)), dict(fused=True)):
        fused = gn.plan(deep, 32, **options)
        assert fused["kernel"] == "registers" and fused["threads"] == 512 > plain["threads"], \
            (options, fused, plain)
    w, b = affine(1280, deep.dtype, "cuda", "both")
    check_epilogue(deep, 32, w, b, epilogue_tensors(deep, INLINE_ALL))
    check_epilogue(deep, 32, w, b, dict(add=torch.randn(2, 1280, device="cuda").half(),
                                        activation="silu"))
    assert gn.plan(deep, 32, activation="gelu")["kernel"] == "contiguous"
    assert gn.plan(deep, 32, activation=("silu", "relu"))["kernel"] == "contiguous"
    with pytest.raises(ValueError, match="takes no activation but SiLU or ReLU alone"):
        gn.plan(deep, 32, kernel="registers", activation="gelu")
    many = torch.empty(512, 1280, 8, 8, device="cuda", dtype=torch.bfloat16)  # 16384 units
    fused, plain = gn.plan(many, 32, activation="silu"), gn.plan(many, 32)
    assert fused.pop("store") == "silu" and plain.pop("store") == "none" and fused == plain
    # 5120 vectors a group (SD UNet): on contiguous input the fused call's
    # clusters, of as many CTAs (at most 3, of at most 3072 vectors each) as
    # the SMs hold for every unit at once, or the team kernel where 2 do not
    # fit; the channels-last twin's team kernel; 11520 vectors a group
    # (768-pixel images) would take more than 3 CTAs: the team kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w, b = affine(320, torch.float16, "cuda", "both")
    for n in (1, 2, 4):
        unet = make_input((n, 320, 64, 64), torch.float16, "contiguous", "cuda")
        ranks = min(3, sms // (32 * n))
        expected = dict(kernel="registers", ranks=ranks, threads=512) if ranks >= 2 else \
            dict(kernel="contiguous")
        plan = gn.plan(unet, 32, activation="silu")
        assert plan_has(plan, expected), (n, expected, plan)
        check_epilogue(unet, 32, w, b, epilogue_tensors(unet, INLINE_ALL))
        check_epilogue(unet, 32, w, b, dict(add=torch.randn(n, 320, device="cuda").half(),
                                            activation="relu"))
    unet = unet.to(memory_format=torch.channels_last)
    assert gn.plan(unet, 32, activation="silu")["kernel"] == "channels_last", gn.plan(unet, 32, fused=True)
    large = torch.empty(1, 320, 96, 96, device="cuda", dtype=torch.float16)
    assert gn.plan(large, 32, activation="silu")["kernel"] == "contiguous", gn.plan(large, 32, fused=True)


@cuda
def test_gpu_plan_chooses_multi_cta_teams_for_large_groups():
    x = torch.randn(2, 64, 256, 256, device="cuda")
    plan = gn.plan(x, 2)
    assert plan["kernel"] == "contiguous" and kept_fraction(plan) == 1 and plan["team"] != 1, plan


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gpu_teams_over_several_rounds(dtype):
    # 128 groups of 512 KiB (float32): each team handles several groups in
    # turn, reusing its workspace by round parity. Fresh weights each call.
    # (float32 is 64 MiB, at least L2's size: forced, or it would stream)
    x = make_input((16, 64, 128, 128), dtype, "contiguous", "cuda", shift=5.0)
    plan = gn.plan(x, 8, kernel="contiguous")
    assert plan["kernel"] == "contiguous" and plan["team"] != 1 and " 1 round" not in plan["reason"], plan
    for _ in range(2):
        check_against_reference(x, 8, *affine(64, dtype, "cuda", "both"), kernel="contiguous")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("shift", [0.0, 1000.0])
def test_gpu_sample_larger_than_on_chip_memory(dtype, shift):
    # One 32 MiB (bfloat16) or 64 MiB (float32) channels-last unit, more than
    # the shared memory of every CTA together: the rows a CTA does not keep
    # get their statistics from a running update and are read once more, to
    # normalise; far from zero (1000 + randn) too.
    x = make_input((1, 64, 512, 512), dtype, "channels_last", "cuda", shift=shift)
    plan = gn.plan(x, 32, kernel="channels_last")
    assert plan["kernel"] == "channels_last" and kept_fraction(plan) < 1, plan
    check_against_reference(x, 32, *affine(64, dtype, "cuda", "both"), kernel="channels_last")


@cuda
def test_gpu_team_result_is_deterministic():
    x = make_input((2, 64, 128, 128), torch.float32, "contiguous", "cuda")
    for force in (dict(kernel="contiguous", team=9), dict(kernel="stream", lag=1)):
        first = gn.groupnorm_cuda(x, None, None, 4, **force)
        for _ in range(5):
            assert torch.equal(gn.groupnorm_cuda(x, None, None, 4, **force), first), force


@cuda
def test_gpu_non_contiguous_and_misaligned_inputs():
    base = torch.randn(3, 40, 20, 21, device="cuda")
    sliced = base[:, ::2, 1:, :]                      # neither layout: copied
    check_against_reference(sliced, 5, None, None)
    flat = torch.randn(1 + 2 * 32 * 16 * 16, device="cuda", dtype=torch.float16)
    offset = flat[1:].view(2, 32, 16, 16)             # 2-byte offset breaks 16-byte alignment
    assert offset.data_ptr() % 16 != 0
    assert gn.plan(offset, 8)["vec"] == 1, gn.plan(offset, 8)
    check_against_reference(offset, 8, *affine(32, torch.float16, "cuda", "both"))
    transposed = torch.randn(2, 50, 24, device="cuda").transpose(1, 2)  # (N, C, L), C innermost
    assert gn.plan(transposed, 6)["layout"] == "channels_last", gn.plan(transposed, 6)
    check_against_reference(transposed, 6, *affine(24, torch.float32, "cuda", "both"))


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_nan_and_inf_propagate_like_torch(layout):
    x = make_input((2, 16, 6, 6), torch.float32, layout, "cuda")
    x[0, 1, 2, 3] = float("nan")
    x[1, 9, 0, 0] = float("inf")
    y = gn.groupnorm_cuda(x, None, None, 4)
    expected = tools.torch_group_norm(x, 4, None, None, 1e-5)
    assert torch.equal(y.isnan(), expected.isnan())
    finite = ~expected.isnan()
    torch.testing.assert_close(y[finite], expected[finite], rtol=1e-5, atol=1e-5)


@cuda
def test_gpu_forced_kernel_errors_name_the_problem():
    wide = make_input((2, 4096, 2, 2), torch.float32, "channels_last", "cuda")
    small = make_input((2, 8, 16, 16), torch.float32, "contiguous", "cuda")
    big_group = make_input((1, 8, 512, 512), torch.float32, "contiguous", "cuda")
    cases = [
        (lambda: gn.plan(wide, 1, kernel="channels_last"), RuntimeError,
         "the channels_last kernel needs C / 4 <= 512, got C = 4096"),
        (lambda: gn.plan(wide, 1, kernel="stream"), ValueError,
         "the stream kernel for channels-last input needs C / 4 <= 256, got C = 4096"),
        (lambda: gn.plan(small, 2, kernel="channels_last"), ValueError, "does not match the input's layout"),
        # team= is for the team and registers kernels alone, lag= for the stream kernels alone
        (lambda: gn.plan(small, 2, kernel="reference", team=2), ValueError,
         "team= sets the CTAs per unit of the team kernels (kernel='contiguous' or "
         "'channels_last') or the cluster of the registers kernel, not of kernel 'reference'"),
        (lambda: gn.plan(small, 2, kernel="registers", team=9), ValueError,
         "the registers kernel takes at most 8 CTAs a group (team=), got 9"),
        (lambda: gn.plan(small, 2, kernel="stream", team=2), ValueError,
         "team= sets the CTAs per unit of the team kernels (kernel='contiguous' or "
         "'channels_last') or the cluster of the registers kernel, not of kernel 'stream'"),
        (lambda: gn.plan(small, 2, team=2), ValueError,
         "team= sets the CTAs per unit of the team kernels (kernel='contiguous' or "
         "'channels_last') or the cluster of the registers kernel, not of kernel 'auto'"),
        (lambda: gn.plan(small, 2, kernel="contiguous", lag=4), ValueError,
         "lag= sets the stream kernels' lag (kernel='stream'), not that of kernel 'contiguous'"),
        (lambda: gn.plan(small, 2, lag=4), ValueError,
         "lag= sets the stream kernels' lag (kernel='stream'), not that of kernel 'auto'"),
        (lambda: gn.plan(small, 2, kernel="contiguous", team=-1), ValueError,
         "team and lag must be >= 0, got team=-1, lag=0"),
        (lambda: gn.plan(small, 2, kernel="stream", lag=-1), ValueError,
         "team and lag must be >= 0, got team=0, lag=-1"),
        (lambda: gn.groupnorm_cuda(small, None, None, 2, kernel="stream", team=2), ValueError,
         "team= sets the CTAs per unit of the team kernels"),
        (lambda: gn.groupnorm_cuda(small, None, None, 2, kernel="contiguous", lag=4), ValueError,
         "lag= sets the stream kernels' lag"),
        (lambda: gn.plan(big_group, 1, kernel="contiguous", team=100000), RuntimeError,
         "a team of 100000 CTAs cannot be co-resident"),
    ]
    raise_each(cases)


@cuda
def test_gpu_automatic_fallbacks_are_correct():
    # channels-last rows too wide for one thread per column, in groups too
    # large for the registers kernel: the reference kernel
    wide = make_input((1, 1025, 80, 80), torch.float32, "channels_last", "cuda", shift=3.0)
    plan = gn.plan(wide, 1)
    assert plan["kernel"] == "reference" and "C too wide" in plan["reason"], plan
    check_against_reference(wide, 1, *affine(1025, torch.float32, "cuda", "both"))
    # a contiguous group larger than every CTA's shared memory together, in an
    # input under L2's size: the contiguous team kernel, re-reading part of it
    big = make_input((1, 8, 1024, 1024), torch.float32, "contiguous", "cuda", shift=1000.0)
    plan = gn.plan(big, 1)
    assert (plan["kernel"] == "contiguous" and "partly re-read" in plan["reason"] and
            kept_fraction(plan) < 1), plan
    check_against_reference(big, 1, *affine(8, torch.float32, "cuda", "both"))


@cuda
@pytest.mark.parametrize("shape", [(0, 8, 4, 4), (2, 8, 0)], ids=["no-samples", "no-positions"])
def test_gpu_backward_of_empty_input(shape):
    x = torch.randn(shape, device="cuda").requires_grad_()
    w = torch.randn(8, device="cuda", requires_grad=True)
    b = torch.randn(8, device="cuda", requires_grad=True)
    dy = torch.randn(shape, device="cuda")
    dx, dw, db = torch.autograd.grad(gn.groupnorm_cuda(x, w, b, 2), (x, w, b), dy)
    assert dx.shape == x.shape
    assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gpu_backward_without_dx_and_of_non_dense_input(dtype):
    # channels-last input that wants no gradient: the backward's launches
    # without their dx pass, dweight and dbias against float64
    x = make_input((2, 32, 7, 9), dtype, "channels_last", "cuda")
    w, b = affine(32, dtype, "cuda", "both")
    dy = make_input((2, 32, 7, 9), dtype, "channels_last", "cuda")
    dx, dw, db = check_backward(x, 4, w, b, dy, need_dx=False)
    assert dx is None and dw is not None and db is not None
    # a non-dense input (every other position) is copied, then differentiated
    sliced = make_input((2, 32, 7, 18), dtype, "contiguous", "cuda")[..., ::2]
    assert not sliced.is_contiguous() and not channels_last_like(sliced)
    check_backward(sliced, 4, w, b, make_input((2, 32, 7, 9), dtype, "contiguous", "cuda"))


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_second_device():
    # the current device stays cuda:0: the kernels must follow the tensors
    assert torch.cuda.current_device() == 0
    for layout in LAYOUTS:
        x = make_input((2, 64, 33, 35), torch.float32, layout, "cuda:1")
        w, b = affine(64, torch.float32, "cuda:1", "both")
        y = check_against_reference(x, 4, w, b)
        assert y.device == x.device
        check_backward(x, 4, w, b, torch.randn_like(x))


@cuda
def test_gpu_runs_on_current_stream_and_in_cuda_graph():
    x = make_input((2, 64, 128, 128), torch.float32, "contiguous", "cuda")
    w, b = affine(64, torch.float32, "cuda", "both")
    expected = tools.reference_group_norm(x, 2, w, b, 1e-5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = gn.groupnorm_cuda(x, w, b, 2)
    torch.cuda.current_stream().wait_stream(stream)
    assert tools.max_error(y, expected) < 1e-4
    # capture with a multi-CTA team (cooperative launch + workspace memset) and replay
    plan = gn.plan(x, 2)
    assert plan["kernel"] == "contiguous" and plan["team"] > 1, plan
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        gn.groupnorm_cuda(x, w, b, 2)  # warm-up on the capture stream
        torch.cuda.current_stream().synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = gn.groupnorm_cuda(x, w, b, 2)
    for _ in range(3):
        x.copy_(make_input(x.shape, x.dtype, "contiguous", "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert tools.max_error(captured, tools.reference_group_norm(x, 2, w, b, 1e-5)) < 1e-4


# (shape, groups, layout, forced path): one case per forward launch site (the
# team kernels' cooperative launch after a workspace memset, each stream
# kernel after a counter memset, the registers and reference kernels).
DELAYED_STREAM_CASES = [
    ((2, 64, 128, 128), 2, "contiguous", {}),  # a contiguous team; the backward too
    ((3, 12, 61, 37), 3, "contiguous", dict(kernel="stream")),
    ((1, 128, 100, 100), 64, "channels_last", dict(kernel="stream")),
    ((3, 40, 77, 19), 4, "channels_last", dict(kernel="channels_last", team=11)),
    ((2, 8, 64, 64), 2, "contiguous", dict(kernel="registers")),
    ((2, 6, 5, 7), 3, "contiguous", dict(kernel="reference")),
]


@cuda
@pytest.mark.parametrize("shape, groups, layout, force", DELAYED_STREAM_CASES,
                         ids=[f"{c[2]}-{c[3].get('kernel', 'auto')}" for c in DELAYED_STREAM_CASES])
def test_gpu_waits_for_work_queued_on_a_delayed_stream(shape, groups, layout, force):
    # The side stream sleeps (50M cycles, about 25 ms), then rewrites x with
    # fresh data, then runs GroupNorm: plainly, and replayed from a CUDA graph
    # captured on it. A kernel launched on another stream than the current
    # one runs before the rewrite and normalises stale data; a launch or
    # memset that the capture missed runs at capture time only, so replays
    # leave a stale output (or stale counters); a host synchronisation shows
    # up as a side stream already idle.
    x = make_input(shape, torch.float32, layout, "cuda")
    w, b = affine(shape[1], torch.float32, "cuda", "both")
    plan = gn.plan(x, groups, **force)
    assert plan["kernel"] == force.get("kernel", "contiguous"), plan
    assert force or plan["team"] != 1, plan  # automatic: a team of several CTAs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # x, w and b are written

    def sleep_then_rewrite_x():  # under torch.cuda.stream(side)
        torch.cuda._sleep(50_000_000)
        x.normal_()

    def check(y):
        torch.cuda.synchronize()
        ref = tools.reference_group_norm(x, groups, w, b, 1e-5)
        tol = tolerance(x, ref, x.dtype, None, w)
        assert tools.max_error(y, ref) <= tol, describe_mismatch(y, ref, tol)

    with torch.cuda.stream(side):
        gn.groupnorm_cuda(x, w, b, groups, **force)  # warm-up: plan and kernel attributes cached
        torch.cuda.synchronize()
        sleep_then_rewrite_x()
        y = gn.groupnorm_cuda(x, w, b, groups, **force)
        assert not side.query(), "the side stream finished before the check could mean anything"
    check(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = gn.groupnorm_cuda(x, w, b, groups, **force)
    for _ in range(2):
        with torch.cuda.stream(side):
            sleep_then_rewrite_x()
            graph.replay()
            assert not side.query(), "the side stream finished before the check could mean anything"
        check(captured)
    if not force:  # the backward through autograd, on the side stream after the rewrite
        with torch.cuda.stream(side):
            sleep_then_rewrite_x()
            check_backward(x, groups, w, b, torch.randn_like(x))


# ---------------------------------------------------------------------------
# training: backward kernels, autograd, torch.library, compile, export
# ---------------------------------------------------------------------------

BACKWARD_SHAPES = [((2, 6, 5, 7), 3), ((3, 60, 31), 5), ((2, 96, 17, 23), 6), ((2, 320, 16, 16), 32),
                   ((2, 64, 9, 9), 1), ((2, 64, 1, 1), 64), ((3, 16), 4), ((2, 24, 3, 5, 7), 4),
                   ((2, 512, 4, 4), 1)]


def gradients(fn, x, w, b, dy):
    """(dx, dw, db) of sum(fn(x, w, b) * dy), for whichever inputs require grad."""
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(fn(x, w, b), leaves, dy))
    return [next(grads) if t is not None and t.requires_grad else None for t in (x, w, b)]


def weight_for_torch(x, w, b):
    """(weight, bias) for torch's F.group_norm when it is the comparison:
    torch 2.11's backward raises "tensor does not have a device" for a bias
    without a weight, so that case gets a weight of ones (the same function,
    with no gradient asked of it)."""
    if w is None and b is not None:
        return torch.ones(x.shape[1], device=x.device, dtype=x.dtype), b
    return w, b


def forced_gradients(x, groups, w, b, dy, kernel, lag, affine=True, eps=1e-5):
    """(dx, dw, db) from the extension's backward with its kernel forced, dx
    landing in a poisoned block (unwritten elements show up as NaN); with
    affine=False dweight and dbias are not asked for (None)."""
    ext = gn.load()
    x, w, b = (t.detach() if t is not None else None for t in (x, w, b))
    _, mean, rstd = ext.forward(x, w, b, groups, eps, "auto", 0, 0)
    grads = []

    def run():
        grads[:] = ext.backward(dy, x, mean, rstd, w, groups, True, affine, kernel, lag)
        return grads[0]

    # blocks for what the backward allocates before dx: copies of a strided x
    # and dy, and (for tiny x, of dx's allocation size) workspaces
    _, landed = poisoned(run, x, blocks=6)
    assert landed, "dx did not reuse the poisoned block"
    dx, dw, db = grads
    if not affine:
        assert dw.numel() == 0 and db.numel() == 0
        return [dx, None, None]
    return [dx, dw if w is not None else None, db if b is not None else None]


def gradient_tolerance(dtype, torch_err, largest):
    """The bound on a gradient's error against float64. 16-bit: torch's own
    error, or one output step at the largest gradient; float32/64: four
    times torch's error plus four ulps of the largest gradient
    (test_tolerances_catch_wrong_kernels)."""
    eps = torch.finfo(dtype).eps
    if dtype in (torch.float16, torch.bfloat16):
        return 1.1 * torch_err + eps * largest
    return 4 * torch_err + 4 * eps * largest + 1e-12


def check_backward(x, groups, w, b, dy, kernel="auto", lag=0, affine=True,
                   need_dx=True, eps=1e-5):
    """Gradients through autograd (kernel "auto") or from the forced backward
    kernel, against a float64 reference, within torch's own error; with
    affine=False (forced kernels only) dx alone is asked for and checked,
    with need_dx=False (autograd only) dweight and dbias alone."""
    assert need_dx or kernel == "auto", "forced kernels always compute dx"
    x = x.detach().requires_grad_(need_dx)
    w = w.detach().requires_grad_() if w is not None else None
    b = b.detach().requires_grad_() if b is not None else None
    if kernel == "auto":
        ours = gradients(lambda *t: gn.groupnorm_cuda(t[0], t[1], t[2], groups, eps), x, w, b, dy)
    else:
        ours = forced_gradients(x, groups, w, b, dy, kernel, lag, affine, eps)
    x64 = x.detach().double().requires_grad_(need_dx)
    w64 = w.detach().double().requires_grad_() if w is not None else None
    b64 = b.detach().double().requires_grad_() if b is not None else None
    ref = gradients(lambda *t: tools.reference_group_norm(t[0], groups, t[1], t[2], eps),
                    x64, w64, b64, dy.double())
    theirs = gradients(lambda *t: F.group_norm(t[0], groups, *weight_for_torch(t[0], t[1], t[2]), eps),
                       x.detach().requires_grad_(need_dx), *(t.detach().requires_grad_() if t is not None else None
                                                      for t in (w, b)), dy)
    N = x.shape[0]
    var = x.detach().double().reshape(N, groups, -1).var(dim=-1, unbiased=False)
    rstd_max = (var + eps).rsqrt().max().item()
    for name, mine, r, t in zip(("dx", "dweight", "dbias"), ours, ref, theirs):
        if r is None or (mine is None and not affine):
            continue
        assert mine.shape == r.shape and mine.dtype == x.dtype, name
        scale = r.abs().max().item() + 1e-30
        err = tools.max_error(mine, r)
        torch_err = tools.max_error(t, r)
        eps = torch.finfo(x.dtype).eps
        # dx = rstd * (g - mean(g) - ...) cancels terms of size rstd * |g| in the
        # accumulation type (float32 for half types): a group of one value
        # (rstd = 1/sqrt(eps)) leaves rounding noise of that size where dx is 0
        acc_eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
        cancel = 8 * acc_eps * rstd_max * dy.abs().max().item() * (w.abs().max().item() if w is not None
                                                                    else 1.0)
        tol = gradient_tolerance(x.dtype, torch_err, scale) + (cancel if name == "dx" else 0)
        assert not mine.isnan().any(), name
        assert err <= tol, f"{name}: error {err:.3e} > {tol:.3e} (torch {torch_err:.3e}, scale {scale:.3e})"
    return ours


@cuda
@pytest.mark.parametrize("case", BACKWARD_SHAPES, ids=[shape_id(c) for c in BACKWARD_SHAPES])
@pytest.mark.parametrize("layout", LAYOUTS)
@EVERY_DTYPE
def test_gpu_backward_matches_float64_reference(case, layout, dtype):
    shape, groups = case
    x = make_input(shape, dtype, layout, "cuda")
    w, b = affine(shape[1], dtype, "cuda", "both")
    # a fresh dy for every call: gradients a kernel fails to write cannot be
    # an earlier call's right answer left in a reused block
    dy = lambda: make_input(shape, dtype, layout, "cuda")  # noqa: E731
    check_backward(x, groups, w, b, dy())
    check_backward(x, groups, None, None, dy())
    check_backward(x, groups, None, b, dy())  # bias without weight: autograd edges shift
    # grad_output in another layout than the input (a transposed view)
    dy_t = make_input(shape, dtype, "channels_last" if layout == "contiguous" else "contiguous", "cuda")
    check_backward(x, groups, w, b, dy_t)


def plan_has(plan, expected):
    """Whether the plan dict holds each of the expected fields and values."""
    return all(name in plan and plan[name] == value for name, value in expected.items())


# One case per tiling of the backward's passes (the plan's fields name it, so
# a case that stops taking its path fails instead of passing on another one).
BACKWARD_TILINGS = [
    ((1, 8, 256, 256), 2, torch.float32, "contiguous", dict(vec=4, chunks=8)),  # rows cut into chunks
    ((3, 40, 8, 8), 4, torch.bfloat16, "contiguous", dict(warp_rows=True)),  # a warp per row
    ((2, 64, 33, 35), 4, torch.float32, "contiguous", dict(vec=1, chunks=1)),  # odd rows, one CTA each
    ((1, 32, 256, 128), 4, torch.bfloat16, "channels_last", dict(chunks=64)),  # lanes split chunks
    ((2, 2304, 5, 7), 48, torch.float32, "channels_last", dict(blocks=3)),  # column blocks
    ((2, 515, 6, 6), 5, torch.float16, "channels_last", dict(vec=1)),  # odd C: scalar access
]


@cuda
@pytest.mark.parametrize("case", BACKWARD_TILINGS, ids=[f"{c[3]}-{shape_id(c[:2])}"
                                                       for c in BACKWARD_TILINGS])
def test_gpu_backward_tilings(case):
    shape, groups, dtype, layout, expected = case
    x = make_input(shape, dtype, layout, "cuda")
    plan = gn.plan(x, groups, backward=True, kernel="passes")  # some take the registers unforced
    assert plan["kernel"] == "passes" and plan["layout"] == layout and plan_has(plan, expected), \
        (expected, plan)
    w, b = affine(shape[1], dtype, "cuda", "both")
    check_backward(x, groups, w, b, make_input(shape, dtype, layout, "cuda"), kernel="passes")


# The stream backward forced on awkward sizes: one tile per row, rows cut into
# ragged tiles, scalar and 2-element vectors, G = 1 and G = C, 1-D and 3-D,
# more tiles than resident CTAs.
BACKWARD_STREAM_CASES = [
    ((2, 8, 64, 64), 2, torch.float32),
    ((3, 12, 50, 70), 3, torch.float32),
    ((2, 6, 129, 65), 3, torch.float32),  # odd HxW: scalar loads, 5 ragged tiles a row
    ((2, 64, 48, 48), 1, torch.bfloat16),
    ((2, 32, 40, 40), 32, torch.float16),
    ((1, 4, 300, 300), 2, torch.float64),
    ((2, 16, 1000), 4, torch.float32),
    ((2, 8, 4, 30, 30), 4, torch.bfloat16),
    ((8, 64, 128, 128), 8, torch.float32),  # 1024 tiles, more than the resident CTAs
]


@cuda
@pytest.mark.parametrize("case", BACKWARD_STREAM_CASES,
                         ids=[f"{shape_id(c[:2])}-{str(c[2])[6:]}" for c in BACKWARD_STREAM_CASES])
def test_gpu_backward_stream_kernel(case):
    shape, groups, dtype = case
    check_stream_backward(shape, groups, dtype, "contiguous", {})


def check_stream_backward(shape, groups, dtype, layout, expected):
    """The stream backward forced on fresh input, with and without weight and
    bias, with dx alone asked for, at the default lag, the smallest (one unit: every dx item waits on
    the sums just before) and one past the end (every sums item before any dx
    item). `expected`: fields the plan must hold, so that a case that stops
    testing what it says fails."""
    x = make_input(shape, dtype, layout, "cuda")
    plan = gn.plan(x, groups, kernel="stream", backward=True)
    assert plan["kernel"] == "stream" and plan["layout"] == layout and plan_has(plan, expected), \
        (expected, plan)
    w, b = affine(shape[1], dtype, "cuda", "both")
    dy = lambda: make_input(shape, dtype, layout, "cuda")  # noqa: E731  (fresh each call)
    check_backward(x, groups, w, b, dy(), kernel="stream")
    check_backward(x, groups, None, None, dy(), kernel="stream")
    check_backward(x, groups, w, b, dy(), kernel="stream", affine=False)  # dx alone
    for lag in (1, 1 << 40):
        check_backward(x, groups, w, b, dy(), kernel="stream", lag=lag)


# The channels-last stream backward forced: ragged last tiles, blocks of
# groups (3 and 8 a sample), scalar and 2-element vectors, a unit row of
# exactly kBackwardThreads vectors (one row a step), G = 1 and G = C, 1-D and
# 3-D, more tiles than resident CTAs. The plan's fields name vec and blocks,
# so a case that stops testing what it says fails.
BACKWARD_STREAM_CL_CASES = [
    ((2, 64, 33, 35), 8, torch.bfloat16, dict(vec=8, chunks=5, chunk=256, tiles=10, blocks=1)),
    ((2, 512, 20, 20), 32, torch.bfloat16, dict(vec=8, chunks=2, chunk=256, tiles=32, blocks=8)),
    ((3, 96, 17, 19), 6, torch.float32, dict(vec=4, chunks=2, chunk=256, tiles=18, blocks=3)),
    ((2, 15, 9, 11), 5, torch.float32, dict(vec=1, chunks=1, chunk=136, tiles=2, blocks=1)),
    ((2, 32, 40, 40), 1, torch.float16, dict(vec=8, chunks=4, chunk=512, tiles=8, blocks=1)),
    ((2, 32, 24, 24), 32, torch.float16, dict(vec=1, chunks=9, chunk=64, tiles=18, blocks=1)),
    ((2, 16, 30, 30), 4, torch.float64, dict(vec=2, chunks=4, chunk=256, tiles=8, blocks=1)),
    ((2, 64, 4, 20, 20), 8, torch.bfloat16, dict(vec=8, chunks=7, chunk=256, tiles=14, blocks=1)),
    ((2, 64, 1000), 8, torch.float32, dict(vec=4, chunks=4, chunk=256, tiles=16, blocks=2)),
    ((2, 2048, 3, 7), 1, torch.bfloat16, dict(vec=8, chunks=3, chunk=8, tiles=6, blocks=1)),
    ((8, 256, 64, 64), 32, torch.bfloat16, dict(vec=8, chunks=16, chunk=256, tiles=512, blocks=4)),
]


@cuda
@pytest.mark.parametrize("case", BACKWARD_STREAM_CL_CASES,
                         ids=[f"{shape_id(c[:2])}-{str(c[2])[6:]}" for c in BACKWARD_STREAM_CL_CASES])
def test_gpu_backward_stream_channels_last_kernel(case):
    shape, groups, dtype, expected = case
    check_stream_backward(shape, groups, dtype, "channels_last", expected)


# The registers backward forced on awkward groups: every vector width of every
# dtype, either layout, channels-last rows of 3 and 5 vectors (blocks of
# multiples of 96 and 160 threads, so that a thread keeps one column), ragged
# last vectors, G = 1 and G = C, 1-D and 3-D, few units (threads for a vector
# each where four a thread take fewer than 256, else four), two an SM (half
# the threads) and many (2,048 units; 768 and 1,280 of 3-4 vectors a
# thread), the largest group one CTA holds and a table near the shared
# memory limit. Fields: what the plan
# must hold, so that a case that stops testing what it says fails.
BACKWARD_REGISTERS = [  # (shape, groups, dtypes, layout, fields)
    ((2, 12, 9, 11), 3, (BF16, F16, F32, F64), "contiguous", dict(vec=1, threads=416)),
    ((2, 12, 10, 15), 3, (BF16, F16, F32, F64), "contiguous", dict(vec=2, threads=320)),
    ((2, 12, 9, 12), 3, (BF16, F16, F32), "contiguous", dict(vec=4, threads=128)),
    ((3, 40, 8, 8), 4, (BF16, F16), "contiguous", dict(vec=8, threads=96)),
    ((2, 8, 16, 16), 8, (F32,), "contiguous", dict(vec=4, threads=64, tiles=16)),  # G = C
    ((2, 16, 8, 8), 1, (F16,), "contiguous", dict(vec=8, tiles=2)),  # G = 1
    ((4, 16, 100), 4, (F32,), "contiguous", dict(vec=4)),  # 1-D
    ((64, 256, 8, 8), 32, (F32,), "contiguous", dict(tiles=2048, threads=32)),
    ((2, 16, 64, 64), 4, (F32,), "contiguous", dict(vec=4, threads=1024, smem=32768)),  # largest
    ((2, 12, 27, 31), 3, (BF16, F32), "contiguous", dict(vec=1, threads=864)),  # few, 3-4 a thread
    ((6, 1280, 8, 8), 32, (BF16,), "contiguous", dict(vec=8, threads=320)),  # 2 units an SM
    ((256, 12, 9, 11), 3, (F32,), "contiguous", dict(vec=1, threads=128)),  # many units: 4 a thread
    ((2, 15, 9, 11), 5, (BF16, F16, F32, F64), "channels_last", dict(vec=1, threads=384)),
    ((2, 12, 20, 20), 6, (BF16, F16, F32, F64), "channels_last", dict(vec=2, threads=416)),
    ((2, 32, 10, 10), 8, (BF16, F16, F32), "channels_last", dict(vec=4, threads=128)),
    ((2, 80, 8, 8), 2, (BF16, F16), "channels_last", dict(vec=8, threads=320)),
    ((2, 24, 6, 6), 2, (F32,), "channels_last", dict(vec=4, threads=192)),
    ((2, 16, 4, 6, 6), 4, (BF16,), "channels_last", dict(vec=4, threads=160)),  # 3-D
    ((256, 15, 9, 11), 5, (BF16,), "channels_last", dict(vec=1, threads=96)),  # many units: 3 a thread
    ((6, 1280, 8, 8), 32, (BF16,), "channels_last", dict(vec=8, threads=320)),  # 2 units an SM
    ((64, 256, 8, 8), 32, (F16,), "channels_last", dict(tiles=2048, vec=8)),
    ((2, 256, 46, 64), 32, (F16,), "channels_last", dict(vec=8, threads=736, smem=47104)),
]
BACKWARD_REGISTERS_CASES = [(shape, groups, dtype, layout, fields)
                            for shape, groups, dtypes, layout, fields in BACKWARD_REGISTERS
                            for dtype in dtypes]


def layout_case_id(case):
    """layout-shape-Ggroups-dtype of a (shape, groups, dtype, layout, fields) case."""
    shape, groups, dtype, layout, _ = case
    return f"{layout}-{shape_id((shape, groups))}-{str(dtype)[6:]}"


@cuda
@pytest.mark.parametrize("case", BACKWARD_REGISTERS_CASES, ids=layout_case_id)
def test_gpu_backward_registers_kernel(case):
    shape, groups, dtype, layout, fields = case
    x = make_input(shape, dtype, layout, "cuda")
    plan = gn.plan(x, groups, kernel="registers", backward=True)
    assert plan["kernel"] == "registers" and plan["layout"] == layout and plan_has(plan, fields), \
        (fields, plan)
    assert list(plan) == ["kernel", "layout", "vec", "grid", "threads", "tiles", "chunks", "chunk",
                          "smem", "reason"], plan
    w, b = affine(shape[1], dtype, "cuda", "both")
    dy = lambda: make_input(shape, dtype, layout, "cuda")  # noqa: E731  (fresh each call)
    check_backward(x, groups, w, b, dy(), kernel="registers")
    check_backward(x, groups, None, None, dy(), kernel="registers")
    check_backward(x, groups, w, b, dy(), kernel="registers", affine=False)  # dx alone


@cuda
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gpu_backward_registers_chosen_below_l2_size(layout):
    # the suite's small rows take the registers backward through autograd,
    # shifted input included; dweight and dbias alone leave dx unwritten
    for shape, groups, dtype in [((2, 1280, 16, 16), 32, F16), ((8, 1280, 8, 8), 32, BF16),
                                 ((1, 64, 32, 32), 32, F16), ((4, 32, 8, 8), 8, F32)]:
        x = make_input(shape, dtype, layout, "cuda", shift=1000.0)
        plan = gn.plan(x, groups, backward=True)
        assert plan["kernel"] == "registers" and plan["layout"] == layout, plan
        w, b = affine(shape[1], dtype, "cuda", "both")
        check_backward(x, groups, w, b, torch.randn_like(x))
        check_backward(x, groups, w, b, torch.randn_like(x), need_dx=False)
    # a group past one CTA takes the passes, and forcing it names the limit;
    # so does a channels-last table of 48 KiB (a thread's 8 entries for each
    # of 768 threads), which with the kernel's scratch passes it (the
    # contiguous table of that group: an entry a vector, 24 KiB)
    too_large = [((2, 16, 64, 65), 4, F32)]
    if layout == "channels_last":
        too_large.append(((2, 256, 48, 64), 32, F16))
    for shape, groups, dtype in too_large:
        x = make_input(shape, dtype, layout, "cuda")
        assert gn.plan(x, groups, backward=True)["kernel"] == "passes"
        with pytest.raises(ValueError, match="registers kernel holds a group in one CTA"):
            gn.plan(x, groups, kernel="registers", backward=True)


@cuda
@pytest.mark.parametrize("kernel", ["passes", "registers"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_backward_kernels_without_dx(kernel, layout):
    # dweight and dbias alone (no dx written) from each kernel that serves
    # them, forced through the extension (autograd's plan is the registers
    # kernel for this input), against float64
    shape, groups = (2, 32, 7, 9), 4
    x = make_input(shape, torch.float32, layout, "cuda")
    w, b = affine(32, torch.float32, "cuda", "both")
    dy = make_input(shape, torch.float32, layout, "cuda")
    ext = gn.load()
    _, mean, rstd = ext.forward(x, w, b, groups, 1e-5, "auto", 0, 0)
    dx, dw, db = ext.backward(dy, x, mean, rstd, w, groups, False, True, kernel, 0)
    assert dx.numel() == 0
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y64 = tools.reference_group_norm(x64, groups, w64, b64, 1e-5)
    ref_w, ref_b = torch.autograd.grad(y64, (w64, b64), dy.double())
    for mine, ref in ((dw, ref_w), (db, ref_b)):
        assert tools.max_error(mine, ref) <= 1e-4 * (ref.abs().max().item() + 1), (kernel, mine, ref)


@cuda
def test_gpu_backward_stream_shifted_inputs():
    x = make_input((2, 64, 33, 32), torch.float32, "contiguous", "cuda", shift=1000.0)
    w, b = affine(64, x.dtype, "cuda", "both")
    check_backward(x, 8, w, b, torch.randn_like(x), kernel="stream")
    x = x.to(memory_format=torch.channels_last)
    check_backward(x, 8, w, b, torch.randn_like(x), kernel="stream")


@cuda
def test_gpu_backward_plan_takes_stream_for_large_input():
    """Input at least as large as L2 takes the stream backward through
    autograd, in either layout; smaller input whose groups do not fit one
    CTA takes the four launches."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n = max(1, -(-l2 // (64 * 128 * 128 * 4)))
    x = make_input((n, 64, 128, 128), torch.float32, "contiguous", "cuda")
    plan = gn.plan(x, 8, backward=True)
    assert plan["kernel"] == "stream" and plan["layout"] == "contiguous", plan
    w, b = affine(64, x.dtype, "cuda", "both")
    check_backward(x, 8, w, b, torch.randn_like(x))
    # channels-last: the stream when a unit (64 tiles here) is at most half
    # the grid, and the four launches for units larger than that (256 tiles)
    x_cl = x.to(memory_format=torch.channels_last)
    forced = gn.plan(x_cl, 8, kernel="stream", backward=True)
    assert forced["chunks"] == 64, forced
    grid = forced["grid"]
    auto = gn.plan(x_cl, 8, backward=True)
    expected = (dict(kernel="stream", layout="channels_last", vec=4) if 2 * 64 <= grid
                else dict(kernel="passes"))
    assert plan_has(auto, expected), (expected, auto)
    check_backward(x_cl, 8, w, b, torch.randn_like(x_cl))
    plan = gn.plan(x[:1], 8, backward=True)
    assert plan["kernel"] == "passes", plan
    plan = gn.plan(x_cl[:1], 8, backward=True)
    assert plan["kernel"] == "passes", plan
    wide_units = make_input((n, 64, 256, 256), torch.float32, "channels_last", "cuda")
    forced = gn.plan(wide_units, 8, kernel="stream", backward=True)
    assert forced["chunks"] == 256, forced
    auto = gn.plan(wide_units, 8, backward=True)
    assert auto["kernel"] == ("stream" if 2 * 256 <= grid else "passes"), auto
    # a row of 256 vectors leaves tiles of 8 rows, whose per-channel pairs
    # would be half the size of x: the four launches
    wide_rows = make_input((max(1, -(-l2 // (2048 * 64 * 2))), 2048, 8, 8), torch.bfloat16,
                           "channels_last", "cuda")
    forced = gn.plan(wide_rows, 1, kernel="stream", backward=True)
    assert forced["chunk"] == 8, forced
    plan = gn.plan(wide_rows, 1, backward=True)
    assert plan["kernel"] == "passes", plan
    plan = gn.plan(x, 8, kernel="passes", backward=True)
    assert plan["kernel"] == "passes", plan


@cuda
def test_gpu_backward_kernel_errors_name_the_problem():
    x = make_input((2, 8, 16, 16), torch.float32, "contiguous", "cuda")
    with pytest.raises(ValueError, match="kernel must be"):
        gn.plan(x, 2, kernel="fast", backward=True)
    wide = make_input((2, 4096, 2, 2), torch.float32, "channels_last", "cuda")
    with pytest.raises(ValueError, match=r"channels-last input needs C / 4 <= 256, got C = 4096"):
        gn.plan(wide, 1, kernel="stream", backward=True)
    with pytest.raises(ValueError, match="lag must be >= 0, got -1"):
        gn.plan(x, 2, kernel="stream", lag=-1, backward=True)
    # lag= is the stream kernel's alone
    for kernel in ("passes", "auto"):
        with pytest.raises(ValueError, match=re.escape("lag= sets the stream kernel's lag (kernel='stream')")):
            gn.plan(x, 2, kernel=kernel, lag=4, backward=True)
    ext = gn.load()
    _, mean, rstd = ext.forward(x, None, None, 2, 1e-5, "auto", 0, 0)
    with pytest.raises(ValueError, match="stream kernel needs dx wanted"):
        ext.backward(torch.randn_like(x), x, mean, rstd, None, 2, False, True, "stream", 0)
    with pytest.raises(ValueError, match=re.escape("lag= sets the stream kernel's lag (kernel='stream')")):
        ext.backward(torch.randn_like(x), x, mean, rstd, None, 2, True, True, "passes", 4)


@cuda
def test_gpu_backward_misaligned_grad_output():
    x = make_input((2, 64, 16, 16), torch.float16, "contiguous", "cuda")
    plan = gn.plan(x, 4, backward=True)
    assert plan["vec"] == 8, plan
    dy = torch.randn(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view(x.shape)
    w, b = affine(64, x.dtype, "cuda", "both")
    check_backward(x, 4, w, b, dy)  # the registers kernel, at scalar width
    check_backward(x, 4, w, b, dy, kernel="passes")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gpu_backward_shifted_inputs(dtype):
    x = make_input((2, 64, 33, 31), dtype, "contiguous", "cuda", shift=1000.0)
    w, b = affine(64, dtype, "cuda", "both")
    check_backward(x, 8, w, b, torch.randn_like(x))


@cuda
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("wants", ["x", "weight", "bias", "weight+bias", "x+bias"])
def test_gpu_backward_any_subset_of_inputs(wants, weight):
    if "weight" in wants and not weight:
        pytest.skip("no weight to differentiate")
    x = make_input((2, 32, 7, 9), torch.float32, "contiguous", "cuda").requires_grad_("x" in wants)
    w = torch.randn(32, device="cuda", requires_grad="weight" in wants) if weight else None
    b = torch.randn(32, device="cuda", requires_grad="bias" in wants)
    y = gn.groupnorm_cuda(x, w, b, 4)
    assert y.requires_grad
    y.square().sum().backward()
    for t, name in ((x, "x"), (w, "weight"), (b, "bias")):
        if t is not None:
            assert (t.grad is not None) == (name in wants.split("+")), name
    # the same gradients as torch's
    x2, b2 = x.detach().requires_grad_(x.requires_grad), b.detach().requires_grad_(b.requires_grad)
    w2 = w.detach().requires_grad_(w.requires_grad) if w is not None else None
    F.group_norm(x2, 4, *weight_for_torch(x2, w2, b2)).square().sum().backward()
    for mine, theirs in ((x.grad, x2.grad), (b.grad, b2.grad)) + (((w.grad, w2.grad),) if weight else ()):
        if theirs is not None:
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@cuda
def test_gpu_backward_with_nothing_wanted_returns_empty_outputs():
    x = make_input((2, 32, 7, 9), torch.float32, "contiguous", "cuda")
    w = torch.randn(32, device="cuda")
    ext = gn.load()
    _, mean, rstd = ext.forward(x, w, None, 4, 1e-5, "auto", 0, 0)
    dy = torch.randn_like(x)
    outputs = ext.backward(dy, x, mean, rstd, w, 4, False, False, "auto", 0)
    assert [t.numel() for t in outputs] == [0, 0, 0]
    # and the same op with each output wanted still matches torch
    dx, dw, db = ext.backward(dy, x, mean, rstd, w, 4, True, True, "auto", 0)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.group_norm(x2, 4, w2, None).backward(dy)
    torch.testing.assert_close(dx, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw, w2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db, dy.sum((0, 2, 3)), rtol=1e-4, atol=1e-4)


@cuda
def test_gpu_torch_func_transforms_go_to_torch():
    x = make_input((2, 16, 5, 5), torch.float32, "contiguous", "cuda")
    w, b = affine(16, torch.float32, "cuda", "both")
    ours = torch.func.grad(lambda t: gn.group_norm(t, 4, w, b).square().sum())(x)
    theirs = torch.func.grad(lambda t: F.group_norm(t, 4, w, b).square().sum())(x)
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="torch.func"):
        torch.func.grad(lambda t: gn.groupnorm_cuda(t, w, b, 4).sum())(x)


@cuda
def test_gpu_forward_mode_ad_goes_to_torch():
    # a dual tensor's tangent would be dropped by our kernels without a word
    import torch.autograd.forward_ad as fwAD
    x = make_input((2, 16, 5, 5), torch.float32, "contiguous", "cuda")
    w, b = affine(16, torch.float32, "cuda", "both")
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        ours = fwAD.unpack_dual(gn.group_norm(dual, 4, w, b))
        theirs = fwAD.unpack_dual(F.group_norm(dual, 4, w, b))
        with pytest.raises(ValueError, match="forward-mode AD"):
            gn.groupnorm_cuda(dual, w, b, 4)
    torch.testing.assert_close(ours.primal, theirs.primal)
    torch.testing.assert_close(ours.tangent, theirs.tangent)


def test_fast_path_leaves_cpu_and_subclassed_inputs_to_group_norm():
    # the fast path serves eager calls on plain CUDA tensors alone
    x = torch.randn(2, 6, 4)
    assert gn._fast_forward(x, 3, None, None, 1e-5) is None
    assert gn._fast_forward(x.as_subclass(PretendCuda), 3, None, None, 1e-5) is None


@pytest.mark.parametrize("activation, expected", [
    (None, None), ((), None), ("silu", ([0], 0.01)), ("relu", ([3], 0.01)),
    (("tanh", "hardswish"), ([5, 7], 0.01)), (("leaky_relu", 0.25), ([4], 0.25)),
    (("leaky_relu", "tanh"), ([4, 5], 0.01)), ("leaky", False), (["silu"], False),
    (("leaky_relu", 1), False), (("leaky_relu", True), False),
    (("leaky_relu", float("inf")), False), (("silu",) * 5, False), (True, False), (1, False)])
def test_fast_activation_takes_valid_names_and_leaves_the_rest(activation, expected):
    # False: group_norm's checks see it (a bool hashes as 1 does, so only
    # names, tuples of names and ("leaky_relu", float) are looked up); an
    # empty chain is no activation, as group_norm takes it
    assert gn._fast_activation(activation) == expected
    assert gn._fast_activation(activation) == expected  # cached as it was found


def test_fast_activation_keeps_the_sign_of_a_zero_slope():
    # 0.0 and -0.0 compare equal; the kernel's v * slope keeps the sign
    assert math.copysign(1, gn._fast_activation(("leaky_relu", 0.0))[1]) == 1
    assert math.copysign(1, gn._fast_activation(("leaky_relu", -0.0))[1]) == -1


def test_dual_tensors_count_as_transformed():
    import torch.autograd.forward_ad as fwAD
    x = torch.randn(2, 4, 3)
    assert not gn._func_transformed(x, None)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        assert gn._func_transformed(None, dual)
        assert not gn._func_transformed(x)


FAST_PATH_LAYOUTS = [((2, 64, 12, 10), 8, torch.float16, "contiguous"),
                     ((2, 96, 7, 9), 12, torch.bfloat16, "channels_last"),
                     ((3, 32, 50), 4, torch.float32, "contiguous")]


@cuda
@pytest.mark.parametrize("case", FAST_PATH_LAYOUTS, ids=lambda c: f"{c[2]}-{c[3]}"[6:])
@pytest.mark.parametrize("activation", [None, "silu", ("tanh", "hardswish")])
def test_gpu_fast_path_serves_layers_as_the_checked_path(case, activation, monkeypatch):
    # with group_norm's checked path disabled, the layer and the function
    # still run (the fast path), bitwise as groupnorm_cuda, gradients too
    shape, groups, dtype, layout = case
    x = make_input(shape, dtype, layout, "cuda")
    layer = gn.GroupNorm(groups, shape[1], activation=activation).to("cuda", dtype)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x_grad = x.clone().requires_grad_()
    checked = gn.groupnorm_cuda(x_grad, layer.weight, layer.bias, groups, activation=activation)
    dy = torch.randn_like(checked)
    checked_grads = torch.autograd.grad(checked, (x_grad, layer.weight, layer.bias), dy)

    def refuse(*args, **kwargs):
        raise AssertionError("the checked path ran")

    monkeypatch.setattr(gn, "_check_arguments", refuse)
    with torch.no_grad():
        y = layer(x)
        assert torch.equal(y, checked) and y.stride() == checked.stride()
        assert torch.equal(gn.group_norm(x, groups, layer.weight, layer.bias,
                                         activation=activation), checked)
    y = layer(x_grad)
    assert y.grad_fn is not None and torch.equal(y, checked)
    grads = torch.autograd.grad(y, (x_grad, layer.weight, layer.bias), dy)
    for ours, theirs in zip(grads, checked_grads):
        assert torch.equal(ours, theirs)


@cuda
@pytest.mark.parametrize("case", [
    "autocast", "single value per channel", "empty batch", "weight of another dtype",
    "weight on the CPU", "bool groups", "int eps", "groups not dividing C", "negative eps",
    "integer input", "subclass", "dual tensor", "sparse weight"])
def test_gpu_fast_path_leaves_to_group_norm_what_it_must_decide(case):
    # each of these takes torch's path or raises group_norm's own error
    import torch.autograd.forward_ad as fwAD
    x = make_input((2, 8, 3, 3), torch.float16, "contiguous", "cuda")
    w, b = affine(8, torch.float16, "cuda", "both")
    args = dict(input=x, groups=4, weight=w, bias=b, eps=1e-5)
    context = contextlib.nullcontext()
    if case == "autocast":
        context = torch.autocast("cuda")
    elif case == "single value per channel":
        args.update(input=x[:1, :, :1, :1].contiguous(), groups=8)
    elif case == "empty batch":
        args["input"] = x[:0]
    elif case == "weight of another dtype":
        args["weight"] = w.float()
    elif case == "weight on the CPU":
        args["weight"] = w.cpu()
    elif case == "bool groups":
        args["groups"] = True
    elif case == "int eps":
        args["eps"] = 0
    elif case == "groups not dividing C":
        args["groups"] = 3
    elif case == "negative eps":
        args["eps"] = -1.0
    elif case == "integer input":
        args["input"] = x.to(torch.int32)
    elif case == "subclass":
        args["input"] = torch.nn.Parameter(x)
    elif case == "dual tensor":
        context = fwAD.dual_level()
    elif case == "sparse weight":
        args["weight"] = w.to_sparse()
    with context, torch.no_grad():
        if case == "dual tensor":
            args["input"] = fwAD.make_dual(x, torch.ones_like(x))
        assert gn._fast_forward(**args) is None


@cuda
def test_gpu_backward_output_is_fully_written():
    x = make_input((4, 64, 24, 24), torch.float32, "contiguous", "cuda").requires_grad_()
    y = gn.groupnorm_cuda(x, None, None, 8)
    dy = torch.randn_like(y)
    # the graph kept: poisoned may run the backward again
    dx, landed = poisoned(lambda: torch.autograd.grad(y, x, dy, retain_graph=True)[0], x)
    assert landed, "dx did not reuse the poisoned block"
    assert not dx.isnan().any()


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_gradcheck_float64(layout):
    x = make_input((2, 6, 4, 5), torch.float64, layout, "cuda").requires_grad_()
    w = torch.randn(6, device="cuda", dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: gn.groupnorm_cuda(t[0], t[1], t[2], 3), (x, w, b))


@cuda
def test_gpu_double_backward_is_refused():
    x = make_input((2, 8, 5, 5), torch.float32, "contiguous", "cuda").requires_grad_()
    (dx,) = torch.autograd.grad(gn.groupnorm_cuda(x, None, None, 2).square().sum(), x,
                                create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()
    # the registered op (torch.compile / export) says the same
    y = torch.ops.groupnorm_inline.forward(x, None, None, 2, 1e-5)[0]
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()


@cuda
def test_gpu_bundle_beside_the_module_shares_its_operators(tmp_path):
    path = tools.bundle(str(tmp_path / "standalone_gn.py"))
    spec = importlib.util.spec_from_file_location("standalone_gn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._OPS is gn._OPS and module._LIBRARY is None  # defined once
    x = make_input((2, 16, 5, 7), torch.float32, "contiguous", "cuda")
    w = torch.randn(16, device="cuda", requires_grad=True)
    for m in (gn, module):
        xs = x.clone().requires_grad_()
        y = m.group_norm(xs, 4, w, None)
        y.square().sum().backward()
        expected = F.group_norm(x.double(), 4, w.double().detach()).float()
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        assert xs.grad is not None and not xs.grad.isnan().any()


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_opcheck(layout):
    x = make_input((2, 32, 6, 7), torch.float32, layout, "cuda").requires_grad_()
    w = torch.randn(32, device="cuda", requires_grad=True)
    b = torch.randn(32, device="cuda", requires_grad=True)
    for args in ((x, w, b, 4, 1e-5), (x, None, None, 8, 1e-3)):
        torch.library.opcheck(torch.ops.groupnorm_inline.forward.default, args)
    # one group of 512 channels: the fake backward must give dx x's layout too
    wide = make_input((2, 512, 4, 4), torch.float32, layout, "cuda").requires_grad_()
    w512 = torch.randn(512, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.groupnorm_inline.forward.default, (wide, w512, None, 1, 1e-5))


class _Block(nn.Module):
    """conv -> GroupNorm by this module's kernels (forward and backward) -> SiLU,
    through groupnorm_cuda or through the GroupNorm layer itself."""

    def __init__(self, through_layer=False):
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3, padding=1)
        self.norm = gn.GroupNorm(8, 32)
        self.through_layer = through_layer

    def forward(self, x):
        h = self.conv(x)
        y = self.norm(h) if self.through_layer else gn.groupnorm_cuda(h, self.norm.weight,
                                                                      self.norm.bias, 8)
        return torch.nn.functional.silu(y)


THROUGH = pytest.mark.parametrize("through_layer", [False, True], ids=["groupnorm_cuda", "GroupNorm"])


@cuda
@THROUGH
def test_gpu_torch_compile_fullgraph_forward_and_backward(through_layer, monkeypatch):
    forbid_torch_group_norm(monkeypatch)
    model = _Block(through_layer).cuda()
    x = torch.randn(2, 16, 12, 12, device="cuda")
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-3, atol=1e-4)


@cuda
@THROUGH
def test_gpu_torch_compile_graphs_call_the_custom_ops(through_layer):
    # The test above checks what a compiled model computes; this one what
    # torch.compile traced, through a backend that records the graphs: Dynamo's
    # and AOTAutograd's forward and backward must call groupnorm_inline::forward
    # and ::backward and nothing of torch's GroupNorm (a fallback to
    # F.group_norm, or the op decomposed into aten's, would show up here).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    targets = {}  # graph name -> str() of each call_function node's target

    def record(name, gm):
        targets[name] = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        record("dynamo", gm)
        return aot_autograd(fw_compiler=lambda g, _: record("forward", g),
                            bw_compiler=lambda g, _: record("backward", g))(gm, example_inputs)

    torch._dynamo.reset()  # a cached compilation for another backend would bypass this one
    model = _Block(through_layer).cuda()
    x = torch.randn(2, 16, 12, 12, device="cuda")
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    out.square().sum().backward()
    assert "groupnorm_inline.forward" in targets["dynamo"], targets
    assert "groupnorm_inline.forward.default" in targets["forward"], targets
    assert "groupnorm_inline.backward.default" in targets["backward"], targets
    for name, called in targets.items():
        assert not [t for t in called if "group_norm" in t], (name, called)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


@cuda
@THROUGH
def test_gpu_torch_export(through_layer):
    model = _Block(through_layer).cuda().eval()
    x = torch.randn(2, 16, 12, 12, device="cuda")
    exported = torch.export.export(model, (x,))
    assert "groupnorm_inline" in str(exported.graph)
    torch.testing.assert_close(exported.module()(x), model(x), rtol=1e-5, atol=1e-5)


@cuda
def test_gpu_group_norm_and_module_take_cuda_path_and_match_torch(monkeypatch):
    x = make_input((2, 64, 16, 16), torch.bfloat16, "channels_last", "cuda")
    layer = gn.GroupNorm(8, 64).cuda().to(torch.bfloat16)
    reference = nn.GroupNorm(8, 64).cuda().to(torch.bfloat16)
    layer.weight.data.normal_()
    reference.load_state_dict(layer.state_dict())
    with torch.no_grad():
        ref = tools.reference_group_norm(x, 8, layer.weight, layer.bias, 1e-5)
        torch_err = tools.max_error(reference(x), ref)
        forbid_torch_group_norm(monkeypatch)
        out = layer(x)
    assert tools.max_error(out, ref) <= tolerance(x, ref, x.dtype, torch_err, layer.weight)
    assert out.is_contiguous(memory_format=torch.channels_last)
    # with gradients too, both entry points record this module's backward
    x32 = make_input((2, 8, 5, 5), torch.float32, "contiguous", "cuda").requires_grad_()
    for y32 in (gn.group_norm(x32, 2), gn.groupnorm_cuda(x32, None, None, 2),
                gn.GroupNorm(2, 8).cuda()(x32)):
        assert "GroupNormFunction" in y32.grad_fn.name()
        x32.grad = None
        y32.square().sum().backward()
        assert x32.grad is not None


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=["float16", "bfloat16", "float32", "float64"])
def test_gpu_autocast_dtype_like_torch(dtype, monkeypatch):
    x = make_input((2, 16, 5, 5), dtype, "contiguous", "cuda")
    w, b = affine(16, dtype, "cuda", "both")
    with torch.no_grad(), torch.autocast("cuda"):
        theirs = F.group_norm(x, 4, w, b)
        forbid_torch_group_norm(monkeypatch)
        ours = gn.group_norm(x, 4, w, b)
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@cuda
def test_gpu_more_than_2_31_elements():
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    shape = (2, 4, 2**28 + 64)  # 2^31 + 512 elements, bfloat16 = 4 GiB
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    assert x.numel() > 2**31
    for kernel in ("contiguous", "stream"):
        y, landed = poisoned(lambda: gn.groupnorm_cuda(x, None, None, 2, kernel=kernel), x)
        assert landed, "output did not reuse the poisoned block"
        # reference per (sample, group) in float64, chunk by chunk
        for n in range(2):
            for g in range(2):
                xs = x[n, 2 * g:2 * g + 2].double()
                mean, var = xs.mean(), xs.var(unbiased=False)
                expected = ((xs - mean) / torch.sqrt(var + 1e-5))
                del xs
                ys = y[n, 2 * g:2 * g + 2]
                assert not ys.isnan().any(), (kernel, n, g)
                err = ys.double().sub_(expected).abs_()
                # bfloat16 output: half a step at each element's magnitude, and
                # a little (in place: each of these tensors is 4 GiB)
                tol = expected.abs_().clamp_min_(1e-3).log2_().floor_().exp2_()
                tol.mul_(0.5 * torch.finfo(torch.bfloat16).eps).add_(1e-3)
                excess = err.sub_(tol).max().item()
                assert excess <= 0, (kernel, n, g, excess)
                del expected, err, tol
        del y


@cuda
def test_gpu_backward_more_than_2_31_elements():
    free, _ = torch.cuda.mem_get_info()
    if free < 60 * 2**30:
        pytest.skip("needs 60 GiB of free GPU memory")
    shape = (2, 4, 2**28 + 64)  # 2^31 + 512 elements, bfloat16 = 4 GiB per tensor
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
    y = gn.groupnorm_cuda(x, None, None, 2)
    dy = torch.randn_like(y)
    # the graph kept: poisoned may run the backward again
    dx, landed = poisoned(lambda: torch.autograd.grad(y, x, dy, retain_graph=True)[0], x)
    assert landed, "dx did not reuse the poisoned block"
    assert not dx.isnan().any()
    del y
    # dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat)) per (sample, group), in float64
    for n in range(2):
        for g in range(2):
            xs = x[n, 2 * g:2 * g + 2].detach().double()
            rstd = 1 / torch.sqrt(xs.var(unbiased=False) + 1e-5)
            xhat = (xs - xs.mean()) * rstd
            del xs
            g_ = dy[n, 2 * g:2 * g + 2].double()
            expected = rstd * (g_ - g_.mean() - xhat * (g_ * xhat).mean())
            del xhat, g_
            err = (dx[n, 2 * g:2 * g + 2].double() - expected).abs().max().item()
            assert err <= 0.04, (n, g, err)  # bfloat16 output
            del expected


@cuda
def test_gpu_bundles_run(tmp_path):
    path = tools.bundle(str(tmp_path / "standalone_gpu.py"))
    namespace = {}
    with open(path) as f:
        exec(compile(f.read(), "<string>", "exec"), namespace)
    x = make_input((2, 32, 12, 12), torch.float16, "channels_last", "cuda")
    ref = tools.reference_group_norm(x, 4, None, None, 1e-5)
    torch_err = tools.max_error(tools.torch_group_norm(x, 4, None, None, 1e-5), ref)
    y, landed = poisoned(lambda: namespace["groupnorm_cuda"](x, None, None, 4), x)
    assert landed and not y.isnan().any()
    assert tools.max_error(y, ref) <= tolerance(x, ref, x.dtype, torch_err, None)

    check_kernelbench_bundle(tmp_path, "level1-35", kernelbench_reference_model(), "gn", trials=3)


def kernelbench_models(kb, Model, norm):
    """On the GPU: the reference Model (its GroupNorm `norm` given random
    affine parameters) and the bundle kb's ModelNew holding its state."""
    init = kb["get_init_inputs"]()
    reference = Model(*init).cuda()
    getattr(reference, norm).weight.data.normal_()
    getattr(reference, norm).bias.data.normal_()
    candidate = kb["ModelNew"](*init).cuda()
    candidate.load_state_dict(reference.state_dict())
    return reference, candidate


def check_kernelbench_bundle(tmp_path, problem, Model, norm, trials):
    """The problem's bundle on the GPU against the reference Model (its
    GroupNorm `norm` given random affine parameters), on the problem's
    inputs, at KernelBench's tolerance."""
    path = tools.bundle(str(tmp_path / f"{problem}.py"), kernelbench=problem)
    kb = {}
    with open(path) as f:
        exec(compile(f.read(), "<string>", "exec"), kb)
    reference, candidate = kernelbench_models(kb, Model, norm)
    for _ in range(trials):
        (x,) = kb["get_inputs"]()
        x = x.cuda()
        with torch.no_grad():
            torch.testing.assert_close(candidate(x), reference(x), atol=1e-4, rtol=1e-4)
        del x
    # built for float32 alone: another dtype is refused by name, not run
    other = torch.randn(2, 8, 4, 4, dtype=torch.float64, device="cuda")
    with pytest.raises(RuntimeError, match="no kernels for Double"):
        kb["_extension"].forward(other, None, None, 2, 1e-5, "auto", 0, 0)


@pytest.mark.parametrize("name", ["unet", "vae", "resnet50_gn", "efficientnet_b3_gn", "segresnet"])
def test_models_benchmark_swaps_every_groupnorm_of_tiny_models(name):
    # The model families of benchmarks/models.py at toy sizes on the CPU:
    # every GroupNorm swapped (strict), the same outputs, state_dicts that
    # load both ways. (On the CPU our group_norm is torch's: equal errors.)
    pytest.importorskip({"unet": "diffusers", "vae": "diffusers", "segresnet": "monai"}.get(name, "timm"))
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import models

    result = models.run_model(name, ["eager"], 1, torch.device("cpu"), tiny=True)
    assert result["swapped"] == result["groupnorms"] > 0, result
    assert result["variants"]["ours"]["max_error"] == result["variants"]["torch"]["max_error"]
    model = models.MODELS[name](True)[0]
    swapped = gn.replace_groupnorm(copy.deepcopy(model), strict=True)
    assert list(swapped.state_dict()) == list(model.state_dict())
    swapped.load_state_dict(model.state_dict())
    model.load_state_dict(swapped.state_dict())


def test_profile_models_train_mode_reports_both_variants_and_the_bound(tmp_path):
    # profile_models.py --mode train at toy sizes on the CPU (its operators'
    # times stand in for kernels): wall and profiled times of both variants,
    # the bound, the JSON
    pytest.importorskip("timm")
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import profile_models

    path = tmp_path / "train.json"
    report = profile_models.main(["--tiny", "--mode", "train", "--models", "resnet50_gn",
                                  "--variants", "torch,ours", "--calls", "1", "--rounds", "1",
                                  "--top", "0", "--json", str(path)])
    entry = report["models"]["resnet50_gn"]
    assert set(entry) == {"torch", "ours", "bound_without_groupnorm"}, entry
    for variant in ("torch", "ours"):
        assert entry[variant]["wall_unprofiled_ms"] > 0 and entry[variant]["kernel_ms"] > 0
        # --top 0 lists every kernel: together they are the variant's kernel time
        listed = sum(ms for _, ms in entry[variant]["top"])
        assert listed == pytest.approx(entry[variant]["kernel_ms"], rel=1e-6), variant
        # the host's side: no launches on the CPU
        assert entry[variant]["host"]["launches"] == 0, entry[variant]["host"]
    rest = entry["ours"]["kernel_ms"] - entry["ours"]["groupnorm_named_ms"]
    assert entry["bound_without_groupnorm"] == pytest.approx(entry["torch"]["kernel_ms"] / rest)
    assert json.loads(path.read_text())["mode"] == "train"


def test_profile_models_host_table_counts_each_operator_call_once(operators_on_the_cpu):
    # our operator's calls per profiled call, with their CPU time (CPU
    # kernels registered for the operators), and no launches
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import profile_models
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 4, 3, 3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            gn._OPS.forward.default(x, None, None, 2, 1e-5)
    host = profile_models.host_table(prof, 3, gn._NAMESPACE)
    assert host["operator_calls"] == pytest.approx(1) and host["operator_us"] > 0, host
    assert host["launches"] == 0 and host["memsets"] == 0, host


def test_benchmark_tools_select_suite_cases_by_name_and_refuse_typos():
    # ab_compare.py --rows and profile_rows.py --rows share suite_cases
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import bench_groupnorm

    assert bench_groupnorm.suite_cases([], "tool") == bench_groupnorm.SUITE
    picked = bench_groupnorm.suite_cases(["tiny", "SD UNet"], "tool")
    assert {case[0] for case in picked} == {"tiny", "SD UNet"} and len(picked) == 3
    with pytest.raises(SystemExit, match="tool: no suite case named 'tiyn'"):
        bench_groupnorm.suite_cases(["tiny", "tiyn"], "tool")


def test_training_table_gives_the_backward_over_its_copy_and_issue_26_target():
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import bench_groupnorm

    def row(name, element_bytes, ours, copy):
        return {"name": name, "shape": [1], "G": 1, "dtype": "float16", "layout": "contiguous",
                "pass": "forward+backward", "bytes": 5 * element_bytes, "floor_ms": 1.0,
                "ms": {"groupnorm_inline": 2.0, "eager": 4.0, "compile": 3.0},
                "backward_ms": {"groupnorm_inline": ours, "eager": 1.0, "compile": 1.0},
                "backward_floor_ms": 0.1, "backward_copy_ms": copy}

    meta = {"device": "card", "torch": "t", "cuda": "c", "date": "d", "copy_GBps": 1000.0}
    table = bench_groupnorm.markdown([row("large", 64e6, 0.3, 0.2), row("small", 1e6, 0.05, 0.04)],
                                     meta)
    backward = table.split("Backward alone")[1].splitlines()
    large = next(line for line in backward if line.startswith("| large"))
    small = next(line for line in backward if line.startswith("| small"))
    assert "| 0.2000 | 1.50 | 1.3 |" in large, large
    assert "| 0.0400 | 1.25 | 1.6 |" in small, small


def test_profile_rows_splits_ncu_kernels_at_the_markers():
    # profile_rows.py's parsing of Nsight Compute's raw CSV (base units):
    # each call's kernels summed between its two markers (the inputs'
    # kernels outside them left out), the units row skipped
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import profile_rows

    names = list(profile_rows.METRICS.values())
    header = ["ID", "Process ID", "Kernel Name"] + names
    units = ["", "", ""] + ["ns" if n.startswith("gpu__time") else "" for n in names]

    def kernel(i, name, ns, read, write):
        values = {"gpu__time_duration.sum": ns, "dram__bytes_read.sum": read,
                  "dram__bytes_write.sum": write, "launch__registers_per_thread": 32,
                  "launch__grid_size": 132, "launch__block_size": 256}
        return [str(i), "1", name] + [f"{values.get(n, 50):,}" for n in names]

    spin = "cuda::<unnamed>::spin_kernel(long)"
    table = [header, units, kernel(0, "normal_kernel(float *)", 5000, 0, 4000),
             kernel(1, spin, 1000, 0, 0),
             kernel(2, "elementwise_kernel<128, 4>(at::TensorIteratorBase &)", 2000, 4000, 4000),
             kernel(3, spin, 1000, 0, 0), kernel(4, spin, 1000, 0, 0),
             kernel(5, "groupnorm_stream_kernel<float, 4>(const float *)", 3000, 6000, 4000),
             kernel(6, "groupnorm_finish(float *)", 1000, 0, 0), kernel(7, spin, 1000, 0, 0),
             kernel(8, "normal_kernel(float *)", 5000, 0, 4000)]
    text = "==PROF== Connected\n" + "\n".join(
        ",".join(f'"{v}"' for v in line) for line in table) + "\nROWS []\n"
    kernels = profile_rows.kernels_from_csv(text)
    assert len(kernels) == 9 and kernels[2]["name"].startswith("elementwise_kernel<128, 4>")
    order = [{"row": "r", "contender": c, "elements": 1000, "bytes": 4000,
              "plan": {"kernel": "stream"}} for c in ("copy", "ours")]
    clone, ours = profile_rows.attribute(order, kernels)
    assert clone["us"] == 2.0 and clone["dram_over_bytes"] == 2.0
    assert ours["us"] == 4.0 and ours["dram_mb"] == pytest.approx(0.01)
    assert ours["kernels"] == ["groupnorm_stream_kernel<float, 4>", "groupnorm_finish"]
    assert ours["registers"] == 32 and ours["grid"] == 132  # the longest kernel's
    assert "| r | stream | 2.0 | 4.0 | 2.00 |" in profile_rows.markdown([clone, ours])
    with pytest.raises(SystemExit, match="marker pairs"):
        profile_rows.attribute(order + order, kernels)


def test_models_benchmark_pass_variant_compiles_with_the_pass_and_removes_it():
    # the "pass" variant's harness on a toy block (CPU: the pass serves CUDA
    # graphs only, so here it runs and changes nothing)
    from torch._inductor import config
    try:
        gn.load()
    except gn.ToolchainError as error:
        pytest.skip(f"the extension cannot be built here: {error}")
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    import models

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.SiLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    seen = []
    call = models.with_compile_fusion(lambda m, t: seen.append(config.pre_grad_custom_pass) or m(t))
    call(model, x)
    assert len(seen) == 1 and isinstance(seen[0], gn._GroupNormPass) and gn._compile_pass is None
    result, callables = {"variants": {}}, {}
    reference = model.double()(x.double())
    models.add_pass_variant(result, callables, model.float(), lambda m, t: m(t), (x,), reference,
                            ["compile"])
    assert set(callables) == {("pass", "compile")}
    assert result["variants"]["pass"]["max_error"] < 1e-5
    callables[("pass", "compile")]()
    assert config.pre_grad_custom_pass is None
    # a compiled training step: two steps timed as its compile, the pass
    # removed after them, the parameters left without gradients; the error
    # is the training forward's output
    result, callables = {"variants": {}}, {}
    models.add_pass_variant(result, callables, model, lambda m, t: m(t), (x,), reference,
                            ["compile-train"])
    assert set(callables) == {("pass", "compile-train")}
    assert result["variants"]["pass"]["compile-train_first_calls_s"] > 0
    assert result["variants"]["pass"]["max_error"] < 1e-5
    callables[("pass", "compile-train")]()
    assert config.pre_grad_custom_pass is None and not model.training
    assert all(p.grad is None for p in model.parameters())
    torch._dynamo.reset()


def _dynamo_graph(fn, *args):
    """The pre-grad FX graph Dynamo traces of fn(*args), as Inductor's
    pre-grad passes see it."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    except RuntimeError:
        pass  # running it may fail (torch refuses mixed dtypes on the CPU): traced already
    return graphs[0]


def test_compile_pass_rewrites_torch_group_norm_it_serves_exactly():
    block = nn.Sequential(nn.Conv2d(4, 8, 3), nn.GroupNorm(2, 8), nn.SiLU())
    gm = _dynamo_graph(block, torch.randn(1, 4, 8, 8))
    assert gn._rewrite_group_norms(gm.graph, devices=("cpu",)) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert F.group_norm not in targets and gn._OPS.forward.default in targets
    gm.graph.lint()
    # on a device it is not asked to serve, nothing changes
    gm = _dynamo_graph(block, torch.randn(1, 4, 8, 8))
    assert gn._rewrite_group_norms(gm.graph) == 0


def test_compile_pass_rewrites_the_torch_group_norm_dynamo_may_record():
    # Dynamo traces into F.group_norm when its trace rules were built while
    # F.group_norm was patched (a test's monkeypatch, a profiling wrapper);
    # the graph then calls torch.group_norm, which the pass serves alike
    x, w, b = torch.randn(1, 8, 5, 5), torch.randn(8), torch.randn(8)
    gm = _dynamo_graph(lambda t, w, b: torch.group_norm(t, 2, w, b, 1e-3, True), x, w, b)
    assert gn._rewrite_group_norms(gm.graph, devices=("cpu",)) == 1
    (call,) = [n for n in gm.graph.nodes if n.target is gn._OPS.forward.default]
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert list(call.args) == [*inputs, 2, 1e-3]
    assert torch.group_norm not in [n.target for n in gm.graph.nodes]
    gm.graph.lint()
    gm = _dynamo_graph(lambda t: torch.group_norm(t, num_groups=4), torch.randn(1, 8, 5, 5))
    assert gn._rewrite_group_norms(gm.graph, devices=("cpu",)) == 1


def test_compile_pass_serves_f_group_norm_while_a_wrapper_is_patched_in(monkeypatch):
    # graphs hold the F.group_norm torch defines; a wrapper patched over it
    # when the pass runs (no signature of its own) changes nothing
    gm = _dynamo_graph(nn.GroupNorm(2, 8), torch.randn(1, 8, 5, 5))
    monkeypatch.setattr(F, "group_norm", lambda *args, **kwargs: None)
    assert gn._rewrite_group_norms(gm.graph, devices=("cpu",)) == 1


def _fused_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target is gn._OPS.forward_fused.default]


def test_compile_pass_fuses_the_activation_after_group_norm_with_and_without_gradients():
    block = nn.Sequential(nn.Conv2d(4, 8, 3), nn.GroupNorm(2, 8), nn.SiLU())
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        gm = _dynamo_graph(block, x)
    assert gn._rewrite_group_norms(gm.graph, devices=("cpu",)) == 1
    assert gn._fuse_epilogues(gm.graph) == 1
    (fused,) = _fused_calls(gm)
    # (and the convolution's bias as its add: see the test below)
    assert fused.args[5:10] == (None, None, None, [gn._ACTIVATION_CODES["silu"]], 0.01)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert F.silu not in targets and gn._OPS.forward.default not in targets
    gm.graph.lint()
    # where gradients flow (training) too: the fused operator's backward
    # gives every operand's gradient
    gm = _dynamo_graph(block, x)
    assert gn._rewrite_group_norms(gm.graph, devices=("cpu",)) == 1
    assert gn._fuse_epilogues(gm.graph) == 1


def used_twice(t):
    y = F.group_norm(t, 2)
    return F.silu(y) + y


@pytest.mark.parametrize("case", ["chain", "gelu tanh", "two slopes", "output used twice",
                                  "the operator", "not an activation"])
def test_compile_pass_fuses_what_the_kernels_compute(case):
    w, b = torch.randn(8), torch.randn(8)
    codes = gn._ACTIVATION_CODES
    functions = {
        "chain": (lambda t: F.hardswish(torch.tanh(F.group_norm(t, 2, w, b))),
                  [codes["tanh"], codes["hardswish"]], 0.01),
        "gelu tanh": (lambda t: F.gelu(F.group_norm(t, 2, w, b), approximate="tanh"),
                      [codes["gelu_tanh"]], 0.01),
        # one slope a chain: the second leaky_relu stays a graph op
        "two slopes": (lambda t: F.leaky_relu(F.leaky_relu(F.group_norm(t, 2), 0.2), 0.3),
                       [codes["leaky_relu"]], 0.2),
        "output used twice": (used_twice, None, None),
        # the operator itself in the graph (what our group_norm traces to)
        "the operator": (lambda t: F.relu(gn._OPS.forward(t, None, None, 2, 1e-5)[0]),
                         [codes["relu"]], 0.01),
        "not an activation": (lambda t: F.softplus(F.group_norm(t, 2)), None, None),
    }
    fn, expected_codes, slope = functions[case]
    with torch.no_grad():
        gm = _dynamo_graph(fn, torch.randn(2, 8, 5))
    gn._rewrite_group_norms(gm.graph, devices=("cpu",))
    fused = gn._fuse_epilogues(gm.graph)
    gm.graph.lint()
    if expected_codes is None:
        assert fused == 0 and not _fused_calls(gm)
        return
    (call,) = _fused_calls(gm)
    assert fused == 1 and call.args[8:] == (expected_codes, slope)


def _epilogue_graph_case(case):
    """(function, its inputs, the fused call's expected scale/shift/residual
    operands as names of its inputs, expected codes) of a graph case."""
    w, b = torch.randn(8), torch.randn(8)
    silu = [gn._ACTIVATION_CODES["silu"]]

    def scale_shift(t, temb, r):  # diffusers' scale-shift ResNet block, then a residual
        scale, shift = torch.chunk(temb[:, :, None, None], 2, dim=1)
        return F.silu(F.group_norm(t, 2, w, b) * (1 + scale) + shift) + r

    def sum_twice(t, temb, r):
        total = t + temb[:, :8, None, None]
        return F.relu(F.group_norm(total, 2)) + total

    def factor_twice(t, temb, r):
        factor = temb[:, :8, None, None] + 1
        return F.group_norm(t, 2, w, b) * factor + factor

    t, temb, r = torch.randn(2, 8, 5, 3), torch.randn(2, 16), torch.randn(2, 8, 5, 3)
    cases = {
        "scale, shift, silu, residual": (scale_shift, (t, temb, r), (True, True, True, False), silu),
        "shift alone": (lambda t, temb, r: F.group_norm(t, 2) + temb[:, 8:, None, None],
                        (t, temb, r), (False, True, False, False), []),
        "factor used twice": (factor_twice, (t, temb, r), (True, True, False, False), []),
        # diffusers' ResNet block: h + temb[:, :, None, None] before the norm
        "time embedding added before": (
            lambda t, temb, r: F.silu(F.group_norm(t + temb[:, :8, None, None], 2, w, b)),
            (t, temb, r), (False, False, False, True), silu),
        # the sum is kept: no prologue, and it comes back as the residual
        "sum used twice": (sum_twice, (t, temb, r), (False, False, True, False),
                           [gn._ACTIVATION_CODES["relu"]]),
        "per channel, not per sample": (
            lambda t, temb, r: F.silu(F.group_norm(t, 2) * (1 + temb[:1, :8, None, None])),
            (t, temb, r), None, None),
        "scale of another dtype": (
            lambda t, temb, r: F.group_norm(t, 2) * (1 + temb.double()[:, :8, None, None]),
            (t, temb, r), None, None),
        "residual that broadcasts": (lambda t, temb, r: F.relu(F.group_norm(t, 2)) + r[:1],
                                     (t, temb, r), (False, False, False, False),
                                     [gn._ACTIVATION_CODES["relu"]]),
    }
    return cases[case]


def _fusing_backend(calls):
    """A Dynamo backend that runs the pass's two rewrites on CPU graphs and
    appends the fused calls it made to `calls`."""

    def backend(gm, example_inputs):
        gn._rewrite_group_norms(gm.graph, devices=("cpu",))
        gn._fuse_epilogues(gm.graph)
        gm.graph.lint()
        gm.recompile()
        calls.extend(_fused_calls(gm))
        return gm.forward
    return backend


def compiled_with_the_pass(fn, inputs):
    """fn compiled without gradients by a backend that runs the pass's two
    rewrites (CPU kernels registered for the operators), its output checked
    against the eager one; returns the fused calls the pass made."""
    calls = []
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(fn, backend=_fusing_backend(calls), fullgraph=True)(*inputs)
        torch.testing.assert_close(compiled, fn(*inputs), rtol=1e-5, atol=1e-5)
    return calls


def trained_with_the_pass(fn, inputs):
    """fn compiled with gradients for every input by a backend that runs the
    pass's two rewrites (CPU kernels registered for the operators), its
    output and the inputs' gradients checked against eager ones; returns
    the fused calls the pass made."""
    calls = []
    torch._dynamo.reset()
    compiled_inputs = [t.detach().requires_grad_() for t in inputs]
    eager_inputs = [t.detach().requires_grad_() for t in inputs]
    out = torch.compile(fn, backend=_fusing_backend(calls), fullgraph=True)(*compiled_inputs)
    expected = fn(*eager_inputs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(expected)
    grads = torch.autograd.grad(out, compiled_inputs, dy, allow_unused=True)
    expected_grads = torch.autograd.grad(expected, eager_inputs, dy, allow_unused=True)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)
    return calls


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", ["scale, shift, silu, residual", "shift alone", "factor used twice",
                                  "time embedding added before", "sum used twice",
                                  "per channel, not per sample", "scale of another dtype",
                                  "residual that broadcasts"])
def test_compile_pass_fuses_scale_shift_and_residual(operators_on_the_cpu, case, training):
    # the epilogue's tensors, and an add before the norm, folded into the
    # fused call where they are exactly (N, C, 1, ...) or the output's
    # shape, in its dtype; the compiled function (CPU kernels registered
    # for the operators) equals the eager one, and in training every
    # input's gradient too (the fused call's backward gives the input,
    # scale, shift, residual and add gradients)
    fn, inputs, operands, codes = _epilogue_graph_case(case)
    calls = (trained_with_the_pass if training else compiled_with_the_pass)(fn, inputs)
    if operands is None:
        assert not calls
        return
    (call,) = calls
    add = call.args[10] if len(call.args) > 10 else None
    assert tuple(a is not None for a in (*call.args[5:8], add)) == operands
    assert call.args[8] == codes


class _ConvNormBlock(nn.Module):
    """A convolution, then GroupNorm and SiLU: the VAE's ResNet block
    (conv1, norm2); with the time embedding added between, the UNet's."""

    def __init__(self, bias=True, temb=False, shortcut=False):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=bias)
        self.norm = nn.GroupNorm(2, 8)
        self.temb, self.shortcut = temb, shortcut

    def forward(self, x, emb):
        h = self.conv(x)
        total = h + emb[:, :, None, None] if self.temb else h
        y = F.silu(self.norm(total))
        return y + h if self.shortcut else y


@pytest.mark.parametrize("case", ["bias", "bias and time embedding", "no bias",
                                  "convolution used twice"])
def test_compile_pass_folds_a_convolutions_bias_into_the_add(operators_on_the_cpu, case):
    # Inductor adds a CUDA convolution's bias by a pass of its own before an
    # operator: the pass gives the convolution no bias and the fused call an
    # (N, C, 1, 1) add that holds it (plus the time embedding's)
    block = _ConvNormBlock(bias=case != "no bias", temb="time" in case,
                           shortcut=case == "convolution used twice")
    x, emb = torch.randn(2, 4, 6, 5), torch.randn(2, 8)
    with torch.no_grad():
        gm = _dynamo_graph(block, x, emb)
    gn._rewrite_group_norms(gm.graph, devices=("cpu",))
    assert gn._fuse_epilogues(gm.graph) == 1
    gm.graph.lint()
    (conv,) = [n for n in gm.graph.nodes if n.target is torch.conv2d]
    (call,) = _fused_calls(gm)
    folded = case in ("bias", "bias and time embedding")
    assert (conv.args[2] is None) == (case != "convolution used twice")
    assert (len(call.args) > 10 and call.args[10] is not None) == (folded or "time" in case)
    # the compiled block, CPU kernels registered for the operators, equals the eager one
    assert len(compiled_with_the_pass(block, (x, emb))) == 1


@pytest.mark.parametrize("case", ["bias", "bias and time embedding", "convolution used twice"])
def test_compile_pass_folds_a_convolutions_bias_in_training(operators_on_the_cpu, case):
    # with the parameters requiring grad the convolution's bias gets its
    # gradient through the fused call's add, as it would from the convolution
    block = _ConvNormBlock(temb="time" in case, shortcut=case == "convolution used twice")
    eager_block = copy.deepcopy(block)
    x, emb = torch.randn(2, 4, 6, 5), torch.randn(2, 8)
    calls = trained_with_the_pass(block, (x, emb))  # the output and x's and emb's gradients
    assert len(calls) == 1 and (len(calls[0].args) > 10) == (case != "convolution used twice")
    torch._dynamo.reset()
    dy = torch.randn(2, 8, 6, 5)
    compiled = torch.compile(block, backend=_fusing_backend([]), fullgraph=True)
    for module, call in ((block, compiled), (eager_block, eager_block)):
        module.zero_grad()
        call(x, emb).backward(dy)
    for (name, ours), theirs in zip(block.named_parameters(), eager_block.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_compile_pass_leaves_a_convolutions_bias_without_an_epilogue():
    # a GroupNorm with nothing to fuse keeps the plain kernels: the bias stays
    block = nn.Sequential(nn.Conv2d(4, 8, 3), nn.GroupNorm(2, 8))
    with torch.no_grad():
        gm = _dynamo_graph(block, torch.randn(1, 4, 8, 8))
    gn._rewrite_group_norms(gm.graph, devices=("cpu",))
    assert gn._fuse_epilogues(gm.graph) == 0
    (conv,) = [n for n in gm.graph.nodes if n.target is torch.conv2d]
    assert conv.args[2] is not None


def resnet_tail(t, r):  # timm's Bottleneck: x = bn3(x); x += shortcut; x = act3(x)
    x = F.group_norm(t, 2)
    x += r
    return F.relu(x, inplace=True)


def added_twice(t, r):
    total = F.group_norm(t, 2) + r
    return F.relu(total) + total


@pytest.mark.parametrize("case", ["add, then relu", "+=, then relu in place", "add, then a chain",
                                  "sum used twice"])
def test_compile_pass_fuses_a_residual_before_the_activation(operators_on_the_cpu, case):
    # ResNet blocks add the shortcut between the norm and the activation:
    # the fused call adds the residual first; a sum used elsewhere too keeps
    # the activation a graph op (the residual then comes last, nothing after)
    codes = gn._ACTIVATION_CODES
    functions = {
        "add, then relu": (lambda t, r: F.relu(F.group_norm(t, 2) + r), [codes["relu"]], True),
        "+=, then relu in place": (resnet_tail, [codes["relu"]], True),
        "add, then a chain": (lambda t, r: F.hardswish(torch.tanh(F.group_norm(t, 2) + r)),
                              [codes["tanh"], codes["hardswish"]], True),
        "sum used twice": (added_twice, [], False),
    }
    fn, expected_codes, first = functions[case]
    (call,) = compiled_with_the_pass(fn, (torch.randn(2, 8, 5, 3), torch.randn(2, 8, 5, 3)))
    assert call.args[7] is not None and call.args[8] == expected_codes
    assert (len(call.args) > 11 and call.args[11] is True) == first


@pytest.mark.parametrize("case", ["weight of another dtype", "autocast"])
def test_compile_pass_leaves_what_torch_must_compute(case):
    x, w = torch.randn(2, 8, 5), torch.randn(8)
    if case == "weight of another dtype":
        gm = _dynamo_graph(lambda t: F.group_norm(t, 2, w.double()), x)
    else:
        def autocast_group_norm(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.group_norm(t, 2, w)
        gm = _dynamo_graph(autocast_group_norm, x)
    assert any(n.target is F.group_norm for n in gm.graph.nodes)
    assert gn._rewrite_group_norms(gm.graph, devices=("cpu",)) == 0


def test_enable_compile_fusion_installs_one_pass_with_a_uuid(monkeypatch):
    from torch._inductor import config
    try:
        gn.load()
    except gn.ToolchainError as error:
        pytest.skip(f"the extension cannot be built here: {error}")
    monkeypatch.setattr(config, "pre_grad_custom_pass", None)
    gn.enable_compile_fusion()
    gn.enable_compile_fusion()  # twice: still one
    installed = config.pre_grad_custom_pass
    assert installed is gn._compile_pass and installed.uuid() == installed.uuid()
    # Inductor's cache key pickles the config (torch 2.11: the pass itself)
    copied = pickle.loads(pickle.dumps(installed))
    assert type(copied) is type(installed) and copied.uuid() == installed.uuid()
    gn.disable_compile_fusion()
    assert config.pre_grad_custom_pass is None and gn._compile_pass is None


def run_with_the_pass(fn, call, warm=True):
    """call(torch.compile(fn, fullgraph=True)) with the compile pass
    installed and Dynamo reset around it: once to compile (unless not
    warm), then under the profiler. Returns its result and the names of the
    CUDA kernels it launched."""
    from torch.profiler import ProfilerActivity, profile
    gn.enable_compile_fusion()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        if warm:
            call(compiled)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            result = call(compiled)
            torch.cuda.synchronize()
    finally:
        gn.disable_compile_fusion()
        torch._dynamo.reset()
    return result, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def conv_norm_silu(dtype):
    """A conv -> torch's GroupNorm -> SiLU block on the GPU and an input."""
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SiLU())
    return model.cuda().to(dtype), torch.randn(2, 16, 12, 12, device="cuda", dtype=dtype)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_compile_fusion_runs_our_kernels_for_torchs_group_norm(dtype):
    model, x = conv_norm_silu(dtype)

    def output_and_grads(module, t):
        module.zero_grad()
        out = module(t)
        out.double().square().sum().backward()
        return [out, *(p.grad for p in module.parameters())]

    exact = output_and_grads(copy.deepcopy(model).double(), x.double())  # the reference
    eager = output_and_grads(model, x)
    fused, launched = run_with_the_pass(model, lambda compiled: output_and_grads(compiled, x),
                                        warm=False)
    # ours by namespace: the layout Inductor picks decides which kernel runs
    kernels = [name for name in launched if "groupnorm::groupnorm_" in name]
    assert any("backward" not in k for k in kernels), launched
    assert any("groupnorm_backward" in k for k in kernels), launched
    # the SiLU fused in training too: no kernel of Inductor's computes one
    assert not any("silu" in name for name in launched if name not in kernels), launched
    # as close to float64 as torch's eager run in the dtype, give or take a
    # rounding at the largest value (the conv's sums round their own way)
    for name, ours, theirs, ref in zip(["output", "conv.weight", "conv.bias", "norm.weight", "norm.bias"],
                                       fused, eager, exact):
        slack = 4 * torch.finfo(dtype).eps * ref.abs().max().item()
        assert tools.max_error(ours, ref) <= 2 * tools.max_error(theirs, ref) + slack, name


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_compile_fusion_fuses_the_activation_in_inference(dtype):
    # under torch.no_grad the SiLU after torch's GroupNorm runs inside our
    # kernel: every groupnorm kernel launched is a fused instantiation, its
    # SiLU copy or, at vector widths without copies, its Any one (the last
    # template argument, Store::SiLU or Store::Any), and no other kernel
    # computes a SiLU
    model, x = conv_norm_silu(dtype)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        eager = model(x)
        out, launched = run_with_the_pass(model, lambda compiled: compiled(x))
    kernels = [name for name in launched if "groupnorm::" in name]
    fused = (", true, (groupnorm::Store)1>", ", true, (groupnorm::Store)3>")
    assert kernels and all(any(copy in k for copy in fused) for k in kernels), launched
    assert not any("silu" in name for name in launched if name not in kernels), launched
    slack = 4 * torch.finfo(dtype).eps * exact.abs().max().item()
    assert tools.max_error(out, exact) <= 2 * tools.max_error(eager, exact) + slack


def fused_and_exact(fn, args, training):
    """fn's output compiled with the compile pass, eager and in float64 (then
    with `training` each input's gradient too, for one fixed dy: every
    tensor a list's next item), and the CUDA kernels the compiled call
    launched."""
    def run(call, inputs):
        inputs = [t.detach().requires_grad_(training) for t in inputs]
        with torch.set_grad_enabled(training):
            out = call(*inputs)
        if not training:
            return [out]
        dy = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(1),
                         device="cuda", dtype=torch.float64)
        return [out, *torch.autograd.grad(out, inputs, dy.to(out.dtype))]

    exact = run(fn, [a.double() for a in args])
    eager = run(fn, args)
    fused, launched = run_with_the_pass(fn, lambda compiled: run(compiled, args))
    return fused, eager, exact, launched


def assert_fused_as_close_as_eager(fused, eager, exact, launched, dtype, training):
    """Each output and gradient of the compiled call as close to float64 as
    eager torch's in the dtype (give or take a rounding at the largest
    value); our forward ran (and with training our backward) and none of
    Inductor's GroupNorm or SiLU kernels."""
    for i, (ours, theirs, ref) in enumerate(zip(fused, eager, exact)):
        slack = 4 * torch.finfo(dtype).eps * ref.abs().max().item()
        assert tools.max_error(ours, ref) <= 2 * tools.max_error(theirs, ref) + slack, i
    kernels = [name for name in launched if "groupnorm::groupnorm_" in name]
    assert any("backward" not in k for k in kernels), launched
    assert any("groupnorm_backward" in k for k in kernels) == training, launched
    others = [name for name in launched if name not in kernels]
    assert not any("group_norm" in name or "silu" in name for name in others), launched


@cuda
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_compile_fusion_folds_scale_shift_and_residual(dtype, training):
    # diffusers' scale-shift ResNet block with a residual: the graph's
    # (N, C, 1, 1) scale and shift reach the fused operator as they are, and
    # the compiled block is as close to float64 as eager torch is; in
    # training every input's gradient too, from the fused backward
    torch.manual_seed(0)
    x = torch.randn(2, 64, 16, 16, device="cuda", dtype=dtype)
    temb, r = torch.randn(2, 128, device="cuda", dtype=dtype), torch.randn_like(x)
    w, b = torch.randn(64, device="cuda", dtype=dtype), torch.randn(64, device="cuda", dtype=dtype)

    def block(t, temb, r, w, b):
        scale, shift = torch.chunk(temb[:, :, None, None], 2, dim=1)
        return F.silu(F.group_norm(t, 32, w, b) * (1 + scale) + shift) + r

    fused, eager, exact, launched = fused_and_exact(block, (x, temb, r, w, b), training)
    assert_fused_as_close_as_eager(fused, eager, exact, launched, dtype, training)


@cuda
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("temb", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gpu_compile_fusion_folds_a_convolutions_bias(temb, layout, training):
    # the convolution's bias reaches the fused call as its add (with the
    # time embedding's): the compiled block is as close to float64 as eager,
    # in training the gradients of the input, the embedding and every
    # parameter too (the bias's through the fused backward's add)
    torch.manual_seed(0)
    block = _ConvNormBlock(temb=temb).cuda().to(torch.bfloat16)
    x = torch.randn(2, 4, 24, 20, device="cuda", dtype=torch.bfloat16)
    if layout == "channels_last":
        block = block.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    # the embedding an input where the block uses it (each input gets a gradient)
    embs = (torch.randn(2, 8, device="cuda", dtype=torch.bfloat16),) if temb else ()
    params = dict(block.named_parameters())

    def call(x, *rest):  # the parameters as inputs: their gradients come back
        emb, values = (rest[0], rest[1:]) if temb else (None, rest)
        return torch.func.functional_call(block, dict(zip(params, values)), (x, emb))

    fused, eager, exact, launched = fused_and_exact(call, (x, *embs, *params.values()), training)
    assert_fused_as_close_as_eager(fused, eager, exact, launched, torch.bfloat16, training)


# ---------------------------------------------------------------------------
# GPU: the fused epilogue
# ---------------------------------------------------------------------------

def largest_spread(by_group, eps):
    """max |x| * rstd in float64 over groups laid along the last dim: how much
    a group of small spread far from zero cancels, where the tolerance
    table's rounding of x assumes a unit spread."""
    x64 = by_group.double()
    rstd = (x64.var(dim=-1, correction=0, keepdim=True) + eps).rsqrt()
    return (x64.abs() * rstd).max().item()


def epilogue_tolerance(x, w, args, ref_gn, ref_pre, ref, torch_err, spread):
    """float32/64: GroupNorm's tolerance (at least 8 roundings of x at its
    magnitude times rstd, `spread` = max |x| * rstd: a group of small spread
    far from zero cancels that much) scaled by |1 + scale| and by 1.5 per
    activation (the steepest slope among them: hardswish's, at 3), plus a few
    roundings of each activation and of the residual's sum at the largest
    value; float16/bfloat16: the error of torch's unfused sequence in that
    dtype (which rounds after every op) against the same reference, give or
    take half an output ulp at the largest output. Where torch's sequence is
    NaN (torch 2.11's float16 kernel on a group of one value with eps =
    1e-12), float32's bound plus one rounding to x's dtype at the largest
    value: the kernels compute in float32 and round once."""
    dtype = x.dtype
    big = max(ref_pre.abs().max().item(), ref.abs().max().item())
    if args.get("residual") is not None:  # the sum, before the activations too
        big = max(big, ref_pre.abs().max().item() + args["residual"].abs().max().item())
    if dtype in (torch.float16, torch.bfloat16):
        if math.isfinite(torch_err):
            return 1.1 * torch_err + 0.5 * torch.finfo(dtype).eps * ref.abs().max().item()
        return epilogue_tolerance(x.float(), w, args, ref_gn, ref_pre, ref, None, spread) + \
            torch.finfo(dtype).eps * big
    eps = torch.finfo(dtype).eps
    steps = len(gn._activation_steps("test", args.get("activation")))
    scale = args.get("scale")
    gain = (1 + scale.double()).abs().max().item() if scale is not None else 1.0
    gmax = max(w.abs().max().item(), 1.0) if w is not None else 1.0
    norm = max(tolerance(x, ref_gn, dtype, None, w), 8 * eps * spread * gmax)
    return norm * gain * 1.5 ** steps + (2 + 4 * steps) * eps * big


def check_epilogue(x, groups, w, b, args, eps=1e-5, **force):
    """groupnorm_cuda with the epilogue `args` (and forcing arguments), its
    output in a poisoned block, against a float64 reference: GroupNorm
    written out in float64, then the epilogue's torch ops in float64 on the
    GPU (torch's CUDA formulas, which the kernels follow). An (N, C) `add`
    among args is the prologue: the references normalise x + add rounded to
    x's dtype, as torch's add rounds. The epilogue's tensors must come back
    unchanged."""
    epilogue = {k: v for k, v in args.items() if k != "add"}
    s = pre_norm_sum(x, args.get("add"))
    ref_gn = tools.reference_group_norm(s, groups, w, b, eps)
    double = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in epilogue.items()}
    ref_pre = apply_epilogue(ref_gn, scale=double.get("scale"), shift=double.get("shift"))
    ref = apply_epilogue(ref_gn, **double)
    dense = x.is_contiguous() or channels_last_like(x)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    # a copy of x (to make it dense) or s = x + add by a separate pass (plans
    # without the prologue) comes before the output
    y, landed = poisoned(lambda: gn.groupnorm_cuda(x, w, b, groups, eps, **force, **args), x,
                         blocks=1 + (not dense) + ("add" in args))
    assert landed, "output did not reuse a poisoned block"
    assert y.shape == x.shape and y.dtype == x.dtype
    if dense:  # x's memory format, up to the strides of size-1 dims
        assert [st for st, n in zip(y.stride(), y.shape) if n > 1] == \
               [st for st, n in zip(x.stride(), x.shape) if n > 1], \
               f"memory format not kept: {y.stride()} vs {x.stride()}"
    for name, value in before.items():
        assert torch.equal(args[name], value), f"{name} was modified"
    if x.numel() == 0:
        return y
    theirs = apply_epilogue(tools.torch_group_norm(s, groups, w, b, eps), **epilogue)
    spread = largest_spread(s.reshape(s.shape[0], groups, -1), eps)
    tol = epilogue_tolerance(s, w, epilogue, ref_gn, ref_pre, ref, tools.max_error(theirs, ref), spread)
    assert not y.isnan().any(), describe_mismatch(y, ref, tol)
    assert tools.max_error(y, ref) <= tol, describe_mismatch(y, ref, tol)
    return y


@cuda
@pytest.mark.parametrize("case", FORCED, ids=forced_id)
def test_gpu_epilogue_forced_paths(case):
    # every option and their combination on every forced kernel path
    shape, groups, dtype, layout, kernel, n = case
    x, _, force = forced_input(case)
    before = x.clone()
    for _, options in EPILOGUES:
        w, b = affine(shape[1], dtype, "cuda", "both")
        args = epilogue_tensors(x, options)
        if kernel == "registers" and not inline_chain(options.get("activation")):
            # no call of a chain in that kernel (kernels/epilogue.cuh): refused, not bypassed
            with pytest.raises(ValueError, match="takes no activation but SiLU or ReLU alone"):
                gn.groupnorm_cuda(x, w, b, groups, kernel=kernel, **force, **args)
            continue
        check_epilogue(x, groups, w, b, args, kernel=kernel, **force)
    assert torch.equal(x, before), "input was modified"
    # the statistics do not depend on the epilogue where the plan does not:
    # a fused call on few units gives the registers kernel other threads
    # (plan_forward.cpp), which add in another order
    args = epilogue_tensors(x, dict(EPILOGUES)["all"] if kernel != "registers" else INLINE_ALL)
    epilogue = gn._check_epilogue("test", x, args["scale"], args["shift"], args["activation"],
                                  args["residual"])
    ext = gn.load()
    plain = ext.forward(x, w, b, groups, 1e-5, kernel, force.get("team", 0), force.get("lag", 0))
    fused = ext.forward_fused(x, w, b, groups, 1e-5, kernel, force.get("team", 0),
                              force.get("lag", 0), epilogue.scale, epilogue.shift,
                              epilogue.residual, epilogue.codes(), epilogue.slope())
    forcing = dict(kernel=kernel, team=force.get("team", 0), lag=force.get("lag", 0))
    plans = [{k: v for k, v in gn.plan(x, groups, activation=a, **forcing).items() if k != "store"}
             for a in (None, args["activation"])]  # the store's copy aside
    if plans[0] == plans[1]:
        assert torch.equal(plain[1], fused[1]) and torch.equal(plain[2], fused[2])
    else:
        tight = dict(rtol=1e-12, atol=0) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused[1], plain[1], **tight)
        torch.testing.assert_close(fused[2], plain[2], **tight)


@cuda
@pytest.mark.parametrize("case", FORCED, ids=forced_id)
def test_gpu_add_prologue_equals_the_add_first(case):
    # an (N, C) add inside the kernels (the prologue; the stream kernels form
    # s by a separate add first) gives bitwise what the same kernel gives for
    # x + add computed by torch: s rounds as torch's add rounds, and the
    # kernel then sees the same values in the same order. The input and add
    # are left as they were.
    shape, groups, dtype, layout, kernel, n = case
    x, _, force = forced_input(case)
    add = torch.randn(shape[:2], device="cuda").to(dtype)
    w, b = affine(shape[1], dtype, "cuda", "both")
    before = (x.clone(), add.clone())
    per_channel = add.reshape(shape[:2] + (1,) * (len(shape) - 2))
    for activation in (None, "silu"):
        ours = gn.groupnorm_cuda(x, w, b, groups, kernel=kernel, add=add, activation=activation,
                                 **force)
        # the fused kernel for x + add too: a scale of zeros changes no value
        options = {"activation": activation} if activation else {"scale": torch.zeros_like(add)}
        first = gn.groupnorm_cuda(x + per_channel, w, b, groups, kernel=kernel, **options, **force)
        assert torch.equal(ours, first), (activation, tools.max_error(ours, first))
    assert torch.equal(x, before[0]) and torch.equal(add, before[1]), "an input was modified"


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout,kernel,shape,team", [
    ("contiguous", "reference", (2, 32, 6, 8), 0), ("contiguous", "contiguous", (2, 32, 6, 8), 0),
    ("contiguous", "contiguous", (1, 32, 200, 200), 1),  # part kept: the separate add
    ("contiguous", "registers", (2, 32, 6, 8), 0), ("contiguous", "stream", (2, 32, 6, 8), 0),
    ("channels_last", "channels_last", (2, 32, 6, 8), 0),
    ("channels_last", "registers", (2, 32, 6, 8), 0),
    ("channels_last", "stream", (2, 32, 6, 8), 0)])  # the separate add
def test_gpu_add_rounds_as_torch_at_the_edges(dtype, layout, kernel, shape, team):
    # 16-bit lanes are added two an instruction (rounded_sum): sums in the
    # subnormal range, sums that overflow, large plus small, carries, exact
    # zeros, each group against torch's add first through the same kernel
    tiny = torch.finfo(dtype).tiny / 8  # a magnitude among each dtype's subnormals
    big = torch.finfo(dtype).max * 0.9
    groups, rest = 8, (shape[0], 4, *shape[2:])  # groups of 4 channels
    x = torch.randn(shape, device="cuda") * tiny
    add = torch.randn(shape[:2], device="cuda") * tiny  # group 0: subnormal sums
    x[:, 4:8], add[:, 4:8] = big, big / 6  # group 1: inf
    x[:, 8:12] = torch.randn(rest, device="cuda")  # group 2: x plus a subnormal
    x[:, 12:16] = torch.randn(rest, device="cuda") * 100
    add[:, 12:16] = torch.randn(shape[0], 4, device="cuda") * 0.01  # group 3: carries
    x[:, 16:18], add[:, 16:18] = 3.0, -3.0  # group 4: exact zeros beside other values
    x[:, 18:20] = torch.randn(shape[0], 2, *shape[2:], device="cuda")
    add[:, 18:20] = 0.5
    x, add = x.to(dtype), add.to(dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    w, _ = affine(shape[1], dtype, "cuda", "weight")  # no bias: y keeps tiny differences
    ours = gn.groupnorm_cuda(x, w, None, groups, kernel=kernel, team=team, add=add,
                             activation="silu")
    first = gn.groupnorm_cuda(x + add[:, :, None, None], w, None, groups, kernel=kernel,
                              team=team, activation="silu")
    assert ours[:, 4:8].isnan().all() and not ours[:, 8:].isnan().any()
    torch.testing.assert_close(ours, first, rtol=0, atol=0, equal_nan=True)


@cuda
@pytest.mark.parametrize("shape,groups,layout,kernel,team", [
    ((2, 64, 24, 20), 8, "channels_last", "stream", 0),
    ((300, 32, 4, 6), 8, "channels_last", "stream", 0),
    ((1, 8, 200, 200), 1, "contiguous", "contiguous", 1),  # a CTA keeps part of the group
    ((2, 16, 300, 300), 2, "channels_last", "channels_last", 1)])
def test_gpu_add_of_odd_address_and_many_samples(shape, groups, layout, kernel, team):
    # the separate add (add_per_channel_kernel) reads vectors of add where x
    # is channels-last: an add 2 bytes off narrows them; a batch larger than
    # the CTAs it wants gives each sample one CTA
    x = make_input(shape, torch.float16, layout, "cuda", shift=2.0)
    flat = torch.randn(1 + shape[0] * shape[1], device="cuda").half()
    add = flat[1:].view(shape[:2])
    assert add.data_ptr() % 4 != 0
    w, b = affine(shape[1], torch.float16, "cuda", "both")
    force = {"team": team} if team else {}
    ours = gn.groupnorm_cuda(x, w, b, groups, kernel=kernel, add=add, activation="silu", **force)
    first = gn.groupnorm_cuda(x + add[:, :, None, None], w, b, groups, kernel=kernel,
                              activation="silu", **force)
    assert torch.equal(ours, first), (shape, tools.max_error(ours, first))


@cuda
def test_gpu_epilogue_residual_of_other_strides_and_alignment():
    w, b = affine(32, torch.float16, "cuda", "both")
    for layout, other in (("contiguous", "channels_last"), ("channels_last", "contiguous")):
        x = make_input((2, 32, 12, 10), torch.float16, layout, "cuda")
        residual = make_input((2, 32, 12, 10), torch.float16, other, "cuda")
        assert residual.stride() != x.stride()
        check_epilogue(x, 4, w, b, dict(residual=residual, activation="gelu"))  # copied first
        check_epilogue(x, 4, w, b, dict(residual=x, activation="relu"))  # the input itself
    x = make_input((2, 32, 12, 10), torch.float16, "contiguous", "cuda")
    sliced = torch.randn(2, 64, 12, 10, device="cuda").half()[:, ::2]  # neither layout
    check_epilogue(x, 4, w, b, dict(residual=sliced))
    flat = torch.randn(1 + x.numel(), device="cuda").half()
    misaligned = flat[1:].view(x.shape)  # 2 bytes off: the vectors narrow for it
    assert misaligned.data_ptr() % 16 != 0
    for kernel in ("auto", "contiguous", "reference"):
        check_epilogue(x, 4, w, b, dict(residual=misaligned, shift=torch.randn(2, 32, device="cuda").half()),
                       kernel=kernel)


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_epilogue_nan_and_inf_propagate_like_torch(layout):
    x = make_input((2, 16, 6, 6), torch.float32, layout, "cuda")
    x[0, 1, 2, 3] = float("nan")
    residual = torch.randn_like(x)
    residual[1, 9, 0, 0] = float("inf")
    residual[1, 3, 1, 1] = float("-inf")
    scale = torch.randn(2, 16, device="cuda")
    scale[1, 5] = float("nan")
    for activation in ACTIVATIONS:
        args = dict(scale=scale, activation=activation, residual=residual)
        y = gn.groupnorm_cuda(x, None, None, 4, **args)
        expected = apply_epilogue(tools.torch_group_norm(x, 4, None, None, 1e-5), **args)
        assert torch.equal(y.isnan(), expected.isnan()), activation
        finite = expected.isfinite()
        assert torch.equal(y[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()])
        torch.testing.assert_close(y[finite], expected[finite], rtol=1e-5, atol=1e-5)


@cuda
def test_gpu_epilogue_bad_arguments():
    x = torch.randn(2, 6, 4, device="cuda")
    s = torch.randn(2, 6, device="cuda")
    ext = gn.load()
    cases = [
        (lambda: gn.group_norm(x, 3, scale=s.double()), TypeError, "scale dtype must be the input's"),
        (lambda: gn.groupnorm_cuda(x, None, None, 3, shift=s.cpu()), ValueError, "input's device"),
        (lambda: gn.group_norm(x, 3, residual=torch.randn(2, 6, 5, device="cuda")), ValueError,
         "residual must have the input's shape"),
        (lambda: gn.group_norm(x, 3, scale=torch.randn(2, 6, 4, device="cuda")), ValueError,
         "scale must have shape (N, C) = (2, 6)"),
        (lambda: gn.group_norm(x, 3, activation="swish"), ValueError, "unknown activation"),
        # the extension's own checks
        (lambda: ext.forward_fused(x, None, None, 3, 1e-5, "auto", 0, 0, None, None, None, [9], 0.01),
         ValueError, "unknown activation code 9"),
        (lambda: ext.forward_fused(x, None, None, 3, 1e-5, "auto", 0, 0, None, None, None, [0] * 5,
                                   0.01), ValueError, "at most 4 activations"),
        (lambda: ext.forward_fused(x, None, None, 3, 1e-5, "auto", 0, 0, s.t(), None, None, [], 0.01),
         ValueError, "scale must have shape [2, 6]"),
        (lambda: ext.forward_fused(x, None, None, 3, 1e-5, "auto", 0, 0, None, s.half(), None, [],
                                   0.01), TypeError, "shift has dtype Half"),
        (lambda: ext.forward_fused(x, None, None, 3, 1e-5, "auto", 0, 0, None, None, x.cpu(), [],
                                   0.01), ValueError, "residual is on cpu"),
        (lambda: ext.forward_fused(x, None, None, 3, 1e-5, "auto", 0, 0, None, None, None, [4],
                                   float("nan")), ValueError, "slope must be finite"),
    ]
    raise_each(cases)


@cuda
def test_gpu_epilogue_under_torch_compile():
    # graphs call the fused operator: the eager result, bitwise, without
    # gradients; with them, the eager gradients (Inductor compiles the
    # backward's torch ops its own way)
    x = make_input((2, 16, 6, 6), torch.float16, "channels_last", "cuda")
    s = torch.randn(2, 16, 1, 1, device="cuda").half()
    layer = gn.GroupNorm(4, 16, activation="silu").cuda().half()
    functions = [lambda t: gn.group_norm(t, 4, scale=s, shift=s[:, :, 0, 0], activation="gelu",
                                         residual=t),
                 layer]
    for fn in functions:
        with torch.no_grad():
            expected = fn(x)
            for fullgraph in (True, False):
                torch._dynamo.reset()
                torch.testing.assert_close(torch.compile(fn, fullgraph=fullgraph)(x), expected,
                                           rtol=0, atol=0)
        dy = torch.randn_like(x)
        leaf = x.detach().requires_grad_()
        (eager,) = torch.autograd.grad(fn(leaf), leaf, dy)
        torch._dynamo.reset()
        (compiled,) = torch.autograd.grad(torch.compile(fn, fullgraph=True)(leaf), leaf, dy)
        torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


def epilogue_leaves(x, w, b, args):
    """x, w, b (either may be None: no leaf) and the epilogue's tensors as
    fresh leaves that want gradients, and the epilogue's arguments over them."""
    leaves = {"input": x, "weight": w, "bias": b,
              **{k: v for k, v in args.items() if isinstance(v, torch.Tensor)}}
    leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items() if v is not None}
    return leaves, {**args, **{k: leaves[k] for k in args if isinstance(args[k], torch.Tensor)}}


def off_kinks(dy, x, weight, bias, args, groups=8, eps=1e-5):
    """dy, zero where the pre-activation lies so near a jump in the slope of
    the activation chain (hardswish at +-3, relu at 0) that rounding in x's
    dtype may pick the side: within four times torch's own rounding of it
    there plus two ulps. One element's jump would swamp the comparison."""
    if args.get("activation") is None:
        return dy

    def pre_activation(cast):
        small = {k: cast(args[k]) for k in ("scale", "shift") if k in args}
        weight_, bias_ = (None if t is None else cast(t) for t in (weight, bias))
        z = apply_epilogue(unfused_group_norm(cast(x), groups, weight_, bias_, eps), **small)
        if args.get("residual_before_activation"):
            z = z + cast(args["residual"])
        return z.double()

    z = pre_activation(torch.Tensor.double)
    delta = 4 * (pre_activation(lambda t: t) - z).abs() + 2 * torch.finfo(x.dtype).eps * z.abs()

    def slope(at):
        at = at.detach().requires_grad_()
        return torch.autograd.grad(apply_epilogue(at, activation=args["activation"]).sum(), at)[0]

    return dy.masked_fill((slope(z + delta) - slope(z - delta)).abs() > 0.1, 0)


def fused_gradients(x, w, b, args, dy, groups):
    """Every gradient of the fused call (ours) and of the unfused torch
    sequence in x's dtype (theirs) and in float64 (exact). args: the
    epilogue's options, add included; w and b may be None."""
    def gradients(fn, cast):
        leaves, call_args = epilogue_leaves(cast(x), *(None if t is None else cast(t) for t in (w, b)),
                                            {k: cast(v) if isinstance(v, torch.Tensor) else v
                                             for k, v in args.items()})
        y = fn(leaves["input"], leaves.get("weight"), leaves.get("bias"), call_args)
        return dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), cast(dy))))

    def torch_sequence(t, weight, bias, call_args):
        rest = dict(call_args)
        add = rest.pop("add", None)
        total = t if add is None else t + broadcast_add(add, t)
        return apply_epilogue(F.group_norm(total, groups, weight, bias, 1e-5), **rest)

    ours = gradients(lambda t, weight, bias, a: gn.group_norm(t, groups, weight, bias, **a),
                     lambda v: v)
    return ours, gradients(torch_sequence, lambda v: v), gradients(torch_sequence, lambda v: v.double())


def assert_as_close_as_torch(ours, theirs, exact, dtype):
    """Each gradient within twice torch's own error in the dtype (four times
    for float32, as the plain backward's bound, gradient_tolerance: shifted
    inputs' errors come from the statistics, which differ by a few times
    either way) plus four ulps of the largest, and 1e-12 as
    gradient_tolerance: in float64 torch's sequence is the reference itself
    (its error 0), our sums add in another order."""
    factor = 4 if dtype == torch.float32 else 2
    for key, ref in exact.items():
        slack = 4 * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1e-30) + 1e-12
        error, torch_error = tools.max_error(ours[key], ref), tools.max_error(theirs[key], ref)
        assert error <= factor * torch_error + slack, (key, error, torch_error)


def forced_fused_gradients(x, w, b, args, dy, groups, kernel, need_dx=True, need_affine=True):
    """The fused backward's gradients of input (need_dx), weight and bias
    (need_affine, where given) and of the scale, shift and (N, C) add that
    args holds, from the extension with its kernel forced; the statistics
    from the extension's fused forward. The residual's gradient (dy) is not
    the kernels'."""
    ext = gn.load()
    steps = gn._activation_steps("test", args.get("activation"))
    codes = [gn._ACTIVATION_CODES[name] for name, _ in steps]
    slope = next((v for _, v in steps if v is not None), 0.01)
    scale, shift, add = (args.get(k) for k in ("scale", "shift", "add"))
    _, mean, rstd = ext.forward_fused(x, w, b, groups, 1e-5, "auto", 0, 0, scale, shift, None,
                                      codes, slope, add)
    grads = ext.backward_fused(dy, x, mean, rstd, w, b, groups, scale, shift, codes, slope, add,
                               need_dx, need_affine, scale is not None, shift is not None,
                               add is not None, kernel)
    wanted = {"input": need_dx, "weight": need_affine and w is not None,
              "bias": need_affine and b is not None, **{k: k in args for k in ("scale", "shift", "add")}}
    return {k: g for k, g in zip(wanted, grads) if wanted[k]}


# Shapes for the fused registers backward, forced (16-byte vectors, at most
# 512 threads, a table of three sums an entry): each layout's thread and
# table arrangements, one channel a group and one group, a 1-D and a 3-D
# input, and the largest groups it takes. Fields: what the plan must hold.
FUSED_BACKWARD_REGISTERS = [  # (shape, groups, dtypes, layout, fields)
    ((2, 32, 8, 8), 8, (BF16, F16), "contiguous", dict(threads=32)),
    ((2, 32, 8, 8), 8, (F32,), "contiguous", dict(threads=64)),
    ((2, 32, 8, 8), 8, (F64,), "contiguous", dict(threads=128)),
    ((3, 40, 16, 16), 4, (F16,), "contiguous", dict(vec=8, threads=320)),
    ((2, 8, 16, 16), 8, (F32,), "contiguous", dict(vec=4, threads=64, tiles=16)),  # G = C
    ((2, 16, 8, 8), 1, (BF16,), "contiguous", dict(vec=8, tiles=2)),  # G = 1
    ((4, 16, 100), 4, (F32,), "contiguous", dict(vec=4)),  # 1-D
    ((2, 8, 64, 64), 4, (F32,), "contiguous", dict(threads=512, smem=24576)),  # largest
    ((256, 32, 16, 16), 8, (F16,), "contiguous", dict(threads=32)),  # many units: 4 a thread
    ((6, 1280, 8, 8), 32, (BF16,), "contiguous", dict(threads=256)),  # 2 units an SM: 1-2 a thread
    ((2, 32, 10, 10), 8, (F32,), "channels_last", dict(vec=4, threads=128)),
    ((2, 64, 10, 10), 8, (BF16, F16), "channels_last", dict(vec=8, threads=128)),
    ((2, 80, 8, 8), 2, (BF16, F16), "channels_last", dict(vec=8, threads=320)),
    ((2, 16, 9, 11), 4, (F64,), "channels_last", dict(vec=2, threads=224)),
    ((2, 16, 4, 6, 6), 2, (BF16,), "channels_last", dict(vec=8, threads=160)),  # 3-D
    ((2, 256, 30, 32), 16, (F16,), "channels_last", dict(threads=480, smem=46080)),  # largest
    ((6, 1280, 8, 8), 32, (BF16,), "channels_last", dict(threads=160)),  # 2 units an SM
]
FUSED_BACKWARD_REGISTERS_CASES = [
    (shape, groups, dtype, layout, fields)
    for shape, groups, dtypes, layout, fields in FUSED_BACKWARD_REGISTERS for dtype in dtypes]
# SiLU with every small input (taken back inline), GELU (the chain kernel
# first) with scale, a leaky ReLU with add and shift, add alone
FUSED_BACKWARD_FORMS = [
    dict(activation="silu", scale=True, shift=True, add=True),
    dict(activation="gelu", scale=True),
    dict(activation=("leaky_relu", 0.2), shift=True, add=True),
    dict(add=True),
]


@cuda
@pytest.mark.parametrize("case", FUSED_BACKWARD_REGISTERS_CASES, ids=layout_case_id)
def test_gpu_fused_backward_registers_kernel(case):
    # every gradient of each form from the registers kernel and from the
    # passes, forced, against the unfused torch sequence in float64
    shape, groups, dtype, layout, fields = case
    x = make_input(shape, dtype, layout, "cuda", shift=1.0)
    plan = gn.plan(x, groups, kernel="registers", backward=True, fused=True)
    assert plan["kernel"] == "registers" and plan["layout"] == layout and plan_has(plan, fields), \
        (fields, plan)
    N, C = shape[:2]
    w, b = affine(C, dtype, "cuda", "both")
    for form in FUSED_BACKWARD_FORMS:
        args = epilogue_tensors(x, form)
        if form.get("add"):
            args["add"] = torch.randn(N, C, device="cuda").to(dtype)
        total = x + broadcast_add(args["add"], x) if "add" in args else x
        dy = off_kinks(torch.randn_like(x), total, w, b,
                       {k: v for k, v in args.items() if k != "add"}, groups)
        _, theirs, exact = fused_gradients(x, w, b, args, dy, groups)
        for kernel in ("registers", "passes"):
            forced = forced_fused_gradients(x, w, b, args, dy, groups, kernel)
            assert set(forced) == set(exact), (forced.keys(), exact.keys())
            assert_as_close_as_torch(forced, theirs, exact, dtype)
    # ReLU, no weight or bias, and the small tensors' gradients alone (no dx
    # written: the sums and dadd without the dx pass)
    args = dict(epilogue_tensors(x, dict(activation="relu", scale=True, shift=True)),
                add=torch.randn(N, C, device="cuda").to(dtype))
    dy = off_kinks(torch.randn_like(x), x + broadcast_add(args["add"], x), None, None,
                   {k: v for k, v in args.items() if k != "add"}, groups)
    _, theirs, exact = fused_gradients(x, None, None, args, dy, groups)
    for kernel in ("registers", "passes"):
        forced = forced_fused_gradients(x, None, None, args, dy, groups, kernel, need_dx=False)
        assert set(forced) == {"scale", "shift", "add"}, forced.keys()
        assert_as_close_as_torch(forced, theirs, {k: exact[k] for k in forced}, dtype)


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_fused_backward_takes_registers_below_l2_size(layout):
    # autograd's fused backward takes the registers kernel where the plain
    # one does (16-byte vectors), shifted input included, unless the chain
    # kernel runs first; elsewhere the passes, and forcing the registers
    # kernel names the limit
    for shape, groups, dtype in [((2, 1280, 16, 16), 32, F16), ((8, 1280, 8, 8), 32, BF16),
                                 ((4, 32, 8, 8), 8, F32)]:
        x = make_input(shape, dtype, layout, "cuda", shift=1000.0)
        assert gn.plan(x, groups, backward=True, activation="silu")["kernel"] == "registers"
        assert gn.plan(x, groups, backward=True, fused=True)["kernel"] == "registers"
        assert gn.plan(x, groups, backward=True, activation="gelu")["kernel"] == "passes"
        N, C = shape[:2]
        w, b = affine(C, dtype, "cuda", "both")
        args = dict(activation="silu", scale=0.5 * torch.randn(N, C, device="cuda").to(dtype),
                    add=torch.randn(N, C, device="cuda").to(dtype))
        dy = torch.randn_like(x)
        ours, theirs, exact = fused_gradients(x, w, b, args, dy, groups)
        assert_as_close_as_torch(ours, theirs, exact, dtype)
        # autograd ran the registers kernel: bitwise its forced gradients (no atomics)
        forced = forced_fused_gradients(x, w, b, args, dy, groups, "registers")
        assert all(torch.equal(ours[k], forced[k]) for k in forced), \
            [k for k in forced if not torch.equal(ours[k], forced[k])]
    for shape, groups, dtype, limit in [((2, 16, 64, 65), 4, F32, "holds a group in one CTA"),
                                        ((2, 12, 9, 11), 3, F16, "takes 16-byte vectors")]:
        x = make_input(shape, dtype, layout, "cuda")
        assert gn.plan(x, groups, backward=True, fused=True)["kernel"] == "passes"
        with pytest.raises(ValueError, match=f"fused registers kernel {limit}"):
            gn.plan(x, groups, kernel="registers", backward=True, fused=True)
    x = make_input((2, 32, 8, 8), F32, layout, "cuda")
    with pytest.raises(ValueError, match="the fused backward has no stream kernel"):
        gn.plan(x, 8, kernel="stream", backward=True, fused=True)


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name, options", EPILOGUES, ids=[name for name, _ in EPILOGUES])
def test_gpu_epilogue_gradients_match_float64(name, options, dtype, layout):
    # every input's gradient through the fused backward against the unfused
    # torch sequence in float64: as close as that sequence in the dtype is
    x = make_input((2, 32, 9, 7), dtype, layout, "cuda", shift=1.0)
    w, b = affine(32, dtype, "cuda", "both")
    args = epilogue_tensors(x, options)
    dy = off_kinks(torch.randn_like(x), x, w, b, args)
    assert_as_close_as_torch(*fused_gradients(x, w, b, args, dy, 8), dtype)


@cuda
@pytest.mark.parametrize("return_sum", [False, True], ids=["y", "y and s"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("form", list(ADD_FORMS))
def test_gpu_add_matches_float64(form, dtype, layout, return_sum):
    # the pre-norm sum on the CUDA path (the kernels' prologue for an (N, C)
    # add without return_sum, else torch's add first): y, s and every
    # gradient against the torch sequence in float64, as close as that
    # sequence in the dtype is; s bitwise torch's add
    x = make_input((2, 32, 9, 7), dtype, layout, "cuda", shift=1.0)
    add = torch.randn(ADD_FORMS[form](2, 32, (9, 7)), device="cuda").to(dtype)
    w, b = affine(32, dtype, "cuda", "both")
    dy, ds = torch.randn_like(x), torch.randn_like(x)

    def run(fn, cast):
        leaves = [cast(t).detach().requires_grad_() for t in (x, add, w, b)]
        y, total = fn(*leaves)
        grads = torch.autograd.grad((y * cast(dy)).sum() + (total * cast(ds)).sum(), leaves)
        return {"y": y.detach(), "s": total.detach(),
                **dict(zip(("dx", "dadd", "dweight", "dbias"), grads))}

    def ours(t, a, weight, bias):
        if return_sum:
            return gn.group_norm(t, 8, weight, bias, add=a, activation="silu", return_sum=True)
        return (gn.group_norm(t, 8, weight, bias, add=a, activation="silu"),
                t + broadcast_add(a, t))  # s for the loss's second term, by torch

    def sequence(t, a, weight, bias):
        total = t + broadcast_add(a, t)
        return F.silu(F.group_norm(total, 8, weight, bias)), total

    mine, exact, theirs = run(ours, lambda v: v), run(sequence, lambda v: v.double()), \
        run(sequence, lambda v: v)
    assert torch.equal(mine["s"], theirs["s"])
    for key, ref in exact.items():
        slack = 4 * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1e-30)
        error, torch_error = tools.max_error(mine[key], ref), tools.max_error(theirs[key], ref)
        assert error <= 2 * torch_error + slack, (key, error, torch_error)
    # and forced kernels take it too
    y, total = gn.groupnorm_cuda(x, w, b, 8, add=add, return_sum=True, kernel="reference")
    torch.testing.assert_close(y, gn.groupnorm_cuda(x + broadcast_add(add, x), w, b, 8,
                                                    kernel="reference"), rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "mish", ("tanh", "sigmoid")])
def test_gpu_epilogue_gradcheck(activation):
    # float64 finite differences through every input of the fused op
    x = make_input((2, 8, 5, 3), torch.float64, "contiguous", "cuda")
    w, b = affine(8, torch.float64, "cuda", "both")
    args = dict(epilogue_tensors(x, dict(scale=True, shift=True, residual=True)),
                activation=activation)
    leaves, call_args = epilogue_leaves(x, w, b, args)
    names = list(leaves)

    def fn(*tensors):
        given = dict(zip(names, tensors))
        return gn.group_norm(given["input"], 4, given["weight"], given["bias"],
                             **{k: given.get(k, v) for k, v in call_args.items()})

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()), eps=1e-6, atol=1e-5)


@cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 64, 128, 256), (3, 40, 40000)], ids=["2-D", "1-D"])
@pytest.mark.parametrize("activation, dtype, shift", [
    ("silu", torch.float32, 1000.0), ("silu", torch.bfloat16, 1.0),
    (("tanh", "hardswish"), torch.bfloat16, 1.0)],
    ids=["silu float32 1000+randn", "silu bfloat16", "chain bfloat16"])
def test_gpu_fused_backward_over_chunked_tiles(activation, dtype, shift, shape, layout):
    # the fused backward's passes where a channel's positions are cut into
    # several chunks, whose sums of g, g * (s - mean) and s - mean the
    # coefficients add: add, scale, shift, the activation and the residual
    # at once, every gradient against the unfused torch sequence in float64.
    # Not the chain on float32 1000+randn: there one rounding of a group's
    # mean moves every z of the group alike, and through the chain's second
    # derivative the sums' error is that rounding's, a few times torch's own
    # or a fraction of it by chance (2.2x and over 4x in two runs). Rows of
    # at least 64 KiB, so that contiguous ones are cut too (pieces of 32 KiB
    # or more, plan_backward.cpp)
    x = make_input(shape, dtype, layout, "cuda", shift=shift)
    plan = gn.plan(x, 8, backward=True, activation=activation)
    assert plan["kernel"] == "passes" and plan["chunks"] > 1, plan
    N, C = shape[:2]
    w, b = affine(C, dtype, "cuda", "both")
    args = dict(epilogue_tensors(x, dict(scale=True, shift=True, residual=True)),
                activation=activation, add=torch.randn(N, C, device="cuda").to(dtype))
    total = x + broadcast_add(args["add"], x)
    kinks = {k: v for k, v in args.items() if k != "add"}
    dy = off_kinks(torch.randn_like(x), total, w, b, kinks)
    assert_as_close_as_torch(*fused_gradients(x, w, b, args, dy, 8), dtype)


@cuda
def test_gpu_fused_backward_of_input_larger_than_l2():
    # the plain backward streams such input; the fused one takes the passes
    x = make_input((1, 128, 512, 512), torch.bfloat16, "contiguous", "cuda", shift=1.0)
    w, b = affine(128, torch.bfloat16, "cuda", "both")
    args = dict(activation="silu", add=torch.randn(1, 128, device="cuda").to(torch.bfloat16),
                scale=0.5 * torch.randn(1, 128, device="cuda").to(torch.bfloat16))
    assert_as_close_as_torch(*fused_gradients(x, w, b, args, torch.randn_like(x), 32),
                             torch.bfloat16)


@cuda
def test_gpu_epilogue_takes_the_cuda_path_and_module_and_autocast(monkeypatch):
    forbid_torch_group_norm(monkeypatch)
    x = make_input((2, 32, 9, 9), torch.float16, "channels_last", "cuda")
    s, t = torch.randn(2, 32, 1, 1, device="cuda").half(), torch.randn(2, 32, device="cuda").half()
    with torch.no_grad():
        ours = gn.group_norm(x, 8, scale=s, shift=t, activation="mish")
        check_epilogue(x, 8, None, None, dict(scale=s, shift=t, activation="mish"))
        torch.testing.assert_close(ours, gn.groupnorm_cuda(x, None, None, 8, scale=s, shift=t,
                                                           activation="mish"), rtol=0, atol=0)
        layer = gn.GroupNorm(8, 32, activation=("leaky_relu", 0.1)).cuda().half()
        expected = gn.groupnorm_cuda(x, layer.weight, layer.bias, 8, activation=("leaky_relu", 0.1))
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
        with torch.autocast("cuda", dtype=torch.float16):  # float32, as torch's group_norm
            y = gn.group_norm(x, 8, scale=s, activation="silu")
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, gn.groupnorm_cuda(x.float(), None, None, 8, scale=s.float(),
                                                        activation="silu"), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# GPU: kernel instantiations that no other test launches
# ---------------------------------------------------------------------------

# The fused kernels' copies per store kind (kernels/launch.cuh, with_store):
# no activation, SiLU alone and ReLU alone, each without a residual, at the
# vector width the kernel's planner prefers (8 bytes for the channels-last
# team kernel, 16 for the others; kernels/kernel_shapes.h). Each row reaches
# that width for bfloat16, float16 and float32 with the plan fields it lists
# (both merges of the stream kernels, both items of the registers kernel),
# so that every copy is launched.
STORE_COPY_ROWS = [  # (shape, groups, layout, kernel, lag or team, plan fields)
    ((8, 1024, 26, 40), 64, "contiguous", "stream", 10**9, dict(merge="once")),
    ((2, 16, 48, 56), 2, "contiguous", "stream", 1, dict(merge="each")),
    ((2, 248, 40, 40), 31, "channels_last", "stream", 0, dict(merge="once")),
    ((2, 32, 40, 40), 4, "channels_last", "stream", 0, dict(merge="each")),
    ((2, 32, 16, 16), 8, "contiguous", "contiguous", 0, dict()),
    ((2, 64, 12, 12), 8, "channels_last", "channels_last", 0, dict()),
    ((8, 1280, 8, 8), 32, "contiguous", "registers", 0, dict(items=4, ranks=1)),
    ((2, 16, 64, 64), 2, "contiguous", "registers", 0, dict(items=16, ranks=1)),
]
STORE_KINDS = [("none", dict(scale=True, shift=True)), ("silu", dict(activation="silu")),
               ("relu", dict(scale=True, activation="relu"))]


@cuda
@pytest.mark.parametrize("dtype", (BF16, F16, F32), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("row", STORE_COPY_ROWS, ids=lambda r: f"{shape_id(r[:2])}-{r[2]}-{r[3]}")
def test_gpu_store_copies_equal_the_any_copy(row, dtype):
    # each copy against float64, and bitwise against the same kernel's Any
    # copy, which a zero residual takes: a copy leaves out the tests of the
    # options it cannot meet, none of the arithmetic
    shape, groups, layout, kernel, n, fields = row
    x, _, force = forced_input((shape, groups, dtype, layout, kernel, n))
    w, b = affine(shape[1], dtype, "cuda", "both")
    zero = torch.zeros_like(x)
    wide = 8 if kernel == "channels_last" else 16
    for store, options in STORE_KINDS:
        plan = gn.plan(x, groups, kernel=kernel, fused=True, activation=options.get("activation"),
                       **force)
        assert plan["store"] == store and plan["vec"] * x.element_size() == wide, plan
        assert plan_has(plan, fields), (fields, plan)
        args = epilogue_tensors(x, options)
        if store == "silu":  # ResnetBlock2D's norm2: the (N, C) add before the norm
            args["add"] = torch.randn(shape[:2], device="cuda").to(dtype)
        check_epilogue(x, groups, w, b, args, kernel=kernel, **force)
        copy = gn.groupnorm_cuda(x, w, b, groups, kernel=kernel, **args, **force)
        any_copy = gn.groupnorm_cuda(x, w, b, groups, kernel=kernel, **args, residual=zero,
                                     **force)
        assert torch.equal(copy, any_copy), (store, tools.max_error(copy, any_copy))


@cuda
def test_gpu_store_copies_only_at_the_preferred_width_and_not_for_double():
    # a width the kernel has no copies for, and double, take the Any copy
    for shape, groups, dtype, layout, kernel in [
            ((2, 16, 30, 45), 2, F16, "contiguous", "stream"),  # 4-byte vectors
            ((2, 16, 48, 56), 2, F64, "contiguous", "stream"),
            ((2, 2680, 5, 3), 67, BF16, "channels_last", "channels_last")]:  # 16-byte vectors
        x = make_input(shape, dtype, layout, "cuda")
        plan = gn.plan(x, groups, kernel=kernel, activation="silu")
        assert plan["store"] == "any", plan
        w, b = affine(shape[1], dtype, "cuda", "both")
        check_epilogue(x, groups, w, b, dict(activation="silu"), kernel=kernel)


# Each row launches, for each of its dtypes T, the kernel instantiations its
# comment names, which the rest of the GPU tests never reach (what
# tools/kernel_coverage.py reports). Template arguments: stream kernels
# <T, V, kEachMerges, kFused, store>, team kernels <T, V, kFused, store>, the
# reference kernel <T, kFused>, the registers kernel <T, V, items a thread,
# kFused, store>, the backward's <T, V>; * is both values: a forward row runs
# plain (store Bare) and with every epilogue option at once (store Any; in the
# registers kernel, SiLU for the chain; STORE_COPY_ROWS launch the other
# stores' copies). V is the widest
# vector of at most 16 bytes that divides HxW (contiguous), C / G (the
# channels-last stream kernels) or C (the channels-last passes and team
# kernel, whose vectors are 8 bytes unless a row of them would need more than
# its 512 threads). The contiguous stream merges by the lag: at 1 every
# normalise item merges its unit's partials; at 10**9 over 1024 pieces, one
# merge a unit wherever at most 1362 CTAs are resident (8 of 256 threads a
# SM, the most there can be, on up to 170 SMs).
# The channels-last stream merges by the shape: each item, while a unit's
# piece partials are few next to a piece's bytes. The plan fields a row
# lists must hold, so that a row that stops reaching its instantiation fails.
UNLAUNCHED_ELSEWHERE = [  # (direction, shape, groups, dtypes, layout, kernel, lag or team, plan fields)
    # groupnorm_stream_kernel<T, 1, false, *>: odd HxW, 512 units of 2 pieces
    ("forward", (8, 128, 45, 23), 64, (BF16, F16, F32, F64), "contiguous", "stream", 10**9, dict(vec=1, merge="once")),
    # groupnorm_stream_kernel<T, 2, false, *>: HxW = 2 mod 4
    ("forward", (8, 256, 22, 47), 64, (BF16, F16, F32), "contiguous", "stream", 10**9, dict(vec=2, merge="once")),
    # groupnorm_stream_kernel<Half, 4, false, *>: HxW = 4 mod 8
    ("forward", (8, 512, 28, 37), 64, (F16,), "contiguous", "stream", 10**9, dict(vec=4, merge="once")),
    # groupnorm_stream_kernel<T, 8, false, *>: HxW = 0 mod 8
    ("forward", (8, 1024, 26, 40), 64, (BF16, F16), "contiguous", "stream", 10**9, dict(vec=8, merge="once")),
    # groupnorm_stream_kernel<BFloat16, 1, true, true>
    ("forward", (2, 8, 45, 45), 2, (BF16,), "contiguous", "stream", 1, dict(vec=1, merge="each")),
    # groupnorm_stream_kernel<T, 2, true, *>
    ("forward", (2, 8, 30, 45), 2, (BF16, F16, F64), "contiguous", "stream", 1, dict(vec=2, merge="each")),
    # groupnorm_stream_kernel<Half, 4, true, *>
    ("forward", (2, 8, 36, 57), 2, (F16,), "contiguous", "stream", 1, dict(vec=4, merge="each")),
    # groupnorm_stream_kernel<Half, 8, true, true>
    ("forward", (2, 16, 48, 56), 2, (F16,), "contiguous", "stream", 1, dict(vec=8, merge="each")),
    # groupnorm_stream_channels_last_kernel<T, 1, true, *>: C / G odd
    ("forward", (2, 15, 30, 30), 5, (BF16, F16), "channels_last", "stream", 0, dict(vec=1, merge="each")),
    # groupnorm_stream_channels_last_kernel<T, 1, false, *>: 31 pieces, too many partials for each
    ("forward", (2, 15, 64, 64), 5, (BF16, F64), "channels_last", "stream", 0, dict(vec=1, merge="once")),
    # groupnorm_stream_channels_last_kernel<T, 2, true, *>: C / G = 2
    ("forward", (2, 12, 40, 40), 6, (BF16, F16, F32), "channels_last", "stream", 0, dict(vec=2, merge="each")),
    # groupnorm_stream_channels_last_kernel<Half, 2, false, *>
    ("forward", (2, 12, 100, 100), 6, (F16,), "channels_last", "stream", 0, dict(vec=2, merge="once")),
    # groupnorm_stream_channels_last_kernel<double, 2, false, *>: 31 groups, one unit a sample
    ("forward", (2, 62, 30, 30), 31, (F64,), "channels_last", "stream", 0, dict(vec=2, merge="once")),
    # groupnorm_stream_channels_last_kernel<T, 4, true, *>: C / G = 4
    ("forward", (2, 16, 40, 40), 4, (BF16, F16), "channels_last", "stream", 0, dict(vec=4, merge="each")),
    # groupnorm_stream_channels_last_kernel<T, 4, false, *>: 2 blocks of 16 groups a sample
    ("forward", (2, 128, 60, 60), 32, (BF16, F16), "channels_last", "stream", 0,
     dict(vec=4, merge="once", blocks=2)),
    # groupnorm_stream_channels_last_kernel<float, 4, false, true>
    ("forward", (2, 124, 40, 40), 31, (F32,), "channels_last", "stream", 0, dict(vec=4, merge="once")),
    # groupnorm_stream_channels_last_kernel<T, 8, false, *>
    ("forward", (2, 248, 40, 40), 31, (BF16, F16), "channels_last", "stream", 0, dict(vec=8, merge="once")),
    # groupnorm_forward_contiguous_kernel<T, 2, *>: HxW = 2 mod 4
    ("forward", (2, 12, 10, 15), 3, (BF16, F16, F32), "contiguous", "contiguous", 0, dict(vec=2)),
    # groupnorm_forward_contiguous_kernel<T, 4, *>: HxW = 4 mod 8
    ("forward", (2, 12, 9, 12), 3, (BF16, F16), "contiguous", "contiguous", 0, dict(vec=4)),
    # groupnorm_forward_channels_last_kernel<BFloat16, 1, *>: odd C
    ("forward", (2, 21, 17, 19), 3, (BF16,), "channels_last", "channels_last", 0, dict(vec=1)),
    # groupnorm_forward_channels_last_kernel<T, 2, false>: C = 2 mod 4
    ("forward", (2, 30, 9, 11), 3, (BF16, F16), "channels_last", "channels_last", 0, dict(vec=2)),
    # groupnorm_forward_channels_last_kernel<T, 8, *>: rows of 335 16-byte vectors (670 of 8
    # bytes would need more threads); 67 groups (prime) of 80 bytes: no blocks, a unit a sample
    ("forward", (2, 2680, 5, 3), 67, (BF16, F16), "channels_last", "channels_last", 0, dict(vec=8, blocks=1)),
    # groupnorm_forward_channels_last_kernel<float, 4, *>
    ("forward", (2, 1340, 5, 3), 67, (F32,), "channels_last", "channels_last", 0, dict(vec=4, blocks=1)),
    # groupnorm_forward_channels_last_kernel<double, 2, *>
    ("forward", (2, 670, 5, 3), 67, (F64,), "channels_last", "channels_last", 0, dict(vec=2, blocks=1)),
    # groupnorm_forward_reference_kernel<double, true>
    ("forward", (2, 6, 5, 7), 3, (F64,), "contiguous", "reference", 0, dict()),
    # groupnorm_forward_registers_kernel<T, 4, 16, *>: 4104 vectors in 512 threads
    ("forward", (2, 16, 36, 57), 2, (BF16, F16), "contiguous", "registers", 0, dict(vec=4, items=16, ranks=1)),
    # groupnorm_forward_registers_kernel<BFloat16, 2, 16, *>: 5400 vectors in 512 threads
    ("forward", (2, 16, 30, 45), 2, (BF16,), "contiguous", "registers", 0, dict(vec=2, items=16, ranks=1)),
    # groupnorm_backward_{sums,dx}_channels_last_kernel<T, 1>: odd C
    ("backward", (2, 15, 9, 11), 5, (BF16, F64), "channels_last", "passes", 0, dict(vec=1)),
    # groupnorm_backward_{sums,dx}_contiguous_kernel<T, 2>: HxW = 2 mod 4
    ("backward", (2, 12, 10, 15), 3, (BF16, F16), "contiguous", "passes", 0, dict(vec=2)),
    # groupnorm_backward_{sums,dx}_contiguous_kernel<Half, 4>: HxW = 4 mod 8
    ("backward", (2, 12, 9, 12), 3, (F16,), "contiguous", "passes", 0, dict(vec=4)),
    # groupnorm_backward_stream_channels_last_kernel<T, 1>: C / G odd
    ("backward", (2, 15, 9, 11), 5, (BF16, F64), "channels_last", "stream", 0, dict(vec=1)),
    # groupnorm_backward_stream_channels_last_kernel<T, 2>: C / G = 2
    ("backward", (2, 12, 20, 20), 6, (BF16, F16, F32), "channels_last", "stream", 0, dict(vec=2)),
    # groupnorm_backward_stream_channels_last_kernel<T, 4>: C / G = 4
    ("backward", (2, 32, 20, 20), 8, (BF16, F16), "channels_last", "stream", 0, dict(vec=4)),
    # groupnorm_backward_stream_kernel<T, 1>: odd HxW
    ("backward", (2, 8, 33, 35), 2, (BF16, F16, F64), "contiguous", "stream", 0, dict(vec=1)),
    # groupnorm_backward_stream_kernel<T, 2>: HxW = 2 mod 4
    ("backward", (2, 8, 30, 45), 2, (BF16, F16, F32), "contiguous", "stream", 0, dict(vec=2)),
    # groupnorm_backward_stream_kernel<T, 4>: HxW = 4 mod 8
    ("backward", (2, 8, 36, 57), 2, (BF16, F16), "contiguous", "stream", 0, dict(vec=4)),
]
# The fused backward's passes (16-byte vectors or single elements,
# plan_backward.cpp) and its chain kernel at the widths and dtypes no other
# test reaches, forced (autograd's plan for some is the registers kernel),
# against torch's sequence: SiLU (taken back in the passes) and GELU (the
# chain kernel first). A row that stops reaching its width fails.
FUSED_BACKWARD_WIDTHS = [  # (shape, groups, dtypes, layout, vec)
    ((2, 8, 9, 11), 2, (F16,), "contiguous", 1),  # odd HxW
    ((2, 8, 8, 8), 2, (F16, F64), "contiguous", None),  # 16 bytes
    ((2, 15, 9, 11), 5, (BF16, F16, F32, F64), "channels_last", 1),  # odd C
    ((2, 16, 9, 11), 4, (F64,), "channels_last", 2),
]
FUSED_BACKWARD_WIDTH_CASES = [(shape, groups, dtype, layout, vec or 16 // dtype.itemsize)
                              for shape, groups, dtypes, layout, vec in FUSED_BACKWARD_WIDTHS
                              for dtype in dtypes]


@cuda
@pytest.mark.parametrize("shape,groups,dtype,layout,vec", FUSED_BACKWARD_WIDTH_CASES,
                         ids=lambda v: str(v)[6:] if isinstance(v, torch.dtype) else str(v))
def test_gpu_fused_backward_at_every_width(shape, groups, dtype, layout, vec):
    x = make_input(shape, dtype, layout, "cuda", shift=1.0)
    assert gn.plan(x, groups, backward=True, kernel="passes", fused=True)["vec"] == vec
    N, C = shape[:2]
    w, b = affine(C, dtype, "cuda", "both")
    for activation in ("silu", "gelu"):
        args = dict(activation=activation,
                    scale=0.5 * torch.randn(N, C, device="cuda").to(dtype))
        dy = torch.randn_like(x)
        _, theirs, exact = fused_gradients(x, w, b, args, dy, groups)
        forced = forced_fused_gradients(x, w, b, args, dy, groups, "passes")
        assert_as_close_as_torch(forced, theirs, exact, dtype)


UNLAUNCHED_ELSEWHERE_CASES = [(direction, shape, groups, dtype, layout, kernel, n, fields)
                              for direction, shape, groups, dtypes, layout, kernel, n, fields
                              in UNLAUNCHED_ELSEWHERE for dtype in dtypes]


def unlaunched_elsewhere_id(case):
    direction, shape, groups, dtype, layout, kernel, n, _ = case
    return f"{direction}-{shape_id((shape, groups))}-{str(dtype)[6:]}-{layout}-{kernel}" + \
        (f"-L{n}" if n else "")


@cuda
@pytest.mark.parametrize("case", UNLAUNCHED_ELSEWHERE_CASES, ids=unlaunched_elsewhere_id)
def test_gpu_instantiations_no_other_test_launches(case):
    direction, shape, groups, dtype, layout, kernel, n, fields = case
    if direction == "backward":  # forced, as test_gpu_backward_stream_kernel forces it
        x = make_input(shape, dtype, layout, "cuda")
        plan = gn.plan(x, groups, kernel=kernel, lag=n, backward=True)
    else:
        x, plan, force = forced_input((shape, groups, dtype, layout, kernel, n))
    assert plan["kernel"] == kernel and plan["layout"] == layout and plan_has(plan, fields), \
        (fields, plan)
    w, b = affine(shape[1], dtype, "cuda", "both")
    if direction == "backward":
        dy = lambda: make_input(shape, dtype, layout, "cuda")  # noqa: E731  (fresh each call)
        check_backward(x, groups, w, b, dy(), kernel=kernel, lag=n)
        check_backward(x, groups, None, None, dy(), kernel=kernel, lag=n, affine=False)  # dx alone
        return
    check_against_reference(x, groups, w, b, kernel=kernel, **force)
    check_saved_statistics(x, groups, kernel, **force)
    # the registers kernel takes no called chain (kernels/epilogue.cuh): SiLU inline there
    options = dict(EPILOGUES)["all"] if kernel != "registers" else INLINE_ALL
    check_epilogue(x, groups, w, b, epilogue_tensors(x, options), kernel=kernel, **force)

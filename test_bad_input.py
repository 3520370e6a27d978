"""Bad input: each mistake raises a clear error (the message names it) of the
type torch raises for the same mistake, on either device, and leaves the
user's tensors as they were; what torch accepts gives torch's answer.

  BAD_INPUTS  mistakes this module's checks catch, in group_norm and
              groupnorm_cuda alike: a GroupNormError
  LIKE_TORCH  inputs group_norm takes as torch does (or hands to torch):
              torch's answer and gradients, or an error of torch's type
  CUDA_ONLY   what groupnorm_cuda and plan need beyond torch's rules; on the
              CPU with PretendCuda tensors
  MODULES     GroupNorm's constructor and calls, against nn.GroupNorm's

Each table runs on CPU tensors, and on a GPU (the cuda marker) with the same
rows' tensors there.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import groupnorm_inline as gn
from test_groupnorm import PretendCuda, assert_unchanged, copies, cuda, weight_for_torch

DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def args(device, groups=2, weight=None, bias=None, eps=1e-5, x=None, shape=(2, 6, 4)):
    """(input, num_groups, weight, bias, eps) as F.group_norm takes them; x
    defaults to a (2, 6, 4) float32 tensor on the device."""
    return (torch.randn(shape, device=device) if x is None else x), groups, weight, bias, eps


def randn(device, *shape, **kwargs):
    return torch.randn(shape, device=device, **kwargs)


# (description, args builder taking the device, exception, message fragment)
BAD_INPUTS = [
    # num_groups
    ("C % G != 0", lambda d: args(d, groups=4), ValueError, "divisible"),
    ("G > C", lambda d: args(d, groups=12), ValueError, "num_channels (6) must be divisible"),
    ("G == 0", lambda d: args(d, groups=0), ValueError, "positive"),
    ("G == 0 and C == 0", lambda d: args(d, groups=0, shape=(2, 0, 4)), ZeroDivisionError, "positive"),
    ("G < 0", lambda d: args(d, groups=-2), ValueError, "positive"),
    ("G not int", lambda d: args(d, groups=2.0), TypeError, "int"),
    ("G bool", lambda d: args(d, groups=True), TypeError, "int"),
    ("G None", lambda d: args(d, groups=None), TypeError, "num_groups must be an int, got NoneType"),
    ("G str", lambda d: args(d, groups="2"), TypeError, "num_groups must be an int, got str"),
    ("G numpy float", lambda d: args(d, groups=np.float64(2.0)), TypeError, "got float64"),
    ("G 0-d float tensor", lambda d: args(d, groups=torch.tensor(2.0)), TypeError,
     "num_groups must be an int, got a tensor"),
    ("G 0-d bool tensor", lambda d: args(d, groups=torch.tensor(True)), TypeError, "num_groups must be an int"),
    ("G 1-d tensor", lambda d: args(d, groups=torch.tensor([2])), TypeError, "num_groups must be an int"),
    # the input
    ("1-D input", lambda d: args(d, x=randn(d, 6)), ValueError, "(N, C, *)"),
    ("0-D input", lambda d: args(d, groups=1, x=torch.tensor(1.0, device=d)), ValueError, "(N, C, *)"),
    ("int input", lambda d: args(d, x=torch.ones(2, 6, 4, dtype=torch.int64, device=d)), TypeError, "dtype"),
    ("int32 input", lambda d: args(d, x=torch.ones(2, 6, 4, dtype=torch.int32, device=d)), NotImplementedError,
     "input dtype must be float32, float16, bfloat16 or float64, got torch.int32"),
    ("uint8 input", lambda d: args(d, x=torch.ones(2, 6, 4, dtype=torch.uint8, device=d)), TypeError, "uint8"),
    ("bool input", lambda d: args(d, x=torch.ones(2, 6, 4, dtype=torch.bool, device=d)), TypeError, "dtype"),
    ("complex input", lambda d: args(d, x=randn(d, 2, 6, 4, dtype=torch.complex64)), TypeError, "dtype"),
    ("float8 input", lambda d: args(d, x=randn(d, 2, 6, 4).to(torch.float8_e4m3fn)), NotImplementedError,
     "got torch.float8_e4m3fn"),
    ("input a list", lambda d: args(d, groups=1, x=[[1.0]]), TypeError, "input must be a torch.Tensor, got list"),
    ("input a numpy array", lambda d: args(d, x=np.ones((2, 6, 4), np.float32)), AttributeError,
     "got ndarray"),
    ("input None", lambda d: (None, 2, None, None, 1e-5), AttributeError, "got NoneType"),
    ("sparse input", lambda d: args(d, x=randn(d, 2, 6, 4).to_sparse()), NotImplementedError,
     "input must be a strided (dense) tensor, got torch.sparse_coo"),
    ("sparse CSR input", lambda d: args(d, x=randn(d, 2, 6).to_sparse_csr()), NotImplementedError,
     "got torch.sparse_csr"),
    ("nested (jagged) input", lambda d: args(d, x=torch.nested.nested_tensor(
        [randn(d, 6, 4), randn(d, 6, 3)], layout=torch.jagged)), NotImplementedError, "got torch.jagged"),
    ("one value per channel", lambda d: args(d, groups=4, x=randn(d, 1, 4, 1, 1)), ValueError,
     "more than 1 value"),
    ("empty spatial dim", lambda d: args(d, shape=(2, 6, 3, 0)), RuntimeError,
     "number of channels and each spatial size to be greater than 0, got input of size [2, 6, 3, 0]"),
    ("C == 0", lambda d: args(d, shape=(2, 0, 4)), RuntimeError, "greater than 0"),
    ("C == 0 and N == 0", lambda d: args(d, shape=(0, 0, 4)), RuntimeError, "greater than 0"),
    # weight and bias
    ("weight of wrong shape", lambda d: args(d, weight=randn(d, 5)), ValueError,
     "weight must have shape [6] (one value per channel), got [5]"),
    ("weight of shape (C, 1)", lambda d: args(d, weight=randn(d, 6, 1)), ValueError, "weight must have shape [6]"),
    ("weight 0-d", lambda d: args(d, weight=torch.tensor(1.0, device=d)), ValueError, "got []"),
    ("bias of wrong shape", lambda d: args(d, bias=randn(d, 7)), ValueError,
     "bias must have shape [6] (one value per channel), got [7]"),
    ("bias of shape (1, C)", lambda d: args(d, bias=randn(d, 1, 6)), ValueError, "got [1, 6]"),
    ("weight a list", lambda d: args(d, weight=[1.0] * 6), TypeError,
     "weight must be a torch.Tensor or None, got list"),
    ("weight a numpy array", lambda d: args(d, weight=np.ones(6, np.float32)), TypeError, "got ndarray"),
    ("bias a list", lambda d: args(d, bias=[0.0] * 6), TypeError, "bias must be"),
    ("sparse weight", lambda d: args(d, weight=randn(d, 6).to_sparse()), NotImplementedError,
     "weight must be a strided (dense) tensor, got torch.sparse_coo"),
    ("sparse bias", lambda d: args(d, bias=randn(d, 6).to_sparse()), NotImplementedError,
     "bias must be a strided (dense) tensor"),
    # eps (torch takes any float: NaN, negative and inf are refused here only)
    ("negative eps", lambda d: args(d, eps=-1e-5), ValueError, "eps"),
    ("nan eps", lambda d: args(d, eps=float("nan")), ValueError, "eps must be finite and >= 0, got nan"),
    ("inf eps", lambda d: args(d, eps=float("inf")), ValueError, "eps"),
    ("eps not a number", lambda d: args(d, eps="1e-5"), TypeError, "eps must be a float, got str"),
    ("eps None", lambda d: args(d, eps=None), TypeError, "eps must be a float, got NoneType"),
    ("eps complex", lambda d: args(d, eps=1j), TypeError, "got complex"),
    ("eps 1-d tensor", lambda d: args(d, eps=torch.tensor([1e-5])), TypeError, "got a tensor of shape [1]"),
]
TORCH_TAKES = {"negative eps", "nan eps", "inf eps"}  # refused on purpose
# torch before 2.14 takes empty channel and spatial dims (an empty result on
# the CPU, a failed launch on CUDA); refused here on every version
OLD_TORCH_TAKES = {"empty spatial dim", "C == 0", "C == 0 and N == 0", "no channels"}
OLD_TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 14)
# groupnorm_cuda has no such rule: it takes empty dims
GROUP_NORM_ONLY = {"one value per channel", "empty spatial dim", "C == 0", "C == 0 and N == 0"}


def torch_error(call):
    """The exception call() raises, or None."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 (any type: it is the point)
        return error
    return None


def assert_refused_like_torch(description, ours, theirs, refused_on_purpose):
    """ours (the error raised) is of torch's type for the same call (theirs,
    None where torch took it): torch may take only what we refuse on purpose,
    and, before 2.14, empty dims (which it takes, or crashes on)."""
    crashed = isinstance(theirs, torch.AcceleratorError)
    if OLD_TORCH and description in OLD_TORCH_TAKES and (theirs is None or crashed):
        return
    if theirs is None:
        assert description in refused_on_purpose, "torch took arguments that we refused"
    else:
        assert isinstance(ours, type(theirs)), (type(theirs), type(ours).__mro__)


def kernels_unreachable(monkeypatch):
    """Stands in for the extension with one that fails when used: a CPU test
    that calls group_norm on a PretendCuda input passes only if the call is
    refused before the kernels."""
    def load():
        raise AssertionError("group_norm took the input to the kernels")
    monkeypatch.setattr(gn, "load", load)
    monkeypatch.setattr(gn, "_toolchain_error", None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_clear_error(case, device, monkeypatch):
    description, build, exc, fragment = case
    x, groups, weight, bias, eps = build(device)
    kept = copies(x, weight, bias)
    with pytest.raises(exc) as ours:
        gn.group_norm(x, groups, weight, bias, eps)
    assert fragment in str(ours.value), str(ours.value)
    assert isinstance(ours.value, gn.GroupNormError)
    assert_unchanged(kept, x, weight, bias)
    # catchable as what torch raises for the same mistake
    theirs = torch_error(lambda: F.group_norm(x, groups, weight, bias, eps))
    assert_refused_like_torch(description, ours.value, theirs, TORCH_TAKES)
    # groupnorm_cuda makes the same checks, before the device's: the same
    # error on either device
    if description not in GROUP_NORM_ONLY:
        with pytest.raises(type(ours.value)) as raw:
            gn.groupnorm_cuda(x, weight, bias, groups, eps)
        assert fragment in str(raw.value), str(raw.value)
        assert_unchanged(kept, x, weight, bias)
    # on the CPU, the same refusal of an input that takes the CUDA path
    if device == "cpu" and isinstance(x, torch.Tensor) and x.layout == torch.strided:
        kernels_unreachable(monkeypatch)
        with pytest.raises(type(ours.value)) as pretended:
            gn.group_norm(x.as_subclass(PretendCuda), groups, weight, bias, eps)
        assert fragment in str(pretended.value), str(pretended.value)


def other_device(device):
    return "meta" if device == "cpu" else "cpu"


def leaf(t):
    return t.requires_grad_()


# (description, args builder taking the device, message fragment where torch
# raises): group_norm gives torch's answer and gradients, or raises torch's
# type of error
LIKE_TORCH = [
    ("N = 0", lambda d: args(d, shape=(0, 6, 4)), None),
    ("N = 0, 2-D", lambda d: args(d, shape=(0, 6)), None),
    ("N = 0 with weight and bias", lambda d: args(d, weight=randn(d, 6), bias=randn(d, 6), shape=(0, 6, 4)), None),
    ("N = 0 channels_last", lambda d: args(d, groups=4, x=randn(d, 0, 8, 3, 3).to(
        memory_format=torch.channels_last)), None),
    ("G = C", lambda d: args(d, groups=6), None),
    ("G = 1", lambda d: args(d, groups=1), None),
    ("eps = 0", lambda d: args(d, eps=0.0), None),
    ("eps = 1e30", lambda d: args(d, eps=1e30), None),
    ("G a 0-d int tensor", lambda d: args(d, groups=torch.tensor(3)), None),
    ("eps a 0-d tensor", lambda d: args(d, eps=torch.tensor(1e-3)), None),
    ("meta input", lambda d: args("meta", weight=randn("meta", 6)), None),
    ("x requires grad", lambda d: args(d, x=leaf(randn(d, 2, 6, 4)), weight=randn(d, 6), bias=randn(d, 6)), None),
    ("weight requires grad, x not", lambda d: args(d, weight=leaf(randn(d, 6)), bias=randn(d, 6)), None),
    ("bias requires grad, no weight", lambda d: args(d, bias=leaf(randn(d, 6))), None),
    ("x and bias require grad", lambda d: args(d, x=leaf(randn(d, 2, 6, 4)), weight=randn(d, 6),
                                               bias=leaf(randn(d, 6))), None),
    ("all require grad, float16", lambda d: args(d, x=leaf(randn(d, 2, 6, 4, dtype=torch.float16)),
                                                 weight=leaf(randn(d, 6, dtype=torch.float16)),
                                                 bias=leaf(randn(d, 6, dtype=torch.float16))), None),
    ("weight float64, x float32", lambda d: args(d, weight=randn(d, 6, dtype=torch.float64)), "dtype"),
    ("weight int64", lambda d: args(d, weight=torch.ones(6, dtype=torch.int64, device=d)), "dtype"),
    ("x float16, weight float32", lambda d: args(d, x=randn(d, 2, 6, 4, dtype=torch.float16),
                                                 weight=randn(d, 6)), "dtype"),
    ("weight on another device", lambda d: args(d, weight=randn(other_device(d), 6)), "device"),
    ("bias on another device", lambda d: args(d, bias=randn(other_device(d), 6)), "device"),
]


def check_same_values(ours, theirs, device):
    """Bitwise on the CPU (the same kernel: torch's), within float tolerances
    on a GPU (two roundings of a 16-bit result: torch's and ours)."""
    assert (ours.shape, ours.dtype, ours.device) == (theirs.shape, theirs.dtype, theirs.device)
    if ours.is_meta:
        return
    eps = torch.finfo(ours.dtype).eps
    if device == "cpu":
        close = dict(rtol=0, atol=0)
    else:
        close = dict(rtol=2 * eps, atol=eps) if ours.element_size() == 2 else {}
    torch.testing.assert_close(ours, theirs, equal_nan=True, **close)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", LIKE_TORCH, ids=[c[0] for c in LIKE_TORCH])
def test_input_taken_like_torch(case, device):
    description, build, fragment = case
    x, groups, weight, bias, eps = build(device)
    kept = copies(x, weight, bias)
    theirs = torch_error(lambda: F.group_norm(x, groups, weight, bias, eps))
    if theirs is not None:
        with pytest.raises(type(theirs)) as ours:
            gn.group_norm(x, groups, weight, bias, eps)
        assert fragment is not None, f"torch refused {description}: {theirs}"
        # mixed dtypes and devices go to torch: its message where it refuses them
        assert fragment in str(ours.value) or str(ours.value) == str(theirs), str(ours.value)
        assert_unchanged(kept, x, weight, bias)
        return
    y = gn.group_norm(x, groups, weight, bias, eps)
    expected = F.group_norm(x, groups, weight, bias, eps)
    check_same_values(y, expected, device)
    leaves = [t for t in (x, weight, bias) if isinstance(t, torch.Tensor) and t.requires_grad]
    assert y.requires_grad == bool(leaves)
    if leaves:
        dy = torch.randn_like(expected)
        # torch's backward before 2.14 may refuse a bias without a weight
        expected = F.group_norm(x, groups, *weight_for_torch(x, weight, bias), eps)
        for mine, torchs in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(expected, leaves, dy)):
            check_same_values(mine, torchs, device)
    assert_unchanged(kept, x, weight, bias)


def pretend_cuda(device, *shape, **kwargs):
    """A GPU tensor, or on the CPU one that says it is (PretendCuda)."""
    x = torch.randn(shape or (2, 6, 4), device=device, **kwargs)
    return x.as_subclass(PretendCuda) if device == "cpu" else x


def call(function, *arguments, **keywords):
    return function, arguments, keywords


# (description, call builder taking the device, exception, message fragment):
# groupnorm_cuda's and plan's own rules, checked before the kernels run
CUDA_ONLY = [
    ("x on the CPU", lambda d: call(gn.groupnorm_cuda, randn("cpu", 2, 6, 4), None, None, 2), ValueError,
     "groupnorm_cuda: x must be a CUDA tensor, got one on cpu; group_norm() also takes CPU tensors"),
    ("x on meta", lambda d: call(gn.groupnorm_cuda, randn("meta", 2, 6, 4), None, None, 2), ValueError,
     "got one on meta"),
    ("weight of another dtype", lambda d: call(gn.groupnorm_cuda, pretend_cuda(d), randn(d, 6, dtype=torch.float64),
                                               None, 2), TypeError,
     "weight dtype must be x's (torch.float32), got torch.float64; group_norm() takes mixed dtypes"),
    ("bias of another dtype", lambda d: call(gn.groupnorm_cuda, pretend_cuda(d), None,
                                             randn(d, 6, dtype=torch.float16), 2), TypeError,
     "bias dtype must be x's (torch.float32), got torch.float16"),
    ("weight on another device", lambda d: call(gn.groupnorm_cuda, pretend_cuda(d), randn(other_device(d), 6),
                                                None, 2), ValueError, "weight must be on x's device"),
    ("bias on another device", lambda d: call(gn.groupnorm_cuda, pretend_cuda(d), None, randn(other_device(d), 6),
                                              2), ValueError, "bias must be on x's device"),
    ("forced kernel, x requires grad", lambda d: call(gn.groupnorm_cuda, leaf(pretend_cuda(d)), None, None, 2,
                                                      kernel="reference"), ValueError, "they record no gradients"),
    ("forced kernel, weight requires grad", lambda d: call(gn.groupnorm_cuda, pretend_cuda(d), leaf(randn(d, 6)),
                                                           None, 2, kernel="stream"), ValueError, "no gradients"),
    ("forced team, bias requires grad", lambda d: call(gn.groupnorm_cuda, pretend_cuda(d), None, leaf(randn(d, 6)),
                                                       2, team=2), ValueError, "no gradients"),
    ("plan of a CPU tensor", lambda d: call(gn.plan, randn("cpu", 2, 6, 4), 2), ValueError,
     "plan: x must be a CUDA tensor"),
    ("plan: G == 0", lambda d: call(gn.plan, pretend_cuda(d), 0), ZeroDivisionError, "positive num_groups"),
    ("plan: G not int", lambda d: call(gn.plan, pretend_cuda(d), 2.0), TypeError, "num_groups must be an int"),
    ("plan: teams for the backward", lambda d: call(gn.plan, pretend_cuda(d), 2, team=2, backward=True), ValueError,
     "the backward has no teams, got team=2"),
]
# rows whose call reaches the extension: on a GPU only
CUDA_ONLY_GPU = [
    ("unknown kernel", lambda d: call(gn.groupnorm_cuda, randn(d, 2, 6, 4), None, None, 2, kernel="fast"),
     ValueError, "unknown kernel"),
    ("plan: unknown kernel", lambda d: call(gn.plan, randn(d, 2, 6, 4), 2, kernel="fast"), ValueError,
     "unknown kernel"),
]
CUDA_ONLY_CASES = ([pytest.param(case, "cpu", id=f"{case[0]}-cpu") for case in CUDA_ONLY] +
                   [pytest.param(case, "cuda", id=f"{case[0]}-cuda", marks=cuda) for case in CUDA_ONLY + CUDA_ONLY_GPU])


@pytest.mark.parametrize("case, device", CUDA_ONLY_CASES)
def test_cuda_only_rules_raise_clear_errors(case, device):
    description, build, exc, fragment = case
    function, arguments, keywords = build(device)
    kept = copies(*arguments)
    with pytest.raises(exc) as error:
        function(*arguments, **keywords)
    assert fragment in str(error.value), str(error.value)
    assert isinstance(error.value, gn.GroupNormError) or "unknown kernel" in description
    assert_unchanged(kept, *arguments)


# (description, GroupNorm's arguments, its keyword arguments, input builder
# taking the device, exception or None where torch takes it, fragment):
# each against nn.GroupNorm built and called the same way
MODULES = [
    ("num_channels not divisible by num_groups", (4, 6), {}, lambda d: randn(d, 2, 6, 4), ValueError,
     "num_channels (6) must be divisible by num_groups (4)"),
    ("negative num_channels", (2, -6), {}, lambda d: randn(d, 2, 6, 4), RuntimeError, "negative dimension"),
    ("num_channels a float", (2, 6.0), {}, lambda d: randn(d, 2, 6, 4), TypeError, "float"),
    ("num_groups 0", (0, 6), {}, lambda d: randn(d, 2, 6, 4), ZeroDivisionError, "modulo by zero"),
    ("negative num_groups", (-2, 6), {}, lambda d: randn(d, 2, 6, 4), RuntimeError,
     "must be divisible by a positive num_groups (-2)"),
    ("num_groups a float", (2.0, 6), {}, lambda d: randn(d, 2, 6, 4), TypeError,
     "GroupNorm: num_groups must be an int, got float"),
    ("eps a string", (2, 6), {"eps": "1e-5"}, lambda d: randn(d, 2, 6, 4), TypeError,
     "GroupNorm: eps must be a float, got str"),
    ("negative eps", (2, 6), {"eps": -1.0}, lambda d: randn(d, 2, 6, 4), ValueError,
     "GroupNorm: eps must be finite and >= 0, got -1.0"),
    ("input with fewer channels", (2, 6), {}, lambda d: randn(d, 2, 4, 3), RuntimeError,
     "weight must have shape [4] (one value per channel), got [6]"),
    ("input with more channels", (2, 6), {}, lambda d: randn(d, 2, 8, 3), RuntimeError, "got [6]"),
    ("input with channels not divisible", (2, 6), {}, lambda d: randn(d, 2, 5, 3), RuntimeError, "divisible"),
    ("affine=False, channels not divisible", (4, 8), {"affine": False}, lambda d: randn(d, 2, 6, 3), RuntimeError,
     "num_channels (6) must be divisible by a positive num_groups (4)"),
    ("affine=False, another channel count", (2, 6), {"affine": False}, lambda d: randn(d, 2, 4, 3), None, None),
    ("int input", (2, 6), {}, lambda d: torch.ones(2, 6, 4, dtype=torch.long, device=d), RuntimeError, "dtype"),
    ("1-D input", (2, 6), {}, lambda d: randn(d, 6), ValueError, "(N, C, *)"),
    ("no channels", (2, 0), {}, lambda d: randn(d, 2, 0, 3), RuntimeError, "greater than 0"),
]
TORCH_TAKES_LAYER = {"negative eps"}  # refused on purpose


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MODULES, ids=[c[0] for c in MODULES])
def test_module_mistakes_raise_torchs_errors(case, device):
    description, arguments, keywords, build, exc, fragment = case
    x = build(device)
    kept = copies(x)
    torch.manual_seed(0)
    theirs = torch_error(lambda: nn.GroupNorm(*arguments, device=device, **keywords)(x))
    if exc is None:
        assert theirs is None, theirs
        torch.manual_seed(0)
        expected = nn.GroupNorm(*arguments, device=device, **keywords)(x)
        torch.manual_seed(0)
        check_same_values(gn.GroupNorm(*arguments, device=device, **keywords)(x), expected, device)
        assert_unchanged(kept, x)
        return
    built = torch_error(lambda: gn.GroupNorm(*arguments, device=device, **keywords))
    with pytest.raises(exc) as ours:
        gn.GroupNorm(*arguments, device=device, **keywords)(x)
    assert fragment in str(ours.value), str(ours.value)
    # the constructor raises torch's own errors or ours; a call, ours
    assert built is not None or isinstance(ours.value, gn.GroupNormError), type(ours.value)
    assert_refused_like_torch(description, ours.value, theirs, TORCH_TAKES_LAYER)
    assert_unchanged(kept, x)

"""Property-based tests (hypothesis): random shapes, groups, dtypes, layouts,
eps and data, against torch's GroupNorm in float64 on a copy of the input;
and the same inputs with random fused options (scale, shift, an activation
chain, residual, an (N, C) add) against the unfused sequence.

GROUPNORM_FUZZ_PROFILE picks the profile (default "ci"):
  ci   derandomized, the same cases every run: 300 through group_norm on CPU
       tensors (torch's kernel behind this module's argument handling, which
       checks that handling, the float64 reference and the tolerances) and
       100 fused ones (bitwise torch's unfused sequence there), and on a GPU
       300 forward, 50 backward and 100 fused cases through the kernels;
  gpu  random cases on a GPU: 2,500 forward through groupnorm_cuda with forced
       kernels, 500 backward, 1,000 fused; the CPU tests keep their ci cases.
GPU tests skip without a GPU. A failure prints the case and the
@reproduce_failure line that replays it.
"""

import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import groupnorm_inline as gn
import groupnorm_tools as tools
from test_groupnorm import (ACTIVATIONS, DTYPES, affine, apply_epilogue, assert_unchanged, channels_last_like,
                            check_backward, check_epilogue, copies, cuda, describe_mismatch, epilogue_tensors,
                            inline_chain, largest_spread, make_input, poisoned, pre_norm_sum,
                            tolerance)

PROFILE = os.environ.get("GROUPNORM_FUZZ_PROFILE", "ci")
_COMMON = dict(deadline=None, database=None, print_blob=True)
PROFILES = {  # (forward cases, backward cases, derandomized, fused forward cases)
    "ci": (300, 50, True, 100),
    "gpu": (2500, 500, False, 1000),
}
if PROFILE not in PROFILES:
    raise ValueError(f"GROUPNORM_FUZZ_PROFILE must be one of {sorted(PROFILES)}, got {PROFILE!r}")
FORWARD_CASES, BACKWARD_CASES, DERANDOMIZE, FUSED_CASES = PROFILES[PROFILE]
CI_SETTINGS = settings(max_examples=PROFILES["ci"][0], derandomize=True, **_COMMON)
CI_FUSED_SETTINGS = settings(max_examples=PROFILES["ci"][3], derandomize=True, **_COMMON)
FUSED_SETTINGS = settings(max_examples=FUSED_CASES, derandomize=DERANDOMIZE, **_COMMON)
FORWARD_SETTINGS = settings(max_examples=FORWARD_CASES, derandomize=DERANDOMIZE, **_COMMON)
BACKWARD_SETTINGS = settings(max_examples=BACKWARD_CASES, derandomize=DERANDOMIZE, **_COMMON)

# Elements in one case: small on the CPU (torch's kernel, 2 cores), up to
# several MiB on a GPU, where one dim of tens of thousands still fits.
CPU_BUDGET = 20_000
GPU_BUDGET = 1 << 21
SIZES = [1, 2, 3, 5, 7, 13, 31, 61, 127, 251, 1021, 4099, 16381, 65521,  # 1 and primes
         4, 8, 16, 64, 256, 1024, 4096, 65536]                             # and powers of two
WIDE = [64, 96, 128, 160, 320, 512, 640, 1024, 1280, 2048, 2560, 4096]     # C of real models
DATA = {  # (shift, scale) of the values: randn * scale + shift
    "randn": (0.0, 1.0),
    "large mean": (1e4, 1.0),
    "tiny spread": (0.0, 1e-4),
    "shifted": (-3.0, 5.0),
}
EPS = [1e-5, 1e-6, 1e-3, 0.1, 1.0, 1e-12, 0.0]
FORWARD_KERNELS = ["auto", "reference", "registers", "contiguous", "channels_last", "stream"]
STEPS = [*ACTIVATIONS, ("leaky_relu", 0.2)]  # an activation chain's steps
BACKWARD_KERNELS = ["auto", "passes", "stream", "registers"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One input: x of `shape` viewed into a flat storage at `offset`, its
    dims stored in `order` (outermost first), each dim d taken from index
    slices[d][0] in steps of slices[d][1], and the dims in `expanded` of
    stride 0; values randn * scale + shift from `seed`, `specials` (NaN, inf)
    at random places."""
    shape: tuple
    groups: int
    dtype: torch.dtype
    layout: str
    order: tuple
    offset: int
    slices: tuple
    expanded: tuple
    data: str
    eps: float
    affine: str
    specials: tuple
    seed: int
    kernel: str = "auto"


def _at_most(choices, room):
    return st.sampled_from([c for c in choices if c <= room] or [1])


@st.composite
def cases(draw, budget, kernels=("auto",), specials=True):
    rank = draw(st.sampled_from([4, 3, 2, 5]))
    N = draw(_at_most([1, 2, 3, 4, 5, 7, 16, 33], budget))
    C = draw(st.one_of(st.integers(1, 16), st.integers(17, 48), _at_most(WIDE, budget // N)))
    groups = draw(st.sampled_from([g for g in range(1, C + 1) if C % g == 0]))
    shape = [N, C]
    for _ in range(rank - 2):
        shape.append(draw(_at_most(SIZES, budget // math.prod(shape))))
    layouts = ["contiguous", "permuted"] + (["channels_last"] if rank >= 3 else [])
    layout = draw(st.sampled_from(layouts))
    if layout == "contiguous":
        order = tuple(range(rank))
    elif layout == "channels_last":  # C innermost: torch's channels_last(_3d) at rank 4 (5)
        order = (0, *range(2, rank), 1)
    else:
        order = tuple(draw(st.permutations(range(rank))))
    offset = draw(st.sampled_from([0, 0, 0, 1, 3, 8]))
    slices = ((0, 1),) * rank  # (start, step) of each dim
    if draw(st.integers(0, 3)) == 0:
        slices = tuple(draw(st.lists(st.sampled_from([(0, 1), (1, 1), (0, 2), (1, 3)]),
                                     min_size=rank, max_size=rank)))
        if math.prod(start + step * n for (start, step), n in zip(slices, shape)) > 4 * budget:
            slices = tuple((start, 1) for start, _ in slices)  # steps would store too much
    expanded = ()
    if draw(st.integers(0, 5)) == 0:
        expanded = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=2))))
    return Case(
        shape=tuple(shape), groups=groups, dtype=draw(st.sampled_from(DTYPES)), layout=layout,
        order=order, offset=offset, slices=slices, expanded=expanded,
        data=draw(st.sampled_from(list(DATA))), eps=draw(st.sampled_from(EPS)),
        affine=draw(st.sampled_from(["both", "none", "weight", "bias"])),
        specials=tuple(draw(st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=3)))
        if specials and draw(st.integers(0, 4)) == 0 else (),
        seed=draw(st.integers(0, 2**31 - 1)), kernel=draw(st.sampled_from(kernels)))


def _stored(case):
    """(dims of x before expansion, dims before slicing, dims as stored)."""
    unexpanded = [1 if d in case.expanded else n for d, n in enumerate(case.shape)]
    sliced = [start + step * n for (start, step), n in zip(case.slices, unexpanded)]
    return unexpanded, sliced, [sliced[d] for d in case.order]


def _view(storage, case):
    """x before its expansion: a view into the flat storage."""
    unexpanded, _, stored = _stored(case)
    view = storage[case.offset:case.offset + math.prod(stored)].view(stored)
    view = view.permute([case.order.index(d) for d in range(len(case.shape))])
    return view[tuple(slice(start, start + step * n, step)
                      for (start, step), n in zip(case.slices, unexpanded))]


def build(case, device):
    """(x, storage, weight, bias) for a case. The storage's elements outside
    x, 8 after it included, are NaN: a kernel that reads past its view shows it."""
    shift, scale = DATA[case.data]
    size = case.offset + math.prod(_stored(case)[2]) + 8
    device = torch.device(device)
    gpus = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):  # drawn where they are used: no copies
        torch.manual_seed(case.seed)
        storage = make_input((size,), case.dtype, "contiguous", device, shift, scale)
        weight, bias = affine(case.shape[1], case.dtype, device, case.affine)
        used = torch.zeros(size, dtype=torch.bool, device=device)
        _view(used, case).fill_(True)
        storage[~used] = float("nan")
        places = used.nonzero().flatten()
        for value in case.specials:
            storage[places[torch.randint(len(places), ())]] = float(value)
    return _view(storage, case).expand(case.shape), storage, weight, bias


def reference(x, groups, weight, bias, eps):
    """torch's GroupNorm in float64 on a contiguous copy of the input (its
    CPU channels-last kernel is off by 4e-8 on 1e4 + randn even in float64);
    its kernel itself where F.group_norm refuses a single value per channel."""
    weight, bias = (t.detach().double() if t is not None else None for t in (weight, bias))
    x = x.detach().double().contiguous()
    if x.numel() == groups:
        return tools.torch_group_norm(x, groups, weight, bias, eps)
    return F.group_norm(x, groups, weight, bias, eps)


def by_group(t, groups):
    return t.reshape(t.shape[0], groups, -1)


def compare(y, x, case, weight, bias):
    """In the groups of x with a NaN or inf, y is NaN where torch's output in
    x's dtype is; in the others (a NaN in one group leaves them finite), y is
    within the tolerance of the float64 reference. (torch's own output there
    may be NaN: torch 2.11's float16 CUDA kernel gives NaN for a group of one
    value with eps = 1e-12; then y answers to the reference alone.)"""
    G, eps = case.groups, case.eps
    theirs = tools.torch_group_norm(x, G, weight, bias, eps)
    clean = by_group(x, G).isfinite().all(dim=-1)
    y_nan, torch_nan = (by_group(t, G)[~clean].isnan() for t in (y, theirs))
    assert torch.equal(y_nan, torch_nan), \
        f"NaN at {int(y_nan.sum())} places, torch at {int(torch_nan.sum())}"
    if not clean.any():
        return
    x, y, theirs, ref = (by_group(t, G)[clean] for t in (x, y, theirs, reference(x, G, weight, bias, eps)))
    torch_err = tools.max_error(theirs, ref)
    if math.isfinite(torch_err):
        tol = tolerance(x, ref, x.dtype, torch_err, weight)
    else:  # float32 arithmetic, then one rounding to x's dtype
        tol = tolerance(x, ref, torch.float32, None, weight) + torch.finfo(x.dtype).eps * ref.abs().max().item()
    if x.dtype in (torch.float32, torch.float64):
        # the table's rounding of x at x's magnitude takes a unit spread; in
        # a group of small spread (or one value) y = x * rstd * w + (b - mean
        # * rstd * w), torch's own form, cancels terms of |x| * rstd * |w|
        gmax = max(weight.abs().max().item(), 1.0) if weight is not None else 1.0
        tol = max(tol, 8 * torch.finfo(x.dtype).eps * largest_spread(x, eps) * gmax)
    assert not y.isnan().any() and tools.max_error(y, ref) <= tol, describe_mismatch(y, ref, tol)


def assume_defined(x, case):
    """With eps = 0 a group of equal values has no defined output: skip it."""
    if case.eps == 0:
        assume(not (by_group(x, case.groups).double().var(dim=-1, correction=0) == 0).any())


def module_output(x, case, weight, bias):
    """GroupNorm with the case's parameters on x (None where it has no such
    layer: a bias without a weight)."""
    if case.affine == "bias":
        return None
    layer = gn.GroupNorm(case.groups, x.shape[1], case.eps, affine=case.affine != "none",
                         bias=case.affine == "both", device=x.device, dtype=x.dtype)
    with torch.no_grad():
        for parameter, value in ((layer.weight, weight), (layer.bias, bias)):
            if value is not None:
                parameter.copy_(value)
    return layer(x).detach()


def kernels_output(x, case, weight, bias):
    """groupnorm_cuda(x) with the case's kernel forced where it can take x
    (else the automatic one), its output landing in NaN-filled memory."""
    G, kernel = case.groups, case.kernel
    if kernel != "auto":
        try:
            plan = gn.plan(x, G, kernel=kernel)
        except (ValueError, RuntimeError) as error:  # this kernel cannot take x
            event(f"kernel={kernel} refused")
            with pytest.raises(type(error)):
                gn.groupnorm_cuda(x, weight, bias, G, case.eps, kernel=kernel)
            kernel = "auto"
        else:
            assert plan["kernel"] == kernel, plan
    event(f"kernel={kernel}")
    # a dense input is read in place; others are copied first, into the
    # first poisoned block
    dense = x.is_contiguous() or channels_last_like(x)
    y, landed = poisoned(lambda: gn.groupnorm_cuda(x, weight, bias, G, case.eps, kernel=kernel), x,
                         blocks=1 if dense else 2)
    assert landed, "output did not reuse a poisoned block"
    assert y.shape == x.shape and y.dtype == x.dtype
    if dense:  # x's memory format, up to the strides of size-1 dims
        assert [s for s, n in zip(y.stride(), y.shape) if n > 1] == \
               [s for s, n in zip(x.stride(), x.shape) if n > 1], (y.stride(), x.stride())
    else:
        assert y.is_contiguous(), y.stride()
    return y, kernel


def torch_cpu_channels_last(x, case):
    """Whether torch's CPU group_norm takes x to its channels-last kernel
    (4-D and 5-D input with channels-last-like strides) with shifted data:
    that kernel loses the variance of such groups (float32, 1e4 + randn over
    2 x 64 x 8 x 8: errors of 1.3e3; 0.33 at 1e3 + randn), so there group_norm
    on CPU, which is torch's, is compared with torch alone."""
    return (torch._prims_common.suggest_memory_format(x) != torch.contiguous_format and
            DATA[case.data][0] != 0)


def check_forward(case, device):
    x, storage, weight, bias = build(case, device)
    assume_defined(x, case)
    kept = copies(storage, weight, bias)
    one_value = x.numel() == case.groups  # F.group_norm refuses it
    if device == "cpu":
        kernel = "auto"
        if one_value:
            with pytest.raises(ValueError, match="more than 1 value"):
                gn.group_norm(x, case.groups, weight, bias, case.eps)
            y = tools.torch_group_norm(x, case.groups, weight, bias, case.eps)
        else:
            y = gn.group_norm(x, case.groups, weight, bias, case.eps)
            torch.testing.assert_close(y, F.group_norm(x, case.groups, weight, bias, case.eps),
                                       rtol=0, atol=0, equal_nan=True)
    else:
        y, kernel = kernels_output(x, case, weight, bias)
    if device == "cpu" and torch_cpu_channels_last(x, case):
        event("torch's CPU channels-last kernel, shifted data: not compared with the reference")
    else:
        compare(y, x, case, weight, bias)
    if one_value and case.affine != "bias":
        with pytest.raises(ValueError, match="more than 1 value"):
            module_output(x, case, weight, bias)
    elif kernel == "auto":  # the layer runs the same kernels: bitwise the same
        layer_y = module_output(x, case, weight, bias)
        if layer_y is not None:
            torch.testing.assert_close(layer_y, y, rtol=0, atol=0, equal_nan=True)
    assert_unchanged(kept, storage, weight, bias)


@st.composite
def fused_options(draw):
    """Which fused options a case takes: any of scale, shift, residual and an
    (N, C) add, and an activation chain of up to four steps (or none)."""
    # one leaky ReLU slope a chain (the library refuses two)
    chain = tuple(draw(st.lists(st.sampled_from(STEPS), max_size=4).filter(
        lambda steps: not ("leaky_relu" in steps and ("leaky_relu", 0.2) in steps))))
    return {"scale": draw(st.booleans()), "shift": draw(st.booleans()),
            "residual": draw(st.booleans()), "add": draw(st.booleans()),
            "activation": chain or None}


def fused_arguments(x, case, options):
    """The keyword arguments of the case's fused options: fresh tensors of x's
    dtype and device drawn from the case's seed (reproducible from the case)."""
    devices = [x.device.index if x.device.index is not None else torch.cuda.current_device()] \
        if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(case.seed + 2)
        args = epilogue_tensors(x, options)
        if options["add"]:
            args["add"] = torch.randn(x.shape[:2], device=x.device).to(x.dtype)
    return args


def unfused_sequence(x, case, weight, bias, args):
    """What the fused call computes, by torch's ops one after another."""
    y = F.group_norm(pre_norm_sum(x, args.get("add")), case.groups, weight, bias, case.eps)
    return apply_epilogue(y, **{k: v for k, v in args.items() if k != "add"})


@CI_FUSED_SETTINGS
@given(case=cases(CPU_BUDGET, specials=False), options=fused_options())
def test_cpu_fused_options_match_the_unfused_sequence(case, options):
    x, storage, weight, bias = build(case, "cpu")
    assume_defined(x, case)
    assume(x.numel() != case.groups)  # F.group_norm refuses one value per channel
    args = fused_arguments(x, case, options)
    kept = copies(storage, weight, bias, *args.values())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y = gn.group_norm(x, case.groups, weight, bias, case.eps, **args)
        expected = unfused_sequence(x, case, weight, bias, args)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert_unchanged(kept, storage, weight, bias, *args.values())


@cuda
@FUSED_SETTINGS
@given(case=cases(GPU_BUDGET, kernels=FORWARD_KERNELS, specials=False), options=fused_options())
def test_gpu_fused_options_match_float64_reference(case, options):
    x, storage, weight, bias = build(case, "cuda")
    assume_defined(x, case)
    args = fused_arguments(x, case, options)
    assume_defined(pre_norm_sum(x, args.get("add")), case)  # the sum's groups too
    kernel = case.kernel
    if kernel != "auto":
        try:
            gn.plan(x, case.groups, kernel=kernel, fused=True, activation=options["activation"])
        except (ValueError, RuntimeError):  # this kernel cannot take x, or this chain
            if kernel == "registers" and not inline_chain(options["activation"]):
                with pytest.raises(ValueError, match="takes no activation but SiLU or ReLU alone"):
                    gn.groupnorm_cuda(x, weight, bias, case.groups, case.eps, kernel=kernel, **args)
            kernel = "auto"
    event(f"fused kernel={kernel}")
    kept = copies(storage, weight, bias)
    check_epilogue(x, case.groups, weight, bias, args, eps=case.eps,
                   **({"kernel": kernel} if kernel != "auto" else {}))
    assert_unchanged(kept, storage, weight, bias)


@CI_SETTINGS
@given(case=cases(CPU_BUDGET))
def test_cpu_group_norm_matches_float64_reference(case):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threads cost more than they give
    try:
        check_forward(case, "cpu")
    finally:
        torch.set_num_threads(threads)


@cuda
@FORWARD_SETTINGS
@given(case=cases(GPU_BUDGET, kernels=FORWARD_KERNELS))
def test_gpu_matches_float64_reference(case):
    check_forward(case, "cuda")


@cuda
@BACKWARD_SETTINGS
@given(case=cases(GPU_BUDGET // 4, kernels=BACKWARD_KERNELS, specials=False), need_dx=st.booleans(),
       dy_like_x=st.booleans())
def test_gpu_backward_matches_float64_autograd(case, need_dx, dy_like_x):
    x, storage, weight, bias = build(case, "cuda")
    assume_defined(x, case)
    assume(x.numel() != case.groups)  # torch, the comparison, refuses one value per channel
    kernel = case.kernel
    if kernel != "auto":
        try:
            plan = gn.plan(x, case.groups, kernel=kernel, backward=True)
        except (ValueError, RuntimeError):  # this kernel cannot take x
            event(f"backward kernel={kernel} refused")
            kernel = "auto"
        else:
            assert plan["kernel"] == kernel, plan
    event(f"backward kernel={kernel}")
    need_dx = need_dx or kernel != "auto" or (weight is None and bias is None)
    values = torch.randn(case.shape, generator=torch.Generator().manual_seed(case.seed + 1))
    # grad_output in x's memory format, or contiguous
    dy = (torch.empty_like(x) if dy_like_x else x.new_empty(x.shape)).copy_(values)  # x's dtype
    kept = copies(storage, weight, bias, dy)
    check_backward(x, case.groups, weight, bias, dy,
                   kernel=kernel, need_dx=need_dx, eps=case.eps)
    assert_unchanged(kept, storage, weight, bias, dy)

"""Reliability on a GPU: concurrency (threads on streams, CUDA graphs of the
forward and backward), determinism on every forced path, memory over many
calls and out of memory, and eps where it dominates. docs/RELIABILITY.md
says what each shows; GPU tests skip without a device.
"""

import threading

import pytest
import torch
import torch.nn.functional as F

import groupnorm_inline as gn
import groupnorm_tools as tools
from test_groupnorm import (FORCED, affine, check_against_reference, check_backward, cuda,
                            forced_id, forced_input, make_input)

# (shape, groups, dtype, layout): each takes another kernel
MIXED = [
    ((2, 320, 64, 64), 32, torch.float16, "channels_last"),
    ((4, 32, 8, 8), 8, torch.float32, "contiguous"),
    ((2, 64, 128, 128), 2, torch.float32, "contiguous"),
    ((3, 60, 31), 5, torch.bfloat16, "contiguous"),
    ((1, 128, 100, 100), 64, torch.bfloat16, "channels_last"),
    ((2, 6, 5, 7), 3, torch.float64, "contiguous"),
    ((2, 512, 16, 32, 32), 32, torch.bfloat16, "channels_last"),
    ((8, 1280, 8, 8), 32, torch.float16, "contiguous"),
]


def forward_backward(x, w, b, groups, dy):
    """y and (dx, dweight, dbias) through autograd, on the current stream."""
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = gn.group_norm(leaves[0], groups, leaves[1], leaves[2])
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


def case_tensors(shape, groups, dtype, layout, seed):
    torch.manual_seed(seed)
    x = make_input(shape, dtype, layout, "cuda", shift=3.0)
    w, b = affine(shape[1], dtype, "cuda", "both")
    return x, w, b, groups, torch.randn_like(x)


@cuda
def test_gpu_threads_on_streams_give_the_serial_results():
    # 8 threads on 4 streams, each running forward and backward of its
    # cases at once: every result bitwise equal to the same call run alone
    jobs = [(case, seed) for seed in range(4) for case in MIXED]
    inputs = [case_tensors(*case, seed) for case, seed in jobs]
    serial = [forward_backward(*args) for args in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(4)]
    results, errors = [None] * len(jobs), []
    start = threading.Barrier(8)

    def work(thread):
        try:
            stream = streams[thread % 4]
            stream.wait_stream(torch.cuda.default_stream())
            start.wait()
            with torch.cuda.stream(stream):
                for j in range(thread, len(jobs), 8):
                    results[j] = forward_backward(*inputs[j])
            stream.synchronize()
        except Exception as error:  # noqa: BLE001 (reported below, with the thread)
            errors.append((thread, error))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (case, seed), ours, alone in zip(jobs, results, serial):
        for name, a, b in zip(("y", "dx", "dweight", "dbias"), ours, alone):
            assert torch.equal(a, b), (case, seed, name)


@cuda
@pytest.mark.parametrize("case", MIXED[:4], ids=lambda c: f"{'x'.join(map(str, c[0]))}-{str(c[2])[6:]}")
def test_gpu_graph_of_forward_and_backward_replays_the_same(case):
    # forward and backward captured in one CUDA graph, replayed 1,000 times
    # on fresh inputs copied in: each replay equals the eager call
    x, w, b, groups, dy = case_tensors(*case, seed=0)
    static = [t.detach().clone() for t in (x, w, b, dy)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward_backward(static[0], static[1], static[2], groups, static[3])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward_backward(static[0], static[1], static[2], groups, static[3])
    for replay in range(1000):
        if replay % 250 == 0:  # new values now and then; the same ones between
            fresh = case_tensors(*case, seed=replay + 1)
            for target, value in zip(static, (fresh[0], fresh[1], fresh[2], fresh[4])):
                target.copy_(value)
            expected = forward_backward(static[0], static[1], static[2], groups, static[3])
        graph.replay()
        if replay % 50 == 0 or replay == 999:
            torch.cuda.synchronize()
            for name, a, e in zip(("y", "dx", "dweight", "dbias"), captured, expected):
                assert torch.equal(a, e), (replay, name)


@cuda
@pytest.mark.parametrize("case", FORCED, ids=forced_id)
def test_gpu_every_forced_path_is_deterministic(case):
    x, _, force = forced_input(case)
    groups, kernel = case[1], case[4]
    w, b = affine(x.shape[1], x.dtype, "cuda", "both")
    first = gn.groupnorm_cuda(x, w, b, groups, kernel=kernel, **force)
    for _ in range(3):
        assert torch.equal(gn.groupnorm_cuda(x, w, b, groups, kernel=kernel, **force), first)
    ext = gn.load()
    _, mean, rstd = ext.forward(x, w, b, groups, 1e-5, "auto", 0, 0)
    dy = torch.randn_like(x)
    grads = ext.backward(dy, x, mean, rstd, w, groups, True, True, "auto", 0)
    for _ in range(3):
        again = ext.backward(dy, x, mean, rstd, w, groups, True, True, "auto", 0)
        assert all(torch.equal(a, g) for a, g in zip(again, grads))


# (shape, groups, dtype, layout, forcing): the plans whose CTAs wait on each
# other through counters, of several sizes, each within a stream's slot
# (16 KiB: stream plans of up to 1,363 units).
COUNTER_CASES = [
    ((3, 12, 61, 37), 3, torch.float32, "contiguous", dict(kernel="stream")),
    ((64, 64, 32, 32), 8, torch.float16, "contiguous", dict(kernel="stream")),
    ((1, 128, 100, 100), 64, torch.bfloat16, "channels_last", dict(kernel="stream")),
    ((3, 12, 61, 37), 3, torch.float32, "contiguous", dict(kernel="contiguous", team=13)),
    ((3, 40, 77, 19), 4, torch.float32, "channels_last", dict(kernel="channels_last", team=11)),
]


def run_counter_case(shape, groups, dtype, layout, force, seed):
    """The forced forward (and, for the stream plans, backward) on fresh
    input, checked against the float64 reference."""
    torch.manual_seed(seed)
    x = make_input(shape, dtype, layout, "cuda", shift=2.0)
    w, b = affine(shape[1], dtype, "cuda", "both")
    check_against_reference(x, groups, w, b, **force)
    if force["kernel"] == "stream":
        check_backward(x, groups, w, b, torch.randn_like(x), kernel="stream")


@cuda
def test_gpu_counters_are_left_zeroed_for_the_next_plan():
    # Launches on one stream share its counters, which each must leave at
    # zero: every plan after every other, forward and reverse, on fresh
    # input (stale counters end a stream kernel early or let a CTA read
    # statistics not yet merged: a wrong output)
    # 4,096 units: counters larger than a slot, zeroed in a temporary
    larger = ((128, 32, 16, 16), 32, torch.float16, "contiguous", dict(kernel="stream"))
    for case in COUNTER_CASES + [larger]:
        assert gn.plan(make_input(case[0], case[2], case[3], "cuda"), case[1],
                       **case[4])["kernel"] == case[4]["kernel"], case
    order = COUNTER_CASES + [larger] + COUNTER_CASES[::-1] + COUNTER_CASES[::2] + COUNTER_CASES[1::2]
    for seed, case in enumerate(order):
        run_counter_case(*case, seed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a stream's first launches: its own counters
        for seed, case in enumerate(order[:len(COUNTER_CASES)]):
            run_counter_case(*case, seed)
    torch.cuda.current_stream().wait_stream(side)


@cuda
def test_gpu_counter_plans_launch_no_memset():
    # After a stream's first launch, the team and stream plans find their
    # counters zeroed: a call enqueues its kernels and no memset
    from torch.profiler import ProfilerActivity, profile
    for shape, groups, dtype, layout, force in COUNTER_CASES:
        x = make_input(shape, dtype, layout, "cuda")
        w, b = affine(shape[1], dtype, "cuda", "both")
        ext = gn.load()
        calls = [lambda: gn.groupnorm_cuda(x, w, b, groups, **force)]
        if force["kernel"] == "stream":
            _, mean, rstd = ext.forward(x, w, b, groups, 1e-5, "auto", 0, 0)
            dy = torch.randn_like(x)
            calls.append(lambda: ext.backward(dy, x, mean, rstd, w, groups, True, True, "stream", 0))
        for call in calls:
            call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            names = [event.name for event in prof.events()]
            assert any("groupnorm" in n for n in names), names  # the kernel was seen
            assert not [n for n in names if "memset" in n.lower()], (shape, force, names)


@cuda
def test_gpu_memory_is_flat_over_many_calls():
    # 10,000 forward + backward calls: what is allocated afterwards is what
    # was before (nothing kept per call); a call's peak is its outputs and a
    # bounded workspace
    x, w, b, groups, dy = case_tensors((2, 320, 64, 64), 32, torch.float16, "channels_last", 0)
    forward_backward(x, w, b, groups, dy)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(10_000):
        forward_backward(x, w, b, groups, dy)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = gn.groupnorm_cuda(x, w, b, groups)
    torch.cuda.synchronize()
    statistics = 2 * 512  # mean and rstd, 256 bytes each, in the allocator's 512-byte blocks
    outputs = y.numel() * y.element_size() + statistics
    workspace = torch.cuda.max_memory_allocated() - base - outputs
    assert 0 <= workspace <= outputs // 4, workspace  # counters and per-piece partials


@cuda
def test_gpu_out_of_memory_is_torchs_error_and_the_process_goes_on():
    # an input of 30 % of the free memory, then all but 3 % of the rest
    # taken: y cannot be allocated
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    x = torch.randn(1, 8, int(free * 0.3) // 4 // 8, device="cuda")
    hog = torch.empty(int(torch.cuda.mem_get_info()[0] * 0.97), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            gn.groupnorm_cuda(x, None, None, 4)
    finally:
        del hog, x
        torch.cuda.empty_cache()
    small = make_input((2, 32, 8, 8), torch.float32, "contiguous", "cuda")
    y = gn.groupnorm_cuda(small, None, None, 4)
    assert tools.max_error(y, tools.reference_group_norm(small, 4, None, None, 1e-5)) < 1e-4


@cuda
@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-3, 0.5])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gpu_eps_where_it_dominates(eps, layout):
    # a spread of 1e-3 (variance 1e-6): a kernel that dropped or misplaced
    # eps is far off for every eps but 0 (float32 around 5, float16 around 0:
    # its steps at 5 are wider than the spread)
    for shape, groups, dtype, centre in (((2, 64, 24, 24), 8, torch.float32, 5.0),
                                         ((2, 320, 16, 16), 32, torch.float16, 0.0)):
        x = (centre + 1e-3 * make_input(shape, torch.float32, layout, "cuda")).to(dtype)
        ref = tools.reference_group_norm(x, groups, None, None, eps)
        theirs = F.group_norm(x.float(), groups, None, None, eps).to(dtype)
        for kernel in ("auto", "reference"):
            y = gn.groupnorm_cuda(x, None, None, groups, eps, kernel=kernel)
            tol = 3 * max(tools.max_error(theirs, ref), torch.finfo(dtype).eps * ref.abs().max().item())
            assert tools.max_error(y, ref) <= tol, (shape, kernel, tools.max_error(y, ref), tol)

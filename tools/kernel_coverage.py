"""Which kernels of the built library a GPU test run launches: a pytest
plugin. Each test runs under torch.profiler (CUDA activity only); at the end
the plugin lists the kernel instantiations in the extension's library
(`nm -C`) and fails the run, naming them, if any was never launched. A
kernel no test launches is either untested or dead code: add the test or
stop instantiating it.

    python3 -m pytest -p tools.kernel_coverage [--kernel-coverage PATH] test_*.py

PATH (optional) gets the JSON: built, launched and never-launched names.
Without a GPU the plugin does nothing. Tests that run a profiler of their
own run without this one (one profiler at a time). Kernels launched in
subprocesses (the bundle and build-fault tests) are not seen.
"""

import inspect
import json
import re
import subprocess

import pytest
import torch

# template arguments may hold a cast enumerator: (groupnorm::Store)1
KERNEL = re.compile(r"groupnorm::groupnorm_\w+_kernel<(?:[^()]|\([\w:]+\))*>")


def kernel_key(name):
    """The instantiation a demangled kernel name denotes, spaces removed
    ('void ns::k<float, 4, false>(float const*, ...)' -> 'ns::k<float,4,false>'),
    or None for another library's kernel."""
    match = KERNEL.search(name)
    return match.group(0).replace(" ", "") if match else None


def built_kernels(library):
    """Every kernel instantiation whose host stub the library defines."""
    listing = subprocess.run(["nm", "-C", "--defined-only", library], capture_output=True,
                             text=True, check=True).stdout
    return {key for line in listing.splitlines() if (key := kernel_key(line))}


def launched_kernels(profiler):
    """The kernels a finished torch.profiler session saw on the GPU."""
    results = getattr(profiler.profiler, "kineto_results", None)
    if results is not None:
        events = [(e.name(), e.device_type()) for e in results.events()]
    else:
        events = [(e.name, e.device_type) for e in profiler.events()]
    return {key for name, device in events
            if device == torch.autograd.DeviceType.CUDA and (key := kernel_key(name))}


def runs_its_own_profiler(item):
    try:
        return "profiler" in inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return False


class Coverage:
    def __init__(self, path):
        self.path = path
        self.launched = set()
        self.missing = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if runs_its_own_profiler(item):
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            yield
        self.launched |= launched_kernels(profiler)

    def pytest_sessionfinish(self, session, exitstatus):
        import groupnorm_inline as gn

        library = gn.load().__file__
        built = built_kernels(library)
        self.missing = sorted(built - self.launched)
        if self.path:
            with open(self.path, "w") as f:
                json.dump({"library": library, "built": sorted(built),
                           "launched": sorted(self.launched & built),
                           "never_launched": self.missing}, f, indent=1)
        if self.missing and session.exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        write(f"kernel coverage: {len(self.launched)} kernel instantiations launched; "
              f"{len(self.missing)} built but never launched")
        for name in self.missing:
            write(f"  never launched: {name}")


def pytest_addoption(parser):
    parser.addoption("--kernel-coverage", metavar="PATH", default=None,
                     help="write the built, launched and never-launched kernels here (JSON)")


def pytest_configure(config):
    if torch.cuda.is_available():
        config.pluginmanager.register(Coverage(config.getoption("--kernel-coverage")),
                                      "kernel-coverage")

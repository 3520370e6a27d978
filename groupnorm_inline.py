"""groupnorm_inline: a fast GroupNorm for PyTorch on NVIDIA GPUs.

Same answer as torch.nn.GroupNorm, forward and backward, from CUDA kernels
compiled on first use with torch.utils.cpp_extension (in parallel, cached).

    import groupnorm_inline as gn
    y = gn.group_norm(x, 32, weight, bias)          # like F.group_norm
    layer = gn.GroupNorm(32, 320).cuda()            # like nn.GroupNorm
    model = gn.replace_groupnorm(model)             # swap every nn.GroupNorm

Command line (run by groupnorm_tools.py, which a bundle embeds):
    python groupnorm_inline.py [check]              build and self-check
    python groupnorm_inline.py build [--arch 9.0]   compile only, print the extension's name
    python groupnorm_inline.py --version
    python groupnorm_inline.py bundle OUT.py        standalone single-file copy
    python groupnorm_inline.py bundle --kernelbench level1-35 OUT.py
"""

import contextlib
import errno
import functools
import glob
import hashlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import socket
import sys
import threading
import time
import types
import typing
import warnings

try:
    import fcntl
except ImportError:  # Windows: torch's own build lock only
    fcntl = None

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _torch_module

__version__ = "0.1.0"
__all__ = [
    "GroupNorm", "GroupNormAct", "group_norm", "groupnorm_cuda", "replace_groupnorm", "plan",
    "GroupNormError", "ToolchainError", "BuildCacheError", "load", "sources", "extension_name",
    "enable_compile_fusion", "disable_compile_fusion",
]

# ---------------------------------------------------------------------------
# Loader: kernels/ (or the sources embedded by `bundle`) -> one extension
# ---------------------------------------------------------------------------

# A bundled copy carries its kernel sources here, {file name: text}, and the
# text of groupnorm_tools.py, which its command line runs.
_EMBEDDED_SOURCES = None  # replaced by `bundle`
_EMBEDDED_TOOLS = None  # replaced by `bundle`

_HERE = os.path.dirname(os.path.abspath(globals()["__file__"])) if "__file__" in globals() else None
# The extension is compiled as separate translation units, in parallel: the
# host code, the Python module, and each kernel family once per dtype and
# epilogue switch (without the epilogue, with it).
_HOST_UNITS = ["counter_slots.cu", "counters.cpp", "device.cpp", "errors.cpp",
               "plan_forward.cpp", "plan_backward.cpp", "ops.cpp", "library.cpp", "bindings.cpp"]
_KERNEL_UNITS = ["launch_forward_small.cu", "launch_forward_registers_many.cu",
                 "launch_forward_team.cu", "launch_forward_stream.cu",
                 "launch_forward_stream_channels_last.cu", "launch_backward.cu"]
# 16-bit dtypes first: their units take the longest (_kernel_units)
_UNIT_DTYPES = {"half": "c10::Half", "bfloat16": "c10::BFloat16", "float": "float",
                "double": "double"}
# Everything but the Python module as one translation unit, and the
# declarations to bind: the KernelBench export (load_inline compiles strings).
_SINGLE_UNIT = "extension.cu"
_DECLARATIONS = "ops.h"
_CXX_FLAGS = ["-O3"]
_CUDA_FLAGS = ["-O3"]   # torch adds its own -std (C++17 or C++20 by version)
_DEFAULT_ARCH = "9.0"                # used when no GPU is visible (CI compiles this way)
# What a build directory holds (see _cache_problem), in the extension's name:
# a build by a loader that stamped nothing is never taken for a finished one.
_CACHE_LAYOUT = "stamped library, flock"
_LOCAL_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)
_extension = None
_load_lock = threading.Lock()


def _read_source(name):
    if _EMBEDDED_SOURCES is not None:
        return _EMBEDDED_SOURCES[name]
    if _HERE is None:
        raise RuntimeError("groupnorm_inline: no kernels/ directory and no embedded sources; "
                           "exec a copy made by `python groupnorm_inline.py bundle OUT.py`")
    with open(os.path.join(_HERE, "kernels", name), encoding="utf-8") as f:
        return f.read()


_SOURCE_SUFFIXES = (".h", ".cuh", ".cu", ".cpp")


def _kernel_files():
    """Every kernel source file name (editor and cache files in kernels/ are
    not sources), for the build and for bundling."""
    if _EMBEDDED_SOURCES is not None:
        return sorted(_EMBEDDED_SOURCES)
    folder = os.path.join(_HERE, "kernels")
    return sorted(name for name in os.listdir(folder)
                  if name.endswith(_SOURCE_SUFFIXES) and os.path.isfile(os.path.join(folder, name)))


def _expand(name, seen):
    """The text of `name` with local #include "..." lines replaced by the
    files they name, each file once: load_inline compiles a single string."""
    if name in seen:
        return ""
    seen.add(name)
    text = _read_source(name).replace("#pragma once\n", "")  # one file: each is inlined once
    return _LOCAL_INCLUDE.sub(lambda m: _expand(m.group(1), seen), text)


def sources():
    """(declarations, single CUDA translation unit) as strings, for
    load_inline: every kernel source inlined once."""
    return _expand(_DECLARATIONS, set()), _expand(_SINGLE_UNIT, set())


def _arch_list():
    """Architectures to build for: TORCH_CUDA_ARCH_LIST if set, else every
    visible device's, so that a host with GPUs of two generations can run
    on either."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        capabilities = {torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())}
        return ";".join(f"{major}.{minor}" for major, minor in sorted(capabilities))
    return _DEFAULT_ARCH


def _dtype_units(family):
    """{file stem: text} of a kernel family's translation units: one per
    dtype and epilogue switch, those with the epilogue first."""
    units = {}
    for suffix, fused in (("_epilogue", "true"), ("", "false")):
        for dtype, type_name in _UNIT_DTYPES.items():
            units[f"{family[:-3]}_{dtype}{suffix}"] = (
                f"#define GROUPNORM_DTYPES(X) X({type_name})\n"
                f"#define GROUPNORM_EPILOGUES(X, T) X(T, {fused})\n"
                f"#include \"{family}\"\n")
    return units


def _kernel_units():
    """{file stem: text} of every kernel unit, in the order the build starts
    them: ninja starts units in the order it is given them, and the longest
    going first leaves none running alone at the end (docs/DESIGN.md
    "Build"). Each family's units with the epilogue, then those without,
    each in _UNIT_DTYPES's order."""
    per_family = [list(_dtype_units(family).items()) for family in _KERNEL_UNITS]
    return dict(unit for rank in range(2 * len(_UNIT_DTYPES)) for units in per_family
                for unit in units[rank:rank + 1])


def extension_name(arch=None):
    """Name of the compiled extension: a hash of everything that shapes the
    binary (sources, the units they are compiled as, flags, versions) and of
    the cache's layout, so an edited kernel can never load a stale build."""
    units = [*_HOST_UNITS, *_kernel_units().values()]
    key = "\0".join([*(name + "\0" + _read_source(name) for name in _kernel_files()), *units,
                     " ".join(_CXX_FLAGS + _CUDA_FLAGS), arch or _arch_list(), torch.__version__,
                     str(torch.version.cuda), sys.version.split()[0], _CACHE_LAYOUT])
    return "groupnorm_inline_" + hashlib.sha256(key.encode()).hexdigest()[:16]


class ToolchainError(RuntimeError):
    """What a build needs is missing: a CUDA build of torch, nvcc, the CUDA
    runtime library or ninja. The message names the fix."""


class BuildCacheError(ToolchainError):
    """The build cache cannot serve or hold the build: its directory is not
    writable or its disk is full, or another process's build there did not
    end in time. A ToolchainError, so group_norm falls back to torch the
    same way; the message names the directory and the fix."""


def _check_toolchain():
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise ToolchainError("groupnorm_inline: this PyTorch build has no CUDA support "
                              f"(torch {torch.__version__}); install a CUDA build of torch")
    home = cpp_extension.CUDA_HOME
    if not home or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        raise ToolchainError("groupnorm_inline: the CUDA compiler (nvcc) was not found "
                              f"(CUDA_HOME={home!r}). Install the CUDA toolkit and set CUDA_HOME to "
                              "its directory, the one holding bin/nvcc, e.g. "
                              "export CUDA_HOME=/usr/local/cuda")
    libs = [os.path.join(home, "lib64"), *glob.glob(os.path.join(home, "targets", "*", "lib"))]
    if not any(glob.glob(os.path.join(d, "libcudart.so*")) for d in libs) and os.name != "nt":
        raise ToolchainError(f"groupnorm_inline: CUDA_HOME={home!r} has nvcc but no CUDA runtime library "
                              "(lib64/libcudart.so); set CUDA_HOME to the toolkit directory itself, "
                              "e.g. export CUDA_HOME=/usr/local/cuda-13.0")
    if not cpp_extension.is_ninja_available():
        raise ToolchainError("groupnorm_inline: ninja was not found; install it with `pip install ninja`")


# A build directory holds, beside ninja's files, the library; a stamp that
# the build writes once the library is whole and imports (its size and
# sha256); and our lock, taken by whoever builds there. The lock is an OS
# lock (flock), which dies with its holder, so a killed build leaves nothing
# to clear. torch's own `lock` is one too in newer torch (2.14.1, as CI has); in
# older torch it is a file whose existence blocks (FileBaton), which a
# killed build leaves behind for every later build to wait on forever.
_STAMP_SUFFIX = ".sha256"
_LOCK_FILE = "groupnorm_inline.lock"
_LOCK_TIMEOUT_S = 1800  # GROUPNORM_INLINE_LOCK_TIMEOUT's default: a cold build takes 0.5-6 min
_LOCK_REPORT_S = 30     # how often a process that waits says who for
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # a full disk or quota
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # file systems without flock


def _library_path(build_dir, name):
    return os.path.join(build_dir, name + (".pyd" if os.name == "nt" else ".so"))


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_problem(built):
    """None when `built` is the library a finished build stamped (the same
    size and sha256), "" when neither is there (a cold cache), else what is
    wrong with it, in words."""
    stamp = built + _STAMP_SUFFIX
    try:
        with open(stamp, encoding="utf-8") as f:
            digest, size = f.read().split()
            size = int(size)
    except FileNotFoundError:
        return f"the build that wrote {built} did not finish" if os.path.exists(built) else ""
    except ValueError:
        return f"the stamp {stamp} is damaged"
    if not os.path.exists(built):
        return f"{built} is missing"
    if os.path.getsize(built) != size:
        return f"{built} is damaged ({os.path.getsize(built)} bytes; the build wrote {size})"
    if _sha256(built) != digest:
        return f"{built} is damaged (its sha256 is not the one the build wrote)"
    return None


def _load_cached(name, built):
    """The extension from a finished build, or None. The library is
    checked against its stamp first: a damaged one can crash the process
    that imports it, or load wrong code."""
    if _cache_problem(built) is not None:
        return None
    spec = importlib.util.spec_from_file_location(name, built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stamp(built):
    """Records `built` as whole: its size and sha256, written atomically."""
    temporary = f"{built}{_STAMP_SUFFIX}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(f"{_sha256(built)} {os.path.getsize(built)}\n")
    os.replace(temporary, built + _STAMP_SUFFIX)


def _lock_timeout():
    return float(os.environ.get("GROUPNORM_INLINE_LOCK_TIMEOUT", _LOCK_TIMEOUT_S))


def _holder(fd):
    """What the lock file says of its last holder: {pid, pgid, host, since}."""
    try:
        fields = dict(item.split("=", 1) for item in os.pread(fd, 512, 0).decode().split())
        return {"pid": int(fields["pid"]), "pgid": int(fields["pgid"]), "host": fields["host"],
                "since": float(fields["since"])}
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        return None  # not written yet, or being written


def _describe(holder):
    if holder is None:
        return "another process"
    return (f"process {holder['pid']} on {holder['host']} (building for "
            f"{time.time() - holder['since']:.0f} s)")


def _acquire(fd, name, build_dir):
    """Takes the lock on fd, waiting at most GROUPNORM_INLINE_LOCK_TIMEOUT
    seconds and saying every so often who holds it."""
    timeout = _lock_timeout()
    start = time.monotonic()
    reported = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError as error:
            if error.errno in _NO_LOCKS:
                return  # no locks here: torch's own lock is all there is, as before
            raise
        waited = time.monotonic() - start
        holder = _holder(fd)  # None for the moment between a holder's lock and its record
        if waited >= timeout:
            raise BuildCacheError(
                f"groupnorm_inline: gave up after {waited:.0f} s waiting for {_describe(holder)} "
                f"to finish building {name} in {build_dir}. If that process is stuck, stop it; "
                f"to wait longer, set GROUPNORM_INLINE_LOCK_TIMEOUT (seconds, now {timeout:g})")
        if (waited - reported >= _LOCK_REPORT_S if reported is not None
                else holder is not None or waited >= 1):
            print(f"groupnorm_inline: waiting for {_describe(holder)} to finish building {name} "
                  f"in {build_dir} ({waited:.0f} s so far)", file=sys.stderr, flush=True)
            reported = waited
        time.sleep(0.2)


def _leftovers(holder, build_dir):
    """Processes that a killed holder started and that still work in
    build_dir (ninja, compilers: its process group, with their working
    directory there). Linux only; elsewhere none are seen."""
    if holder is None or holder["host"] != socket.gethostname() or not os.path.isdir("/proc"):
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if (os.getpgid(int(entry)) == holder["pgid"]
                    and os.path.samefile(f"/proc/{entry}/cwd", build_dir)):
                found.append(int(entry))
        except OSError:  # gone, or another user's
            pass
    return found


def _wait_for_leftovers(holder, build_dir):
    """Waits, at most GROUPNORM_INLINE_LOCK_TIMEOUT seconds, until nothing
    that a killed holder started works in build_dir any more."""
    start = time.monotonic()
    pids = _leftovers(holder, build_dir)
    if pids:
        print(f"groupnorm_inline: waiting for processes {pids}, left running in {build_dir} by a "
              "build that was killed", file=sys.stderr, flush=True)
    while pids:
        if time.monotonic() - start >= _lock_timeout():
            raise BuildCacheError(
                f"groupnorm_inline: processes {pids}, left running in {build_dir} by a build that "
                f"was killed, still run after {time.monotonic() - start:.0f} s; stop them, or set "
                "GROUPNORM_INLINE_LOCK_TIMEOUT (seconds) to wait longer")
        time.sleep(0.2)
        pids = _leftovers(holder, build_dir)


@contextlib.contextmanager
def _build_lock(build_dir, name):
    """Held while this process builds in build_dir; another process that
    wants to build there waits (see _acquire). The holder records itself in
    the lock file until it lets go: a record found on taking the lock is a
    killed holder's, whose ninja and compilers may still be writing objects
    and ninja's log, so the new holder waits for them before building."""
    if fcntl is None:
        yield
        return
    fd = os.open(os.path.join(build_dir, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        _acquire(fd, name, build_dir)
        previous = _holder(fd)
        with contextlib.suppress(OSError):  # a full disk: the record is only for messages
            os.ftruncate(fd, 0)
            os.pwrite(fd, (f"pid={os.getpid()} pgid={os.getpgrp()} host={socket.gethostname()} "
                           f"since={time.time():.0f}\n").encode(), 0)
        _wait_for_leftovers(previous, build_dir)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # releases the lock


def _cache_error(error, name, build_dir):
    """The BuildCacheError for `error`, met while loading or building name
    in build_dir, when the cache is at fault (no space, not writable); else
    None. ninja's failures arrive as torch's RuntimeError, with its output."""
    text = str(error)
    code = getattr(error, "errno", None)
    if code in _NO_SPACE or "No space left on device" in text or "Disk quota exceeded" in text:
        lines = [line.strip() for line in text.splitlines()
                 if "No space left on device" in line or "Disk quota exceeded" in line]
        return BuildCacheError(
            f"groupnorm_inline: no space left to build {name} in {build_dir} "
            f"({lines[0] if lines else text}). Free space there, or set TORCH_EXTENSIONS_DIR to a "
            "directory on another disk; the next import builds again")
    if code in _NOT_WRITABLE:
        where = error.filename or build_dir  # a file or directory it could not create
        while where and not os.path.isdir(where):
            where = os.path.dirname(where)
        problem = _cache_problem(_library_path(build_dir, name)) if build_dir else ""
        if problem:
            return BuildCacheError(
                f"groupnorm_inline: {problem}, and {where} is not writable ({error.strerror}) to "
                f"build it again. Delete {_library_path(build_dir, name)} where the cache is "
                "writable and import again, or set TORCH_EXTENSIONS_DIR to a writable directory")
        return BuildCacheError(
            f"groupnorm_inline: cannot build {name}: {where} is not writable ({error.strerror}). "
            "Set TORCH_EXTENSIONS_DIR to a writable directory, or build once where the cache is "
            "writable (python groupnorm_inline.py build)")
    return None


def _write_sources(build_dir):
    """The translation units to compile, written under build_dir, in the
    order the build starts them (_kernel_units): the kernel sources in src/,
    and for each kernel family one file per dtype and epilogue switch that
    includes it (GROUPNORM_DTYPES, kernels/launchers.h)."""
    src = os.path.join(build_dir, "src")
    os.makedirs(src, exist_ok=True)

    def write(path, text):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if f.read() == text:
                    return  # unchanged: ninja keeps its object
        # whole or not at all: another process may be compiling this file
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)

    for name in _kernel_files():
        write(os.path.join(src, name), _read_source(name))
    kernel_units = []
    for stem, text in _kernel_units().items():
        path = os.path.join(build_dir, f"{stem}.cu")
        write(path, text)
        kernel_units.append(path)
    units = [os.path.join(src, name) for name in _HOST_UNITS] + kernel_units
    return units


class _Progress:
    """Prints each translation unit as its object file appears, with the
    time since the build started: ninja runs them in parallel, silently."""

    def __init__(self, build_dir, units):
        objects = {os.path.splitext(os.path.basename(u))[0] + (".cuda.o" if u.endswith(".cu") else ".o")
                   for u in units}
        self._pending = {os.path.join(build_dir, o) for o in objects}
        self._total = len(objects)
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        done = 0
        while not self._stop.wait(0.5):
            for path in sorted(p for p in self._pending if os.path.exists(p)):
                self._pending.discard(path)
                done += 1
                print(f"groupnorm_inline: [{done}/{self._total}] {os.path.basename(path)} "
                      f"({time.perf_counter() - self._start:.0f} s)", file=sys.stderr, flush=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def load():
    """The compiled extension, built on first use and cached on disk.

    A fresh build prints what it compiles and when each unit is done; a
    cached load is silent. Threads that call it at once wait for one load;
    processes, for one build (_build_lock). A build that did not finish, or
    a library that is not the one its build wrote, is built again; a cache
    that cannot be written raises BuildCacheError.
    """
    if _extension is not None:
        return _extension
    with _load_lock:
        return _extension if _extension is not None else _load_or_build()


def _load_or_build():
    global _extension
    from torch.utils import cpp_extension

    arch = _arch_list()
    name = extension_name(arch)
    build_dir = None
    try:
        build_dir = cpp_extension._get_build_directory(name, verbose=False)  # mkdir -p
        built = _library_path(build_dir, name)
        module = _load_cached(name, built)
        if module is None:
            with _build_lock(build_dir, name):
                module = _load_cached(name, built) or _build(cpp_extension, name, arch, build_dir)
    except ToolchainError:
        raise
    except (OSError, RuntimeError) as error:
        cache_error = _cache_error(error, name, build_dir)
        if cache_error is None:
            raise
        raise cache_error from error
    _register_kernels(module)
    _extension = module
    return module


def _build(cpp_extension, name, arch, build_dir):
    """Builds the extension in build_dir, with its lock held, and imports it."""
    built = _library_path(build_dir, name)
    problem = _cache_problem(built)
    # Nothing is kept of an unfinished or damaged build but the objects,
    # which ninja rebuilds when they are out of date. torch's own `lock`
    # goes too: in older torch its existence blocks every build, and a
    # killed build leaves it behind; no one else builds here while we hold ours.
    for stale in (built, built + _STAMP_SUFFIX, os.path.join(build_dir, "lock")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
    if problem:
        print(f"groupnorm_inline: {problem}; building it again", file=sys.stderr, flush=True)

    _check_toolchain()
    units = _write_sources(build_dir)
    sm = ", ".join("sm_" + a.replace(".", "").replace("+PTX", "") for a in re.split(r"[ ;]+", arch) if a)
    jobs = f"MAX_JOBS={os.environ['MAX_JOBS']}" if os.environ.get("MAX_JOBS") else "ninja's default jobs"
    print(f"groupnorm_inline: building CUDA kernels for {sm} ({'again' if problem else 'first use'}): "
          f"{len(units)} translation units in parallel ({jobs})...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        with _Progress(build_dir, units):
            module = cpp_extension.load(
                name=name, sources=units, extra_cflags=_CXX_FLAGS, extra_cuda_cflags=_CUDA_FLAGS,
                extra_include_paths=[os.path.join(build_dir, "src")], build_directory=build_dir,
                verbose=False)
    finally:
        if saved is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
    _stamp(built)  # it imported: later imports may take it
    print(f"groupnorm_inline: built in {time.perf_counter() - start:.0f} s",
          file=sys.stderr, flush=True)
    return module


# ---------------------------------------------------------------------------
# Python API
# ---------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class GroupNormError(ValueError, RuntimeError):
    """A bad argument to group_norm, GroupNorm, groupnorm_cuda or plan (the
    message names it and its value), or layers that replace_groupnorm with
    strict=True cannot swap (a TypeError too). A ValueError, as this module's
    errors were, and a RuntimeError, as most of torch's for the same mistakes
    are; where torch raises another type for a mistake, also that type: a
    TypeError for an argument of the wrong type, NotImplementedError for an
    input dtype without a kernel or a sparse tensor, ZeroDivisionError for
    num_groups = 0, AttributeError for an input that is not a tensor. So code
    written against torch catches it, on either device."""


class _WrongType(GroupNormError, TypeError):
    """An argument of the wrong type (torch: TypeError)."""


class _UnsupportedDtype(_WrongType, NotImplementedError):
    """An input dtype without a kernel (torch: NotImplementedError)."""


class _NotStrided(GroupNormError, NotImplementedError):
    """A sparse (or other non-strided) tensor (torch: NotImplementedError)."""


class _NotATensor(_WrongType, AttributeError):
    """An input that is not a tensor (torch: AttributeError, from input.dim())."""


class _ZeroGroups(GroupNormError, ZeroDivisionError):
    """num_groups = 0 (torch: ZeroDivisionError, from C // num_groups)."""


def _integral(value):
    """An int for num_groups, as torch takes it: Python and numpy integers and
    0-d integer tensors, not bools."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not (value.is_floating_point() or value.is_complex()
                                         or value.dtype == torch.bool)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value):
    """A float for eps: Python and numpy reals and 0-d real tensors, not bools."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not (value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _type_name(value):
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def _check_scalars(caller, num_groups, eps):
    """(num_groups, eps) as int and float (torch.compile traces plain Python
    numbers)."""
    if type(num_groups) is not int:
        if not _integral(num_groups):
            raise _WrongType(f"{caller}: num_groups must be an int, got {_type_name(num_groups)}")
        num_groups = int(num_groups)
    if type(eps) is not float:
        if not _real(eps):
            raise _WrongType(f"{caller}: eps must be a float, got {_type_name(eps)}")
        eps = float(eps)
    if not (eps >= 0 and eps != float("inf")):
        raise GroupNormError(f"{caller}: eps must be finite and >= 0, got {eps}")
    return num_groups, eps


def _check_arguments(caller, input, num_groups, weight, bias, eps):
    """(num_groups, eps) as int and float, once the arguments pass the checks
    of torch's group_norm, in Python for either device, so that a mistake
    raises the same error type on CPU and GPU."""
    if not isinstance(input, torch.Tensor):
        raise _NotATensor(f"{caller}: input must be a torch.Tensor, got {type(input).__name__}")
    num_groups, eps = _check_scalars(caller, num_groups, eps)
    if input.dim() < 2:
        raise GroupNormError(f"{caller}: input must have shape (N, C, *), got {tuple(input.shape)}")
    C = input.shape[1]
    if num_groups <= 0 or C % num_groups:
        error = _ZeroGroups if num_groups == 0 else GroupNormError
        raise error(f"{caller}: num_channels ({C}) must be divisible by a positive num_groups "
                    f"({num_groups})")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise _WrongType(f"{caller}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.shape != (C,):
            raise GroupNormError(f"{caller}: {name} must have shape [{C}] (one value per channel), "
                                 f"got {list(t.shape)}")
    if input.dtype not in _FLOAT_DTYPES:
        raise _UnsupportedDtype(f"{caller}: input dtype must be float32, float16, bfloat16 or "
                                f"float64, got {input.dtype}")
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is not None and t.layout != torch.strided:  # the kernels read strided memory
            raise _NotStrided(f"{caller}: {name} must be a strided (dense) tensor, got {t.layout}")
    return num_groups, eps


def _check_cuda_arguments(caller, x, groups, weight, bias, eps):
    """_check_arguments, then what this module's kernels need beyond torch:
    x on a GPU, weight and bias of its dtype and on its device."""
    groups, eps = _check_arguments(caller, x, groups, weight, bias, eps)
    if not x.is_cuda:
        raise GroupNormError(f"{caller}: x must be a CUDA tensor, got one on {x.device}; "
                             "group_norm() also takes CPU tensors")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise _WrongType(f"{caller}: {name} dtype must be x's ({x.dtype}), got {t.dtype}; "
                             "group_norm() takes mixed dtypes")
        if t is not None and t.device != x.device:
            raise GroupNormError(f"{caller}: {name} must be on x's device ({x.device}), got one "
                                 f"on {t.device}")
    return groups, eps


# The fused epilogue (issue 24): y = GN(x) * weight + bias, then
# y * (1 + scale) + shift, then the activations, then y + residual (or the
# residual before the activations: act(y + residual), a ResNet block's tail).
# Activation codes are kernels/activation.h's, in its order.
_ACTIVATION_CODES = {name: code for code, name in enumerate(
    ("silu", "gelu", "gelu_tanh", "relu", "leaky_relu", "tanh", "sigmoid", "hardswish", "mish"))}
_MAX_ACTIVATIONS = 4  # kMaxActivations
_LEAKY_SLOPE = 0.01  # F.leaky_relu's default negative_slope


class _Epilogue(typing.NamedTuple):
    """What group_norm applies after the affine: scale and shift as (N, C)
    tensors (views; broadcast shapes expanded) or None, the residual (the
    input's shape) or None, and the activation chain as ((name, slope), ...),
    slope a float for leaky_relu and None for the others; before the norm,
    the kernels' prologue: add, an (N, C) view, or None; residual_first: the
    residual added before the activations (only with both)."""
    scale: typing.Optional[torch.Tensor]
    shift: typing.Optional[torch.Tensor]
    residual: typing.Optional[torch.Tensor]
    steps: tuple
    add: typing.Optional[torch.Tensor] = None
    residual_first: bool = False

    def tensors(self):
        return [t for t in (self.add, self.scale, self.shift, self.residual) if t is not None]

    def codes(self):
        return [_ACTIVATION_CODES[name] for name, _ in self.steps]

    def slope(self):
        return next((slope for _, slope in self.steps if slope is not None), _LEAKY_SLOPE)


def _activation_step(caller, item):
    """(name, slope) of one activation: a name, or ("leaky_relu", slope)."""
    if isinstance(item, str):
        if item not in _ACTIVATION_CODES:
            raise GroupNormError(f"{caller}: unknown activation {item!r}; the activations are "
                                 f"{', '.join(_ACTIVATION_CODES)}, ('leaky_relu', slope) and "
                                 f"tuples of at most {_MAX_ACTIVATIONS} of them")
        return item, (_LEAKY_SLOPE if item == "leaky_relu" else None)
    if _is_leaky_with_slope(item):
        slope = float(item[1])
        if not math.isfinite(slope):
            raise GroupNormError(f"{caller}: the leaky_relu slope must be finite, got {slope}")
        return "leaky_relu", slope
    raise _WrongType(f"{caller}: an activation is a name such as 'silu' or ('leaky_relu', slope), "
                     f"got {item!r}")


def _is_leaky_with_slope(value):
    return (isinstance(value, tuple) and len(value) == 2 and value[0] == "leaky_relu"
            and isinstance(value[1], numbers.Real) and not isinstance(value[1], bool))


# the steps of each activation name seen (every call of a layer passes its own)
_NAMED_STEPS = {}


def _activation_steps(caller, activation):
    """activation (None, a name, ("leaky_relu", slope) or a tuple chain of
    these) as a tuple of (name, slope) steps, applied in order."""
    if activation is None:
        return ()
    if type(activation) is str:
        steps = _NAMED_STEPS.get(activation)
        if steps is None:
            steps = _NAMED_STEPS[activation] = (_activation_step(caller, activation),)
        return steps
    if _is_leaky_with_slope(activation):
        steps = (_activation_step(caller, activation),)
    elif isinstance(activation, (tuple, list)):
        steps = tuple(_activation_step(caller, item) for item in activation)
    else:
        raise _WrongType(f"{caller}: activation must be None, a name such as 'silu', "
                         f"('leaky_relu', slope) or a tuple of them, got {type(activation).__name__}")
    if len(steps) > _MAX_ACTIVATIONS:
        raise GroupNormError(f"{caller}: at most {_MAX_ACTIVATIONS} activations in a chain, "
                             f"got {len(steps)}: {activation!r}")
    slopes = {slope for _, slope in steps if slope is not None}
    if len(slopes) > 1:
        raise GroupNormError(f"{caller}: one leaky_relu slope per chain, got {sorted(slopes)}")
    return steps


def _per_sample_channel(caller, name, t, input):
    """scale or shift as an (N, C) view: shape (N, C), or one that broadcasts
    to the input like (N, C, 1, ...), sizes of 1 in N or C included. (N, C)
    means per sample and channel, whatever the input's rank (plain broadcasting
    would align it with the last two dims)."""
    if not isinstance(t, torch.Tensor):
        raise _WrongType(f"{caller}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    if not _per_sample_channel_shape(t.shape, input):
        N, C = input.shape[:2]
        raise GroupNormError(f"{caller}: {name} must have shape (N, C) = ({N}, {C}), or one that "
                             f"broadcasts like {_broadcast_like(input)}, got {list(t.shape)}")
    return t.reshape(t.shape[:2]).expand(input.shape[:2])


def _per_sample_channel_shape(shape, input):
    """Whether shape is (N, C) or broadcasts to input like (N, C, 1, ...)."""
    N, C = input.shape[:2]
    return (2 <= len(shape) <= input.dim() and shape[0] in (1, N) and shape[1] in (1, C)
            and all(size == 1 for size in shape[2:]))


def _broadcast_like(input):
    """'(N, C, 1, ...)' with input's sizes, for messages."""
    return "(" + ", ".join(map(str, [*input.shape[:2], *[1] * (input.dim() - 2)])) + ")"


def _check_add(caller, input, add):
    if not isinstance(input, torch.Tensor):
        raise _WrongType(f"{caller}: input must be a torch.Tensor, got {type(input).__name__}")
    if not isinstance(add, torch.Tensor):
        raise _WrongType(f"{caller}: add must be a torch.Tensor or None, got {type(add).__name__}")
    if add.dtype != input.dtype:
        raise _WrongType(f"{caller}: add dtype must be the input's ({input.dtype}), got {add.dtype}")
    if add.device != input.device:
        raise GroupNormError(f"{caller}: add must be on the input's device ({input.device}), got "
                             f"one on {add.device}")


def _prologue_add(caller, input, add):
    """add as the kernels' prologue takes it, an (N, C) view, when it is one
    per (sample, channel); None for another shape (the input's full shape:
    torch's add forms the sum; a wrong one: _pre_norm_sum names it)."""
    _check_add(caller, input, add)
    if input.dim() < 2 or (add.shape == input.shape and input.dim() > 2):
        return None
    if not _per_sample_channel_shape(add.shape, input):
        return None
    return _per_sample_channel(caller, "add", add, input)


def _pre_norm_sum(caller, input, add):
    """input + add by torch's add, what GroupNorm then normalises, rounded
    to the input's dtype: add of the input's shape, or per (sample, channel):
    (N, C) or like (N, C, 1, ...), sizes of 1 in N or C included. A pass of
    its own, for what the kernels' prologue does not take (return_sum, a
    full-shape add, torch's path, process_group)."""
    _check_add(caller, input, add)
    if add.shape == input.shape:
        return input + add
    if input.dim() < 2:  # the GroupNorm call names what is wrong with input
        return input
    if not _per_sample_channel_shape(add.shape, input):
        N, C = input.shape[:2]
        raise GroupNormError(f"{caller}: add must have the input's shape {list(input.shape)}, or "
                             f"(N, C) = ({N}, {C}), or one that broadcasts like "
                             f"{_broadcast_like(input)}; got {list(add.shape)}")
    return input + add.reshape(add.shape[:2] + (1,) * (input.dim() - 2))


def _check_return_sum(caller, return_sum):
    if not isinstance(return_sum, bool):
        raise _WrongType(f"{caller}: return_sum must be True or False, got {return_sum!r}")


def _normalise_sum(caller, input, add, return_sum, normalise):
    """normalise(input + add), and with return_sum the sum too."""
    total = input if add is None else _pre_norm_sum(caller, input, add)
    y = normalise(total)
    return (y, total) if return_sum else y


def _check_epilogue(caller, input, scale, shift, activation, residual, add=None,
                    residual_before_activation=False):
    """The epilogue options, checked against input's shape, and the
    prologue's add (an (N, C) view from _prologue_add): an _Epilogue, or
    None when there is nothing to apply."""
    steps = _activation_steps(caller, activation)
    if not isinstance(residual_before_activation, bool):
        raise _WrongType(f"{caller}: residual_before_activation must be a bool, got "
                         f"{type(residual_before_activation).__name__}")
    if residual_before_activation and residual is None:
        raise GroupNormError(f"{caller}: residual_before_activation=True adds the residual "
                             "before the activation, but residual is None")
    if scale is None and shift is None and residual is None and not steps and add is None:
        return None
    if scale is not None:
        scale = _per_sample_channel(caller, "scale", scale, input)
    if shift is not None:
        shift = _per_sample_channel(caller, "shift", shift, input)
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise _WrongType(f"{caller}: residual must be a torch.Tensor or None, got "
                             f"{type(residual).__name__}")
        if residual.shape != input.shape:
            raise GroupNormError(f"{caller}: residual must have the input's shape "
                                 f"{list(input.shape)}, got {list(residual.shape)}")
    # without an activation the two orders are one sum
    return _Epilogue(scale, shift, residual, steps, add, residual_before_activation and bool(steps))


def _check_epilogue_like(caller, epilogue, input):
    """The epilogue's tensors must have the input's dtype and device."""
    for name, t in (("add", epilogue.add), ("scale", epilogue.scale), ("shift", epilogue.shift),
                    ("residual", epilogue.residual)):
        if t is not None and t.dtype != input.dtype:
            raise _WrongType(f"{caller}: {name} dtype must be the input's ({input.dtype}), got "
                             f"{t.dtype}")
        if t is not None and t.device != input.device:
            raise GroupNormError(f"{caller}: {name} must be on the input's device "
                                 f"({input.device}), got one on {t.device}")


def _activate(y, name, slope):
    """One activation by torch.nn.functional, as the kernels apply it."""
    if name == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if name == "leaky_relu":
        return F.leaky_relu(y, slope)
    functions = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh,
                 "sigmoid": torch.sigmoid, "hardswish": F.hardswish, "mish": F.mish}
    return functions[name](y)


def _torch_epilogue(y, epilogue):
    """The epilogue by torch ops, one after another: the CPU path's (and
    torch's path's) definition of what the kernels fuse."""
    per_channel = y.shape[:2] + (1,) * (y.dim() - 2)
    if epilogue.scale is not None:
        y = y * (1 + epilogue.scale.reshape(per_channel))
    if epilogue.shift is not None:
        y = y + epilogue.shift.reshape(per_channel)
    if epilogue.residual is not None and epilogue.residual_first:
        y = y + epilogue.residual
    for name, slope in epilogue.steps:
        y = _activate(y, name, slope)
    if epilogue.residual is not None and not epilogue.residual_first:
        y = y + epilogue.residual
    return y


def _fused_call(caller, epilogue, gamma, beta, groups, eps, kernel, team, lag, x):
    """The forward with the epilogue: the operator <ns>::forward_fused where
    gradients are wanted (its autograd is C++, kernels/library.cpp) and where
    torch.compile / torch.export trace; else the bare extension call, which
    also takes forced kernels (forward-only eager tests)."""
    compiling = torch.compiler.is_compiling()
    if compiling or _needs_grad(x, gamma, beta, *epilogue.tensors()):
        if (kernel, team, lag) != ("auto", 0, 0):
            raise GroupNormError(f"{caller}: kernel/team/lag overrides are for forward-only eager "
                                 "tests: they record no gradients and torch.compile cannot "
                                 "trace them")
        if compiling:
            _kernels_loaded()
        else:
            load()  # the operator's kernels are the extension's
        return _OPS.forward_fused(x, gamma, beta, groups, eps, epilogue.scale, epilogue.shift,
                                  epilogue.residual, epilogue.codes(), epilogue.slope(),
                                  epilogue.add, epilogue.residual_first)[0]
    return load().forward_fused(x, gamma, beta, groups, eps, kernel, team, lag, epilogue.scale,
                                epilogue.shift, epilogue.residual, epilogue.codes(),
                                epilogue.slope(), epilogue.add, epilogue.residual_first)[0]


def groupnorm_cuda(x, gamma, beta, groups, eps=1e-5, *, kernel="auto", team=0, lag=0,
                   scale=None, shift=None, activation=None, residual=None, add=None,
                   return_sum=False, residual_before_activation=False):
    """GroupNorm of a CUDA tensor by this module's kernels, never by torch,
    forward and backward (autograd; under torch.compile / export through the
    registered op groupnorm_inline::forward).

    x: (N, C, *) float32/float16/bfloat16/float64 on a CUDA device; gamma, beta:
    (C,) tensors of x's dtype and device, or None. Returns a new tensor in x's
    dtype and memory format.

    scale, shift, activation, residual, residual_before_activation: the
    fused epilogue, as in group_norm
    (tensors of x's dtype and device), gradients included (torch.compile and
    torch.export trace it as the operator <ns>::forward_fused). add,
    return_sum: the pre-norm sum, as in group_norm.

    For tests and tuning (forward only, eager only; 0 = automatic):
    `kernel` forces a kernel: "auto", "reference", "registers", "contiguous",
    "channels_last" or "stream" (either layout); `team` the CTAs per unit of
    the team kernels ("contiguous", "channels_last") or of the registers
    kernel (a thread-block cluster when above 1, at most 8); `lag` the
    stream kernels' lag in pieces.
    """
    _check_return_sum("groupnorm_cuda", return_sum)
    prologue = None if add is None or return_sum else _prologue_add("groupnorm_cuda", x, add)
    if (add is not None and prologue is None) or return_sum:
        return _normalise_sum("groupnorm_cuda", x, add, return_sum, lambda total: groupnorm_cuda(
            total, gamma, beta, groups, eps, kernel=kernel, team=team, lag=lag, scale=scale,
            shift=shift, activation=activation, residual=residual,
            residual_before_activation=residual_before_activation))
    groups, eps = _check_cuda_arguments("groupnorm_cuda", x, groups, gamma, beta, eps)
    epilogue = _check_epilogue("groupnorm_cuda", x, scale, shift, activation, residual, prologue,
                               residual_before_activation)
    if epilogue is not None:
        _check_epilogue_like("groupnorm_cuda", epilogue, x)
    if _func_transformed(x, gamma, beta, *(epilogue.tensors() if epilogue else ())):
        raise GroupNormError("groupnorm_cuda: torch.func transforms (grad, vmap, ...) and "
                             "forward-mode AD (dual tensors) are not supported; group_norm "
                             "hands them to torch")
    if kernel == "auto" and team == 0 and lag == 0:
        return _cuda_forward(x, gamma, beta, groups, eps, epilogue)
    if torch.compiler.is_compiling() or _needs_grad(x, gamma, beta):
        raise GroupNormError("groupnorm_cuda: kernel/team/lag overrides are for forward-only "
                             "eager tests: they record no gradients and torch.compile cannot "
                             "trace them")
    if epilogue is not None:
        return _fused_call("groupnorm_cuda", epilogue, gamma, beta, groups, eps, kernel, team, lag, x)
    return load().forward(x, gamma, beta, groups, eps, kernel, team, lag)[0]


def _cuda_forward(x, gamma, beta, groups, eps, epilogue=None, caller="groupnorm_cuda"):
    """This module's kernels: the registered op (its autograd is in C++,
    kernels/library.cpp) where gradients are needed and wherever torch.compile
    / export trace; without gradients in eager mode, the bare extension call,
    which skips the dispatcher. With an epilogue, the extension's
    forward_fused, eager and without gradients only (_fused_call)."""
    if epilogue is not None:
        return _fused_call(caller, epilogue, gamma, beta, groups, eps, "auto", 0, 0, x)
    if torch.compiler.is_compiling():
        _kernels_loaded()
        return _OPS.forward(x, gamma, beta, groups, eps)[0]
    extension = load()
    if _needs_grad(x, gamma, beta):
        return _OPS.forward(x, gamma, beta, groups, eps)[0]
    return extension.forward(x, gamma, beta, groups, eps, "auto", 0, 0)[0]


# group_norm's activation -> (codes, slope), or None for an empty chain, for
# the fast path: names and tuples of names, whose keys compare exactly
_FAST_ACTIVATIONS = {}


def _fast_activation(activation):
    """(codes, slope) of a valid activation given as a name, a tuple of
    names or ("leaky_relu", float); None for none (None or an empty tuple);
    False where group_norm's checks must see it (other types: True would
    hash as 1 does)."""
    if activation is None:
        return None
    kind = type(activation)
    if (kind is tuple and len(activation) == 2 and activation[0] == "leaky_relu"
            and type(activation[1]) is float):
        # not cached: 0.0 and -0.0 are one key, and the slope's sign reaches y's zeros
        slope = activation[1]
        return ([_ACTIVATION_CODES["leaky_relu"]], slope) if math.isfinite(slope) else False
    if not (kind is str or kind is tuple and all(type(item) is str for item in activation)):
        return False
    found = _FAST_ACTIVATIONS.get(activation, False)
    if found is False:
        try:
            steps = _activation_steps("group_norm", activation)
        except GroupNormError:
            return False  # group_norm raises it, naming the problem
        epilogue = _Epilogue(None, None, None, steps)
        found = (epilogue.codes(), epilogue.slope()) if steps else None
        _FAST_ACTIVATIONS[activation] = found
    return found


def _fast_forward(input, groups, weight, bias, eps, activation=None):
    """group_norm without add, scale, shift, residual or process_group, by
    the shortest path: the extension's forward (the operator where gradients
    are wanted), with the checks the C++ makes left to it. None where
    group_norm's own path must decide: not an eager call on a plain CUDA
    tensor with a loaded extension; torch's rules apply (autocast, mixed
    dtypes, torch.func, forward-mode AD); an input torch refuses that the
    C++ would take (a single value per channel, an empty one); or any
    argument the C++ refuses, so that group_norm raises its error."""
    if (torch.compiler.is_compiling() or type(input) is not torch.Tensor or not input.is_cuda
            or type(groups) is not int or type(eps) is not float or _extension is None
            or input.layout is not torch.strided or torch.is_autocast_enabled("cuda")
            or torch.autograd.forward_ad._current_level >= 0):
        return None
    fused = _fast_activation(activation)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if fused is False or wrapped(input):
        return None
    numel = input.numel()
    if numel == 0 or numel == groups:
        return None
    grad = torch.is_grad_enabled() and input.requires_grad
    for t in (weight, bias):
        if t is not None:
            if (not isinstance(t, torch.Tensor) or t.dtype is not input.dtype
                    or t.layout is not torch.strided or wrapped(t)):
                return None
            grad = grad or torch.is_grad_enabled() and t.requires_grad
    try:
        if fused is None:
            if grad:
                return _OPS.forward(input, weight, bias, groups, eps)[0]
            return _extension.forward(input, weight, bias, groups, eps, "auto", 0, 0)[0]
        codes, slope = fused
        if grad:
            return _OPS.forward_fused(input, weight, bias, groups, eps, None, None, None, codes,
                                      slope)[0]
        return _extension.forward_fused(input, weight, bias, groups, eps, "auto", 0, 0, None,
                                        None, None, codes, slope, None, False)[0]
    except torch.OutOfMemoryError:
        raise
    except (ValueError, TypeError, RuntimeError):
        return None  # group_norm's checks name the problem (or route it to torch)


def _traced_as_constant(function):
    """Has torch.compile call `function` while it traces, taking the result
    as a constant, instead of tracing into it (what
    torch.compiler.assume_constant_result does, without importing Dynamo on
    import): loading the extension is no graph op."""
    function._dynamo_marked_constant = True
    return function


@_traced_as_constant
def _kernels_loaded():
    """load(), from code that torch.compile traces: the compiled graph calls
    the operators, whose kernels the extension registers when it loads."""
    load()
    return True


def plan(x, groups, *, kernel="auto", team=0, lag=0, backward=False, fused=False, activation=None):
    """The kernel groupnorm_cuda would run for x with these forcing arguments
    (see groupnorm_cuda), its parameters, and why: a dict, as the extension
    returns it. fused=True or an `activation` (as group_norm's): the plan of
    a call with an epilogue (scale, shift, residual, an (N, C) add, the
    activation); a chain other than SiLU or ReLU alone never takes the
    forward's registers kernel, which has no call for one. A residual whose
    address allows narrower vectors than x's narrows them. Its "store" names the
    kernel's copy for the call without a residual: "none" (no activation;
    also the plain kernel's, without fused or an activation), "silu" or
    "relu" alone, or "any", which tests every option as it stores and serves
    the rest (a residual, the other chains, the reference kernel, double,
    vector widths the kernel has no copies for; kernels/kernel_shapes.h).

    With backward=True, the backward's kernel and tiling for x (and a
    grad_output laid out like it, dx wanted): there kernel is "auto",
    "passes" (four launches), "stream" (one launch; either layout; not
    fused) or "registers" (one launch, a group a CTA: groups of a few
    thousand vectors), lag the stream kernel's lag in tiles, and there is no
    team. fused=True or an activation: the fused backward's plan (a chain
    other than SiLU or ReLU alone is taken back by the chain kernel first,
    and takes the passes unless the registers kernel is forced).
    """
    groups, _ = _check_cuda_arguments("plan", x, groups, None, None, 0.0)
    codes = [_ACTIVATION_CODES[name] for name, _ in _activation_steps("plan", activation)]
    if backward:
        if team:
            raise GroupNormError(f"plan: the backward has no teams, got team={team} "
                                 "(its stream kernel's lag is `lag`)")
        return load().backward_plan(x, groups, kernel, lag, bool(fused), codes)
    return load().plan(x, groups, kernel, team, lag, bool(fused), codes)


def _takes_cuda_path(input, weight, bias, *others):
    if not input.is_cuda or _func_transformed(input, weight, bias, *others):
        return False
    for t in (weight, bias):
        if t is not None and (t.dtype != input.dtype or t.device != input.device):
            return False  # mixed precision / placement: torch's rules apply
    return True


def _func_transformed(*tensors):
    """Tensors inside torch.func transforms (grad, vmap, jacrev) are wrappers
    without storage that a CUDA kernel cannot read, and forward-mode AD's dual
    tensors carry a tangent our kernels have no derivative for; torch's
    group_norm takes both. (Checked in eager mode only: a torch.compile trace
    sees plain fake tensors.)"""
    if torch.compiler.is_compiling():
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for t in tensors:
        if t is not None and wrapped(t):
            return True
    # dual tensors exist only inside a dual_level() context, which sets the level
    level = torch.autograd.forward_ad._current_level
    return level >= 0 and any(
        t is not None and torch.autograd.forward_ad.unpack_dual(t, level=level).tangent is not None
        for t in tensors)


def _needs_grad(*tensors):
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return False


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *, scale=None, shift=None,
               activation=None, residual=None, add=None, return_sum=False, process_group=None,
               residual_before_activation=False):
    """Same signature and result as torch.nn.functional.group_norm, and an
    optional fused epilogue:

        s = input + add                 add: input's shape, or (N, C), or like (N, C, 1, ...)
        y = GN(s) * weight + bias
        y = y * (1 + scale) + shift     scale, shift: (N, C), or like (N, C, 1, ...)
        y = act(y)                      activation: see below
        y = y + residual                residual: the input's shape
                                        (before act with residual_before_activation=True:
                                        y = act(y + residual), a ResNet block's tail)

    activation: None, "silu", "gelu" (erf), "gelu_tanh", "relu", "leaky_relu"
    (slope 0.01) or ("leaky_relu", slope), "tanh", "sigmoid", "hardswish",
    "mish", or a tuple of at most 4 of them applied in order, e.g. ("tanh",
    "hardswish"); formulas as torch.nn.functional's. The epilogue's tensors
    must have the input's dtype and device. CUDA tensors apply it inside the
    kernels, in float (double for float64 input) before rounding to the
    output dtype; a residual whose strides differ from the output's (the
    input's layout) is first copied into that layout, a pass over its bytes.
    With gradients, the backward recomputes the value before the activations
    (one pass over the input) and takes the chain back by torch's formulas;
    nothing full-size is saved beyond the input (and the residual, when it
    comes before the activations: the forward without them recomputes that
    value, a pass more). CPU tensors (and mixed
    dtypes or devices of weight and bias, which go to torch) compute it by
    the torch ops above, one after another, gradients included.

    CUDA tensors run this module's kernels, forward and backward (through the
    registered op groupnorm_inline::forward under torch.compile / export).
    Gradients of gradients are not supported: backward through the gradient
    raises and names torch's group_norm as the way out. CPU tensors, and
    weight/bias of another dtype or device than the input, go to torch. Under
    CUDA autocast the op runs in float32, as torch's does. A bad argument
    raises GroupNormError, which is also the type torch raises for it.

    process_group (a torch.distributed group): input is this rank's slab of
    the spatial dims of samples that the group's ranks share (any spatial
    axis, unequal slabs, empty ones too); the result is the slab of the
    GroupNorm of the whole tensor. Every rank of the group must make the
    call, and run its backward, as with any collective (_ShardedGroupNorm).
    torch.compile traces it (functional collectives), fullgraph=True too.

    add, return_sum: GroupNorm of input + add (the pre-norm sum, rounded to
    the input's dtype as torch's add rounds; in the add's shape, its
    gradient); return_sum=True returns (y, s). On CUDA an add of one value
    per (sample, channel) is added where the kernels load the input; a
    full-shape add, return_sum and autocast take torch's add first.
    """
    if (scale is None and shift is None and residual is None and add is None
            and return_sum is False and process_group is None
            and residual_before_activation is False):
        y = _fast_forward(input, num_groups, weight, bias, eps, activation)
        if y is not None:
            return y
    _check_return_sum("group_norm", return_sum)
    prologue = None  # an (N, C) add, for the kernels' prologue
    autocast = isinstance(input, torch.Tensor) and input.is_cuda and torch.is_autocast_enabled("cuda")
    if add is not None and not return_sum and process_group is None and not autocast:
        # (under autocast torch's add rounds s to the input's dtype first)
        prologue = _prologue_add("group_norm", input, add)
    if (add is not None and prologue is None) or return_sum:
        return _normalise_sum("group_norm", input, add, return_sum, lambda total: group_norm(
            total, num_groups, weight, bias, eps, scale=scale, shift=shift, activation=activation,
            residual=residual, process_group=process_group,
            residual_before_activation=residual_before_activation))
    num_groups, eps = _check_arguments("group_norm", input, num_groups, weight, bias, eps)
    epilogue = _check_epilogue("group_norm", input, scale, shift, activation, residual, prologue,
                               residual_before_activation)
    if input.is_cuda and torch.is_autocast_enabled("cuda"):
        # torch's float32 autocast policy: half-precision tensors become
        # float32, float64 ones stay as they are
        input, weight, bias = (_autocast_float32(t) for t in (input, weight, bias))
        if epilogue is not None:
            epilogue = epilogue._replace(**{name: _autocast_float32(getattr(epilogue, name))
                                            for name in ("add", "scale", "shift", "residual")})
    if epilogue is not None:
        _check_epilogue_like("group_norm", epilogue, input)
    if process_group is not None:  # a rank's slab may be empty
        _check_process_group(process_group)
        sharded = _sharded_traced if torch.compiler.is_compiling() else _ShardedGroupNorm.apply
        y = sharded(input, weight, bias, num_groups, eps, process_group)
        return y if epilogue is None else _torch_epilogue(y, epilogue)
    if _single_value_per_channel(input, num_groups):
        raise GroupNormError("group_norm: expected more than 1 value per channel, got input of "
                             f"size {list(input.shape)}")
    if input.shape[1] == 0 or 0 in input.shape[2:]:  # torch takes N = 0 alone
        raise GroupNormError("group_norm: expected the number of channels and each spatial size "
                             f"to be greater than 0, got input of size {list(input.shape)}")
    others = epilogue.tensors() if epilogue is not None else ()
    if _takes_cuda_path(input, weight, bias, *others) and _kernels_available():
        return _cuda_forward(input, weight, bias, num_groups, eps, epilogue, caller="group_norm")
    if weight is None and bias is not None and _needs_grad(input, weight, bias):
        # torch's backward before 2.14 fails on a bias without a weight
        weight = torch.ones_like(bias)
    if epilogue is not None and epilogue.add is not None:  # torch's add first
        input = input + epilogue.add.reshape(input.shape[:2] + (1,) * (input.dim() - 2))
    y = F.group_norm(input, num_groups, weight, bias, eps)
    return y if epilogue is None else _torch_epilogue(y, epilogue)


# ---------------------------------------------------------------------------
# Spatially sharded GroupNorm (process_group=)
# ---------------------------------------------------------------------------

def _centred(x, groups):
    """This rank's slab as [N, G, C / G, elements of a channel], minus each
    group's first value, in float (double for float64 x), and that first
    value [N, G] in float64: x - first is exact near it, so a float32 mean of
    1000 + randn keeps its last digits (as the kernels centre). One pass
    over the slab; a view of it for contiguous and channels-last slabs."""
    view = _group_view(x, groups)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    if view.numel() == 0:  # an empty slab (or N = 0): nothing to centre on
        return (view.to(wide, copy=True),  # in autograd's graph, as every rank's slab
                view.new_zeros(view.shape[:2], dtype=torch.float64))
    # detached: y does not depend on the shift, and a gradient through it
    # would cancel in float32 at each group's first element
    first = view[:, :, :1, :1].detach().to(wide)
    return view - first, first[:, :, 0, 0].double()


def _local_moments(centred, first):
    """(count, mean, m2) of each (n, g) of the centred slab, in float64: the
    element count, the mean and the sum of squared deviations from it (zero
    for an empty slab)."""
    count = centred.shape[2] * centred.shape[3]
    if count == 0:  # zeros in autograd's graph: every rank's backward runs the collective
        zeros = centred.sum((2, 3), dtype=torch.float64)
        return zeros, zeros, zeros
    var, mean = torch.var_mean(centred, dim=(2, 3), correction=0)
    return (torch.full_like(first, count), first + mean.double(), var.double() * count)


def _merged_moments(centred, first, process_group, traced=False):
    """mean, variance and element count of each (n, g) over every rank's slab: one all-gather
    of (count, mean, m2), merged exactly in float64 (Chan et al.): m2 = sum
    of m2_i + n_i (mean_i - mean)^2, so slabs of very different means lose
    nothing. traced (torch.compile): by the functional all-gather that
    autograd goes back through (a reduce-scatter in the backward); eager:
    by c10d's in-place one, whose result is a plain tensor (the functional
    one's is a Python subclass that doubled the call's host time)."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as collectives

    local = torch.stack(_local_moments(centred, first))  # [3, N, G]
    if traced:  # [ranks * 3, N, G], rank by rank
        gathered = collectives.all_gather_tensor_autograd(local.contiguous(), 0, process_group)
    else:
        gathered = local.new_empty((dist.get_world_size(process_group) * 3, *local.shape[1:]))
        # all_gather_single is all_gather_into_tensor's name from torch 2.14 (the old one warns)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, local.contiguous(), group=process_group)
    count, mean, m2 = gathered.reshape(-1, *local.shape).unbind(1)  # each [ranks, N, G]
    total = count.sum(0)
    merged_mean = (count * mean).sum(0) / total
    merged_m2 = (m2 + count * (mean - merged_mean) ** 2).sum(0)
    return merged_mean, merged_m2 / total, total


def _normalising_terms(centred, first, mean, rstd, weight=None, bias=None):
    """a and c, [N, G, C / G, 1] in centred's dtype, with centred * a + c =
    (x - mean) * rstd * weight + bias: a = rstd * weight, c = bias - (mean -
    first) * a, formed in float64 from the [N, G] statistics. (mean - first)
    is a few deviations at most, so c keeps its digits in float32."""
    N, G, D = centred.shape[:3]
    a = _per_group(rstd)
    if weight is not None:
        a = a * weight.reshape(1, G, D, 1).double()
    c = _per_group(first - mean) * a
    if bias is not None:
        c = c + bias.reshape(1, G, D, 1).double()
    return a.to(centred.dtype), c.to(centred.dtype)


def _group_shape(x, groups):
    return x.shape[0], groups, x.shape[1] // groups, math.prod(x.shape[2:])


def _group_view(x, groups):
    """x as [N, G, C / G, elements of a channel]: a view of contiguous and
    channels-last tensors (the spatial dims merge, C splits), else a copy."""
    return x.reshape(_group_shape(x, groups))


def _addcmul_like(x, groups, temporary, base, tensor1, tensor2):
    """base + tensor1 * tensor2 (group-shaped [N, G, C / G, S], computed in
    float) as a tensor of x's shape and dtype, in one pass: written over
    `temporary` (a float temporary among the operands) where that has x's
    dtype, else into a new tensor in x's memory format where its group view
    is a view (contiguous, channels-last), else contiguous."""
    if temporary.dtype == x.dtype:
        return torch.addcmul(base, tensor1, tensor2, out=temporary).reshape(x.shape)
    y = torch.empty_like(x)
    try:
        y_groups = y.view(_group_shape(x, groups))
    except RuntimeError:  # strides no view spans (a permuted x)
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        y_groups = y.view(_group_shape(x, groups))
    torch.addcmul(base, tensor1, tensor2, out=y_groups)
    return y


def _check_process_group(process_group):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise GroupNormError("group_norm: process_group= needs torch.distributed initialised "
                             "(torch.distributed.init_process_group)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise _WrongType("group_norm: process_group must be a torch.distributed.ProcessGroup "
                         f"(e.g. torch.distributed.group.WORLD), got {type(process_group).__name__}")


def _sharded_traced(x, weight, bias, groups, eps, process_group):
    """_ShardedGroupNorm's forward by differentiable ops, for torch.compile:
    torch 2.11 compiles the backward of an autograd.Function that holds a
    functional collective wrongly (the collective moves into the forward
    graph, fed zeros for dy: every gradient off). Here autograd goes back
    through the all-gather itself; Inductor picks what to save."""
    centred, first = _centred(x, groups)
    mean, var, _ = _merged_moments(centred, first, process_group, traced=True)
    a, c = _normalising_terms(centred, first, mean, (var + eps).rsqrt(), weight, bias)
    return torch.addcmul(c, centred, a).reshape(x.shape).to(x.dtype)


class _ShardedGroupNorm(torch.autograd.Function):
    """GroupNorm of a tensor whose spatial dims are split across the ranks
    of a process group, each rank holding a slab. Forward: one all-gather of
    three float64 values per (n, g) (_merged_moments), then this slab
    normalised with the whole tensor's statistics. Backward: one all-reduce
    of two sums per (n, g) for the input's gradient; weight's and bias's
    gradients are this slab's share, to be summed over the ranks like any
    data-parallel gradient (DDP does). torch ops in float (double for
    float64), on any device the group's backend serves (gloo: CPU, NCCL:
    CUDA): exact, not yet this module's kernels. The collectives are
    c10d's in-place ones (torch.compile takes _sharded_traced, with
    functional ones). The slab is centred
    once into one float temporary, and the output (dx) is written by one
    addcmul in x's dtype: a slab too large for one device should not need
    several float copies of itself, nor many passes."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, process_group):
        centred, first = _centred(x, groups)
        mean, var, count = _merged_moments(centred, first, process_group)
        rstd = (var + eps).rsqrt()
        a, c = _normalising_terms(centred, first, mean, rstd, weight, bias)
        y = _addcmul_like(x, groups, centred, c, centred, a)
        ctx.save_for_backward(x, weight, mean, rstd, count)
        ctx.groups, ctx.process_group = groups, process_group
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors[:2]
        with torch.no_grad():  # in place below, and no gradients of gradients
            grads = _ShardedGroupNorm._gradients(ctx, dy)
        return _refusing_double_backward(grads, dy, x, weight) + (None, None, None)

    @staticmethod
    def _gradients(ctx, dy):
        import torch.distributed as dist

        x, weight, mean, rstd, count = ctx.saved_tensors
        groups, C = ctx.groups, x.shape[1]
        centred, first = _centred(x, groups)  # a tensor of its own
        a, c = _normalising_terms(centred, first, mean, rstd)
        xhat = torch.addcmul(c, centred, a, out=centred)
        wide, dyv = xhat.dtype, _group_view(dy, groups)
        # this slab's sums of dy and dy * xhat per (n, channel): the shares of
        # dbias and dweight, and, weighted, of the per-(n, g) sums dx needs
        dy_sums, dy_xhat_sums = dyv.sum(3, dtype=wide), (dyv * xhat).sum(3)  # [N, G, C / G]
        w = weight.reshape(1, groups, C // groups).to(wide) if weight is not None else None
        g_sums = [t if w is None else t * w for t in (dy_sums, dy_xhat_sums)]
        # over the whole tensor: one all-reduce
        sums = torch.stack([t.sum(2) for t in g_sums]).double()
        dist.all_reduce(sums, group=ctx.process_group)
        mean_g, mean_gx = (t / count for t in sums.unbind(0))  # float64 [N, G]
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = dy_xhat_sums.sum(0).reshape(C).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            dbias = dy_sums.sum(0).reshape(C).to(ctx.bias_dtype)
        # dx = (w dy - mean_g - xhat mean_gx) rstd: xhat's terms in xhat's
        # memory, then dy's in one pass into dx, in x's dtype
        dy_scale = _per_group(rstd) if w is None else _per_group(rstd) * w[..., None].double()
        minus_rstd = -rstd
        terms = torch.addcmul(_per_group(mean_g * minus_rstd).to(wide), xhat,
                              _per_group(mean_gx * minus_rstd).to(wide), out=xhat)
        return _addcmul_like(x, groups, terms, terms, dyv, dy_scale.to(wide)), dweight, dbias


def _refusing_double_backward(grads, *sources):
    """grads as they are, or, where autograd records a graph of the backward
    (create_graph=True) and a source requires grad, behind a node that
    raises if anything differentiates through them: as the kernels' op
    does, rather than leaving them silently without a gradient."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in sources):
        return grads
    error = torch._C._functions.DelayedError(_NO_DOUBLE_BACKWARD.encode(), len(grads))
    return tuple(error(*[g.detach().requires_grad_() if g is not None else None for g in grads]))


_NO_DOUBLE_BACKWARD = ("groupnorm_inline: double backward (gradients of gradients) is not "
                       "supported; use torch's own group_norm for that")


def _per_group(t):
    """[N, G] values shaped to broadcast over a [N, G, C / G, S] view."""
    return t[:, :, None, None]


def _autocast_float32(t):
    return t.float() if t is not None and t.dtype in _HALF_DTYPES else t


_toolchain_error = None  # the ToolchainError that sent group_norm to torch


@_traced_as_constant
def _kernels_available():
    """Whether the extension is loaded, or loads now (a cached build, or a new
    one). Without the CUDA toolchain it warns once per process, naming the
    fix, and says no: group_norm and GroupNorm then run torch's GroupNorm,
    while groupnorm_cuda raises the ToolchainError (load() does)."""
    global _toolchain_error
    if _extension is not None:
        return True
    if _toolchain_error is None:
        try:
            load()
            return True
        except ToolchainError as error:
            _toolchain_error = error
            warnings.warn(f"{error}. Until then, group_norm and GroupNorm run torch's GroupNorm "
                          "and groupnorm_cuda raises this error.", stacklevel=3)
    return False


def _single_value_per_channel(input, num_groups):
    """torch.nn.functional.group_norm refuses inputs whose (N * C / G) x spatial
    extent is a single value; so does group_norm, for the same semantics.
    (num_groups divides C: that extent is numel / G.)"""
    return input.numel() == num_groups


# ---------------------------------------------------------------------------
# The operators: autograd, torch.compile and torch.export see these
# ---------------------------------------------------------------------------

# Defined here, at import, so that torch.compile can trace them before the
# extension is built; its C++ kernels (kernels/library.cpp) are registered
# when it loads.
_SCHEMAS = {
    "forward": "forward(Tensor x, Tensor? weight, Tensor? bias, int groups, float eps) "
               "-> (Tensor, Tensor, Tensor)",
    "backward": "backward(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, "
                "int groups, bool need_dx, bool need_affine) -> (Tensor, Tensor, Tensor)",
    # forward with the epilogue (scale, shift: (N, C); activations: codes)
    "forward_fused": "forward_fused(Tensor x, Tensor? weight, Tensor? bias, int groups, float eps, "
                     "Tensor? scale, Tensor? shift, Tensor? residual, int[] activations, "
                     "float slope, Tensor? add=None, bool residual_first=False) "
                     "-> (Tensor, Tensor, Tensor)",
    # its backward: dx, dweight, dbias, dscale, dshift, dadd (the last three (N, C))
    "backward_fused": "backward_fused(Tensor dy, Tensor x, Tensor mean, Tensor rstd, "
                      "Tensor? weight, Tensor? bias, int groups, Tensor? scale, Tensor? shift, "
                      "int[] activations, float slope, Tensor? add, bool need_dx, "
                      "bool need_affine, bool need_scale, bool need_shift, bool need_add) "
                      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
}


def _namespace():
    """groupnorm_inline, unless another copy of this module (a bundle of
    another version) defined ops there with other schemas: then a namespace
    of these schemas' own, so that neither copy runs the other's."""
    def defined_as_ours(ns):
        ops = getattr(torch.ops, ns)
        return all(hasattr(ops, name) and str(getattr(ops, name).default._schema) ==
                   f"{ns}::{schema}" for name, schema in _SCHEMAS.items())

    for ns in ("groupnorm_inline",
               "groupnorm_inline_" + hashlib.sha256(str(_SCHEMAS).encode()).hexdigest()[:8]):
        if not hasattr(getattr(torch.ops, ns), "forward") or defined_as_ours(ns):
            return ns
    raise RuntimeError("groupnorm_inline: the operator namespaces are taken by other definitions")


def _dense(x):
    """Contiguous, or (N, C, *) stored with C innermost: kept as is, so outputs
    share its strides; anything else is computed on a contiguous copy."""
    return x.is_contiguous() or (x.dim() >= 3 and x.permute(0, *range(2, x.dim()), 1).is_contiguous())


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _forward_fake(x, weight, bias, groups, eps):
    y = torch.empty_like(x) if _dense(x) else x.new_empty(x.shape)
    stats = (x.shape[0], groups)
    return y, x.new_empty(stats, dtype=_stat_dtype(x)), x.new_empty(stats, dtype=_stat_dtype(x))


def _forward_fused_fake(x, weight, bias, groups, eps, scale, shift, residual, activations, slope,
                        add=None, residual_first=False):
    return _forward_fake(x, weight, bias, groups, eps)


def _backward_fake(dy, x, mean, rstd, weight, groups, need_dx, need_affine):
    C = x.shape[1]
    # dx takes x's layout when x is dense (contiguous or channels-last-like),
    # contiguous otherwise: x was copied to contiguous first
    if not need_dx:
        dx = x.new_empty((0,))
    elif _dense(x):
        dx = torch.empty_like(x)
    else:
        dx = x.new_empty(x.shape)
    affine = (C,) if need_affine else (0,)
    return dx, x.new_empty(affine), x.new_empty(affine)


def _backward_fused_fake(dy, x, mean, rstd, weight, bias, groups, scale, shift, activations,
                         slope, add, need_dx, need_affine, need_scale, need_shift, need_add):
    dx, dweight, dbias = _backward_fake(dy, x, mean, rstd, weight, groups, need_dx, need_affine)
    per_sample_channel = [x.new_empty(tuple(x.shape[:2]) if wanted and t is not None else (0,))
                          for wanted, t in ((need_scale, scale), (need_shift, shift),
                                            (need_add, add))]
    return (dx, dweight, dbias, *per_sample_channel)


def _define_ops(ns):
    """Defines <ns>::forward, ::backward, ::forward_fused and ::backward_fused
    with their fake functions, once per process: a copy of this module
    imported beside it (a bundle) finds them defined and uses them. Returns
    the Library that holds them."""
    if hasattr(getattr(torch.ops, ns), "forward"):
        return None
    library = torch.library.Library(ns, "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        # any strides: the kernels take dense tensors in their layout (and
        # copy others), and the fake functions give outputs the kernels'
        # strides; so Inductor keeps the layout it chose (channels-last
        # between convolutions) instead of copying around each call
        library.define(schema, tags=(torch.Tag.flexible_layout,))
    torch.library.register_fake(f"{ns}::forward", _forward_fake, lib=library)
    torch.library.register_fake(f"{ns}::backward", _backward_fake, lib=library)
    torch.library.register_fake(f"{ns}::forward_fused", _forward_fused_fake, lib=library)
    torch.library.register_fake(f"{ns}::backward_fused", _backward_fused_fake, lib=library)
    return library


def _register_kernels(extension):
    """The extension's kernels for the operators, unless another copy's
    extension registered its own (the same sources: a bundle beside us)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{_NAMESPACE}::forward", "CUDA"):
        extension.register_kernels(_NAMESPACE)


_NAMESPACE = _namespace()
_LIBRARY = _define_ops(_NAMESPACE)
_OPS = getattr(torch.ops, _NAMESPACE)


# torch 2.14 added nn.GroupNorm's bias argument; with an older torch,
# GroupNorm drops the bias parameter itself, as 2.14 does.
_TORCH_GROUPNORM_TAKES_BIAS = "bias" in inspect.signature(nn.GroupNorm.__init__).parameters


class GroupNorm(nn.GroupNorm):
    """Drop-in nn.GroupNorm: same constructor (bias=False included, with any
    torch), parameters, init and state_dict; forward runs group_norm() above.
    Its repr is nn.GroupNorm's under the name groupnorm_inline.GroupNorm, so
    print(model) tells these layers from torch's.

    activation (keyword only): applied after the affine inside the kernel, as
    group_norm's `activation`. A plain attribute, not in the state_dict; the
    repr shows it when set."""

    # set by replace_groupnorm when an nn.Sequential runs this layer right
    # before an activation a fused kernel could apply (see _activation_name)
    next_activation = None
    _activation = None  # what `activation` returns: the fused activation, as given
    # group_norm's process_group: the ranks that hold slabs of the same samples
    process_group = None

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None,
                 *, bias=True, activation=None, process_group=None):
        # numpy scalars and 0-d tensors become int and float here:
        # torch.compile traces plain Python numbers
        num_groups, eps = _check_scalars("GroupNorm", num_groups, eps)
        if _TORCH_GROUPNORM_TAKES_BIAS:
            super().__init__(num_groups, num_channels, eps, affine, device, dtype, bias=bias)
        else:
            super().__init__(num_groups, num_channels, eps, affine, device, dtype)
            if not bias:
                self.register_parameter("bias", None)
        # not through the setter: GroupNormAct's `activation` has none
        _activation_steps("GroupNorm", activation)  # a bad name fails here, not at the first call
        self._activation = activation
        self.process_group = process_group

    @property
    def activation(self):
        """The activation applied after the affine inside the kernel
        (group_norm's `activation`), or None."""
        return self._activation

    @activation.setter
    def activation(self, value):
        _activation_steps("GroupNorm", value)
        self._activation = value

    def extra_repr(self):
        text = super().extra_repr()
        if self.affine and self.bias is None and "bias=" not in text:
            text += ", bias=False"  # as torch 2.14 shows it; older torch has no bias argument
        if self._activation is not None:
            text += f", activation={self._activation!r}"
        return text

    def _get_name(self):
        name = type(self).__name__
        return f"groupnorm_inline.{name}" if type(self).__module__ == __name__ else name

    def forward(self, input, *, add=None, return_sum=False):
        """nn.GroupNorm's forward; add and return_sum as in group_norm."""
        if add is None and return_sum is False and self.process_group is None:
            y = _fast_forward(input, self.num_groups, self.weight, self.bias, self.eps,
                              self._activation)
            if y is not None:
                return y
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps,
                          activation=self._activation, add=add, return_sum=return_sum,
                          process_group=self.process_group)


_TORCH_ACTIVATIONS = {nn.SiLU: "silu", nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
                      nn.Hardswish: "hardswish", nn.Mish: "mish"}
# timm.layers.activations: Swish is x * sigmoid(x), HardSwish x * relu6(x + 3) / 6,
# the others what their names say (GELU F.gelu, GELUTanh F.gelu(approximate="tanh"))
_TIMM_ACTIVATIONS = {"Swish": "silu", "GELU": "gelu", "GELUTanh": "gelu_tanh", "Tanh": "tanh",
                     "Sigmoid": "sigmoid", "HardSwish": "hardswish", "Mish": "mish"}


def _activation_spec(module):
    """group_norm's `activation` for what `module` applies: "silu", "gelu",
    "gelu_tanh", "relu", ("leaky_relu", slope), "tanh", "sigmoid",
    "hardswish" or "mish"; None for anything else. Exact types only (torch's,
    and timm's own when timm is imported): a subclass may change forward."""
    kind = type(module)
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    if kind is nn.LeakyReLU:
        return ("leaky_relu", float(module.negative_slope))
    if kind in _TORCH_ACTIVATIONS:
        return _TORCH_ACTIVATIONS[kind]
    timm_activations = sys.modules.get("timm.layers.activations")
    for class_name, name in _TIMM_ACTIVATIONS.items():
        if kind is getattr(timm_activations, class_name, None):
            return name
    return None


def _activation_name(module):
    """_activation_spec as one string: "leaky_relu(SLOPE)" for the tuple."""
    spec = _activation_spec(module)
    return f"leaky_relu({spec[1]!r})" if isinstance(spec, tuple) else spec


def _hooked(*modules):
    """Whether any hook would see these modules run (theirs or global ones):
    then they must run as modules, not inside a kernel. (Read from the
    modules' __dict__: every forward of a fused layer asks.)"""
    shared = _torch_module
    if (shared._global_forward_hooks or shared._global_forward_pre_hooks
            or shared._global_backward_hooks or shared._global_backward_pre_hooks):
        return True
    for m in modules:
        own = getattr(m, "__dict__", {})  # a module, or None where one was set to None
        if (own.get("_forward_hooks") or own.get("_forward_pre_hooks")
                or own.get("_backward_hooks") or own.get("_backward_pre_hooks")):
            return True
    return False


class GroupNormAct(GroupNorm):
    """GroupNorm, then the module `drop`, then the module `act` (each
    nn.Identity when None): what replace_groupnorm makes of timm's
    GroupNormAct and GroupNorm1Act, with their state_dict keys and their drop
    and act modules. `activation` (read only) names act for a fused kernel
    (see _activation_name), or is None. With drop an nn.Identity and act an
    activation the kernels have (and no hooks on it), act runs inside the
    GroupNorm kernel; else after it, unfused."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None,
                 *, bias=True, drop=None, act=None):
        super().__init__(num_groups, num_channels, eps, affine, device, dtype, bias=bias)
        self.drop = nn.Identity() if drop is None else drop
        self.act = nn.Identity() if act is None else act

    @property
    def activation(self):
        return _activation_name(self.act)

    def forward(self, input):
        act, drop = self._modules["act"], self._modules["drop"]
        spec = None if type(drop) is not nn.Identity or _hooked(act, drop) \
            else _activation_spec(act)
        if spec is None:  # drop runs between, or an activation the kernels lack
            return act(drop(super().forward(input)))
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps,
                          activation=spec, process_group=self.process_group)


# timm's GroupNorm classes (timm.layers, timm >= 0.9) by the module that
# defines them, and ours for each. Their forwards: GroupNorm and GroupNorm1
# (constructed with 1 group) are F.group_norm of the module's own attributes;
# GroupNormAct and GroupNorm1Act are that, then self.drop, then self.act. With
# timm's fast norm on they run in the autocast dtype instead: left alone.
_TIMM_GROUPNORMS = {("timm.layers.norm", "GroupNorm"): GroupNorm,
                    ("timm.layers.norm", "GroupNorm1"): GroupNorm,
                    ("timm.layers.norm_act", "GroupNormAct"): GroupNormAct,
                    ("timm.layers.norm_act", "GroupNorm1Act"): GroupNormAct}


def _replacement_class(module):
    """(our class that computes what `module`'s forward computes, None) for an
    nn.GroupNorm whose forward is torch's or one of timm's above (inherited or
    not: the function is compared, not the class), else (None, why not)."""
    if "forward" in vars(module):
        return None, "its forward was replaced on the instance"
    if not {"weight", "bias"} <= module._parameters.keys():
        return None, "its weight or bias is not a parameter (parametrize or weight_norm)"
    forward = type(module).forward
    if forward is nn.GroupNorm.forward:
        return GroupNorm, None
    for (module_name, class_name), ours in _TIMM_GROUPNORMS.items():
        theirs = getattr(sys.modules.get(module_name), class_name, None)
        if theirs is not None and forward is theirs.forward:
            if getattr(module, "_fast_norm", False):
                return None, "timm's fast norm is on (it runs in the autocast dtype)"
            return ours, None
    owner = next(cls for cls in type(module).__mro__ if "forward" in vars(cls))
    return None, (f"its forward (from {owner.__module__}.{owner.__qualname__}) is neither "
                  "nn.GroupNorm's nor a timm GroupNorm's")


def _kind(module):
    """How counts and messages name the class of a GroupNorm."""
    kind = type(module)
    if kind is nn.GroupNorm:
        return "nn.GroupNorm"
    if kind.__module__.split(".")[0] == "timm":
        return f"timm {kind.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _converted(module, cls):
    """`module` as a `cls`: the same Parameter, buffer and child objects under
    the same names (so device, dtype, state_dict keys and optimizer state
    carry over), the same hooks and training flag."""
    new = cls(module.num_groups, module.num_channels, module.eps, module.affine, device="meta")
    for name, parameter in module._parameters.items():
        new.register_parameter(name, parameter)
    for name, buffer in module._buffers.items():
        new.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
    for name, child in module._modules.items():
        new.add_module(name, child)
    # the hook dicts themselves, so that existing handles still remove them
    new.__dict__.update((key, value) for key, value in vars(module).items() if "hook" in key)
    new.training = module.training  # not train(): the children keep their own modes
    return new


def _record_activation_pairs(model):
    """Sets next_activation on each of our GroupNorms that an nn.Sequential
    runs right before a known activation; returns how many."""
    recorded = 0
    for parent in model.modules():
        if type(parent).forward is not nn.Sequential.forward:
            continue
        children = list(parent._modules.values())
        for first, second in zip(children, children[1:]):
            name = _activation_name(second)
            if type(first) is GroupNorm and name is not None:
                first.next_activation = name
                recorded += 1
    return recorded


def _layers(count):
    return f"{count} GroupNorm layer{'' if count == 1 else 's'}"


def replace_groupnorm(model, *, strict=False, verbose=False, process_group=None):
    """Swaps every nn.GroupNorm inside `model` (in place) for GroupNorm, keeping
    its parameters, buffers, hooks and training mode; returns the model (or
    the replacement, if `model` itself is one).

    Subclasses are swapped when their forward is known to compute what ours
    does: inherited from nn.GroupNorm, or timm's GroupNorm, GroupNorm1 (both
    become GroupNorm), GroupNormAct and GroupNorm1Act (GroupNormAct, keeping
    drop and act). Any other is left as it is: one warning names each, or
    with strict=True a GroupNormError (also a TypeError) does, before anything
    is swapped. verbose=True prints the counts by class. A GroupNorm that an
    nn.Sequential runs right before a known activation gets that activation's
    name in next_activation (the Sequential is unchanged). process_group (a
    torch.distributed group) is set on every GroupNorm of the model, ours
    before too: each rank then holds a spatial slab (group_norm's
    process_group)."""
    swaps, left, already_ours = {}, [], 0
    for name, module in model.named_modules():
        if isinstance(module, GroupNorm):
            already_ours += 1
        elif isinstance(module, nn.GroupNorm):
            cls, reason = _replacement_class(module)
            if cls is None:
                left.append(f"{name or 'the model'} ({_kind(module)}): {reason}")
            else:
                swaps[id(module)] = (module, cls)
    if left:
        message = f"replace_groupnorm: left {_layers(len(left))} alone: " + "; ".join(left)
        if strict:
            raise _WrongType(message)
        warnings.warn(message + ". strict=True makes this an error.", stacklevel=2)
    new_of = {key: _converted(module, cls) for key, (module, cls) in swaps.items()}
    for parent in [*model.modules(), *new_of.values()]:
        for name, child in list(parent._modules.items()):
            if id(child) in new_of:
                setattr(parent, name, new_of[id(child)])
    model = new_of.get(id(model), model)
    if process_group is not None:
        for module in model.modules():
            if isinstance(module, GroupNorm):
                module.process_group = process_group
    paired = _record_activation_pairs(model)
    if verbose:
        kinds = [_kind(module) for module, _ in swaps.values()]
        counts = ", ".join(f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds))
        print(f"replace_groupnorm: replaced {_layers(len(swaps))}"
              f"{': ' + counts if counts else ''}; left {len(left)}"
              + (f"; {already_ours} already ours" if already_ours else "")
              + (f"; {paired} followed by an activation in an nn.Sequential" if paired else ""))
    return model


# ---------------------------------------------------------------------------
# torch.compile: torch's own GroupNorm calls rewritten to the operator
# ---------------------------------------------------------------------------

def _torch_group_norm(input, num_groups, weight=None, bias=None, eps=1e-05, cudnn_enabled=True):
    """torch.group_norm's signature (a builtin, which inspect cannot read);
    cudnn_enabled picks torch's kernel, so the rewrite ignores it."""


_F_GROUP_NORM = F.group_norm  # as imported: a wrapper patched in later is not what graphs call


@functools.cache
def _group_norm_signatures():
    """(function, its signature) for each GroupNorm call a graph may hold."""
    return ((_F_GROUP_NORM, inspect.signature(_F_GROUP_NORM)),
            (torch.group_norm, inspect.signature(_torch_group_norm)))


def _rewrite_group_norms(graph, devices=("cuda",)):
    """Replaces each F.group_norm or torch.group_norm call in a pre-grad FX
    graph (what Dynamo traces of nn.GroupNorm and F.group_norm) whose input
    this module's kernels serve exactly (a float tensor on `devices`, weight
    and bias None or of its dtype and device, constant groups and eps) by
    the operator <ns>::forward. Graphs under autocast are left as they are:
    there torch computes GroupNorm in float32. Returns how many calls it
    replaced."""
    import operator

    if any(node.op == "call_function" and "autocast" in str(node.target) for node in graph.nodes):
        return 0
    # Dynamo records F.group_norm, or the torch.group_norm it calls once its
    # trace rules were built while F.group_norm was patched
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        signature = next((s for f, s in _group_norm_signatures() if node.target is f), None)
        if signature is None:
            continue
        try:
            bound = signature.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        x, groups, weight, bias, eps = (bound.arguments[k]
                                        for k in ("input", "num_groups", "weight", "bias", "eps"))
        value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        if (not isinstance(value, torch.Tensor) or value.device.type not in devices
                or value.dtype not in _FLOAT_DTYPES or value.dim() < 2
                or not isinstance(groups, int) or isinstance(groups, bool)
                or not isinstance(eps, (int, float)) or isinstance(eps, bool)
                or groups <= 0 or value.shape[1] % groups != 0):
            continue
        affine = [t.meta.get("example_value") if isinstance(t, torch.fx.Node) else t
                  for t in (weight, bias)]
        if any(t is not None and (not isinstance(t, torch.Tensor) or t.dtype != value.dtype
                                  or t.device != value.device) for t in affine):
            continue
        with graph.inserting_before(node):
            outputs = graph.call_function(_OPS.forward.default, (x, weight, bias, groups, float(eps)))
            y = graph.call_function(operator.getitem, (outputs, 0))
        y.meta.update(node.meta)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        replaced += 1
    return replaced


# What Dynamo traces of nn.SiLU, F.silu, torch.tanh, ...: target -> (the
# kernels' name for it, its parameters after the input, in order).
_GRAPH_ACTIVATIONS = {
    F.silu: ("silu", ("inplace",)), F.relu: ("relu", ("inplace",)), torch.relu: ("relu", ()),
    torch.tanh: ("tanh", ()), F.tanh: ("tanh", ()), torch.sigmoid: ("sigmoid", ()),
    F.sigmoid: ("sigmoid", ()), F.hardswish: ("hardswish", ("inplace",)),
    F.mish: ("mish", ("inplace",)), F.gelu: ("gelu", ("approximate",)),
    F.leaky_relu: ("leaky_relu", ("negative_slope", "inplace")),
}


def _graph_activation(node, source):
    """(name, slope) of the activation `node` computes of `source` alone, as
    the kernels name it (inplace forms too: `source` has no other user), or
    None."""
    if (node.op != "call_function" or node.target not in _GRAPH_ACTIVATIONS or not node.args
            or node.args[0] is not source):
        return None
    name, parameters = _GRAPH_ACTIVATIONS[node.target]
    if len(node.args) - 1 > len(parameters) or not set(node.kwargs) <= set(parameters):
        return None
    arguments = {**dict(zip(parameters, node.args[1:])), **node.kwargs}
    if name == "gelu":
        return {"none": ("gelu", None), "tanh": ("gelu_tanh", None)}.get(
            arguments.get("approximate", "none"))
    if name == "leaky_relu":
        slope = arguments.get("negative_slope", _LEAKY_SLOPE)
        number = isinstance(slope, (int, float)) and not isinstance(slope, bool)
        return (name, float(slope)) if number and math.isfinite(slope) else None
    return name, None


def _operands(node, functions, method):
    """The two operands of node when it is a binary call of one of
    `functions` or of the Tensor method `method`, with nothing else; or None."""
    binary = len(node.args) == 2 and not node.kwargs
    if node.op == "call_function" and node.target in functions and binary:
        return node.args
    if node.op == "call_method" and node.target == method and binary:
        return node.args
    return None


def _other_operand(operands, source):
    """The operand that is not `source`, when exactly one of the two is."""
    a, b = operands
    if (a is source) == (b is source):
        return None
    return b if a is source else a


def _fixed_size(sizes, expected):
    """Whether two sizes are equal for every value of their symbols."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(sizes) == len(expected) and all(statically_known_true(a == b)
                                               for a, b in zip(sizes, expected))


def _epilogue_operand(node, value, per_channel):
    """Whether a graph value can be an epilogue tensor of the GroupNorm
    output `value`: of its dtype and device and of shape (N, C, 1, ...)
    (per_channel: scale, shift) or value's (residual). Other shapes
    broadcast differently, so they stay graph ops."""
    tensor = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if (not isinstance(tensor, torch.Tensor) or tensor.dtype != value.dtype
            or tensor.device != value.device):
        return False
    expected = (tuple(value.shape[:2]) + (1,) * (value.dim() - 2) if per_channel
                else tuple(value.shape))
    return _fixed_size(tuple(tensor.shape), expected)


def _only_user_with(node, functions, method):
    """(node's only user, its other operand) when that user is a binary call
    of one of `functions` or of the Tensor method `method` on node and one
    other graph value; else None."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    other = _other_operand(_operands(user, functions, method) or (None, None), node)
    return (user, other) if isinstance(other, torch.fx.Node) else None


def _scale_step(node, value):
    """(the multiply, the (1 + scale) node, scale) when node's only user
    computes node * (1 + scale)."""
    import operator

    step = _only_user_with(node, (operator.mul, torch.mul), "mul")
    if step is None:
        return None
    user, factor = step
    pair = _operands(factor, (operator.add, torch.add), "add")
    one = [a for a in pair or () if not isinstance(a, (torch.fx.Node, bool)) and a == 1]
    scale = [a for a in pair or () if isinstance(a, torch.fx.Node)]
    if len(one) != 1 or len(scale) != 1 or not _epilogue_operand(scale[0], value, True):
        return None
    return user, factor, scale[0]


def _add_step(node, value, per_channel):
    """(the add, the other operand) when node's only user adds a shift
    (per_channel) or a residual to it (also `+=`, as timm's ResNet blocks
    add their shortcut: node has no other user to see the change)."""
    import operator

    functions = (operator.add, torch.add) if per_channel else (operator.add, torch.add, operator.iadd)
    step = _only_user_with(node, functions, "add")
    return step if step is not None and _epilogue_operand(step[1], value, per_channel) else None


def _residual_before_activation(node, value):
    """(the add, the residual) when node's only user adds a residual whose
    only user is an activation (ResNet blocks: act(norm(x) + shortcut))."""
    step = _add_step(node, value, per_channel=False)
    if step is None or len(step[0].users) != 1:
        return None
    return step if _graph_activation(next(iter(step[0].users)), step[0]) is not None else None


def _prologue_step(node, value):
    """(the add, x, add) when the GroupNorm call's input is x + add of one
    value per (sample, channel) (diffusers' ResNet block: h + temb[:, :,
    None, None]), computed for that call alone."""
    import operator

    total = node.args[0]
    if not isinstance(total, torch.fx.Node) or len(total.users) != 1:
        return None
    operands = _operands(total, (operator.add, torch.add), "add")
    for x, add in (operands, operands[::-1]) if operands else ():
        x_value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        if (isinstance(x_value, torch.Tensor) and _fixed_size(tuple(x_value.shape), tuple(value.shape))
                and x_value.dtype == value.dtype and isinstance(add, torch.fx.Node)
                and _epilogue_operand(add, value, per_channel=True)):
            return total, x, add
    return None


_CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d)  # F.conv2d is torch.conv2d


def _conv_bias_step(x, value):
    """(the convolution, its bias) when the GroupNorm call's input x is the
    output of a convolution with a bias of its dtype, used by nothing else.
    Inductor adds a CUDA convolution's bias by a pointwise pass after it,
    which its own GroupNorm kernel absorbs and our operator cannot: the
    fused call's (N, C) add takes it instead."""
    if (not isinstance(x, torch.fx.Node) or x.op != "call_function"
            or x.target not in _CONVOLUTIONS or len(x.users) != 1):
        return None
    bias = x.args[2] if len(x.args) > 2 else x.kwargs.get("bias")
    tensor = bias.meta.get("example_value") if isinstance(bias, torch.fx.Node) else None
    if (not isinstance(tensor, torch.Tensor) or tensor.dtype != value.dtype
            or tensor.device != value.device
            or not _fixed_size(tuple(tensor.shape), (value.shape[1],))):
        return None
    return x, bias


def _fold_conv_bias(graph, conv, bias, add, value):
    """The convolution without its bias, and the (N, C, 1, ...) add that
    holds it (plus the add the call had): nodes before the fused call."""
    import operator

    per_channel = graph.call_method("view", (bias, 1, -1, *(1,) * (value.dim() - 2)))
    if add is None:
        samples = graph.call_method("size", (conv, 0))
        add = graph.call_method("expand", (per_channel, samples, *(-1,) * (value.dim() - 1)))
    else:
        add = graph.call_function(operator.add, (add, per_channel))
    if len(conv.args) > 2:
        conv.args = (*conv.args[:2], None, *conv.args[3:])
    else:
        conv.kwargs = {**conv.kwargs, "bias": None}
    return add


def _fuse_epilogues(graph):
    """In a pre-grad FX graph, folds what follows each <ns>::forward call
    into one <ns>::forward_fused call, and the add that makes its input:
    `x + add` before it, the add one value per (sample, channel) and the
    sum used by nothing else (the kernels' prologue), and the bias of a
    convolution whose output only this call reads (_conv_bias_step); then,
    in the epilogue's order, each step the previous value's only user and
    each optional: `* (1 + scale)` and `+ shift` with (N, C, 1, ...)
    tensors (diffusers' scale-shift ResNet blocks, AdaGroupNorm), up to
    _MAX_ACTIVATIONS activations (one leaky_relu slope a chain),
    `+ residual` of the output's shape, after the activations or right
    before them (ResNet blocks). One pass over the tensor instead of one
    more per step, in inference and in training alike: the fused
    operator's backward gives every operand's gradient, recomputing the
    pre-activation values from x and the statistics. Returns how many
    calls it fused."""
    import operator

    fused = 0
    for node in list(graph.nodes):
        # Dynamo records the overload packet, the rewrite above the overload
        if (node.op != "call_function" or node.target not in (_OPS.forward, _OPS.forward.default)
                or node.kwargs or len(node.args) != 5):
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
            continue
        value = users[0].meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        last, steps = users[0], []
        factor = scale = shift = residual = None
        step = _scale_step(last, value)
        if step is not None:
            last, factor, scale = step
            steps.append(last)
        step = _add_step(last, value, per_channel=True)
        if step is not None:
            last, shift = step
            steps.append(last)
        residual_first = _residual_before_activation(last, value)
        if residual_first is not None:
            last, residual = residual_first
            steps.append(last)
        chain, slope = [], None
        while len(chain) < _MAX_ACTIVATIONS and len(last.users) == 1:
            user = next(iter(last.users))
            activation = _graph_activation(user, last)
            if activation is None or (activation[1] is not None and slope not in (None, activation[1])):
                break
            chain.append(activation[0])
            slope = activation[1] if activation[1] is not None else slope
            last = user
            steps.append(last)
        step = None if residual is not None else _add_step(last, value, per_channel=False)
        if step is not None:
            last, residual = step
            steps.append(last)
        prologue = _prologue_step(node, value)
        if not steps and prologue is None:
            continue
        x, add = (node.args[0], None) if prologue is None else prologue[1:]
        conv_bias = _conv_bias_step(x, value)
        codes = [_ACTIVATION_CODES[name] for name in chain]
        with graph.inserting_before(last):  # after every operand of the steps
            if conv_bias is not None:
                add = _fold_conv_bias(graph, *conv_bias, add, value)
            arguments = (x, *node.args[1:], scale, shift, residual, codes,
                         _LEAKY_SLOPE if slope is None else slope)
            if residual_first is not None:
                arguments = (*arguments, add, True)
            elif add is not None:
                arguments = (*arguments, add)
            outputs = graph.call_function(_OPS.forward_fused.default, arguments)
            y = graph.call_function(operator.getitem, (outputs, 0))
        y.meta.update(last.meta)
        last.replace_all_uses_with(y)
        for dead in [*reversed(steps), users[0], node]:
            graph.erase_node(dead)
        if prologue is not None:  # x + add, used by the GroupNorm alone
            graph.erase_node(prologue[0])
        if factor is not None and not factor.users:  # 1 + scale, unless used elsewhere
            graph.erase_node(factor)
        fused += 1
    return fused


_compile_pass = None  # the pass enable_compile_fusion installed


def enable_compile_fusion():
    """Installs an Inductor graph pass: graphs that torch.compile compiles
    from now on (the default backend) run torch's own nn.GroupNorm and
    F.group_norm on CUDA tensors as this module's operator, forward and
    backward, without changing the model. (Our GroupNorm and group_norm
    reach the operator anyway.) An (N, C) add right before a GroupNorm and
    the scale-shift, activations and residual add right after it run inside
    its kernels, forward and backward (_fuse_epilogues). A
    CustomGraphPass with a uuid(), so Inductor's FX
    graph cache keeps working. Returns nothing; see disable_compile_fusion."""
    global _compile_pass
    from torch._inductor import config

    load()  # the compiled graphs call the operator's kernels
    if _compile_pass is not None:
        return
    installed = config.pre_grad_custom_pass
    if installed is not None and not isinstance(installed, (list, tuple)):
        installed = [installed]
    _compile_pass = _group_norm_pass_class()()
    config.pre_grad_custom_pass = [*(installed or []), _compile_pass] if installed else _compile_pass


def disable_compile_fusion():
    """Removes the pass enable_compile_fusion installed (graphs compiled
    meanwhile keep it)."""
    global _compile_pass
    if _compile_pass is None:
        return
    from torch._inductor import config

    installed = config.pre_grad_custom_pass
    if isinstance(installed, (list, tuple)):
        rest = [p for p in installed if p is not _compile_pass]
        config.pre_grad_custom_pass = rest if len(rest) > 1 else (rest[0] if rest else None)
    elif installed is _compile_pass:
        config.pre_grad_custom_pass = None
    _compile_pass = None


@functools.cache
def _group_norm_pass_class():
    """The compile pass's class, made on first use (torch._inductor takes
    seconds to import) and reachable as this module's _GroupNormPass, so that
    Inductor's cache key can pickle an instance (torch 2.11 does)."""
    import marshal

    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _GroupNormPass(CustomGraphPass):
        def __call__(self, graph):
            _rewrite_group_norms(graph)
            _fuse_epilogues(graph)

        def uuid(self):
            code = b"".join(marshal.dumps(f.__code__) for f in
                            (_rewrite_group_norms, _graph_activation, _fuse_epilogues, _operands,
                             _other_operand, _fixed_size, _epilogue_operand, _only_user_with,
                             _scale_step, _add_step, _residual_before_activation,
                             _prologue_step, _conv_bias_step, _fold_conv_bias))
            table = str([(f.__name__, entry) for f, entry in _GRAPH_ACTIVATIONS.items()])
            key = code + table.encode() + _NAMESPACE.encode() + __version__.encode()
            return hashlib.sha256(key).hexdigest()

    _GroupNormPass.__module__, _GroupNormPass.__qualname__ = __name__, "_GroupNormPass"
    return _GroupNormPass


def __getattr__(name):
    if name == "_GroupNormPass":
        return _group_norm_pass_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tools():
    """groupnorm_tools (bundle, KernelBench export, self-check, command line),
    working on this module: the copy a bundle embeds, else the file beside
    this one."""
    if _EMBEDDED_TOOLS is None:
        import groupnorm_tools as tools
    else:
        tools = types.ModuleType("groupnorm_tools")
        exec(compile(_EMBEDDED_TOOLS, "groupnorm_tools.py (embedded)", "exec"), vars(tools))
    this = sys.modules.get(__name__)
    if this is None or vars(this) is not globals():  # exec'd text, or loaded outside sys.modules
        this = _Namespace(globals())
    tools.bind(this)
    return tools


class _Namespace:
    """Attribute access to a dict of globals that no module object holds."""

    def __init__(self, namespace):
        self.__dict__ = namespace


# Build (or load the cached build) on import when a GPU is present, so the
# first call does not pay for it (without the toolchain: one warning, and
# group_norm falls back to torch); GROUPNORM_INLINE_LAZY=1 defers it to
# first use. Run as a script, the command decides (bundle needs no build).
if (__name__ != "__main__" and torch.cuda.is_available()
        and os.environ.get("GROUPNORM_INLINE_LAZY", "0") in ("", "0")):
    _kernels_available()

if __name__ == "__main__" and "__file__" in globals():
    sys.exit(_tools().main())

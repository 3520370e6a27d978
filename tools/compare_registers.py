"""Registers, stack frame and spills per kernel in two ptxas reports, for
checking that a change to the kernels' code did not add spills. A report is
what `nvcc -cubin -Xptxas -v` prints for a checkout's single translation
unit (torch's include paths and flags, as tools/check_sources.sh uses):

    (cd BEFORE && python3 -c "import groupnorm_inline as g; print(g.sources()[1])") > before.cu
    nvcc ... -cubin -Xptxas -v before.cu -o before.cubin 2> before.txt
    nvcc ... -cubin -Xptxas -v kernels/extension.cu -o after.cubin 2> after.txt
    python3 tools/compare_registers.py before.txt after.txt

Prints each kernel whose figures differ, and the kernels that spill more.
"""
import re
import subprocess
import sys


def report(path):
    """{mangled kernel name: {"regs", "stack", "spill_stores", "spill_loads"}}.
    A frame line belongs to the function the "Function properties for" line
    before it names: ptxas prints those of a called (not inlined) device
    function among its callers' lines, and they are not the kernel's."""
    kernels, current, described = {}, None, None
    for line in open(path, encoding="utf-8", errors="replace"):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), {})
            continue
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            described = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and described in kernels:
            kernels[described].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["regs"] = int(m[1])
    return kernels


def without_parameters(name):
    """A demangled name less its trailing parameter list, whose parentheses
    are matched from the end: template arguments such as `(Store)2` keep
    theirs."""
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0 and name[i] == "(":
            return name[:i]
    return name


def readable(names):
    """Demangled names without parameter lists (c++filt), so that kernels
    moved between namespaces or files still pair up."""
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return [without_parameters(n).replace("void ", "") for n in out.splitlines()]


def main(before_path, after_path):
    before, after = report(before_path), report(after_path)
    b = dict(zip(readable(list(before)), before.values()))
    a = dict(zip(readable(list(after)), after.values()))
    spills = lambda k: k.get("spill_stores", 0) + k.get("spill_loads", 0)  # noqa: E731
    more = [name for name in a if name in b and spills(a[name]) > spills(b[name])]
    fewer = [name for name in a if name in b and spills(a[name]) < spills(b[name])]
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            print(f"{name}: before {b.get(name)} after {a.get(name)}")
    print(f"{len(b)} kernels before, {len(a)} after; {len(more)} spill more, {len(fewer)} spill less")
    for name in more:
        print(f"spills more: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))

"""What limits our forward on each row of the suite: Nsight Compute's
counters for our kernels and for x.clone() of the same input.

    python3 benchmarks/profile_rows.py [--rows NAME,...] [--csv ncu.csv] [--json rows.json]

Runs itself under `ncu` (CUDA's bin or PATH; caches flushed before every
kernel, clocks left to the card), one call per (row, contender), each
between two marker kernels (torch.cuda._sleep) that delimit its kernels.
The copy is `torch.neg`: one read and one write in one kernel (x.clone()
of a dense tensor is a memcpy, which Nsight Compute does not profile).
Per contender: GPU time, DRAM bytes and achieved bandwidth, achieved and
theoretical occupancy, registers, grid, issue-slot use, warp instructions
per element, local-memory (spill) requests. Plans are gn.plan's.
"""
import argparse
import csv
import io
import json
import os
import shlex
import shutil
import subprocess
import sys

METRICS = {
    "ns": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_pct": "sm__maximum_warps_per_active_cycle_pct",
    "issue_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warp_instructions": "smsp__inst_executed.sum",
    "local_requests": "l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
# --stalls: warps stalled per issued instruction, by reason (the kernel's main
# kernel only), from Nsight Compute's Warp State section
STALLS = {reason: f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"
          for reason in ("long_scoreboard", "barrier", "lg_throttle", "short_scoreboard",
                         "wait", "math_pipe_throttle", "mio_throttle", "membar", "no_instruction")}
MARKER = "spin_kernel"  # torch.cuda._sleep's


def ncu_path():
    for candidate in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ncu"),
                      shutil.which("ncu")):
        if candidate and os.path.exists(candidate):
            return candidate
    sys.exit("profile_rows: ncu (Nsight Compute) not found")


def launch_rows(names):
    """The child under ncu: for every row, the copy and our forward, each
    between markers; prints the (row, contender, plan) list in launch order."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import groupnorm_inline as gn
    from bench_groupnorm import case_key, make_inputs, suite_cases
    order = []
    for name, shape, groups, dtype, layout in suite_cases(names, "profile_rows"):
        x = make_inputs(shape, dtype, layout, 0)[0]  # one input: ncu flushes the caches itself
        w = torch.randn(shape[1], device="cuda", dtype=dtype)
        b = torch.randn(shape[1], device="cuda", dtype=dtype)
        row = case_key(name, shape, dtype, layout)
        plan = gn.plan(x, groups)
        for contender, call in (("copy", lambda: torch.neg(x)),
                                ("ours", lambda: gn.groupnorm_cuda(x, w, b, groups))):
            torch.cuda.synchronize()
            torch.cuda._sleep(1)
            call()
            torch.cuda._sleep(1)
            torch.cuda.synchronize()
            order.append({"row": row, "contender": contender, "elements": x.numel(),
                          "bytes": x.numel() * x.element_size(), "plan": plan})
        del x
        torch.cuda.empty_cache()
    print("ROWS " + json.dumps(order), flush=True)


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def kernels_from_csv(text):
    """ncu's raw CSV page: one dict a kernel, in launch order (the units row dropped)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    kernels = []
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        if not (rec.get("ID") or "").isdigit():
            continue
        k = {"name": rec["Kernel Name"]}
        for key, metric in {**METRICS, **STALLS}.items():
            k[key] = number(rec.get(metric, "") or "")
        kernels.append(k)
    return kernels


def attribute(order, kernels):
    """The kernels between each pair of markers, summed per contender."""
    groups, current = [], None
    for k in kernels:
        if MARKER in k["name"]:
            if current is None:
                current = []
                groups.append(current)
            else:
                current = None
        elif current is not None:
            current.append(k)
    if len(groups) != len(order):
        sys.exit(f"profile_rows: {len(groups)} marker pairs for {len(order)} calls")
    rows = []
    for slot, ks in zip(order, groups):
        ns = sum(k["ns"] or 0 for k in ks)
        dram = sum((k["dram_read"] or 0) + (k["dram_write"] or 0) for k in ks)
        main = max(ks, key=lambda k: k["ns"] or 0) if ks else {}
        rows.append({**slot, "kernels": [k["name"].split("(")[0][:80] for k in ks],
                     "us": ns / 1e3, "dram_mb": dram / 1e6,
                     "dram_tbs": dram / ns / 1e3 if ns else None,
                     "dram_over_bytes": dram / slot["bytes"],
                     "warp_instructions_per_element":
                         sum(k["warp_instructions"] or 0 for k in ks) * 32 / slot["elements"],
                     **{key: main.get(key) for key in ("dram_pct", "occupancy_pct",
                                                       "theoretical_pct", "issue_pct",
                                                       "local_requests", "registers", "grid",
                                                       "block")},
                     "stalls": {key: main.get(key) for key in STALLS if main.get(key) is not None}})
    return rows


def fmt(value, spec):
    """value formatted, or "–" where Nsight Compute gave none."""
    return "–" if value is None else format(value, spec)


def markdown(rows):
    out = ["| row | plan | copy µs | ours µs | ours / copy | DRAM bytes / input's (copy, ours) "
           "| TB/s (copy, ours) | occupancy % achieved / theoretical | issue % | "
           "thread instructions / element | registers, grid × block | local loads |",
           "|---|---|---:|---:|---:|---|---|---|---:|---:|---|---:|"]
    by_row = {}
    for r in rows:
        by_row.setdefault(r["row"], {})[r["contender"]] = r
    for row, c in by_row.items():
        cl, o = c["copy"], c["ours"]
        ratio = o["us"] / cl["us"] if cl["us"] else None
        out.append(
            f"| {row} | {o['plan'].get('kernel')} | {cl['us']:.1f} | {o['us']:.1f} | "
            f"{fmt(ratio, '.2f')} | {cl['dram_over_bytes']:.2f}, {o['dram_over_bytes']:.2f} | "
            f"{fmt(cl['dram_tbs'], '.2f')}, {fmt(o['dram_tbs'], '.2f')} | "
            f"{fmt(o['occupancy_pct'], '.0f')} / {fmt(o['theoretical_pct'], '.0f')} | "
            f"{fmt(o['issue_pct'], '.0f')} | {o['warp_instructions_per_element']:.1f} | "
            f"{fmt(o['registers'], '.0f')}, {fmt(o['grid'], '.0f')} × {fmt(o['block'], '.0f')} | "
            f"{fmt(o['local_requests'], '.0f')} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="suite row names, comma-separated (default all)")
    ap.add_argument("--csv", help="keep ncu's raw CSV here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--stalls", action="store_true",
                    help="also the warps' stall reasons (more replay passes)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = [n for n in args.rows.split(",") if n]
    if args.child:
        launch_rows(names)
        return
    cmd = [ncu_path(), "--csv", "--page", "raw", "--print-units", "base", "--cache-control", "all",
           "--clock-control", "none", "--metrics",
           ",".join(list(METRICS.values()) + (list(STALLS.values()) if args.stalls else [])),
           sys.executable,
           os.path.abspath(__file__), "--child", "--rows", args.rows]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(done.stdout)
    marker = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode != 0 or not marker:
        sys.exit(f"profile_rows: ncu failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = attribute(json.loads(marker[-1][5:]), kernels_from_csv(done.stdout))
    table = markdown(rows)
    print(table)
    if args.json:
        import datetime
        import torch
        command = [os.path.basename(a) if a in (args.json, args.csv) else a for a in sys.argv]
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
                "command": shlex.join(["python3"] + command)}
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Row-by-row comparison of two benchmark JSON files of the same suite (from
bench_groupnorm.py, before and after a change, same card and run):

    python benchmarks/compare_runs.py BEFORE.json AFTER.json [--limit 1.02]

Prints ours before/after per row (forward, or forward+backward and the
backward alone for --training files), with torch's eager time of each run as
a check that the card did not drift, and exits 1 when a row of ours is
slower than --limit times before.
"""

import argparse
import json
import sys


def timings(row):
    out = {"ours": row["ms"]["groupnorm_inline"], "eager": row["ms"]["eager"]}
    if "backward_ms" in row:
        out["ours backward"] = row["backward_ms"]["groupnorm_inline"]
        out["eager backward"] = row["backward_ms"]["eager"]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--limit", type=float, default=1.02, help="allowed after / before")
    args = parser.parse_args(argv)
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    key = lambda r: (r["name"], tuple(r["shape"]), r["dtype"], r["layout"])  # noqa: E731
    old = {key(r): timings(r) for r in before["rows"]}
    print(f"{'case':<22} {'shape':<18} {'layout':<13} {'what':<14} {'before':>9} {'after':>9} "
          f"{'after/before':>12} {'eager a/b':>9}")
    slower = 0
    for row in after["rows"]:
        if key(row) not in old:
            continue
        b, a = old[key(row)], timings(row)
        for what in ("ours", "ours backward"):
            if what not in a:
                continue
            ratio = a[what] / b[what]
            eager = what.replace("ours", "eager")
            flag = ratio > args.limit
            slower += flag
            print(f"{row['name'][:22]:<22} {'x'.join(map(str, row['shape'])):<18} {row['layout']:<13} "
                  f"{what:<14} {b[what]:9.4f} {a[what]:9.4f} {ratio:12.3f} "
                  f"{a[eager] / b[eager]:9.3f}{'  SLOWER' if flag else ''}")
    print(f"{slower} row(s) slower than {args.limit}x before")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())

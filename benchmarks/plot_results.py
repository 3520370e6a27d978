"""Chart of one benchmark JSON: per case, the speed-up over torch eager and
over torch.compile, and the time against a copy of the same size.

    python3 benchmarks/plot_results.py benchmarks/results-h100.json benchmarks/forward-h100.png

The JSON is what `bench_groupnorm.py --json` writes: {"meta": {...}, "rows":
[...]}, each row with name, shape, dtype, layout, ms {groupnorm_inline,
eager, compile} and, for the forward, clone_ms (x.clone() timed the same
way). The title carries meta's card, date and versions. Rows without
clone_ms (the --training JSON) get the speed-ups alone. matplotlib is
imported only when a chart is drawn, so this module imports without it.
"""

import argparse
import json

PROVIDERS = (("eager", "× torch eager"), ("compile", "× torch.compile"))


def case_label(row):
    """One line per case: name, shape, dtype and layout."""
    layout = "CL" if row["layout"] == "channels_last" else "contig."
    return f"{row['name']}  {'×'.join(map(str, row['shape']))} {row['dtype']} {layout}"


def speedup(row, provider):
    return row["ms"][provider] / row["ms"]["groupnorm_inline"]


def clone_ratio(row):
    """This module's time over a same-size copy's: 1 is as fast as x.clone()."""
    return row["ms"]["groupnorm_inline"] / row["clone_ms"]


def title(meta, training):
    what = "forward + backward" if training else "forward"
    return (f"groupnorm_inline {what}: {meta['device']}, {meta['date']}\n"
            f"torch {meta['torch']}, CUDA {meta['cuda']}; median GPU time per case")


def plot(rows, meta, path):
    """Writes the chart of `rows` (a bench JSON's rows) to `path` (PNG)."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("plot_results needs matplotlib: "
                          "pip install -r requirements-dev.txt") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    training = bool(rows) and rows[0].get("pass") == "forward+backward"
    with_clone = bool(rows) and all(r.get("clone_ms") for r in rows)
    ys = list(range(len(rows)))[::-1]  # the first case at the top
    fig, axes = plt.subplots(1, 2 if with_clone else 1, sharey=True, squeeze=False,
                             figsize=(13 if with_clone else 9, 1.2 + 0.42 * len(rows)),
                             gridspec_kw={"width_ratios": [3, 2]} if with_clone else None)
    ax = axes[0][0]
    height = 0.38
    lowest = highest = 1.0
    for k, (provider, label) in enumerate(PROVIDERS):
        values = [speedup(r, provider) for r in rows]
        lowest, highest = min([lowest] + values), max([highest] + values)
        offset = (0.5 - k) * height
        # Bars grow from 1 (parity): right where ours is faster, left where slower.
        bars = ax.barh([y + offset for y in ys], [v - 1 for v in values], height, left=1,
                       label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], padding=2, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(min(0.8, lowest / 1.25), highest * 1.6)  # room for the labels
    ax.axvline(1, color="black", lw=0.8)
    ax.set_xlabel("speed-up: their time / ours (log scale; > 1: ours is faster)")
    ax.set_yticks(ys, [case_label(r) for r in rows], fontsize=8)
    ax.legend(loc="lower right", fontsize=8)
    if with_clone:
        ax = axes[0][1]
        values = [clone_ratio(r) for r in rows]
        bars = ax.barh(ys, values, 0.6, color="tab:gray")
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], padding=2, fontsize=7)
        ax.axvline(1, color="black", lw=0.8)
        ax.set_xlim(0, max(values) * 1.15)
        ax.set_xlabel("ours / x.clone() time (1: as fast as a same-size copy)")
    fig.suptitle(title(meta, training), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_file(json_path, png_path):
    with open(json_path) as f:
        data = json.load(f)
    plot(data["rows"], data["meta"], png_path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="a bench JSON (bench_groupnorm.py --json)")
    parser.add_argument("png", help="the chart to write")
    args = parser.parse_args(argv)
    plot_file(args.json, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

"""The plans of a checkout from before plans were dicts (text, with `team`
doubling as the stream lag), in .base/, against this checkout's, for the same
inputs and requests on this GPU, each dumped by its own process: every field
the old text names must match, and every refused request must fail with the
same message. The check that the planner's rewrite kept its decisions.
    git worktree add .base 817f504
    python tools/compare_plans.py dump old OLD.json
    python tools/compare_plans.py dump new NEW.json
    python tools/compare_plans.py compare OLD.json NEW.json"""
import itertools
import json
import re
import sys

import torch

FIELDS = {"vec": "vec", "grid": "grid", "threads": "threads", "smem": "smem", "team": "team",
          "pieces": "pieces", "piece": "piece", "rows": "piece", "lag": "lag", "slots": "slots",
          "merge": "merge", "chunk": "chunk", "blocks": "blocks", "items": "items", "ranks": "ranks",
          "chunks": "chunks", "tiles": "tiles", "cblocks": "blocks", "cols": "block_cols"}


def old_fields(text):
    head = text.split(" (")[0]
    f = dict(re.findall(r"(\w+)=(\S+)", head))
    if "kept" in f:
        f["kept"], f["slice"] = f["kept"].split("/")
    words = head.split()
    return words, f


def compare(x, groups, old_text, new_dict, backward):
    words, f = old_fields(old_text)
    bad = []
    if backward:
        kind = words[0]
        if new_dict["kernel"] != kind or new_dict["layout"] != words[1]:
            bad.append(f"kernel {words[:2]} vs {new_dict['kernel']}/{new_dict['layout']}")
        if "(a warp per row)" in old_text and not new_dict.get("warp_rows"):
            bad.append("warp_rows")
    else:
        name = words[0]
        if new_dict["kernel"] != name:
            bad.append(f"kernel {name} vs {new_dict['kernel']}")
        if name == "stream" and (len(words) > 1 and words[1] == "channels_last") != (new_dict["layout"] == "channels_last"):
            bad.append("stream layout")
    if not backward and words[0] == "reference":  # its old text printed an empty team
        for k in ("team", "kept", "slice"):
            f.pop(k, None)
    for k, v in f.items():
        key = FIELDS.get(k, k)
        if key not in new_dict:
            bad.append(f"{k} missing")
            continue
        nv = new_dict[key]
        if str(nv) != v and not (isinstance(nv, bool) and str(int(nv)) == v):
            bad.append(f"{k}: {v} vs {nv}")
    if not backward and "blocks" in new_dict and "blocks" not in f and new_dict["blocks"] != 1:
        bad.append(f"blocks: 1 vs {new_dict['blocks']}")
    return bad


SHAPES = [
    ((112, 64, 512, 512), 8), ((128, 64, 126, 126), 16), ((2, 320, 64, 64), 32), ((2, 1280, 16, 16), 32),
    ((8, 1280, 8, 8), 32), ((1, 128, 512, 512), 32), ((4, 512, 128, 128), 32), ((2, 512, 16, 64, 64), 32),
    ((16, 256, 16000), 16), ((4, 32, 8, 8), 8), ((2, 96, 17, 23), 6), ((3, 60, 31, 1), 5),
    ((16, 64, 126, 126), 16), ((1, 16, 300, 300), 2), ((3, 1280, 5, 7), 40), ((2, 768, 9, 11), 24),
    ((2, 21, 17, 19), 3), ((2, 12, 33, 35), 4), ((1, 512, 32, 32), 16), ((2, 16, 100, 100), 2),
    ((1, 8, 128, 256), 1), ((2, 64, 40, 50), 2), ((3, 12, 61, 37), 3), ((1, 8, 256, 256), 1),
    ((16, 64, 64, 64), 8), ((2, 4, 1000, 1000), 1), ((2, 64, 45, 45), 8), ((1, 128, 100, 100), 64),
    ((2, 512, 33, 35), 32), ((256, 64, 32, 32), 32), ((2, 124, 99, 100), 31), ((1, 4096, 4, 4), 1),
    ((8, 320, 64, 64), 32), ((2, 640, 64, 64), 32), ((32, 128, 56, 56), 32), ((2, 640, 128, 128), 32),
    ((1, 128, 8, 256, 256), 32), ((2, 32, 128, 128, 128), 8), ((1, 64, 32, 32), 32), ((4, 256, 96, 96), 32),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def make(shape, dtype, layout):
    x = torch.empty(shape, device="cuda", dtype=dtype)
    if layout == "channels_last":
        x = x.permute(0, *range(2, len(shape)), 1).contiguous().permute(0, len(shape) - 1, *range(1, len(shape) - 1))
    return x



def cases():
    for (shape, groups), dtype, layout in itertools.product(SHAPES, DTYPES, ["contiguous", "channels_last"]):
        if torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size() > 8 << 30:
            continue
        team_kernel = "channels_last" if layout == "channels_last" else "contiguous"
        fwd = [("auto", 0, {}), ("reference", 0, {"kernel": "reference"}),
               ("stream", 0, {"kernel": "stream"}), ("stream", 7, {"kernel": "stream", "lag": 7}),
               ("registers", 0, {"kernel": "registers"}), (team_kernel, 0, {"kernel": team_kernel}),
               (team_kernel, 3, {"kernel": team_kernel, "team": 3})]
        bwd = [("auto", 0, {}), ("stream", 0, {"kernel": "stream"}), ("passes", 0, {"kernel": "passes"}),
               ("stream", 5, {"kernel": "stream", "lag": 5})]
        yield shape, groups, dtype, layout, fwd, bwd


def dump(which, path):
    if which == "old":
        sys.path.insert(0, ".base")
    else:
        sys.path.insert(0, ".")
    import groupnorm_inline as gn
    out = []
    for shape, groups, dtype, layout, fwd, bwd in cases():
        x = make(shape, dtype, layout)
        for backward, requests in ((False, fwd), (True, bwd)):
            for kernel, n, kw in requests:
                try:
                    if which == "old":
                        r = gn.plan(x, groups, kernel=kernel, team=n, backward=backward)
                    else:
                        r = gn.plan(x, groups, backward=backward, **kw)
                except (RuntimeError, ValueError) as e:
                    r = {"error": type(e).__name__, "message": str(e).split("\n")[0]}
                out.append({"case": [list(shape), groups, str(dtype), layout, backward, kernel, n], "plan": r})
        del x
    with open(path, "w") as f:
        json.dump(out, f)


def compare_files(old_path, new_path):
    old = json.load(open(old_path))
    new = json.load(open(new_path))
    mismatches = 0
    errors_differ = 0
    for o, n in zip(old, new):
        assert o["case"] == n["case"]
        backward = o["case"][4]
        op, np_ = o["plan"], n["plan"]
        oe = op.get("error") if isinstance(op, dict) else None
        ne = np_.get("error")
        if oe or ne:
            if not (oe and ne) or op["message"] != np_["message"]:
                errors_differ += 1
                print("ERR", o["case"], "|", op, "|", np_)
            continue
        bad = compare(None, None, op, np_, backward)
        if bad:
            mismatches += 1
            print("MISMATCH", o["case"], bad, "|", op, "|", np_)
    print(f"compare_plans: {len(old)} requests, {mismatches} plan mismatches, {errors_differ} differing errors")


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3])
    else:
        compare_files(sys.argv[2], sys.argv[3])

"""The registers kernel's CTAs a group (team=, a thread-block cluster when
above 1) on the small shapes it serves, against the automatic plan and a
copy of the same input. The planner takes one CTA a group whenever the group
fits; the SD UNet's 2×320×64×64 then runs 64 CTAs on a card of 132 SMs.

    python3 benchmarks/sweep_ranks.py

Forced `kernel="registers"` with team = 1, 2, 4 and 8 (skipped where the
cluster cannot be scheduled); GPU times as bench_groupnorm.py takes them
(do_bench medians over rotating inputs), each with x.clone()'s time.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_groupnorm as bench  # noqa: E402
import groupnorm_inline as gn  # noqa: E402

CASES = [((2, 320, 64, 64), 32, torch.float16, layout) for layout in ("contiguous", "channels_last")]
CASES += [((2, 1280, 16, 16), 32, torch.float16, layout) for layout in ("contiguous", "channels_last")]
CASES += [((8, 1280, 8, 8), 32, torch.bfloat16, "contiguous"), ((1, 64, 32, 32), 32, torch.float16, "contiguous"),
          ((2, 640, 32, 32), 32, torch.float16, "contiguous")]


def main():
    if not torch.cuda.is_available():
        sys.exit("sweep_ranks.py: needs a CUDA device, and none is visible")
    print(f"{torch.cuda.get_device_name()}: {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    for shape, groups, dtype, layout in CASES:
        inputs = bench.make_inputs(shape, dtype, layout, 2**30)
        clone = bench.median_ms(bench.rotating(lambda t: t.clone(), inputs))
        auto = gn.plan(inputs[0], groups)
        times = {"auto": bench.median_ms(bench.rotating(lambda t: gn.groupnorm_cuda(t, None, None, groups), inputs))}
        for team in (1, 2, 4, 8):
            try:
                plan = gn.plan(inputs[0], groups, kernel="registers", team=team)
            except (RuntimeError, ValueError) as error:
                times[f"team {team}"] = f"({str(error)[:40]})"
                continue
            times[f"team {team} ({plan['threads']} thr)"] = bench.median_ms(bench.rotating(
                lambda t: gn.groupnorm_cuda(t, None, None, groups, kernel="registers", team=team), inputs))
        cells = ", ".join(f"{k} {v:.4f} ({v / clone:.2f}× clone)" if isinstance(v, float) else f"{k} {v}"
                          for k, v in times.items())
        print(f"{'×'.join(map(str, shape))} G={groups} {str(dtype)[6:]} {layout}: clone {clone:.4f} ms; "
              f"auto = {auto['kernel']} ranks {auto.get('ranks', '-')}; {cells}", flush=True)


if __name__ == "__main__":
    main()

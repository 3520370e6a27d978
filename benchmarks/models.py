"""Whole models with torch's GroupNorm (as shipped) and with ours.

    python benchmarks/models.py [--models unet,vae,resnet50_gn,efficientnet_b3_gn,segresnet]
                                [--modes eager,compile,reduce-overhead,train,compile-train]
                                [--rounds 5]
                                [--json PATH] [--markdown PATH] [--tiny]

Real architectures with random weights and the configurations people run
(requirements-models.txt: diffusers, timm, MONAI):
- unet: diffusers' SD1.5 UNet2DConditionModel, fp16, batch 2, 64x64 latent,
  text states 2x77x768;
- vae: the SD VAE decoder (AutoencoderKL.decode), bf16, channels_last,
  1x4x64x64 latent to 512x512;
- resnet50_gn, efficientnet_b3_gn: timm, bf16, channels_last, batch 32, 224x224;
- segresnet: MONAI SegResNet 3-D, bf16, 1x4x128x128x128.

Per model and variant ("torch": as shipped; "ours": replace_groupnorm;
"pass", compiled modes only: as shipped, compiled with
gn.enable_compile_fusion(), the one line that needs no model change): the
largest error against a float64 copy of the same weights, relative to the
output's largest magnitude (the pass's from its first compiled mode: with
compile-train alone, a training forward's output); forward time in eager
mode, compiled (default, and mode="reduce-overhead": CUDA graphs) and a
training step (forward, a mean-square loss, backward) in eager mode and
compiled ("compile-train"); the first compiled calls' wall time. Times are
medians of CUDA-event timings; the variants alternate, round by round, in
one process on one card. --tiny builds the same model
families at toy sizes on the CPU in float32: a smoke test of the harness
(test_groupnorm.py runs it), not a measurement.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import groupnorm_inline as gn  # noqa: E402
from kernel_times import ran_our_kernels  # noqa: E402

MODES = ("eager", "compile", "reduce-overhead", "train", "compile-train")
COMPILED_MODES = ("compile", "reduce-overhead", "compile-train")


def sd_unet(tiny):
    from diffusers import UNet2DConditionModel

    channels = (32, 64) if tiny else (320, 640, 1280, 1280)
    down = ("CrossAttnDownBlock2D",) * (len(channels) - 1) + ("DownBlock2D",)
    up = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (len(channels) - 1)
    text = 32 if tiny else 768
    model = UNet2DConditionModel(
        sample_size=8 if tiny else 64, in_channels=4, out_channels=4, block_out_channels=channels,
        down_block_types=down, up_block_types=up, layers_per_block=1 if tiny else 2,
        cross_attention_dim=text, attention_head_dim=8, norm_num_groups=32 if not tiny else 8)
    batch, size = 2, (8 if tiny else 64)

    def inputs(dtype, device):
        return (torch.randn(batch, 4, size, size, dtype=dtype, device=device),
                torch.tensor([999.0, 500.0], device=device),
                torch.randn(batch, 77, text, dtype=dtype, device=device))

    return model, inputs, torch.float16, False, lambda m, x, t, c: m(x, t, encoder_hidden_states=c).sample


class VaeDecode(torch.nn.Module):
    """AutoencoderKL.decode (post_quant_conv, then the decoder) as a module's
    forward: torch.compile(module) compiles forward only, so a compiled
    AutoencoderKL would still run decode uncompiled; and the encoder's
    GroupNorms, which decode never runs, stay out of the counts."""

    def __init__(self, vae):
        super().__init__()
        self.post_quant_conv, self.decoder = vae.post_quant_conv, vae.decoder

    def forward(self, z):
        return self.decoder(self.post_quant_conv(z))


def sd_vae_decoder(tiny):
    from diffusers import AutoencoderKL

    channels = (32, 32) if tiny else (128, 256, 512, 512)
    model = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=channels,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels), layers_per_block=1 if tiny else 2,
        norm_num_groups=8 if tiny else 32, sample_size=16 if tiny else 512)
    size = 8 if tiny else 64

    def inputs(dtype, device):
        return (torch.randn(1, 4, size, size, dtype=dtype, device=device),)

    return VaeDecode(model), inputs, torch.bfloat16, True, lambda m, z: m(z)


def timm_model(name):
    def build(tiny):
        import timm

        model = timm.create_model("test_efficientnet_gn" if tiny else name, pretrained=False)
        batch, size = (2, 32) if tiny else (32, 224)

        def inputs(dtype, device):
            return (torch.randn(batch, 3, size, size, dtype=dtype, device=device),)

        return model, inputs, torch.bfloat16, True, lambda m, x: m(x)
    return build


def segresnet(tiny):
    from monai.networks.nets import SegResNet

    model = SegResNet(spatial_dims=3, init_filters=8 if tiny else 16, in_channels=4,
                      out_channels=3, blocks_down=(1, 2) if tiny else (1, 2, 2, 4),
                      blocks_up=(1,) if tiny else (1, 1, 1))
    size = 16 if tiny else 128

    def inputs(dtype, device):
        return (torch.randn(1, 4, size, size, size, dtype=dtype, device=device),)

    return model, inputs, torch.bfloat16, True, lambda m, x: m(x)


MODELS = {"unet": sd_unet, "vae": sd_vae_decoder, "resnet50_gn": timm_model("resnet50_gn"),
          "efficientnet_b3_gn": timm_model("efficientnet_b3_gn"), "segresnet": segresnet}


def channels_last(t, on):
    if not on or t.dim() not in (4, 5):
        return t
    return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


def groupnorm_count(model):
    return sum(isinstance(m, torch.nn.GroupNorm) for m in model.modules())


def ours_count(model):
    return sum(isinstance(m, gn.GroupNorm) for m in model.modules())


def relative_error(out, reference):
    return ((out.double() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def event_ms(fn, device):
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def training_step(model, call, args):
    """One forward and backward in training mode, gradients dropped after;
    returns the forward's output (detached)."""
    model.train()
    out = call(model, *args)
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    return out.detach()


def prepare(name, tiny, device):
    """(model in float32 on device, in eval mode; its inputs; dtype; whether
    channels_last; call) for one model of MODELS, inputs drawn from seed 0."""
    model, make_inputs, dtype, cl, call = MODELS[name](tiny)
    if tiny:
        dtype = torch.float32
    model = model.to(device).eval()
    torch.manual_seed(0)
    args = tuple(channels_last(a, cl) if a.is_floating_point() else a
                 for a in make_inputs(dtype, device))
    return model, args, dtype, cl, call


def variant_models(model, dtype, cl):
    """{"torch": as shipped, "ours": after replace_groupnorm}: copies of model
    in dtype, their conv weights channels_last where the inputs are."""
    variants = {"torch": copy.deepcopy(model).to(dtype)}
    variants["ours"] = gn.replace_groupnorm(copy.deepcopy(model).to(dtype), strict=True)
    if cl:
        for m in variants.values():
            for p in m.parameters():  # conv weights: 4-D channels_last, 5-D channels_last_3d
                p.data = channels_last(p.data, True)
    return variants


def run_model(name, modes, rounds, device, tiny):
    model, args, dtype, cl, call = prepare(name, tiny, device)
    reference_model = copy.deepcopy(model).double()
    with torch.no_grad():
        reference = call(reference_model, *(a.double() if a.is_floating_point() else a
                                            for a in args))
    del reference_model
    variants = variant_models(model, dtype, cl)
    result = {"model": name, "dtype": str(dtype)[6:], "channels_last": cl,
              "groupnorms": groupnorm_count(model), "swapped": ours_count(variants["ours"]),
              "variants": {}}
    callables = {}
    for v, m in variants.items():
        with torch.no_grad():
            out = call(m, *args)
        entry = result["variants"][v] = {"max_error": relative_error(out, reference)}
        callables[(v, "eager")] = lambda m=m: torch.no_grad()(call)(m, *args)
        for mode in ("compile", "reduce-overhead"):
            if mode in modes:
                callables[(v, mode)], _ = compiled_variant(entry, m, call, args, mode)
        if "train" in modes:
            callables[(v, "train")] = lambda m=m: training_step(m, call, args)
        if "compile-train" in modes:
            callables[(v, "compile-train")], _ = compiled_training_variant(entry, m, call, args)
    compiled_modes = [mode for mode in COMPILED_MODES if mode in modes]
    if compiled_modes:
        # its own copy of torch's model, as each variant has
        add_pass_variant(result, callables, copy.deepcopy(variants["torch"]), call, args,
                         reference, compiled_modes)
    times = {key: [] for key in callables if key[1] in modes}
    for fn in (callables[key] for key in times):  # warm-up
        fn()
    for _ in range(rounds):
        for key in times:
            times[key].append(event_ms(callables[key], device))
    if device.type == "cuda":  # after the timings: a profile leaves CUPTI loaded, slowing launches
        check_variants({key: callables[key] for key in times if key[1] != "train"})
    for (v, mode), t in times.items():
        result["variants"][v][f"{mode}_ms"] = round(statistics.median(t), 3)
    for mode in modes:
        for v, key in (("ours", f"{mode}_speedup"), ("pass", f"{mode}_pass_speedup")):
            if f"{mode}_ms" in result["variants"].get(v, {}):
                result[key] = round(result["variants"]["torch"][f"{mode}_ms"] /
                                    result["variants"][v][f"{mode}_ms"], 3)
    return result


def with_compile_fusion(call):
    """call(), with groupnorm_inline's compile pass installed while it runs:
    a recompile (after a dynamo reset) keeps the pass, and the other
    variants' compiles never see it."""
    def run(*args):
        gn.enable_compile_fusion()
        try:
            return call(*args)
        finally:
            gn.disable_compile_fusion()
    return run


def warm_inductor(device):
    """Compile times without a head start: one small compile first, so that
    no variant pays Inductor's start-up (imports, Triton, compile workers)
    alone, and no FX graph cache, so that no variant reuses the graphs
    another compiled (the as-shipped and pass variants share most). Left
    shared: Triton's own cache of compiled kernels."""
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._dynamo.reset()
    torch.compile(lambda t: torch.nn.functional.group_norm(t, 2).relu())(
        torch.randn(2, 4, 8, 8, device=device))


def own_frame(model):
    """model's call as a function with a code object of its own. Dynamo keeps
    compiled code on the code object it starts from, guarded by what deep
    copies of one model share (input tensors, module types): variants
    compiled from the same code would all run whichever graph was compiled
    last (checked by ran_our_kernels)."""
    def forward(*args, **kwargs):
        return model(*args, **kwargs)
    code = forward.__code__.replace(co_name=f"forward_{id(model):x}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


def compiled_variant(entry, model, call, args, mode):
    """model compiled in `mode`, its first two calls timed into entry (the
    compile; reduce-overhead records its graph on the second); returns the
    callable to time and the first call's output."""
    torch._dynamo.reset()
    compiled = torch.compile(own_frame(model), mode=None if mode == "compile" else mode)
    start = time.perf_counter()
    with torch.no_grad():
        # cloned: a CUDA graph's second replay overwrites the first's output
        out = call(compiled, *args).clone()
        call(compiled, *args)
    if out.is_cuda:
        torch.cuda.synchronize()
    entry[f"{mode}_first_calls_s"] = round(time.perf_counter() - start, 2)
    return (lambda: torch.no_grad()(call)(compiled, *args)), out


def compiled_training_variant(entry, model, call, args):
    """model compiled for a training step (training_step through the
    compiled forward; the backward graph comes with it), its first two steps
    timed into entry; returns the step to time and the first step's output."""
    torch._dynamo.reset()
    compiled = torch.compile(own_frame(model))

    def step():
        return training_step(model, lambda _, *inputs: call(compiled, *inputs), args)

    start = time.perf_counter()
    out = step()
    step()
    if args[0].is_cuda:
        torch.cuda.synchronize()
    entry["compile-train_first_calls_s"] = round(time.perf_counter() - start, 2)
    return step, out


def check_variants(callables):
    """Each timed variant runs what it is named for: torch's model none of our
    kernels, ours and the pass some (a CUDA run's guard against variants
    sharing compiled code)."""
    for (variant, mode), fn in callables.items():
        if ran_our_kernels(fn) != (variant != "torch"):
            raise RuntimeError(f"models.py: the {variant} variant ({mode}) ran "
                               f"{'none' if variant != 'torch' else 'some'} of groupnorm_inline's "
                               "kernels: the variants' compiled code is mixed up")


def add_pass_variant(result, callables, model, call, args, reference, modes):
    """The "pass" variant: torch's model compiled with the compile pass."""
    entry = result["variants"]["pass"] = {}
    fused_call = with_compile_fusion(call)
    for mode in modes:
        variant = (compiled_training_variant(entry, model, fused_call, args) if mode == "compile-train"
                   else compiled_variant(entry, model, fused_call, args, mode))
        callables[("pass", mode)], out = variant
        # the first compiled mode's output: compile-train's forward when it is the only one
        entry.setdefault("max_error", relative_error(out, reference))


def markdown(results):
    lines = ["| model | GroupNorms swapped | mode | torch ms | ours ms | speed-up | "
             "compile pass ms | speed-up |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for mode in MODES:
            if f"{mode}_speedup" in r:
                passed = r["variants"].get("pass", {})
                extra = (f"{passed[f'{mode}_ms']:.2f} | {r[f'{mode}_pass_speedup']:.2f}"
                         if f"{mode}_ms" in passed else "| ")
                lines.append(f"| {r['model']} | {r['swapped']}/{r['groupnorms']} | {mode} | "
                             f"{r['variants']['torch'][f'{mode}_ms']:.2f} | "
                             f"{r['variants']['ours'][f'{mode}_ms']:.2f} | {r[f'{mode}_speedup']:.2f} | "
                             f"{extra} |")
    lines += ["", "| model | error torch | error ours | error compile pass |", "|---|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['variants']['torch']['max_error']:.2e} | "
              f"{r['variants']['ours']['max_error']:.2e} | "
              f"{r['variants'].get('pass', {}).get('max_error', float('nan')):.2e} |" for r in results]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (smoke test)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device: only --tiny runs on the CPU")
    modes = [m for m in args.modes.split(",") if m]
    if device.type == "cpu":
        modes = [m for m in modes if m != "reduce-overhead"]  # CUDA graphs
    if any(m in modes for m in COMPILED_MODES):
        warm_inductor(device)
    results = [run_model(name, modes, args.rounds, device, args.tiny)
               for name in args.models.split(",") if name]
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "results": results}
    print(json.dumps(report, indent=1))
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results) + "\n")
    return report


if __name__ == "__main__":
    main()

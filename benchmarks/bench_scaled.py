"""Scaled formats on the CPU: the time of ``lpsim.quantize(x, fmt, rule)`` for MXFP8, MXFP4 and
NVFP4 (nearest and stochastic) on float32 tensors, as a ratio to ``x.clone()`` measured alternately
in the same run, and torchao's CPU cast of the same format beside it (quantise and dequantise, as
lpsim's result is the dequantised value; timed after them, not alternated). Medians of --repeat
runs, in milliseconds. x has rows of 1024 elements, so --size is a multiple of 1024.

    python benchmarks/bench_scaled.py [--size 16777216] [--repeat 9] [--threads 2]
    python benchmarks/bench_scaled.py --device cuda [--size 268435456] [--repeat 30]

With --device cuda: the same casts on the GPU, timed with CUDA events, as GB/s (one read and one
write of the tensor) and as a share of a device-to-device copy of the same tensor (the 100%
reference) measured in the same run; lpsim writes into a preallocated tensor (out=), as the copy
does.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import replace

import torch
from bench_options import at_least
from bench_quantize import cuda_median_ms  # benchmarks/ is on sys.path as a script and in tests

import lpsim
from lpsim.scaled import preset

FORMATS = ("mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")
COLUMNS = 1024  # x has rows of COLUMNS elements (whole MX and NVFP4 blocks), so --size a multiple


def _torchao(name: str):
    """torchao's quantise-then-dequantise of the same format, or None where it does not run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.kernels import (  # noqa: PLC0415
                f4_unpacked_to_f32,
                unpack_uint4,
            )
            from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: PLC0415
            from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: PLC0415
                nvfp4_quantize,
                per_tensor_amax_to_scale,
            )
    except ImportError:
        return None
    if name == "nvfp4":

        def nvfp4(x):
            t = per_tensor_amax_to_scale(x.abs().amax())
            scale, data = nvfp4_quantize(x, 16, t)
            q = f4_unpacked_to_f32(unpack_uint4(data)).reshape(x.shape[0], -1, 16)
            return (q * (t * scale.float()).unsqueeze(-1)).reshape(x.shape)

        return nvfp4
    elem = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp4_e2m1": torch.float4_e2m1fn_x2}[name]

    def mx(x):
        code, data = to_mx(x, elem, 32)
        return to_dtype(data, code, elem, 32, torch.float32)

    return mx


def _alternating_medians(fns: dict, x: torch.Tensor, repeat: int) -> dict:
    """Median milliseconds of each function, the functions run in turn within each repetition."""
    for fn in fns.values():
        fn(x)  # warm up
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def run_gpu(size: int, repeat: int) -> list[dict]:
    """The GPU section: each format and rule against a device copy, CUDA events, medians."""
    x = torch.randn(size // COLUMNS, COLUMNS, device="cuda")
    out = torch.empty_like(x)
    bytes_moved = 2 * x.numel() * x.element_size()
    copy_ms = cuda_median_ms(lambda: out.copy_(x), repeat)
    print(f"GPU: {torch.cuda.get_device_name()}, {x.numel()} float32 elements, medians of {repeat}")
    print(f"device-to-device copy: {copy_ms:.3f} ms, {bytes_moved / copy_ms / 1e6:.0f} GB/s")
    print(f"{'format':<18} {'rule':<11} {'lpsim ms':>9} {'GB/s':>7} {'of copy':>8}")
    rows = []
    cases = [(name, preset(name)) for name in FORMATS]
    cases.append(("mxfp8_e4m3 axis 0", replace(preset("mxfp8_e4m3"), axis=0)))
    for name, fmt in cases:
        for rule in ("nearest", "stochastic"):
            ms = cuda_median_ms(
                lambda fmt=fmt, rule=rule: lpsim.quantize(x, fmt, rule, seed=1, out=out), repeat
            )
            rows.append({"format": name, "rule": rule, "lpsim_ms": ms, "of_copy": copy_ms / ms})
            print(
                f"{name:<18} {rule:<11} {ms:9.3f} {bytes_moved / ms / 1e6:7.0f} {copy_ms / ms:7.0%}"
            )
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        type=at_least(COLUMNS, multiple_of=COLUMNS),
        default=None,
        help=f"a multiple of {COLUMNS}: 2**24 on the CPU, 2**28 on CUDA",
    )
    parser.add_argument("--repeat", type=at_least(1), default=None, help="9 on the CPU, 30 on CUDA")
    parser.add_argument("--threads", type=at_least(1), default=torch.get_num_threads())
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.size is None:
        args.size = 2**28 if cuda else 2**24
    if args.repeat is None:
        args.repeat = 30 if cuda else 9
    if cuda:
        if not (torch.cuda.is_available() and lpsim.cuda_built()):
            parser.error("--device cuda: no CUDA device, or lpsim built without its CUDA kernels")
        return run_gpu(args.size, args.repeat)
    torch.set_num_threads(args.threads)
    x = torch.randn(args.size // COLUMNS, COLUMNS)
    rows = []
    print(f"{x.numel()} float32 elements, {args.threads} threads, medians of {args.repeat} (ms)")
    print(f"{'format':<12} {'rule':<11} {'lpsim':>9} {'clone':>9} {'ratio':>7} {'torchao':>9}")
    for name in FORMATS:
        fmt = preset(name)
        theirs = _torchao(name)
        for rule in ("nearest", "stochastic"):
            fns = {
                "lpsim": lambda x, fmt=fmt, rule=rule: lpsim.quantize(x, fmt, rule, seed=1),
                "clone": torch.clone,
            }
            ms = _alternating_medians(fns, x, args.repeat)
            if theirs is not None and rule == "nearest":
                # Timed on its own: alternated with lpsim and clone, its large temporaries made
                # their times 2-3x longer.
                ms.update(_alternating_medians({"torchao": theirs}, x, args.repeat))
            row = {
                "format": name,
                "rule": rule,
                "lpsim_ms": ms["lpsim"],
                "clone_ms": ms["clone"],
                "ratio": ms["lpsim"] / ms["clone"],
                "torchao_ms": ms.get("torchao"),
            }
            rows.append(row)
            ao = "" if row["torchao_ms"] is None else f"{row['torchao_ms']:9.2f}"
            print(
                f"{name:<12} {rule:<11} {row['lpsim_ms']:9.2f} {row['clone_ms']:9.2f} "
                f"{row['ratio']:6.2f}x {ao}"
            )
    return rows


if __name__ == "__main__":
    main()

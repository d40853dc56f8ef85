"""Scaled formats on the CPU: the time of ``lpsim.quantize(x, fmt, rule)`` for MXFP8, MXFP4 and
NVFP4 (nearest and stochastic) on float32 tensors, as a ratio to ``x.clone()`` measured alternately
in the same run, and torchao's CPU cast of the same format beside it (quantise and dequantise, as
lpsim's result is the dequantised value). Medians of --repeat runs, in milliseconds.

    python benchmarks/bench_scaled.py [--size 16777216] [--repeat 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import lpsim
from lpsim.scaled import preset

FORMATS = ("mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")


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


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2**24)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cols = 1024 if args.size >= 1024 else 32
    x = torch.randn(max(1, args.size // cols), cols)
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
            if theirs is not None and rule == "nearest":
                fns["torchao"] = theirs
            ms = _alternating_medians(fns, x, args.repeat)
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

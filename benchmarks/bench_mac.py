"""Throughput of lpsim.mac.matmul against torch.matmul float32, measured in the same run.

    python benchmarks/bench_mac.py [--shapes 512x512x512,2048x2048x256] [--repeat 5]
                                   [--budget 8] [--threads N] [--scalar-loop] [--quick]
                                   [--only TEXT] [--device cpu|cuda]

For each shape MxNxK (float32 operands a: M x K, b: K x N) and each MAC of ``MACS``, the table
gives GFLOP/s = 2 M N K / time (the median of --repeat calls) and the ratio to torch.matmul's
float32 GFLOP/s on the same operands (itself a median, timed in the same run). The native MAC() is
torch.matmul itself (ratio about 1.0). A tensor core's rows (lpsim.mac.PRESETS) take a and b
rounded to nearest in its operand format, and the rows that name operands (OPERANDS) in theirs.

A slow row would take minutes at the full shape, so each row first times its MAC on a few rows of
a; when the full shape would exceed --budget seconds per call, the row is timed on the first M'
rows of a instead (the "rows" column), with M' chosen to fit the budget, and fewer repetitions.
Every result of a row costs the same (K multiply-adds), so GFLOP/s on M' rows is the full shape's
to within the noise. --scalar-loop times every row with mac_matmul's lane loop and tensor-core
loop switched off (csrc/cpu/mac_lanes.h, csrc/cpu/tensor_core_loop.h; the private op
lpsim::_mac_lanes turns off both), which is the kernel before them. --quick: a smoke test's
defaults (shape 64x64x64, one repetition, --budget 0.5); --shapes, --repeat and --budget given
beside it are kept. --device cuda runs both sides on the current CUDA device (each call timed to
a synchronisation), against torch.matmul float32 with TF32 off: its SIMT kernels, the reference
the GPU target is stated against.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_options import at_least, positive_float, shapes

import lpsim
from lpsim import MAC, Float

FLOAT16 = Float(5, 10)
BFLOAT16 = Float(8, 7)
FLOAT32 = Float(8, 23)

MACS = {
    "native MAC() (torch.matmul)": MAC(),
    "sequential fp16 nearest": MAC(accumulator=FLOAT16),
    "sequential fp16 stochastic": MAC(accumulator=FLOAT16, rounding="stochastic"),
    "sequential bf16 nearest": MAC(accumulator=BFLOAT16),
    "sequential bf16 stochastic": MAC(accumulator=BFLOAT16, rounding="stochastic"),
    "sequential fp16 nearest, fp16 operands": MAC(accumulator=FLOAT16),
    "sequential bf16 nearest, bf16 operands": MAC(accumulator=BFLOAT16),
    "chunked 32 bf16 into fp32": MAC(
        accumulator=FLOAT32, order="chunked", chunk=32, chunk_accumulator=BFLOAT16
    ),
    "pairwise bf16 nearest": MAC(accumulator=BFLOAT16, order="pairwise"),
    "Kahan bf16 nearest": MAC(accumulator=BFLOAT16, compensated=True),
    **{f"tensor core {name}": mac for name, mac in lpsim.mac.PRESETS.items()},
}
# Rows whose operands are rounded to nearest in a format first (the float32 operands otherwise;
# a tensor core's rows take its own operand format): products of two such operands are exact
# float32 values, which the lane loop's float32 form sums (csrc/cpu/mac_lanes.h).
OPERANDS = {
    "sequential fp16 nearest, fp16 operands": FLOAT16,
    "sequential bf16 nearest, bf16 operands": BFLOAT16,
}


def _seconds(fn, device: str = "cpu") -> float:
    """Seconds of one call of fn, its CUDA work included on a CUDA device."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _median(fn, repeat: int, device: str = "cpu") -> float:
    return statistics.median(_seconds(fn, device) for _ in range(repeat))


def operands_of(
    label: str, mac: MAC, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b rounded to nearest in the row's operand format (OPERANDS) or a tensor core's
    (unchanged for other MACs)."""
    core = mac.tensor_core
    fmt = OPERANDS.get(label, core.operands if core is not None else None)
    if fmt is None:
        return a, b
    return lpsim.quantize(a, fmt), lpsim.quantize(b, fmt)


def selected(label: str, only: str) -> bool:
    """Whether --only (comma-separated texts, "" for all) selects the row ``label``; an empty item
    (a trailing comma) selects nothing."""
    texts = [text for text in only.split(",") if text]
    return not texts or any(text in label for text in texts)


def time_row(a, b, label: str, mac: MAC, repeat: int, budget: float) -> tuple[int, float]:
    """(rows of a timed, median seconds per call) for one MAC."""
    a, b = operands_of(label, mac, a, b)
    m, device = a.shape[0], a.device.type
    if mac.native:
        lpsim.mac.matmul(a, b, mac)
        return m, _median(lambda: lpsim.mac.matmul(a, b, mac), repeat, device)
    probe_rows = min(m, 8 if device == "cpu" else 256)
    probe = a[:probe_rows].contiguous()
    lpsim.mac.matmul(probe, b, mac, seed=1)  # a first call (CUDA: loads the kernel)
    estimate = _seconds(lambda: lpsim.mac.matmul(probe, b, mac, seed=1), device) * m / probe_rows
    rows = m
    if estimate > budget:
        rows = max(probe_rows, int(m * budget / estimate))
        repeat = 1
    elif estimate * repeat > 3 * budget:
        repeat = max(1, int(3 * budget / estimate))
    part = a[:rows].contiguous()
    return rows, _median(lambda: lpsim.mac.matmul(part, b, mac, seed=1), repeat, device)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", type=shapes, default=None, help="MxNxK,... (default 512x512x512,2048x2048x256)"
    )
    parser.add_argument("--repeat", type=at_least(1), default=None, help="default 5")
    parser.add_argument(
        "--budget", type=positive_float, default=None, help="seconds per timed call (default 8)"
    )
    parser.add_argument("--threads", type=at_least(1), default=None, help="default: torch's")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="defaults for a smoke test: shape 64x64x64, one repetition, budget 0.5",
    )
    parser.add_argument(
        "--only", default="", help="the rows whose label contains one of these texts (a,b,...)"
    )
    parser.add_argument("--scalar-loop", action="store_true", help="the lane loop switched off")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    # --quick changes the defaults only: values given are kept.
    if args.shapes is None:
        args.shapes = [(64, 64, 64)] if args.quick else [(512, 512, 512), (2048, 2048, 256)]
    if args.repeat is None:
        args.repeat = 1 if args.quick else 5
    if args.budget is None:
        args.budget = 0.5 if args.quick else 8.0
    if not any(selected(label, args.only) for label in MACS):
        parser.error(f"--only {args.only!r} matches no row; the rows: {', '.join(MACS)}")
    if args.device == "cuda" and not (torch.cuda.is_available() and lpsim.cuda_built()):
        parser.error("--device cuda: no CUDA device, or lpsim built without its CUDA kernels")
    lanes_before = torch.ops.lpsim._mac_lanes(not args.scalar_loop)
    try:
        return _run(args)
    finally:
        torch.ops.lpsim._mac_lanes(lanes_before)


def _run(args) -> list[dict]:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 SIMT reference
    repeat, budget = args.repeat, args.budget
    rows = []
    for m, n, k in args.shapes:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(m, k, generator=g).to(device)
        b = torch.randn(k, n, generator=g).to(device)
        torch.matmul(a, b)
        seconds = _median(lambda a=a, b=b: torch.matmul(a, b), max(repeat, 5), device)
        reference = 2 * m * n * k / seconds / 1e9
        for label, mac in MACS.items():
            if not selected(label, args.only):
                continue
            timed_rows, seconds = time_row(a, b, label, mac, repeat, budget)
            gflops = 2 * timed_rows * n * k / seconds / 1e9
            rows.append(
                {
                    "mac": label,
                    "shape": f"{m}x{n}x{k}",
                    "rows": timed_rows,
                    "gflops": gflops,
                    "torch_gflops": reference,
                    "ratio": gflops / reference,
                }
            )
    if device == "cuda":
        where = f"{torch.cuda.get_device_name()}, torch.matmul with TF32 off"
    else:
        loop = "scalar loop" if args.scalar_loop else "lane loop"
        where = f"threads={torch.get_num_threads()}, {loop}"
    print(
        f"{where}, float32 operands unless the row names others, median of {repeat} "
        f"(slow rows: fewer rows of a, fewer repetitions)"
    )
    print(f"{'MAC':34} {'MxNxK':>16} {'rows':>6} {'GFLOP/s':>9} {'torch':>8} {'ratio':>9}")
    for r in rows:
        print(
            f"{r['mac']:34} {r['shape']:>16} {r['rows']:>6} {r['gflops']:>9.3f} "
            f"{r['torch_gflops']:>8.1f} {r['ratio']:>9.5f}"
        )
    return rows


if __name__ == "__main__":
    main()

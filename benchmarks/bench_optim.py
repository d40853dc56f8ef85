"""The optimizer step on resnet18's parameters: torch's SGD, OptimLP around it, and FusedSGD.

    python benchmarks/bench_optim.py [--threads 1] [--repeat 7] [--format e5m10] [--quick]

torchvision's resnet18 (11.2M parameters, 62 tensors, float32) with random gradients, each
optimizer on a copy of the weights of its own, all given the same gradients in a round. Each step
is timed alternately for torch.optim.SGD (momentum 0.9, weight decay 5e-4), OptimLP wrapping the
same SGD with ``--format`` for the weight, gradient and momentum (which takes the fused step),
the same with fused=False ("batches": three rounding passes over every parameter after torch's
step), and lpsim.optim.FusedSGD with the same formats (one pass), under round to nearest and
stochastic rounding. Printed: medians of --repeat steps and each one's ratio
to torch's SGD step, measured over the same stretch of time. The block formats (block8: one
exponent per tensor, as the block8 recipe; block8-rows: one per row, as swalp) have no FusedSGD
row: FusedSGD takes element formats only, and OptimLP's fused step rounds them around its pass.

--quick: a small model and, unless --repeat is given, 2 repeats: a smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_options import at_least
from torch import nn

from lpsim import BlockFloat, Float
from lpsim.optim import FusedSGD, OptimLP

FORMATS = {
    "e5m10": Float(5, 10),
    "bf16": Float(8, 7),
    "e4m3": Float(4, 3, special="fn"),
    "block8": BlockFloat(8),
    "block8-rows": BlockFloat(8, 0),
}
SGD = dict(lr=0.01, momentum=0.9, weight_decay=5e-4)


def _model(quick: bool) -> nn.Module:
    if quick:
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10))
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def _optimizers(params, fmt: Float | BlockFloat, rounding: str) -> dict:
    """Each optimizer, on a copy of ``params`` of its own: every one steps the same initial
    weights, not the weights another one left."""

    def own() -> list[torch.Tensor]:
        return [p.detach().clone().requires_grad_() for p in params]

    formats = dict(weight=fmt, grad=fmt, momentum=fmt)
    optimizers = {
        "torch.optim.SGD": torch.optim.SGD(own(), **SGD),
        "OptimLP(SGD)": OptimLP(torch.optim.SGD(own(), **SGD), rounding=rounding, **formats),
        "OptimLP(SGD) batches": OptimLP(
            torch.optim.SGD(own(), **SGD), rounding=rounding, **formats, fused=False
        ),
    }
    if isinstance(fmt, Float):
        optimizers["FusedSGD"] = FusedSGD(
            own(), **SGD, weight_format=fmt, grad_format=fmt, state_format=fmt, rounding=rounding
        )
    return optimizers


def _params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _time(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=at_least(1), default=1)
    parser.add_argument("--repeat", type=at_least(1), default=None, help="default 7 (--quick: 2)")
    parser.add_argument("--format", choices=sorted(FORMATS), default="e5m10")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeat = args.repeat if args.repeat is not None else 2 if args.quick else 7
    fmt = FORMATS[args.format]
    rows = []
    torch.manual_seed(0)
    model = _model(args.quick)
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    print(
        f"{count / 1e6:.1f}M parameters in {len(params)} tensors, {args.format}, "
        f"{args.threads} thread(s), medians of {repeat} steps"
    )
    print(f"{'rounding':<10} {'optimizer':<22} {'ms':>9} {'ratio':>7}")
    for rounding in ("nearest", "stochastic"):
        optimizers = _optimizers(params, fmt, rounding)
        times: dict[str, list[float]] = {name: [] for name in optimizers}
        for _ in range(repeat + 1):  # the first round warms up and is dropped
            # One set of gradients per round, given to every optimizer: the rows compare steps on
            # the same data.
            grads = [torch.randn_like(p) * 1e-2 for p in params]
            for name, optimizer in optimizers.items():
                for p, grad in zip(_params(optimizer), grads):
                    p.grad = grad.clone()
                times[name].append(_time(optimizer.step))
        base = statistics.median(times["torch.optim.SGD"][1:])
        for name, measured in times.items():
            median = statistics.median(measured[1:])
            rows.append(
                dict(rounding=rounding, optimizer=name, ms=median * 1e3, ratio=median / base)
            )
            print(f"{rounding:<10} {name:<22} {median * 1e3:9.1f} {median / base:6.2f}x")
    return rows


if __name__ == "__main__":
    main()

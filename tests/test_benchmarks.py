"""The benchmark scripts run and print their tables (no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import lpsim

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _import(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run(name: str, argv: list[str]):
    """benchmarks/<name>.py's main(argv): (the module, its rows), torch's thread count restored."""
    module = _import(name)
    threads = torch.get_num_threads()
    try:
        return module, module.main(argv)
    finally:
        torch.set_num_threads(threads)


def test_overhead_benchmark_prints_a_row_per_op_and_reference(capsys):
    _, rows = _run("bench_overhead", ["--quick", "--sizes", "64,128", "--repeat", "1"])
    ops = [
        "quantize nearest",
        "quantize stochastic",
        "quantize_ nearest",
        "Quantizer forward+backward",
        "x * 1.0 forward+backward",
        "sr_add_ bfloat16",
        "injected Linear forward",
        "plain Linear forward",
    ]
    assert [(r["op"], r["size"]) for r in rows] == [(op, s) for s in (64, 128) for op in ops]
    assert all(r["us"] > 0 and r["bf16"] > 0 and r["clone"] > 0 for r in rows)
    lines = capsys.readouterr().out.splitlines()
    for label in [*ops, "x.to(torch.bfloat16)", "x.clone()"]:
        assert sum(line.startswith(label + " ") for line in lines) == 1, label
    assert "64 us" in lines[1] and "128 us" in lines[1]


def test_fusable_benchmark_times_every_case_against_the_producer_alone(capsys):
    _, rows = _run("bench_fusable", ["--sizes", "256", "--repeat", "1"])
    assert [r["case"] for r in rows][0] == "x * 2 + 1 compiled alone"
    assert len(rows) == 5 and rows[0]["ratio"] == 1.0
    assert all(r["ms"] > 0 and r["size"] == 256 for r in rows)
    assert "fusable quantize, compiled" in capsys.readouterr().out


def test_scaled_benchmark_times_each_format_and_rule_against_clone(capsys):
    _, rows = _run("bench_scaled", ["--size", "4096", "--repeat", "1"])
    assert [(r["format"], r["rule"]) for r in rows] == [
        (name, rule)
        for name in ("mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")
        for rule in ("nearest", "stochastic")
    ]
    assert all(r["lpsim_ms"] > 0 and r["clone_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert all((r["torchao_ms"] is not None) == (r["rule"] == "nearest") for r in rows)
    assert "torchao" in capsys.readouterr().out


def test_statistics_benchmark_prints_a_row_per_format_and_rule(capsys):
    bench_statistics, rows = _run("bench_statistics", ["--quick"])
    assert [(r["format"], r["rule"]) for r in rows] == [
        (f, r) for f in bench_statistics.FORMATS for r in bench_statistics.RULES
    ]
    assert all(r["quantize_ms"] > 0 and r["with_statistics_ms"] > 0 for r in rows)
    assert "median overhead of the statistics" in capsys.readouterr().out


def test_mac_benchmark_prints_a_row_per_mac_against_torch_matmul(capsys):
    bench_mac, rows = _run("bench_mac", ["--quick"])
    assert [r["mac"] for r in rows] == list(bench_mac.MACS)
    assert all(r["gflops"] > 0 and r["torch_gflops"] > 0 and r["ratio"] > 0 for r in rows)
    assert all(r["rows"] == 64 and r["shape"] == "64x64x64" for r in rows)
    assert "lane loop" in capsys.readouterr().out


def test_optimizer_benchmark_times_each_optimizer_against_torchs_sgd(capsys):
    _, rows = _run("bench_optim", ["--quick"])
    names = ["torch.optim.SGD", "OptimLP(SGD)", "OptimLP(SGD) batches", "FusedSGD"]
    assert [(r["rounding"], r["optimizer"]) for r in rows] == [
        (rule, name) for rule in ("nearest", "stochastic") for name in names
    ]
    assert all(r["ms"] > 0 for r in rows)
    assert [r["ratio"] for r in rows if r["optimizer"] == "torch.optim.SGD"] == [1.0, 1.0]
    assert "FusedSGD" in capsys.readouterr().out


# Option values: a bad one is refused naming the option, never replaced by a default or ignored.
REFUSED = [
    ("bench_quantize", ["--size", "4096", "--repeat", "1", "--threads", "0"], "--threads"),
    ("bench_quantize", ["--size", "1000", "--repeat", "1"], "--size"),
    ("bench_overhead", ["--quick", "--sizes", "64", "--repeat", "0"], "--repeat"),
    ("bench_overhead", ["--quick", "--sizes", "64", "--batch-ms", "0"], "--batch-ms"),
    ("bench_scaled", ["--size", "1024", "--repeat", "1", "--threads", "0"], "--threads"),
    ("bench_scaled", ["--size", "1500", "--repeat", "1"], "--size"),
    ("bench_mac", ["--quick", "--only", "no such row"], "--only"),
    ("bench_mac", ["--quick", "--threads", "0"], "--threads"),
    ("bench_mac", ["--quick", "--shapes", "64x64"], "--shapes"),
    ("bench_optim", ["--quick", "--repeat", "0"], "--repeat"),
    ("bench_fusable", ["--sizes", "256", "--repeat", "0"], "--repeat"),
    ("bench_statistics", ["--quick", "--threads", "0"], "--threads"),
    ("formats_survey", ["--size", "64", "--formats", "e5m2,no such format"], "--formats"),
    (
        "bench_training",
        ["--width", "0", "--models", "vgg7", "--recipes", "wage", "--device", "cpu"]
        + ["--batch-sizes", "1", "--repeat", "1", "--warmup", "1", "--no-compile"],
        "--width",
    ),
]


@pytest.mark.parametrize(("name", "argv", "option"), REFUSED)
def test_a_bad_option_value_is_refused_naming_the_option(capsys, name, argv, option):
    with pytest.raises(SystemExit) as refused:
        _run(name, argv)
    assert refused.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.skipif(
    torch.cuda.is_available() and lpsim.cuda_built(), reason="refused only without CUDA"
)
@pytest.mark.parametrize("name", ["bench_statistics", "bench_scaled", "bench_mac"])
def test_a_cuda_section_without_cuda_is_refused_not_skipped(capsys, name):
    with pytest.raises(SystemExit) as refused:
        _run(name, ["--device", "cuda", "--repeat", "1"])
    assert refused.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


@pytest.mark.skipif(
    torch.cuda.is_available() and lpsim.cuda_built(), reason="refused only without CUDA"
)
def test_quantize_benchmark_refuses_no_cpu_without_cuda(capsys):
    with pytest.raises(SystemExit) as refused:
        _run("bench_quantize", ["--no-cpu", "--gpu-repeat", "1"])
    assert refused.value.code == 2
    assert "--no-cpu" in capsys.readouterr().err


def test_mac_benchmark_only_with_a_trailing_comma_selects_the_rows_named():
    _, rows = _run("bench_mac", ["--quick", "--shapes", "8x8x8", "--only", "native,"])
    assert [r["mac"] for r in rows] == ["native MAC() (torch.matmul)"]


def test_quick_mac_benchmark_keeps_the_shapes_and_repeat_given(capsys):
    _, rows = _run(
        "bench_mac", ["--quick", "--shapes", "8x8x8,4x8x16", "--repeat", "2", "--only", "native"]
    )
    assert [(r["mac"], r["shape"]) for r in rows] == [
        ("native MAC() (torch.matmul)", "8x8x8"),
        ("native MAC() (torch.matmul)", "4x8x16"),
    ]
    assert "median of 2" in capsys.readouterr().out


def test_quick_statistics_benchmark_keeps_the_size_and_repeat_given(capsys):
    _run("bench_statistics", ["--quick", "--size", "100", "--repeat", "2"])
    out = capsys.readouterr().out
    assert "100 float32 elements on cpu" in out and "medians of 2" in out


def test_overhead_benchmark_times_every_op_on_the_references_x_unchanged():
    bench_overhead = _import("bench_overhead")
    seen = []

    class QTorch:  # records the tensor that QPyTorch's row is timed on
        @staticmethod
        def float_quantize(x, exp, man, rounding):
            seen.append(x.clone())
            return x

    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    found = bench_overhead.cases(x, QTorch)
    for _, call in found:
        call()
    assert found[-1][0] == "qtorch float_quantize nearest" and len(seen) == 1
    assert torch.equal(seen[0], before) and torch.equal(x, before)


def test_formats_survey_selects_a_format_whose_name_holds_a_comma(capsys):
    survey = _import("formats_survey")
    survey.main(["--size", "64", "--formats", "e5m2,fixed<8,5>"])
    lines = capsys.readouterr().out.splitlines()
    rules = len(lpsim.Rounding)
    assert sum(line.startswith("fixed<8,5> ") for line in lines) == rules
    assert sum(line.startswith("e5m2 ") for line in lines) == rules


def test_statistics_benchmark_alternates_its_pairs_on_cuda_too(monkeypatch):
    bench_statistics = _import("bench_statistics")

    class Event:  # CUDA events without a device: every run takes 1 ms
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    times = bench_statistics.timed(
        lambda: calls.append("fn"), lambda: calls.append("reference"), 4, "cuda"
    )
    assert times == (1.0, 1.0)
    assert calls[-8:] == ["fn", "reference"] * 4


def test_training_benchmark_times_float32_and_the_recipe_on_the_same_inputs():
    bench_training = _import("bench_training")
    args = bench_training.parse(["--width", "0.125", "--no-compile", "--device", "cpu"])
    args.batch_size, args.compiled = 2, False
    cpu = torch.device("cpu")
    for recipe in ("fp16", "wage"):
        model = "vgg7" if recipe == "wage" else "vgg16"
        base = bench_training.Step(model, recipe, args, cpu, float32=True)
        step = bench_training.Step(model, recipe, args, cpu)
        assert torch.equal(base.x, step.x) and torch.equal(base.y, step.y)


def test_optimizer_benchmark_gives_each_optimizer_its_own_weights_and_the_same_gradients(
    monkeypatch,
):
    bench_optim = _import("bench_optim")
    seen = []  # (gradients, the parameters' ids) of every timed step
    timed = bench_optim._time

    def recording(step):
        optimizer = step.__self__
        params = [p for group in optimizer.param_groups for p in group["params"]]
        seen.append(([p.grad.clone() for p in params], {id(p) for p in params}))
        return timed(step)

    monkeypatch.setattr(bench_optim, "_time", recording)
    bench_optim.main(["--quick", "--repeat", "1"])
    per_round = 4  # torch's SGD, OptimLP, OptimLP's batches, FusedSGD
    assert len(seen) % per_round == 0 and len(seen) >= 2 * per_round
    for start in range(0, len(seen), per_round):
        rounds = seen[start : start + per_round]
        first = rounds[0][0]
        for grads, _ in rounds[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, grads))
        ids = [i for _, params in rounds for i in params]
        assert len(ids) == len(set(ids))  # no tensor stepped by two optimizers

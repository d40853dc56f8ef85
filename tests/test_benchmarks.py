"""The benchmark scripts run and print their tables (no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _import(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_overhead_benchmark_prints_a_row_per_op_and_reference(capsys):
    bench_overhead = _import("bench_overhead")
    threads = torch.get_num_threads()
    try:
        rows = bench_overhead.main(["--quick", "--sizes", "64,128", "--repeat", "1"])
    finally:
        torch.set_num_threads(threads)
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
    bench_fusable = _import("bench_fusable")
    threads = torch.get_num_threads()
    try:
        rows = bench_fusable.main(["--sizes", "256", "--repeat", "1"])
    finally:
        torch.set_num_threads(threads)
    assert [r["case"] for r in rows][0] == "x * 2 + 1 compiled alone"
    assert len(rows) == 5 and rows[0]["ratio"] == 1.0
    assert all(r["ms"] > 0 and r["size"] == 256 for r in rows)
    assert "fusable quantize, compiled" in capsys.readouterr().out


def test_scaled_benchmark_times_each_format_and_rule_against_clone(capsys):
    bench_scaled = _import("bench_scaled")
    threads = torch.get_num_threads()
    try:
        rows = bench_scaled.main(["--size", "4096", "--repeat", "1"])
    finally:
        torch.set_num_threads(threads)
    assert [(r["format"], r["rule"]) for r in rows] == [
        (name, rule)
        for name in ("mxfp8_e4m3", "mxfp4_e2m1", "nvfp4")
        for rule in ("nearest", "stochastic")
    ]
    assert all(r["lpsim_ms"] > 0 and r["clone_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert all((r["torchao_ms"] is not None) == (r["rule"] == "nearest") for r in rows)
    assert "torchao" in capsys.readouterr().out


def test_statistics_benchmark_prints_a_row_per_format_and_rule(capsys):
    bench_statistics = _import("bench_statistics")
    rows = bench_statistics.main(["--quick"])
    assert [(r["format"], r["rule"]) for r in rows] == [
        (f, r) for f in bench_statistics.FORMATS for r in bench_statistics.RULES
    ]
    assert all(r["quantize_ms"] > 0 and r["with_statistics_ms"] > 0 for r in rows)
    assert "median overhead of the statistics" in capsys.readouterr().out


def test_mac_benchmark_prints_a_row_per_mac_against_torch_matmul(capsys):
    bench_mac = _import("bench_mac")
    threads = torch.get_num_threads()
    try:
        rows = bench_mac.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    assert [r["mac"] for r in rows] == list(bench_mac.MACS)
    assert all(r["gflops"] > 0 and r["torch_gflops"] > 0 and r["ratio"] > 0 for r in rows)
    assert all(r["rows"] == 64 and r["shape"] == "64x64x64" for r in rows)
    assert "lane loop" in capsys.readouterr().out


def test_optimizer_benchmark_times_each_optimizer_against_torchs_sgd(capsys):
    bench_optim = _import("bench_optim")
    threads = torch.get_num_threads()
    try:
        rows = bench_optim.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    names = ["torch.optim.SGD", "OptimLP(SGD)", "FusedSGD"]
    assert [(r["rounding"], r["optimizer"]) for r in rows] == [
        (rule, name) for rule in ("nearest", "stochastic") for name in names
    ]
    assert all(r["ms"] > 0 for r in rows)
    assert [r["ratio"] for r in rows if r["optimizer"] == "torch.optim.SGD"] == [1.0, 1.0]
    assert "FusedSGD" in capsys.readouterr().out

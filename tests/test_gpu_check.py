"""tools/gpu_check.py (make gpu-check) in the form CI runs it: without a GPU it reports the
machine, the test dependencies and that the GPU parts were skipped, and exits 0. The GPU form
runs on a GPU machine only."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import gpu_check  # noqa: E402
import torch_cuda_arithmetic  # noqa: E402

sys.path.remove(str(TOOLS))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU form runs the whole check")
def test_without_a_gpu_the_check_reports_the_gpu_parts_skipped(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# lpsim GPU check")
    assert f"torch {torch.__version__}" in report
    assert "## Test dependencies" in report
    assert "the CUDA build, the GPU tests and the GPU benchmarks were skipped" in report
    assert {p.name for p in tmp_path.iterdir()} == {
        "report.md",
        "build.log",
        "tests.log",
        "bench.log",
    }


def test_pytest_summary_is_the_last_summary_line():
    text = "x\n==== 2 failed, 10 passed, 3 skipped in 4.20s ====\n"
    assert gpu_check._pytest_summary(text) == "2 failed, 10 passed, 3 skipped in 4.20s"
    assert gpu_check._pytest_summary("5 passed in 0.1s\n") == "5 passed in 0.1s"
    assert gpu_check._pytest_summary("nothing") == "no summary (see tests.log)"


def test_the_cuda_arithmetic_probe_without_a_gpu_compares_nothing(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: make gpu-check runs the probe")
    assert torch_cuda_arithmetic.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_an_unknown_step_is_refused_with_the_steps_named(capsys, tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--steps", "build,lint"])
    assert "build,tests,probe,bench" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU form runs the steps")
def test_some_steps_without_a_gpu_are_skipped_too(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--steps", "build,bench"]) == 0
    assert "skipped" in (tmp_path / "report.md").read_text()


def test_an_unknown_benchmark_is_refused_with_the_benchmarks_named(capsys, tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--benchmarks", "scaled,gemm"])
    assert "quantize,scaled,statistics,training,mac" in capsys.readouterr().err


def test_every_benchmark_has_a_title_a_share_and_a_script_that_exists():
    for quick in (False, True):
        commands = gpu_check.benchmark_commands(quick)
        assert [name for name, _ in commands] == list(gpu_check.SHARES)
        for _, command in commands:
            assert (gpu_check.ROOT / command[0]).is_file()
    assert set(gpu_check.BENCHMARK_TITLES) == set(gpu_check.SHARES)

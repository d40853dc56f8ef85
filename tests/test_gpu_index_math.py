"""The CUDA kernels' index arithmetic (csrc/cuda/pieces.h: division by invariant integers, and the
element -> shared-exponent block mapping of every block layout; lpsim/philox.h: the Philox counter
-> element mapping of the one-thread-per-counter kernels) is plain host code: compiled here with
the system C++ compiler and checked against 64-bit division and the CPU's element -> counter
mapping, so it is proved without a GPU."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_divider_and_block_pieces_match_plain_division(tmp_path):
    binary = tmp_path / "pieces_check"
    subprocess.run(
        [
            CXX,
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Werror",
            f"-I{ROOT / 'csrc' / 'include'}",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "tests" / "cpp" / "pieces_check.cpp"),
            "-o",
            str(binary),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout
    assert run.stdout.strip() == "0 failures"

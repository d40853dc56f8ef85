"""The CUDA kernels' index arithmetic (csrc/cuda/pieces.h: division by invariant integers, and the
element -> shared-exponent block mapping of every block layout; lpsim/philox.h: the Philox counter
-> element mapping of the one-thread-per-counter kernels) is plain host code: compiled here with
the system C++ compiler and checked against 64-bit division and the CPU's element -> counter
mapping, so it is proved without a GPU."""

from __future__ import annotations

import subprocess

import pytest
from support import CXX, build_cpp_check


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_divider_and_block_pieces_match_plain_division(tmp_path):
    binary = build_cpp_check("pieces_check", tmp_path, ("-std=c++17", "-O1"))
    run = subprocess.run([binary], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout
    assert run.stdout.strip() == "0 failures"

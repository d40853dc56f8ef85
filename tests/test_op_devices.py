"""docs/performance.md's table of the ops that have CUDA kernels against the build: it lists every
public op of the lpsim library once, and where lpsim is built with its CUDA kernels (as in CI), an
op has a CUDA kernel exactly when the table says so."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import lpsim

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "performance.md"


def documented() -> dict[str, bool]:
    """op name -> whether the table says it has a CUDA kernel."""
    text = DOC.read_text()
    table = text[text.index("| op | CUDA kernel |") :].split("\n\n")[0]
    claims = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            assert name not in claims, f"{name} listed twice"
            claims[name] = cells[1] == "yes"
    return claims


def defined() -> set[str]:
    """The public ops of the lpsim library (the private ones start with an underscore)."""
    return {
        name.split("::")[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("lpsim::") and not name.split("::")[1].startswith("_")
    }


def test_the_table_lists_every_public_op_once():
    assert set(documented()) == defined()


@pytest.mark.skipif(not lpsim.cuda_built(), reason="lpsim was built without its CUDA kernels")
def test_the_ops_with_cuda_kernels_are_those_the_table_names():
    for name, has_kernel in documented().items():
        registered = torch._C._dispatch_has_kernel_for_dispatch_key(f"lpsim::{name}", "CUDA")
        assert registered == has_kernel, name

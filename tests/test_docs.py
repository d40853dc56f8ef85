"""The examples in the README, the docs and the docstrings run and print what they claim."""

import doctest
import pathlib

import pytest

import lpsim
import lpsim.formats
import lpsim.functional
import lpsim.rounding
import lpsim.transforms

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_document_examples_run(path):
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} example(s) failed in {path.name}"


@pytest.mark.parametrize(
    "module",
    [lpsim, lpsim.formats, lpsim.functional, lpsim.rounding, lpsim.transforms],
    ids=lambda m: m.__name__,
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0

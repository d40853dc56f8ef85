"""The examples in the README, the docs and the docstrings run and print what they claim."""

import doctest
import pathlib

import pytest
import torch

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


def test_fixed_word_and_fraction_lengths_are_those_a_float64_container_holds():
    # docs/formats.md, Fixed's table: wl 2 to 54 signed, 1 to 53 unsigned; fl such that the
    # spacing is at least 2**-1074 and the largest magnitude below 2**1024. Wider formats are
    # refused when made, with a ValueError that names wl's range or says what does not fit.
    from lpsim import Fixed

    assert Fixed(54, 0).max == 2.0**53 - 1
    assert Fixed(53, 0, signed=False).max == 2.0**53 - 1
    assert Fixed(2, 1074).smallest_subnormal == 2.0**-1074
    assert Fixed(2, -1022).max == 2.0**1022
    for make in (lambda: Fixed(55, 0), lambda: Fixed(64, 0, clamp=False)):
        with pytest.raises(ValueError, match=r"Fixed\.wl must be in \[2, 54\]"):
            make()
    with pytest.raises(ValueError, match=r"Fixed\.wl must be in \[1, 53\]"):
        Fixed(54, 0, signed=False)
    for make in (lambda: Fixed(2, 1075), lambda: Fixed(2, -1023)):
        with pytest.raises(ValueError, match="does not fit even a float64 container"):
            make()


def _text_block_after(path: pathlib.Path, marker: str) -> list[str]:
    """The lines of the first ```text block after ``marker`` in the document."""
    text = path.read_text()
    start = text.index("```text\n", text.index(marker)) + len("```text\n")
    return text[start : text.index("```", start)].splitlines()


def test_the_recorder_table_in_training_md_is_what_its_example_prints():
    # docs/training.md shows part of recorder.table() for its Recorder example (IBM8, 3 steps);
    # every line it shows must be a line of the table that example prints, the stagnation of
    # 2.weight included (updated 132, lost 35: the accumulator's rounding).
    from torch import nn

    from lpsim import recipes
    from lpsim.diagnostics import Recorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = recipes.IBM8.apply(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    with Recorder(model, opt) as recorder:
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(16, 4)).square().mean()
            (loss * recipes.IBM8.loss_scale).backward()
            opt.step()
    printed = recorder.table().splitlines()
    shown = _text_block_after(ROOT / "docs" / "training.md", "for the run above, in part:")
    missing = [line for line in shown if line not in ("...", "") and line not in printed]
    assert not missing, f"lines of the doc's table that the example does not print: {missing}"

"""The examples in the README, the docs and the docstrings run and print what they claim."""

import doctest
import pathlib
import re

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


def _table_rows(path: pathlib.Path, heading: str) -> list[list[str]]:
    """The cells of the body rows of the first table after ``heading`` in the document."""
    lines = path.read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _public_callables_with_a_default_rounding():
    """(qualified name, object, {parameter: default}) of every public function and class of lpsim,
    and every public method of those classes, with a parameter named ``rounding`` or ending in
    ``_rounding`` that has a default. lpsim.reference (the tests' oracle) and lpsim.fusable (what
    quantize runs under torch.compile) are not entry points."""
    import importlib
    import inspect
    import pkgutil

    found, seen = [], set()
    for info in pkgutil.walk_packages(lpsim.__path__, "lpsim."):
        if "._" in info.name or info.name in ("lpsim.reference", "lpsim.fusable"):
            continue
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            members = [(f"{info.name}.{name}", obj)]
            if inspect.isclass(obj):
                members += [
                    (f"{info.name}.{name}.{k}", v)
                    for k, v in vars(obj).items()
                    if inspect.isfunction(v) and not k.startswith("_")
                ]
            for qualified, member in members:
                if id(member) in seen or not callable(member):
                    continue
                try:
                    parameters = inspect.signature(member).parameters
                except (TypeError, ValueError):
                    continue
                defaults = {
                    p: v.default
                    for p, v in parameters.items()
                    if (p == "rounding" or p.endswith("_rounding"))
                    and v.default is not inspect.Parameter.empty
                }
                if defaults:
                    seen.add(id(member))
                    found.append((qualified, member, defaults))
    return found


def _resolve(dotted: str):
    """The object a dotted name gives as attributes from lpsim down (lpsim.nn.quantizer is the
    function lpsim.nn exports, not the module of that name), importing a module only where no
    attribute has the name."""
    import importlib

    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        obj = (
            getattr(obj, part)
            if hasattr(obj, part)
            else importlib.import_module(".".join(parts[:i]))
        )
    return obj


def test_rounding_md_default_table_gives_every_entry_point_its_default_rounding():
    # docs/rounding.md: "Every entry point takes rounding= ... Without rounding= it uses:" and a
    # table. Every public function, class or method with a defaulted rounding parameter must be
    # named in it (a bare name continues the module of the dotted name before it in the row;
    # ``x(_)`` names x and x_; ``*_quantize`` every public name ending so), and the first rule
    # its row gives must be that default (eval_rounding's default, where there is one, in the
    # row too).
    import fnmatch

    rules = {rule.name for rule in lpsim.Rounding}
    named = {}  # id(object) -> (row's first rule, the rules of the row)
    for first, second in _table_rows(ROOT / "docs" / "rounding.md", "## Default rounding"):
        row_rules = [t for t in second.split("`")[1::2] if t in rules]
        home = "lpsim"
        for token in first.split("`")[1::2]:
            if not re.fullmatch(r"[\w*.]+(\(_\))?", token):  # code, not a name: scaler(x)
                continue
            names = [token[:-3], token[:-3] + "_"] if token.endswith("(_)") else [token]
            for name in names:
                if "." in name:
                    home = name.rsplit(".", 1)[0]
                    dotted = name
                else:
                    dotted = f"{home}.{name}"
                if "*" in name:
                    module = _resolve(home)
                    targets = [getattr(module, n) for n in fnmatch.filter(module.__all__, name)]
                else:
                    targets = [_resolve(dotted)]
                    if not callable(targets[0]):  # a module: its bare names follow
                        home = dotted
                for target in targets:
                    named[id(target)] = row_rules
    missing, wrong = [], []
    for qualified, obj, defaults in _public_callables_with_a_default_rounding():
        if id(obj) not in named:
            missing.append(qualified)
            continue
        row_rules = named[id(obj)]
        for parameter, default in defaults.items():
            default = getattr(default, "name", default)
            if parameter == "eval_rounding":
                if default is not None and default not in row_rules:
                    wrong.append(f"{qualified}: {parameter}={default!r}, the row gives {row_rules}")
            elif not row_rules or row_rules[0] != default:
                wrong.append(f"{qualified}: {parameter}={default!r}, the row gives {row_rules}")
    assert not missing, f"entry points missing from the table: {missing}"
    assert not wrong, wrong

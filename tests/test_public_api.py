"""The public surface: one module per feature, every public name documented, no module reaching
into another's private names, keyword-only random arguments, and DyadicTensor as a value."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest
import torch
from torch import nn

import lpsim
import lpsim.compat.stochastorch
from lpsim import Float, dyadic
from lpsim.dyadic import DyadicTensor

PACKAGE = pathlib.Path(lpsim.__file__).resolve().parent
PUBLIC_MODULES = [
    "lpsim",
    "lpsim.update",
    "lpsim.accumulate",
    "lpsim.mac",
    "lpsim.formats",
    "lpsim.rounding",
    "lpsim.functional",
    "lpsim.recipes",
    "lpsim.transforms",
    "lpsim.statistics",
    "lpsim.diagnostics",
    "lpsim.diagnostics.shadow",
    "lpsim.diagnostics.recorder",
    "lpsim.nn",
    "lpsim.nn.functional",
    "lpsim.optim",
    "lpsim.dyadic",
    "lpsim.dyadic.functional",
    "lpsim.dyadic.nn",
    "lpsim.dyadic.optim",
    "lpsim.compat",
    "lpsim.compat.qtorch",
    "lpsim.compat.stochastorch",
]


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring(module_name):
    module = importlib.import_module(module_name)
    undocumented = []
    for name in module.__all__:
        obj = getattr(module, name)
        if not (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj)):
            continue  # constants (PRESETS, RECIPES, DEFAULT, ...) are described where defined
        if not (inspect.getdoc(obj) or "").strip():
            undocumented.append(name)
    assert not undocumented, f"{module_name}: no docstring for {undocumented}"


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return (
        path.with_suffix(".py").exists()
        or (path / "__init__.py").exists()
        or any(path.parent.glob(path.name + ".*.so"))
    )


def _private_imports(path: pathlib.Path) -> list[str]:
    """`from lpsim.x import _y` and `lpsim.x._y` / `alias._y` where _y is no module."""
    tree = ast.parse(path.read_text())
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lpsim"):
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if _is_module(dotted):
                    aliases[alias.asname or alias.name] = dotted
                elif alias.name.startswith("_"):
                    found.append(
                        f"{path.name}:{node.lineno} from {node.module} import {alias.name}"
                    )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lpsim"):
                    key = alias.asname or alias.name.split(".")[0]
                    aliases[key] = alias.name if alias.asname else key
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            continue
        parts, base = [], node.value
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            owner = ".".join([aliases[base.id], *reversed(parts)])
            if _is_module(owner) and not _is_module(f"{owner}.{node.attr}"):
                found.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
    return found


def test_no_module_imports_another_modules_underscore_names():
    roots = [
        PACKAGE,
        PACKAGE.parent / "tests",
        PACKAGE.parent / "experiments",
        PACKAGE.parent / "benchmarks",
    ]
    found = [
        hit
        for root in roots
        if root.exists()
        for path in sorted(root.rglob("*.py"))
        for hit in _private_imports(path)
    ]
    assert not found, found


def test_the_private_name_scan_sees_both_spellings(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from lpsim.functional import _block_dim\n"
        "import lpsim.dyadic.functional as F\nF._add\n"
        "from lpsim import _checks\n_checks.check_int\n"
    )
    assert len(_private_imports(source)) == 2


def test_each_feature_has_one_module_named_by_its_word():
    assert lpsim.update.sr_add is lpsim.sr_add
    assert {"sum", "cumsum", "matvec", "matmul"} <= set(lpsim.accumulate.__all__)
    assert callable(lpsim.quantize)  # no lpsim/quantize.py shadows the function
    assert not (PACKAGE / "quantize.py").exists()
    for gone in ("ops", "arithmetic", "StochasticAdder"):
        assert not hasattr(lpsim, gone), gone
    assert "stochastorch" in lpsim.compat.__all__
    assert lpsim.compat.stochastorch.StochasticAdder.__module__ == "lpsim.compat.stochastorch"


RANDOM_ENTRY_POINTS = [
    lpsim.quantize,
    lpsim.quantize_,
    lpsim.quantize_many_,
    lpsim.sr_add,
    lpsim.sr_add_,
    lpsim.sr_addcmul,
    lpsim.sr_addcmul_,
    lpsim.sr_addcdiv,
    lpsim.sr_addcdiv_,
    lpsim.accumulate.sum,
    lpsim.accumulate.cumsum,
    lpsim.accumulate.matvec,
    lpsim.accumulate.matmul,
    lpsim.optim.SGD,
    lpsim.optim.AdamW,
    dyadic.from_float,
    dyadic.requantize,
    dyadic.align,
    dyadic.add,
    dyadic.sub,
    dyadic.mul,
    dyadic.div,
    dyadic.saturating_add,
    dyadic.saturating_sub,
]


# lpsim.compat.stochastorch.StochasticAdder is absent: it keeps StochasTorch's signature,
# StochasticAdder(float_type, seed=None), whose seed is positional (tests/test_sr_add.py).
def _keyword_only(function) -> set[str]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


# docs/rounding.md, "Default rounding of each entry point": these take keyword-only rbits=, seed=
# and offset=; the optimizers rbits= and seed= only; the QPyTorch names seed= only.
@pytest.mark.parametrize("function", RANDOM_ENTRY_POINTS, ids=lambda f: f.__qualname__)
def test_rbits_seed_and_offset_are_keyword_only(function):
    parameters = inspect.signature(function).parameters
    for name in ("rbits", "seed", "offset"):
        if name in parameters:
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    if function in (lpsim.optim.SGD, lpsim.optim.AdamW):
        assert {"rbits", "seed"} <= _keyword_only(function) and "offset" not in parameters
    else:
        assert {"rbits", "seed", "offset"} <= _keyword_only(function)


def test_the_qpytorch_names_take_a_keyword_only_seed_alone():
    for function in (lpsim.float_quantize, lpsim.fixed_point_quantize, lpsim.block_quantize):
        assert _keyword_only(function) == {"seed"}, function.__qualname__


def test_positional_seed_is_refused():
    with pytest.raises(TypeError):
        lpsim.sr_add(torch.ones(2), 1e-3, None, "stochastic", 8, 0)


def test_dyadic_tensor_is_a_value_without_rounding_arithmetic():
    x = DyadicTensor(torch.tensor([3, -5], dtype=torch.int32), scale=2)
    for name in (
        "add",
        "sub",
        "mul",
        "div",
        "align",
        "requantize",
        "from_float",
        "__add__",
        "__sub__",
        "__mul__",
    ):
        assert not hasattr(x, name), name
    with pytest.raises(TypeError):
        x + x  # noqa: B018
    tree = ast.parse((PACKAGE / "dyadic" / "tensor.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not any(name and name.startswith("lpsim") for name in imported)  # no import cycle


def test_saturating_dyadic_functions_count_what_the_checked_ones_report():
    big = DyadicTensor(torch.tensor([2**31 - 1, 5], dtype=torch.int32))
    one = DyadicTensor(torch.tensor([1, 1], dtype=torch.int32))
    value, overflows = dyadic.saturating_add(big, one)
    assert overflows == 1 and value.mantissa.tolist() == [2**31 - 1, 6]
    with pytest.raises(OverflowError):
        dyadic.add(big, one)
    a = DyadicTensor(torch.full((1, 4), 2**20, dtype=torch.int32))
    product, overflows = dyadic.saturating_matmul(a, a.t(), accumulator_bits=32)
    assert overflows == 1 and product.mantissa.item() == 2**31 - 1
    total, overflows = dyadic.saturating_sum(a, 1, accumulator_bits=16)
    assert overflows == 1 and total.mantissa.tolist() == [2**15 - 1]


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_recipe_apply_takes_a_placement_and_rounds_every_parameter_with_all():
    recipe = lpsim.recipes.Recipe(
        "probe", weight=(Float(5, 2), "nearest"), activation=(Float(5, 2), "nearest")
    )
    model = _mlp()
    layers = {nn.ReLU: lpsim.nn.LayerQuantization(output=recipe.activation)}
    model, optimizer = recipe.apply(
        model, torch.optim.SGD(model.parameters(), lr=0.1), layers=layers, parameters="all"
    )
    assert [type(m) for _, m, _ in lpsim.nn.injected(model)] == [nn.ReLU, nn.ReLU]
    assert all(optimizer.parameter_settings(p) is not None for p in model.parameters())
    with pytest.raises(ValueError, match="matches no module"):
        recipe.apply(
            _mlp(),
            torch.optim.SGD(_mlp().parameters(), lr=0.1),
            layers={nn.Conv2d: lpsim.nn.LayerQuantization(output=recipe.activation)},
        )
    with pytest.raises(ValueError, match="parameters must be 'quantized' or 'all'"):
        recipe.apply(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1), parameters="some")


def test_recipe_apply_rounds_only_the_quantized_parameters_by_default():
    model = _mlp()
    model, optimizer = lpsim.recipes.IBM8.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    edges = {id(p) for name in ("0", "4") for p in model.get_submodule(name).parameters()}
    for p in model.parameters():
        assert (optimizer.parameter_settings(p) is None) == (id(p) in edges)


def test_round_weights_sets_the_weights_step_would_set_from_the_accumulators():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    acc, weight = Float(6, 9), Float(5, 2)
    optimizer = lpsim.optim.OptimLP(
        torch.optim.SGD(model.parameters(), lr=0.1),
        weight=(weight, "nearest"),
        acc=(acc, "stochastic"),
    )
    accumulators = {p: optimizer.accumulators[p].clone() for p in model.parameters()}
    optimizer.round_weights()
    for p in model.parameters():
        assert torch.equal(optimizer.accumulators[p], accumulators[p])  # unchanged
        assert torch.equal(p.detach(), lpsim.quantize(accumulators[p], weight, "nearest"))


def _public_functions(module_name: str):
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attribute, value in vars(obj).items():
                if inspect.isfunction(value) and (attribute == "__init__" or attribute[0] != "_"):
                    yield f"{name}.{attribute}", value


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_function_is_annotated(module_name):
    # Every parameter and return value (constructors return None and need not say so).
    missing = []
    for name, function in _public_functions(module_name):
        signature = inspect.signature(function)
        for p in signature.parameters.values():
            if p.name in ("self", "cls") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.annotation is inspect.Parameter.empty:
                missing.append(f"{name}({p.name})")
        if signature.return_annotation is inspect.Signature.empty and not name.endswith("__init__"):
            missing.append(f"{name} -> ?")
    assert not missing, f"{module_name}: not annotated: {missing}"


def test_recipe_mac_simulates_the_products_of_the_weight_layers_it_reaches():
    mac = lpsim.MAC(accumulator=Float(8, 7))
    for keep_edges, simulated in ((False, ["0", "2", "4"]), (True, ["2"])):
        recipe = lpsim.recipes.Recipe("probe", mac=mac, keep_edges=keep_edges)
        assert recipe.quantises
        model, _ = recipe.apply(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1))
        injected = {name: getattr(m, "_lpsim_injection", {}) for name, m in model.named_modules()}
        found = [name for name, done in injected.items() if "macs" in done]
        assert found == simulated
        x = torch.randn(5, 4)
        a = model[0](x)
        want = lpsim.nn.functional.linear(x, model[0].weight, model[0].bias, mac=mac)
        assert torch.equal(a, want) == (not keep_edges)

"""The main job and the recipes run end to end."""

import pytest
import torch

import lpsim
from lpsim import Float, demo, recipes
from lpsim.nn import LayerQuantization


def test_demo_trains_every_recipe_and_writes_its_outputs(tmp_path, capsys):
    demo.main(["--epochs", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    for name in recipes.RECIPES:
        assert f"| {name} |" in printed
    assert (tmp_path / "digits_accuracy.png").stat().st_size > 10_000
    assert "| recipe |" in (tmp_path / "digits_results.md").read_text()


def test_recipes_keep_the_edge_layers_in_full_precision():
    model = demo.small_cnn()
    recipes.IBM8.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    names = {n for n, _, _ in lpsim.nn.injected(model)}
    first, last = recipes.edge_layers(model)
    assert first not in names and last not in names and "3" in names  # "3" is the second conv


def test_fp32_recipe_changes_nothing():
    model = demo.small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert recipes.FP32.apply(model, opt) == (model, opt)
    assert not lpsim.nn.injected(model)


def test_a_recipe_that_only_scales_the_loss_divides_the_gradients_by_it():
    # The documented loop multiplies the loss by recipe.loss_scale; with nothing to round, the
    # optimizer must still divide the gradients by it: the step equals plain SGD on the loss.
    recipe = recipes.Recipe("scaled", loss_scale=256.0)
    torch.manual_seed(0)
    model = demo.small_cnn()
    reference = demo.small_cnn()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    model, optimizer = recipe.apply(model, optimizer)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    x, y = torch.rand(8, 1, 8, 8), torch.arange(8)
    for _ in range(2):
        optimizer.zero_grad()
        (torch.nn.functional.cross_entropy(model(x), y) * recipe.loss_scale).backward()
        optimizer.step()
        plain.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        plain.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("scale", [0.0, -256.0, float("inf"), float("nan")])
def test_a_recipe_refuses_a_loss_scale_that_is_not_positive_and_finite(scale):
    with pytest.raises(ValueError, match="loss_scale"):
        recipes.Recipe("bad", loss_scale=scale)


@pytest.mark.parametrize("epochs", ["0", "-3"])
def test_demo_refuses_a_number_of_epochs_below_one(epochs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo.main(["--epochs", epochs, "--recipes", "fp32", "--out", str(tmp_path)])
    assert "--epochs must be a positive integer" in capsys.readouterr().err


def test_a_recipe_that_quantises_nothing_still_injects_the_layers_it_is_given():
    # FP32 with a caller's placement: the ReLU outputs are rounded into e5m2 as configured
    # (torch's float8_e5m2 cast, round to nearest even, is the oracle), not silently dropped.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(16, 4)
    with torch.no_grad():
        expected = model[2](model[1](model[0](x)).to(torch.float8_e5m2).float())
    config = {torch.nn.ReLU: LayerQuantization(output=(Float(5, 2), "nearest"))}
    model, _ = recipes.FP32.apply(model, torch.optim.SGD(model.parameters(), lr=0.1), layers=config)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with pytest.raises(ValueError):  # an entry that decides no module is refused, as documented
        fresh = torch.nn.Linear(2, 2)
        recipes.FP32.apply(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), layers=config)


def test_the_diagnosis_names_each_layer_and_its_class_as_the_model_does():
    """Rows are in the model's order, numbered modules first, whatever the names (a model that is
    itself injected, "(model)", raised TypeError sorting against "0"), each labelled with the
    class the model was built of (Linear, not the ParametrizedLinear of a quantised weight)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    model.add_module("head", torch.nn.Linear(3, 2))
    fixed = lpsim.Fixed(6, 3)
    lpsim.nn.inject(
        model,
        {
            torch.nn.Linear: LayerQuantization(weight=fixed, error=fixed, rounding="nearest"),
            torch.nn.Sequential: LayerQuantization(error=lpsim.Float(5, 2), rounding="nearest"),
        },
    )
    with lpsim.diagnostics.Recorder(model, categories="error") as recorder:
        model(torch.randn(8, 4)).square().sum().backward()
    rows = demo.diagnosis({"run": recorder}).splitlines()[2:]
    labels = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert labels == ["0 (Linear)", "2 (Linear)", "(model) (Sequential)", "head (Linear)"]

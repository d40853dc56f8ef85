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


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**70)])
def test_demo_refuses_a_seed_outside_its_range(seed, tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo.main(["--epochs", "1", "--recipes", "fp32", "--seed", seed, "--out", str(tmp_path)])
    assert f"--seed must be an integer from 0 to 2**32 - 1, got {seed}" in capsys.readouterr().err


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


def test_a_recipe_applies_to_an_optimizer_over_part_of_the_model():
    # Fine-tuning: the optimizer holds the last two layers only. Forward still fake-quantises the
    # frozen inner layer; the optimizer rounds the trainable inner layer after its step (by
    # torch's float8_e5m2 cast, round to nearest even; IBM8's e5m2 saturates, and these values
    # are far below its largest), and leaves the last layer in full precision.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 2),
    )
    frozen = model[2].weight.detach().clone()
    trainable = list(model[4].parameters()) + list(model[6].parameters())
    sgd = torch.optim.SGD(trainable, lr=0.1)
    model, opt = recipes.IBM8.apply(model, sgd)
    e5m2 = lambda t: t.to(torch.float8_e5m2).float()  # noqa: E731
    x = torch.randn(16, 4)
    with torch.no_grad():
        h = e5m2(model[1](model[0](x)))
        expected = torch.nn.functional.linear(h, e5m2(frozen), e5m2(model[2].bias))
        assert torch.equal(model[2](h), e5m2(expected))
    (model(x).square().mean() * recipes.IBM8.loss_scale).backward()
    last = model[6].weight.detach().clone()
    opt.step()
    assert torch.equal(model[2].weight, e5m2(frozen))  # the frozen layer is seen quantised
    for p in model[4].parameters():
        assert torch.equal(p.detach(), e5m2(p.detach()))
    assert opt.parameter_settings(model[6].weight) is None
    assert not torch.equal(model[6].weight.detach(), last)
    # Unfreezing later: a group takes the recipe's formats unless it says "quantization": None,
    # as the groups of the layers forward keeps in full precision must.
    opt.add_param_group({"params": list(model[2].parameters())})
    opt.add_param_group({"params": list(model[0].parameters()), "quantization": None})
    settings = opt.parameter_settings(model[2].parametrizations.weight.original)
    assert settings.weight.format == recipes.IBM8.weight[0]
    assert opt.parameter_settings(model[0].weight) is None


def test_readme_quotes_the_demo_results_file_with_every_recipe():
    # The README's demo table is docs/results/digits_results.md, as one run of the demo wrote it:
    # every recipe of the demo, and every wall time from that run.
    import pathlib  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parent.parent
    rows = (root / "docs" / "results" / "digits_results.md").read_text().strip().splitlines()
    assert rows[0].startswith("| recipe | test accuracy after 30 epochs |")
    assert [r.split("|")[1].strip() for r in rows[2:]] == list(recipes.RECIPES)
    assert "\n".join(rows) in (root / "README.md").read_text()


def test_a_recipe_refused_by_the_optimizer_leaves_the_model_as_it_was():
    # A float16 model: inject() accepts the e5m2 quantisers, OptimLP refuses bfloat16 momentum in
    # float16 state. The model must come back without quantisers, computing what it computed.
    import copy  # noqa: PLC0415

    from lpsim.nn import injected  # noqa: PLC0415

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(8, 2)).half()
    original = copy.deepcopy(model)
    e5m2 = (Float(5, 2), "nearest")
    recipe = recipes.Recipe("bad", weight=e5m2, activation=e5m2, momentum=(Float(8, 7), "nearest"))
    with pytest.raises(ValueError, match="momentum"):
        recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert not list(injected(model))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in original.named_parameters()]
    x = torch.randn(3, 4).half()
    assert torch.equal(model(x), original(x))


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


@pytest.mark.parametrize("recipe", [recipes.Recipe("scaled", loss_scale=4.0), recipes.IBM8])
def test_a_recipe_refuses_an_optimizer_that_is_already_an_optim_lp(recipe):
    # Wrapping the OptimLP of a first apply() in a second one divided every gradient by the loss
    # scale twice (a step of 1/16 of SGD's under loss scale 4) and rounded it twice, silently.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model, optimizer = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(TypeError, match="optimizer.*OptimLP"):
        recipe.apply(model, optimizer)
    # The optimizer it wraps takes the recipe afresh: one division by the loss scale.
    model, optimizer = recipe.apply(model, optimizer.optimizer)
    weight = model[0].weight
    before = weight.detach().clone()
    weight.grad = torch.full_like(weight, recipe.loss_scale)
    optimizer.step()
    assert torch.equal(weight.detach(), before - 1.0)


@pytest.mark.parametrize("recipe", [recipes.FP32, recipes.Recipe("scaled", loss_scale=8.0)])
def test_a_recipe_that_quantises_nothing_takes_the_quantisers_of_an_earlier_one_out(recipe):
    # FP32 applied to a model that IBM8 had injected left IBM8's quantisers in place: forward
    # still rounded the activations into e5m2 (0.3 -> 0.3125) while the optimizer rounded nothing.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    reference.load_state_dict(model.state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = recipes.IBM8.apply(model, sgd)
    model, optimizer = recipe.apply(model, optimizer.optimizer)
    assert not lpsim.nn.injected(model)
    x = torch.tensor([[0.3, 0.7, 1.1, -0.4]])
    assert torch.equal(model(x), reference(x))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]

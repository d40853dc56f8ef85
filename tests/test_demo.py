"""The main job and the recipes run end to end."""

import torch

import lpsim
from lpsim import demo, recipes


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

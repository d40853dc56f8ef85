"""The training stack does what its configuration says: what inject() quantises, what OptimLP
rounds, what report() shows, what remove() restores, and what evaluation draws. Each test here
reproduces a way in which the stack once silently differed from its configuration."""

import collections
import copy
import re
import warnings

import pytest
import torch
from support import assert_same_bits
from torch import nn

import lpsim
from lpsim import BlockFloat, Fixed, Float
from lpsim.nn import (
    LayerQuantization,
    Quantizer,
    inject,
    injected,
    quantized_parameters,
    remove,
    report,
)
from lpsim.optim import OptimLP, ParameterQuantization

E5M2 = Float(5, 2)
E6M9 = Float(6, 9)


def on_grid(t: torch.Tensor, fmt) -> bool:
    t = t.detach()
    return torch.equal(lpsim.quantize(t, fmt, "nearest"), t) and torch.equal(
        lpsim.quantize(t, fmt, "up"), t
    )


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def train_step(model, opt, scale=1.0):
    (model(torch.randn(16, 4)).square().mean() * scale).backward()
    opt.step()
    opt.zero_grad()


# Item 0: documented dotted paths


def _documented_paths() -> set[str]:
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    texts = [(root / "README.md").read_text()] + [
        p.read_text() for p in (root / "docs").glob("*.md")
    ]
    found = set()
    for text in texts:
        for path in re.findall(r"\blpsim(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text):
            found.add(path)
    return found


def test_every_documented_dotted_path_resolves_after_import_lpsim():
    missing = []
    for path in sorted(_documented_paths()):
        obj = lpsim
        parts = path.split(".")[1:]
        for part in parts:
            if not hasattr(obj, part):
                # a file name or a method call's attribute of an instance, not an import path
                if isinstance(obj, type) or part in ("py", "md", "png", "csv", "json", "pt"):
                    break
                missing.append(path)
                break
            obj = getattr(obj, part)
    assert not missing, f"not reachable after `import lpsim`: {missing}"
    assert lpsim.recipes.IBM8.name == "ibm8"


# Item 1: the first and last layers stay in full precision, in the optimizer too


def test_recipe_keeps_edge_layers_in_full_precision_in_the_optimizer():
    model = mlp()
    edges = [model[0].weight.detach().clone(), model[4].weight.detach().clone()]
    model, opt = lpsim.recipes.IBM8.apply(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    train_step(model, opt, lpsim.recipes.IBM8.loss_scale)
    remove(model)
    for layer, before in zip((model[0], model[4]), edges):
        assert not torch.equal(layer.weight, before)  # trained
        assert not on_grid(layer.weight, E5M2), "an edge layer's stored weight was rounded"
        assert not on_grid(opt.state[layer.weight]["momentum_buffer"], E6M9)
        assert opt.parameter_settings(layer.weight) is None
    middle = model[2]
    assert on_grid(middle.weight, E5M2) and on_grid(middle.bias, E5M2)
    assert on_grid(opt.state[middle.weight]["momentum_buffer"], E6M9)


@pytest.mark.parametrize(
    ("model", "edges"),
    [
        # a decoder that ends in a transposed convolution: its output layer is the last
        (
            nn.Sequential(
                nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ConvTranspose2d(4, 1, 5)
            ),
            ["0", "3"],
        ),
        # a recurrent first layer (its output is a tuple; the head reads its last state)
        (nn.Sequential(nn.GRU(4, 6, batch_first=True), nn.Identity()), ["0"]),
        # a recurrent cell first: its weights weight_ih and weight_hh are its own
        (nn.Sequential(nn.GRUCell(4, 6), nn.Linear(6, 2)), ["0", "1"]),
    ],
    ids=["conv-transpose-last", "recurrent-first", "recurrent-cell-first"],
)
def test_edge_layers_count_every_layer_with_weights_of_its_own(model, edges):
    """The first and last weight layers kept in full precision are the model's own first and last
    layers with weights, a transposed convolution or a recurrent layer among them: before, a
    decoder's last ConvTranspose2d was quantised and an inner Conv2d kept in its place."""
    assert lpsim.recipes.edge_layers(model) == edges


@pytest.mark.parametrize("first", ["default", "stem[0]", "a?"])
def test_a_recipe_keeps_an_edge_layer_whatever_its_name_and_only_it(first):
    """An edge layer is kept in full precision by its exact name: one called "default" (the key
    of inject's fallback entry) or holding glob characters ("stem[0]", "a?") was quantised, and a
    name like "a?" kept another layer ("ab") in full precision. Oracle: the plain layers, each
    weight rounded by torch's float8_e5m2 cast (IBM8's weights are e5m2, to nearest)."""
    torch.manual_seed(0)
    names = (first, "ab", "out")
    model = nn.Sequential(
        collections.OrderedDict(zip(names, (nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))))
    )
    plain = copy.deepcopy(model)
    model, _ = lpsim.recipes.IBM8.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for name in names:
        weight = getattr(model, name).weight.detach()
        want = getattr(plain, name).weight.detach()
        if name == "ab":  # the only layer that is not an edge
            want = want.to(torch.float8_e5m2).float()
        assert_same_bits(weight, want)


class TiedLM(nn.Module):
    """An embedding whose table is the output layer's weight (tied), two linear layers between."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.first = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = torch.relu(self.first(self.embed(tokens)))
        return self.head(torch.relu(self.middle(h)))


def test_a_recipe_keeps_an_edge_layers_weight_in_full_precision_where_it_is_tied():
    # The last layer's weight is the embedding's table: a kept edge layer's parameter is never
    # rounded, neither by the embedding's forward nor by the optimizer; the embedding's output
    # is still rounded (torch's float8_e5m2 cast, round to nearest even, is the oracle: the
    # values lie far inside IBM8's saturating e5m2).
    torch.manual_seed(0)
    model = TiedLM()
    table = model.embed.weight.detach().clone()
    model, opt = lpsim.recipes.IBM8.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.head.weight is model.embed.weight
    tokens = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        assert torch.equal(model.embed(tokens), table[tokens].to(torch.float8_e5m2).float())
    (model(tokens).square().mean() * lpsim.recipes.IBM8.loss_scale).backward()
    grad = model.embed.weight.grad.clone()
    opt.step()
    expected = table.add(grad * (1.0 / lpsim.recipes.IBM8.loss_scale), alpha=-0.1)
    assert torch.equal(model.head.weight.detach(), expected)
    assert opt.parameter_settings(model.head.weight) is None
    assert opt.parameter_settings(model.middle.parametrizations.weight.original) is not None


def test_optimizer_rounds_exactly_the_parameters_inject_quantises():
    model = mlp()
    inject(model, {"4": None, nn.Linear: LayerQuantization(weight=E5M2, output=E5M2, error=E5M2)})
    fake = quantized_parameters(model)
    assert {id(p) for p in fake} == {
        id(model[0].parametrizations.weight.original),
        id(model[2].parametrizations.weight.original),
    }
    opt = OptimLP(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        weight=E5M2,
        grad=E5M2,
        momentum=E6M9,
        parameters=fake,
    )
    train_step(model, opt)
    assert on_grid(fake[0], E5M2) and on_grid(fake[1], E5M2)
    assert not on_grid(model[4].weight, E5M2) and not on_grid(model[0].bias, E5M2)
    text = report(model, opt)
    assert re.search(r"^4\.weight\s+full precision", text, re.M)
    assert re.search(r"^0\.weight\s+Float\(exp=5, man=2\) stochastic", text, re.M)


def test_parameter_groups_and_mappings_choose_each_parameters_rounding():
    body, edge, odd = (nn.Parameter(torch.randn(20)) for _ in range(3))
    sgd = torch.optim.SGD(
        [{"params": [body, odd]}, {"params": [edge], "quantization": None}], lr=0.1
    )
    opt = OptimLP(sgd, weight=E5M2, rounding="nearest")
    assert opt.parameter_settings(edge) is None
    assert opt.parameter_settings(body).weight.format == E5M2
    fixed = ParameterQuantization(weight=Fixed(8, 4), rounding="nearest")
    opt = OptimLP(
        torch.optim.SGD([body, edge, odd], lr=0.1),
        weight=E5M2,
        parameters={body: fixed, edge: None},
    )
    assert opt.parameter_settings(body) == fixed and opt.parameter_settings(edge) is None
    assert opt.parameter_settings(odd) is None  # unlisted: full precision
    for p in (body, edge, odd):
        p.grad = torch.randn(20)
    opt.step()
    assert on_grid(body, Fixed(8, 4)) and not on_grid(edge, E5M2) and not on_grid(odd, E5M2)
    with pytest.raises(ValueError, match="parameters: 1 tensor"):
        OptimLP(torch.optim.SGD([body], lr=0.1), parameters=[body, edge])


@pytest.mark.parametrize("listed", ["none", "iterable"])
def test_a_parameter_appended_to_a_group_is_rounded_by_its_groups_settings(listed):
    """torch's optimizer steps a parameter appended to a group's "params" list between steps;
    OptimLP worked out its settings only when groups were added or their "quantization"
    changed, so it stepped that parameter unrounded. Oracle: torch's SGD step on twins, rounded
    by torch's float8_e5m2 cast."""
    torch.manual_seed(0)
    first, appended = (nn.Parameter(torch.randn(20)) for _ in range(2))
    twins = [nn.Parameter(p.detach().clone()) for p in (first, appended)]
    sgd = torch.optim.SGD([first], lr=0.1)
    chosen = None if listed == "none" else [first]
    opt = OptimLP(sgd, weight=E5M2, rounding="nearest", parameters=chosen)
    sgd.param_groups[0]["params"].append(appended)
    reference = torch.optim.SGD(twins, lr=0.1)
    for p, twin in zip((first, appended), twins, strict=True):
        p.grad = twin.grad = torch.randn(20)
    opt.step()
    reference.step()
    for p, twin in zip((first, appended), twins, strict=True):
        assert_same_bits(p.detach(), twin.detach().to(torch.float8_e5m2).float())


@pytest.mark.parametrize("listed", ["iterable", "mapping"])
@pytest.mark.parametrize("through", ["optimlp", "wrapped"])
def test_a_group_added_later_takes_its_settings_with_parameters_given(listed, through):
    """A group added after OptimLP was made, through OptimLP.add_param_group or the wrapped
    optimizer's own (the groups are the wrapped optimizer's), takes its "quantization", else the
    defaults, with parameters= as without; the parameters parameters= left out stay in full
    precision. Oracle: torch's SGD step on twins, rounded by torch's float8_e5m2 cast."""
    torch.manual_seed(0)
    listed_p, unlisted, plain, keyed = (nn.Parameter(torch.randn(20)) for _ in range(4))
    twins = [nn.Parameter(p.detach().clone()) for p in (listed_p, unlisted, plain, keyed)]
    sgd = torch.optim.SGD([listed_p, unlisted], lr=0.1)
    own = ParameterQuantization(weight=E5M2, rounding="nearest")
    chosen = [listed_p] if listed == "iterable" else {listed_p: own}
    opt = OptimLP(sgd, weight=E5M2, rounding="nearest", parameters=chosen)
    adder = opt if through == "optimlp" else sgd
    adder.add_param_group({"params": [plain]})
    adder.add_param_group({"params": [keyed], "quantization": None})
    reference = torch.optim.SGD(twins, lr=0.1)
    for p, twin in zip((listed_p, unlisted, plain, keyed), twins, strict=True):
        p.grad = twin.grad = torch.randn(20)
    opt.step()
    reference.step()
    e5m2 = lambda t: t.detach().to(torch.float8_e5m2).float()  # noqa: E731
    for p, twin, rounded in zip(
        (listed_p, unlisted, plain, keyed), twins, (True, False, True, False), strict=True
    ):
        assert_same_bits(p.detach(), e5m2(twin) if rounded else twin.detach())


# Item 2: selectors that decide nothing are errors


@pytest.mark.parametrize(
    "selector",
    ["fc", "Default", "layer4.*", nn.LSTM, lambda name, m: isinstance(m, nn.Conv2d)],
    ids=["name", "misspelled-default", "glob", "type", "callable"],
)
def test_a_selector_that_matches_nothing_is_an_error(selector):
    model = mlp()
    config = {selector: None, nn.Linear: LayerQuantization(output=E5M2)}
    with pytest.raises(ValueError, match="matches no module"):
        inject(model, config)
    assert not injected(model)  # the model is unchanged
    with pytest.warns(UserWarning, match="matches no module"):
        inject(model, config, unmatched="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inject(model, config, unmatched="ignore")
    assert len(injected(model)) == 3


def test_a_selector_shadowed_by_earlier_entries_is_an_error():
    with pytest.raises(ValueError, match=r"'2': matches 1 module\(s\), all decided by an earlier"):
        inject(mlp(), {nn.Linear: LayerQuantization(output=E5M2), "2": None})
    with pytest.raises(ValueError, match="unmatched must be one of"):
        inject(mlp(), {nn.Linear: None}, unmatched="silent")


# Item 3: the root module is a candidate


def test_injecting_into_a_single_layer_quantises_it():
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    inject(
        layer, {nn.Linear: LayerQuantization(weight=(E5M2, "nearest"), output=(E5M2, "nearest"))}
    )
    assert [name for name, _, _ in injected(layer)] == [""]
    y = layer(torch.randn(3, 4))
    assert on_grid(y, E5M2) and on_grid(layer.weight, E5M2)
    assert "1 modules quantised" in report(layer)


# Item 4 is in test_torch_integration.py (the in-place ops and autograd).


# Item 5: report() shows what really runs


@pytest.mark.parametrize("eval_rounding", ["nearest", "up", None])
def test_report_of_a_module_in_eval_mode_shows_the_rules_eval_mode_runs(eval_rounding):
    # report() printed "stochastic" for every injected quantiser of a model in eval mode, which
    # rounds to nearest there (eval_rounding's default): a user checking an evaluation's formats
    # read a rule that never ran. Each module now shows the rules of its own mode.
    e4m3 = Float(4, 3)
    mac = lpsim.MAC(accumulator=Float(8, 10), rounding="stochastic")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    settings = LayerQuantization(
        weight=E5M2, output=e4m3, mac=mac, rounding="stochastic", eval_rounding=eval_rounding
    )
    inject(model, {nn.Linear: settings})
    model[1].eval()
    rows = {line.split()[0]: line for line in report(model).splitlines()[2:4]}
    assert rows["0"].count("stochastic") == 3 and "nearest" not in rows["0"]
    shown = "stochastic" if eval_rounding is None else eval_rounding
    assert rows["1"].count(shown) == 3 and (shown == "stochastic") == ("stochastic" in rows["1"])


def test_report_flags_quantisers_that_never_run_and_counts_only_real_ones():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    inject(
        model,
        {
            nn.ReLU: LayerQuantization(weight=E5M2),  # a ReLU has no weight
            nn.Linear: LayerQuantization(weight=E5M2, output=E5M2),
        },
    )
    text = report(model)
    assert "2 modules quantised, 1 in full precision" in text
    assert re.search(r"^1\s+ReLU .*full precision \(nothing to quantise\)", text, re.M)
    assert "24 of 30 parameter elements fake-quantised (80.0%)" in text

    mha = nn.MultiheadAttention(8, 2)
    with pytest.warns(UserWarning, match="never run: 'out_proj' \\(MultiheadAttention never calls"):
        inject(mha, {nn.Linear: LayerQuantization(weight=E5M2, output=E5M2)})
    with pytest.warns(UserWarning, match="out_proj: input/output/error never run"):
        text = report(mha)
    assert re.search(r"^out_proj\s+NonDynamicallyQuantizableLinear .*never run", text, re.M)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2)})

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.heads["a"](x)


@pytest.mark.parametrize("selector", ["blocks", "heads", nn.ModuleList, nn.ModuleDict])
def test_a_container_selected_for_its_outputs_is_flagged_as_never_running(selector):
    """A selector matching an nn.ModuleList or nn.ModuleDict decides the container itself, which
    has no forward (its parent runs the modules inside it): its input, output and error
    quantisers never run. inject said nothing and report() listed it as quantised ("1 modules
    quantised", output Float(exp=2, man=1) nearest), while the model computed the plain model's
    outputs bit for bit."""
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(3, 4)
    plain = model(x)
    settings = LayerQuantization(output=(Float(2, 1), "nearest"), error=Float(2, 1))
    with pytest.warns(UserWarning, match="never run: .*has no forward"):
        inject(model, {selector: settings})
    assert torch.equal(model(x), plain)  # nothing quantised, as flagged
    with pytest.warns(UserWarning, match="input/output/error never run"):
        text = report(model)
    assert re.search(
        r"^(blocks|heads)\s+Module(List|Dict) .*never run: .*has no forward", text, re.M
    )


def test_report_with_an_example_flags_modules_whose_forward_does_not_run():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    model = Skips()
    inject(model, {nn.Linear: LayerQuantization(output=(E5M2, "stochastic"))})
    example = torch.randn(2, 4)
    state = torch.get_rng_state()
    with pytest.warns(UserWarning, match="unused: input/output/error never ran on the example"):
        text = report(model, example=example)
    assert torch.equal(torch.get_rng_state(), state)  # the example pass drew nothing
    assert re.search(r"^used .*stochastic\s+-$", text, re.M)


def test_report_takes_a_packed_sequence_example_as_one_argument():
    # A PackedSequence (a tuple) was unpacked into four positional arguments of the model.
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.unused = nn.GRU(3, 4), nn.Linear(4, 2)

        def forward(self, packed):
            return self.rnn(packed)[1]

    model = Tagger()
    inject(model, {(nn.GRU, nn.Linear): LayerQuantization(output=(E5M2, "nearest"))})
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 3, 3), torch.tensor([5, 3, 2]))
    with pytest.warns(UserWarning, match="unused: input/output/error never ran on the example"):
        text = report(model, example=packed)
    assert re.search(r"^rnn\s+GRU .*nearest\s+-$", text, re.M)  # it ran: no note


# Item 6: remove() restores registration order


def test_remove_restores_parameter_order_so_saved_optimizer_state_loads():
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    inject(model, {nn.Linear: LayerQuantization(weight=E5M2)})
    remove(model)
    assert [n for n, _ in model.named_parameters()] == names
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(saved)
    model(torch.randn(2, 4)).sum().backward()
    fresh.step()  # shapes match parameter for parameter


# Item 7: evaluation is deterministic and draws nothing


def _sr_model():
    model = mlp()
    inject(
        model,
        {nn.Linear: LayerQuantization(weight=Fixed(8, 3), output=Fixed(8, 3), error=Fixed(8, 3))},
    )
    return model


def test_evaluation_with_stochastic_quantisers_is_deterministic_and_draws_nothing():
    model = _sr_model().eval()
    x = torch.randn(32, 4)
    state = torch.get_rng_state()
    a, b = model(x), model(x)
    assert torch.equal(a, b)
    assert torch.equal(torch.get_rng_state(), state)
    model.train()
    assert not torch.equal(model(x), model(x))  # training still rounds stochastically
    q = Quantizer(forward=Fixed(8, 3), backward=Fixed(8, 3)).eval()
    assert torch.equal(q(x), lpsim.quantize(x, Fixed(8, 3), "nearest"))
    keep = Quantizer(forward=Fixed(8, 3), eval_rounding=None).eval()
    assert not torch.equal(keep(x * 0.01), keep(x * 0.01))
    with pytest.raises(ValueError, match="eval_rounding must be a deterministic rule"):
        LayerQuantization(output=E5M2, eval_rounding="stochastic")
    for bad, error in ((0, TypeError), ("Nearest", ValueError)):  # named as eval_rounding
        with pytest.raises(error, match="^eval_rounding must be"):
            Quantizer(forward=E5M2, eval_rounding=bad)
        with pytest.raises(error, match="^eval_rounding must be"):
            LayerQuantization(output=E5M2, eval_rounding=bad)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_modules_weight_rounds_by_the_modules_own_mode_as_its_input_and_output(mode):
    """A module's mode is its ``training`` flag, which torch's modules read and code may set on
    the module alone (``layer.training = False``, not eval(), which also sets it on the
    parametrisations): the weight's rule follows it as the input's and output's do (it once
    followed the parametrisation's own flag, rounding the weight stochastically, drawing, in a
    module in eval mode). The oracle: torch's linear on tensors rounded by hand."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    inject(layer, {nn.Linear: LayerQuantization(weight=E5M2, input=E5M2, output=E5M2)})
    x = torch.randn(4, 16)
    weight, bias = layer.parametrizations.weight.original.detach(), layer.bias.detach()
    layer.training = mode == "train"
    for m in layer.modules():  # the parametrisation in the other mode
        if m is not layer:
            m.training = mode != "train"
    rule = "stochastic" if mode == "train" else "nearest"
    torch.manual_seed(3)
    got = layer(x)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    # the order of the draws: the input (a pre-hook), the weight (read in forward), the output
    xq = lpsim.quantize(x, E5M2, rule)
    wq = lpsim.quantize(weight, E5M2, rule)
    want = lpsim.quantize(nn.functional.linear(xq, wq, bias), E5M2, rule)
    assert_same_bits(got, want)
    assert torch.equal(torch.get_rng_state(), after)


def test_training_does_not_depend_on_how_often_one_evaluates():
    results = []
    for evaluations in (0, 3):
        model = _sr_model()
        opt = OptimLP(torch.optim.SGD(model.parameters(), lr=0.1), weight=Fixed(8, 3))
        torch.manual_seed(1)
        for _ in range(3):
            train_step(model, opt)
            model.eval()
            with torch.no_grad():
                for _ in range(evaluations):
                    model(torch.ones(4, 4))
            model.train()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert_same_bits(a, b)


# Item 9: accumulators wider than the parameters


def test_bfloat16_model_with_a_float32_accumulator():
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    opt = OptimLP(
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        weight=(Float(8, 7), "nearest"),
        acc=(E6M9, "nearest"),
        momentum=E6M9,
    )
    acc = opt.accumulators[model.weight]
    assert acc.dtype == torch.float32
    before = acc.clone()
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    for _ in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert model.weight.dtype == torch.bfloat16 and acc.dtype == torch.float32
    assert opt.state[model.weight]["momentum_buffer"].dtype == torch.float32
    assert on_grid(acc, E6M9) and not torch.equal(acc, before)
    assert_same_bits(
        model.weight.detach(), lpsim.quantize(acc, Float(8, 7), "nearest").to(torch.bfloat16)
    )
    # Small updates accumulate in e6m9 below bfloat16's spacing.
    assert not on_grid(acc, Float(8, 7))
    saved = opt.state_dict()
    other = OptimLP(
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        weight=(Float(8, 7), "nearest"),
        acc=(E6M9, "nearest"),
        momentum=E6M9,
    )
    other.load_state_dict(saved)
    assert other.state[model.weight]["momentum_buffer"].dtype == torch.float32
    assert_same_bits(
        other.state[model.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )


@pytest.mark.parametrize("name", ["weight", "grad", "momentum"])
def test_a_format_that_does_not_fit_names_its_argument(name):
    model = nn.Linear(4, 2).to(torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=rf"^OptimLP {name}: Float\(exp=6, man=9\) does not fit a "
        r"bfloat16 tensor.*parameter 0 of group 0",
    ):
        OptimLP(torch.optim.SGD(model.parameters(), lr=0.1), **{name: E6M9})


@pytest.mark.parametrize("name", ["weight", "grad", "momentum", "acc"])
@pytest.mark.parametrize(
    "fmt",
    [BlockFloat(8, dim=1), lpsim.scaled.Scaled(Float(4, 3), lpsim.scaled.PowerOfTwo(), 4, axis=1)],
    ids=["block_dim", "scaled_axis"],
)
def test_a_block_dimension_the_parameter_lacks_is_refused_before_any_step(name, fmt):
    # Accepted once, it failed inside step() after the parameter had been updated unrounded.
    p = nn.Parameter(torch.randn(5))
    with pytest.raises(
        ValueError, match=rf"^OptimLP {name}: .*must be in.*parameter 0 of group 0.*shape \(5,\)"
    ):
        OptimLP(torch.optim.SGD([p], lr=0.1, momentum=0.9), **{name: (fmt, "nearest")})
    OptimLP(torch.optim.SGD([nn.Parameter(torch.randn(2, 8))], lr=0.1), **{name: fmt})


def test_state_made_at_construction_goes_to_the_accumulators_dtype():
    # Adagrad makes its sum when constructed, in the parameter's dtype; with a float32
    # accumulator it must be float32 like the state made in a step, and formats that fit float32
    # (not float16) must round it.
    p = nn.Parameter(torch.randn(4, dtype=torch.float16))
    inner = torch.optim.Adagrad([p], lr=0.1)
    opt = OptimLP(inner, momentum=(Fixed(16, 4), "nearest"), acc=(E6M9, "nearest"))
    assert inner.state[p]["sum"].dtype == torch.float32
    p.grad = torch.randn(4, dtype=torch.float16)
    opt.step()
    assert on_grid(inner.state[p]["sum"], Fixed(16, 4))
    # Without an accumulator the existing state's dtype is checked at construction.
    q = nn.Parameter(torch.randn(4))
    inner = torch.optim.Adagrad([q], lr=0.1)
    inner.state[q]["sum"] = inner.state[q]["sum"].half()
    with pytest.raises(ValueError, match=r"^OptimLP momentum: Fixed.*float16.*optimizer state"):
        OptimLP(inner, momentum=(Fixed(16, 4), "nearest"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_adagrad_around_a_wider_accumulator_is_adagrad_around_that_accumulator(dtype):
    # Adagrad fills its sum at construction with initial_accumulator_value in the parameter's
    # dtype; moved to a float32 accumulator it kept that rounding (bfloat16's 0.10009765625 for
    # 0.1), so that the run differed from torch's Adagrad on a float32 master copy.
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 3).to(dtype))
    master = nn.Parameter(p.detach().float())
    opt = OptimLP(
        torch.optim.Adagrad([p], lr=0.1, initial_accumulator_value=0.1),
        acc=(Float(8, 23), "nearest"),
    )
    reference = torch.optim.Adagrad([master], lr=0.1, initial_accumulator_value=0.1)
    for _ in range(3):
        grad = torch.randn(6, 3).to(dtype)
        p.grad, master.grad = grad, grad.float()
        opt.step()
        reference.step()
        assert_same_bits(opt.state[p]["sum"], reference.state[master]["sum"])
        assert_same_bits(opt.accumulators[p], master.detach())
        assert_same_bits(p.detach(), master.detach().to(dtype))


def test_a_recipe_rounds_the_attention_projections_too():
    # MultiheadAttention keeps its in projection as its own parameters (no Linear): a recipe once
    # left them in full precision in the model and the optimizer, silently.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        nn.Linear(16, 2),
    )
    names = {id(p): n for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a warning of quantisers that never run
        model, opt = lpsim.recipes.IBM8.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.randn(3, 5, 8)).sum().backward()
        opt.step()
    quantized = {names[id(p)] for p in quantized_parameters(model)}
    assert {"1.self_attn.in_proj_weight", "1.self_attn.in_proj_bias"} <= quantized
    assert set(names.values()) - quantized == {"0.weight", "0.bias", "2.weight", "2.bias"}
    remove(model)
    attention = model[1].self_attn
    assert on_grid(attention.in_proj_weight, E5M2) and on_grid(attention.out_proj.weight, E5M2)
    assert lpsim.recipes.edge_layers(
        nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2))
    ) == ["0", "1"]


# Item 10: messages that say what is wrong


def test_a_module_instance_as_selector_says_to_use_its_type_or_name():
    model = mlp()
    with pytest.raises(TypeError, match="module instance Linear.*Use its type"):
        inject(model, {model[0]: LayerQuantization(output=E5M2)})


def test_optim_lp_loads_a_plain_optimizers_state_dict():
    model = mlp()
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, plain)
    opt = OptimLP(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), weight=E5M2, acc=E6M9)
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["lr"] == 0.1
    assert_same_bits(
        opt.state[model[0].weight]["momentum_buffer"],
        plain.state[model[0].weight]["momentum_buffer"],
    )
    # The accumulator starts as the weight rounded into E6M9 (by OptimLP's rule): one of the
    # weight's two neighbours on that grid.
    acc, w = opt.accumulators[model[0].weight], model[0].weight.detach()
    down, up = (lpsim.quantize(w, E6M9, rule) for rule in ("down", "up"))
    assert bool(((acc == down) | (acc == up)).all())
    with pytest.raises(ValueError, match="must be an OptimLP state_dict .* or a torch optimizer's"):
        opt.load_state_dict({"weights": []})


# Item 14: the package declares its annotations


def test_package_ships_py_typed():
    import importlib.resources
    import pathlib

    assert importlib.resources.files("lpsim").joinpath("py.typed").is_file()
    pyproject = (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'lpsim = ["py.typed"]' in pyproject


def test_report_flags_a_decided_container_whose_entry_quantises_nothing():
    """weight= takes a module's own parameters: a TransformerEncoderLayer has none (its weights
    are its children's), so the entry quantises nothing; report() lists the layer as such rather
    than leaving it out of the table."""
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1)
    inject(model, {nn.TransformerEncoderLayer: LayerQuantization(weight=E5M2, bias=E5M2)})
    text = report(model)
    assert re.search(
        r"^layers\.0\s+TransformerEncoderLayer .*full precision \(nothing to quantise\)", text, re.M
    )
    assert "0 modules quantised, 10 in full precision" in text
    assert "0 of 600 parameter elements fake-quantised (0.0%)" in text

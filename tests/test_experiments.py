"""The experiments' command lines (experiments/stagnation.py, error_growth.py, scaled_sqnr.py,
mac_error.py, mac_training.py): each writes where --out says, leaves the committed results in
docs/results alone, and reports progress while it runs."""

from __future__ import annotations

import hashlib
import math
import pathlib
import sys
from fractions import Fraction

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from experiments import error_growth, mac_error, mac_training, scaled_sqnr, stagnation  # noqa: E402

RESULTS = ROOT / "docs" / "results"
TINY = {
    stagnation: ["--increments", "40", "--copies", "4", "--steps", "20", "--seeds", "2"],
    error_growth: ["--rows", "4", "--max-exponent", "1.5", "--repeats", "1"],
    mac_error: ["--rows", "2", "--max-exponent", "8"],
    mac_training: ["--epochs", "1", "--configs", "bf16-nearest"],
    scaled_sqnr: [
        *("--digits-epochs", "1", "--resnet-steps", "1", "--batch", "4", "--image-size", "16"),
        *("--presets", "nvfp4", "--rules", "rceil"),
    ],
}


def digests(names: list[str]) -> dict:
    """The SHA-256 of each of docs/results/<name> (None where absent)."""
    return {
        name: hashlib.sha256((RESULTS / name).read_bytes()).hexdigest()
        if (RESULTS / name).exists()
        else None
        for name in names
    }


@pytest.mark.parametrize(
    "experiment, written",
    [
        (stagnation, ["stagnation.md", "stagnation.png"]),
        (error_growth, ["error_growth.md", "error_growth.png"]),
        (scaled_sqnr, ["scaled_sqnr.md", "scaled_sqnr.png"]),
        (mac_error, ["mac_error.md", "mac_error.png"]),
        (mac_training, ["mac_training.md", "mac_training.png"]),
    ],
    ids=["stagnation", "error_growth", "scaled_sqnr", "mac_error", "mac_training"],
)
def test_experiment_writes_into_out_and_leaves_docs_results_alone(experiment, written, tmp_path):
    committed = digests(written)
    out = tmp_path / "results"
    experiment.main([*TINY[experiment], "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == sorted(written)
    assert (out / written[1]).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "![" in (out / written[0]).read_text()
    assert digests(written) == committed


@pytest.mark.parametrize(
    "experiment",
    [stagnation, error_growth, scaled_sqnr, mac_error, mac_training],
    ids=["stagnation", "error_growth", "scaled_sqnr", "mac_error", "mac_training"],
)
def test_out_defaults_to_docs_results_and_help_says_so(experiment):
    p = experiment.parser()
    assert p.parse_args([]).out == RESULTS
    assert "docs/results" in " ".join(p.format_help().split())


def test_stagnation_prints_a_line_per_tenth_of_the_accumulation_and_per_configuration(
    tmp_path, capsys
):
    stagnation.main([*TINY[stagnation], "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    tenths = [line for line in lines if line.startswith("accumulation: ")]
    assert [line.split()[1] for line in tenths] == [f"{4 * k}/40" for k in range(1, 11)]
    # float32, nearest, kahan once; stochastic and stochastic_equal once per seed
    configurations = [line for line in lines if line.startswith("training [")]
    assert [line.split("]")[0] for line in configurations] == [
        f"training [{k}/7" for k in range(1, 8)
    ]


SQNR_DIGITS = [
    *("--models", "digits", "--digits-epochs", "1", "--batch", "8"),
    *("--presets", "mxfp4_e2m1,nvfp4,fp8_e4m3_row", "--rules", "floor,rceil"),
]


def test_scaled_sqnr_gives_the_same_table_twice_and_a_progress_line_per_row(tmp_path, capsys):
    threads = torch.get_num_threads()
    tables = []
    for run in range(2):
        scaled_sqnr.main([*SQNR_DIGITS, "--out", str(tmp_path / str(run))])
        text = (tmp_path / str(run) / "scaled_sqnr.md").read_text()
        tables.append([line for line in text.splitlines() if line.startswith("|")])
    assert tables[0] == tables[1]
    # mxfp4_e2m1 under two rules, nvfp4, fp8_e4m3_row, and the two unscaled formats
    assert [line.split(" | ")[0] for line in tables[0][2:]] == [
        "| mxfp4_e2m1, floor",
        "| mxfp4_e2m1, rceil",
        "| nvfp4, amax",
        "| fp8_e4m3_row, amax",
        "| e4m3fn, no scale",
        "| bfloat16, no scale",
    ]
    assert tables[0][5].count("n/a") == 3  # per-row scales: no transform
    progress = [line for line in capsys.readouterr().out.splitlines() if " SQNR dB " in line]
    assert [line.split("]")[0] for line in progress[:6]] == [f"digits [{k}/6" for k in range(1, 7)]
    assert torch.get_num_threads() == threads  # --threads lasts for the run only


@pytest.mark.parametrize(
    "option, value",
    [
        ("--presets", "mxfp4_e2m1,mxfp5"),
        ("--rules", "floor,nearest"),
        ("--models", "vgg16"),
        ("--presets", ""),
        ("--batch", "1"),
        ("--resnet-lr", "0"),
    ],
)
def test_scaled_sqnr_refuses_bad_options_naming_them(option, value, tmp_path, capsys):
    with pytest.raises(SystemExit):
        scaled_sqnr.main([option, value, "--out", str(tmp_path)])
    assert option in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_scaled_sqnr_lays_blocks_along_the_reduction_and_channel_dimensions():
    conv_weight = torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2)
    assert torch.equal(scaled_sqnr.as_matrix("weight", conv_weight), conv_weight.reshape(2, 12))
    activation = torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2)  # (N, C, H, W)
    matrix = scaled_sqnr.as_matrix("activation", activation)
    assert matrix.shape == (8, 3)
    assert torch.equal(matrix[1], activation[0, :, 0, 1])  # one pixel's channels
    linear = torch.randn(4, 5)
    assert torch.equal(scaled_sqnr.as_matrix("gradient", linear), linear)


def test_scaled_sqnr_lists_block_dimension_lengths_layer_by_layer_for_every_kind():
    # Backward hooks fire from the last layer to the first; the table's "layer by layer" lengths
    # must still follow the model's layer order for the gradients as for weights and activations.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 4 * 4, 5),
        torch.nn.ReLU(),
        torch.nn.Linear(5, 2),
    )
    captured = scaled_sqnr.capture(model, torch.randn(4, 1, 4, 4), torch.tensor([0, 1, 0, 1]))
    assert [list(captured[kind]) for kind in scaled_sqnr.KINDS] == [["0", "3", "5"]] * 3
    matrices = {
        kind: {layer: scaled_sqnr.as_matrix(kind, t) for layer, t in captured[kind].items()}
        for kind in scaled_sqnr.KINDS
    }
    # weights: in * kh * kw or in_features; activations: the input's channels or features;
    # gradients: the output's channels or features
    assert scaled_sqnr.shapes_line(matrices) == (
        "weights 9, 48, 5; activations 1, 48, 5; gradients 3, 5, 2"
    )


def test_scaled_sqnr_in_db_with_exact_and_signal_free_tensors():
    x = torch.tensor([3.0, 4.0])
    assert scaled_sqnr.sqnr_db(x, x + torch.tensor([0.05, 0.0])) == pytest.approx(40.0)
    assert scaled_sqnr.sqnr_db(x, x) == math.inf
    assert scaled_sqnr.sqnr_db(torch.zeros(2), torch.ones(2)) is None


# ---- Options: every size and seed is checked, and refused with the option's name and range


@pytest.mark.parametrize(
    "experiment, option, value",
    [
        (error_growth, "--max-exponent", "1.7"),  # n runs over half decades: 10**1.7 is not one
        (error_growth, "--max-exponent", "0.5"),
        (error_growth, "--max-exponent", "400"),  # 10**400 overflowed a float at the start
        (error_growth, "--rows", "0"),
        (error_growth, "--repeats", "0"),
        (mac_error, "--max-exponent", "7"),  # K runs over even powers of two: 2**7 is not one
        (mac_error, "--max-exponent", "22"),
        (mac_error, "--rows", "0"),
        (stagnation, "--steps", "0"),
        (stagnation, "--lr", "-1"),
        (stagnation, "--lr", "nan"),
        (stagnation, "--copies", "0"),
        (mac_training, "--epochs", "0"),
        (mac_training, "--seed", "-1"),
        (mac_training, "--configs", "bf16-nearest,fp8"),
    ],
)
def test_experiment_refuses_a_bad_option_naming_it_and_its_range(
    experiment, option, value, tmp_path, capsys
):
    with pytest.raises(SystemExit):
        experiment.main([*TINY[experiment], option, value, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert option in err
    assert not any(tmp_path.iterdir())


def first_cells(markdown: str) -> list[str]:
    """The first cell of every table row of ``markdown`` (header and rule rows included)."""
    return [line.split("|")[1].strip() for line in markdown.splitlines() if line.startswith("|")]


def test_error_growth_runs_n_over_half_decades_up_to_10_to_the_max_exponent(tmp_path):
    args = ["--rows", "2", "--max-exponent", "2.5", "--repeats", "1", "--out", str(tmp_path)]
    error_growth.main(args)
    ns = [int(c) for c in first_cells((tmp_path / "error_growth.md").read_text()) if c.isdigit()]
    assert ns == [round(10**e) for e in (1, 1.5, 2, 2.5)] * 2  # float16, then bfloat16


def test_stagnation_gives_no_spread_for_copies_that_overflowed():
    acc = {
        "final": {
            "nearest": torch.ones(3, dtype=torch.float64),
            "stochastic": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
            "stochastic_equal": torch.tensor([1.0, math.inf, 3.0], dtype=torch.float64),
            "kahan": torch.ones(1, dtype=torch.float64),
            "float32": torch.ones(1, dtype=torch.float64),
        },
        "exact": 2.0,
        "overflow": None,
        "steps": [1],
    }
    args = stagnation.parser().parse_args([])
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")[2]
        for line in stagnation.table(acc, {}, 0.0, args).splitlines()
        if line.startswith("| ")
    }
    assert rows["stochastic (mode 1)"] == "1"  # the standard deviation of 1, 2, 3
    assert rows["nearest"] == "0"
    assert rows["stochastic_equal (mode 2)"] == "n/a (1 of 3 copies not finite)"


def test_stagnation_test_accuracy_is_that_of_the_final_weights():
    """The table's test accuracy is the trained weights', beside the final train loss, for any
    --steps (the curve is recorded every 50 steps, so 120 steps used to report step 100's).
    Oracle: the same full-batch gradient descent as a plain torch.optim.SGD loop."""
    data = stagnation.breast_cancer()
    x_train, y_train, x_test, y_test = data
    steps, lr = 120, 0.1
    run = stagnation.train("float32", 0, data, steps, lr, record_every=50)
    w = torch.zeros(x_train.shape[1], requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(x_train @ w, y_train).backward()
        opt.step()
    with torch.no_grad():
        accuracy = ((x_test @ w > 0).float() == y_test).float().mean().item()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x_train @ w, y_train).item()
    assert run["accuracy"] == accuracy and run["final_loss"] == loss
    assert run["accuracies"][-1] == (steps, accuracy)


def _round_bfloat16(value: Fraction) -> Fraction:
    """value rounded to nearest bfloat16 (ties to even; normal range), from the definition."""
    if value == 0:
        return value
    magnitude = abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    spacing = Fraction(2) ** (exponent - 7)
    units, rest = divmod(magnitude, spacing)
    if rest > spacing / 2 or (rest == spacing / 2 and units % 2):
        units += 1
    return (1 if value > 0 else -1) * units * spacing


def test_stagnation_bfloat16_weights_get_their_gradient_rounded_to_bfloat16():
    """The nearest run of part 2 is, step for step, the plain loop its description gives: the
    float32 gradient rounded to nearest bfloat16 (autograd's gradient of a bfloat16 weight), then
    w - lr g exact and rounded once to nearest bfloat16. With the float32 gradient the loop ends
    elsewhere after 20 steps, so the rounding of the gradient is part of the set-up."""
    data = stagnation.breast_cancer()
    x_train, y_train = data[0], data[1]
    steps, lr = 20, 1e-3
    run = stagnation.train("nearest", 0, data, steps, lr, record_every=50)
    losses = {}
    for rounded_gradient in (True, False):
        w = [Fraction(0)] * x_train.shape[1]
        for _ in range(steps):
            w32 = torch.tensor([float(v) for v in w], requires_grad=True)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x_train @ w32, y_train)
            loss.backward()
            g = w32.grad.to(torch.bfloat16).float() if rounded_gradient else w32.grad
            w = [_round_bfloat16(v - Fraction(lr) * Fraction(gv)) for v, gv in zip(w, g.tolist())]
        w32 = torch.tensor([float(v) for v in w])
        losses[rounded_gradient] = torch.nn.functional.binary_cross_entropy_with_logits(
            x_train @ w32, y_train
        ).item()
    assert run["final_loss"] == losses[True] != losses[False]
    assert run["last_change"] == steps


def test_mac_training_committed_table_is_what_the_command_it_names_runs_by_default():
    text = (RESULTS / "mac_training.md").read_text()
    command = text.split("Written by `", 1)[1].split("`", 1)[0].split()
    assert command[:3] == ["python", "-m", "experiments.mac_training"]
    named = mac_training.parser().parse_args(command[3:])
    assert f"## Test accuracy (%) after {named.epochs} epochs" in text
    default = mac_training.parser().parse_args([])
    assert (named.epochs, named.seed) == (default.epochs, default.seed)
    assert named.configs == default.configs


IRIS_TINY = ["--seeds", "1", "--epochs", "2", "--log-every", "1", "--no-ablations"]


def test_iris_tables_name_the_widths_it_trained_and_the_command_that_repeats_it(tmp_path):
    from experiments.iris_int import run

    widths = ["--weight-bits", "12", "--activation-bits", "6", "--error-bits", "7"]
    run.main([*IRIS_TINY, *widths, "--workers", "1", "--out", str(tmp_path)])
    text = (tmp_path / "iris_int.md").read_text()
    assert "| integer (12-bit weights), stochastic |" in text
    assert "(16-bit weights)" not in text
    assert "to 6-bit activations" in text and "the propagated error to 7 bits" in text
    command = text.split("Written by `", 1)[1].split("`", 1)[0].split()
    assert command[:3] == ["python", "-m", "experiments.iris_int.run"]
    named = run.parser().parse_args(command[3:])
    wanted = run.parser().parse_args([*IRIS_TINY, *widths])
    for key in ("workers", "out"):  # neither changes the results
        delattr(named, key)
        delattr(wanted, key)
    assert named == wanted


@pytest.mark.parametrize(
    "option, value",
    [
        ("--log-every", "0"),
        ("--seeds", "0"),
        ("--batch", "0"),
        ("--min-delta", "1"),
        ("--weight-bits", "40"),
        ("--lr-shift", "-1"),
        ("--split-seed", "-1"),
    ],
)
def test_iris_refuses_a_bad_option_naming_it(option, value, tmp_path, capsys):
    from experiments.iris_int import run

    with pytest.raises(SystemExit):
        run.main([*IRIS_TINY, "--workers", "1", option, value, "--out", str(tmp_path)])
    assert option in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_scaled_sqnr_table_records_the_torch_that_trained_its_models(tmp_path):
    options = ["--models", "digits", "--digits-epochs", "1", "--batch", "4"]
    scaled_sqnr.main([*options, "--presets", "nvfp4", "--rules", "rceil", "--out", str(tmp_path)])
    header = (tmp_path / "scaled_sqnr.md").read_text().split("\n\n")[1]
    assert f"torch {torch.__version__})" in header


def test_plots_label_the_rows_and_learning_rate_of_the_run():
    assert error_growth.panel_title("float16", 2.0**-11, 7).endswith("A x with A 7 x n")
    assert stagnation.steps_label(0.01) == "gradient steps (lr 0.01)"
    assert stagnation.steps_label(1e-3) == "gradient steps (lr 0.001)"


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_scaled_sqnr_refuses_a_learning_rate_that_is_not_finite_and_positive(
    value, tmp_path, capsys
):
    # An infinite rate trained resnet18 into NaN weights and wrote a table of nan SQNRs.
    tiny = [*TINY[scaled_sqnr], "--models", "resnet18"]
    with pytest.raises(SystemExit):
        scaled_sqnr.main([*tiny, "--resnet-lr", value, "--out", str(tmp_path)])
    assert "--resnet-lr must be a finite positive number" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_stochastic_rounding_md_sizes_the_error_growth_terms_against_the_spacing_of_the_sum():
    # docs/stochastic-rounding.md explains why few random bits fail in the error-growth experiment
    # by the size of its terms. A product of entries uniform on [0, 1e-3] and [0, 1] averages
    # 2.5e-4 (about 2**-12 in absolute terms, not relative to the sum), and a float16 sum of 10**5
    # of them ends near 25, where float16's spacing is 2**-6: a term is about 2**-6 of a spacing,
    # below what 4 or 2 random bits can resolve.
    g = torch.Generator().manual_seed(0)
    n = 10**5
    a = (torch.rand(n, generator=g, dtype=torch.float64) * 1e-3).half()
    x = torch.rand(n, generator=g, dtype=torch.float64).half()
    terms = a.double() * x.double()
    total, mean = terms.sum().item(), terms.mean().item()
    spacing = 2.0 ** (math.floor(math.log2(total)) - 10)  # float16 keeps 10 fraction bits
    assert round(math.log2(mean)) == -12
    assert round(math.log2(total)) in (4, 5)  # 16 <= total < 32: the spacing is 2**-6
    assert round(math.log2(mean / spacing)) == -6
    assert round(math.log2(terms.max().item() / spacing)) == -4  # the largest terms: 1e-3
    text = " ".join((ROOT / "docs" / "stochastic-rounding.md").read_text().split())
    start = text.index("The error-growth experiment below shows it")
    claim = text[start : text.index("16 bits are indistinguishable from 32", start)]
    assert "about 2^-12 (2.5 10^-4)" in claim
    assert "about 2^-6 of a spacing and at most 2^-4" in claim
    assert "of the final sum" not in claim

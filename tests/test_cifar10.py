"""The CIFAR10 reproductions (experiments/cifar10): every recipe trains end to end through
torchvision's CIFAR10 reader on a tiny dataset in the real pickle layout, resumes bit for bit,
and matches the definitions of QPyTorch's examples; the training benchmark runs."""

from __future__ import annotations

import csv
import math
import pathlib
import pickle
import sys

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from support import (  # noqa: E402
    shares_backpropagate_the_whole_batch,
    tensors_equal,
    without_times,
)

import lpsim  # noqa: E402
from experiments.cifar10 import data as cifar  # noqa: E402
from experiments.cifar10 import recipes, summarize, train  # noqa: E402
from experiments.cifar10.models import build_model  # noqa: E402
from experiments.cifar10.swa import WeightAverage  # noqa: E402
from lpsim import BlockFloat, Fixed, Float  # noqa: E402
from lpsim.nn import injected  # noqa: E402

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PER_BATCH, TEST_IMAGES = 48, 65  # 240 training and 65 test images (test shards of
# 33 and 32 under two processes: different numbers of batches of 16)


def write_tiny_cifar10(root: pathlib.Path, seed: int = 0) -> dict:
    """The python CIFAR10 release's layout (cifar-10-batches-py: data_batch_1..5, test_batch,
    batches.meta; each batch a pickled dict whose "data" is uint8 (n, 3072), the red, green, then
    blue 32x32 planes row by row, and "labels" a list of ints) with random images. Returns the
    arrays written."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    written = {}

    def batch(name: str, n: int) -> None:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n)]
        with open(folder / name, "wb") as f:
            pickle.dump(
                {
                    "batch_label": name,
                    "labels": labels,
                    "data": data,
                    "filenames": [f"{name}_{i:05d}.png" for i in range(n)],
                },
                f,
            )
        written[name] = (data, labels)

    for i in range(1, 6):
        batch(f"data_batch_{i}", PER_BATCH)
    batch("test_batch", TEST_IMAGES)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": LABELS, "num_cases_per_batch": PER_BATCH, "num_vis": 3072}, f)
    return written


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def tiny_cifar10(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar10")
    return root, write_tiny_cifar10(root)


def run_args(data_root, out_dir, recipe, *extra) -> list[str]:
    return [
        "--recipe",
        recipe,
        "--data-dir",
        str(data_root),
        "--unverified-data",
        "--batch-size",
        "32",
        "--width",
        "0.125",
        "--out-dir",
        str(out_dir),
        "--no-progress",
        *extra,
    ]


def representable(t: torch.Tensor, fmt) -> bool:
    return torch.equal(lpsim.quantize(t, fmt, "nearest"), t) and torch.equal(
        lpsim.quantize(t, fmt, "up"), t
    )


# Data


def test_loader_reads_the_pickle_layout_as_channel_planes(tiny_cifar10):
    root, written = tiny_cifar10
    train_set = cifar.load_cifar10(root, train=True, verify=False)
    test_set = cifar.load_cifar10(root, train=False, verify=False)
    assert train_set.images.shape == (5 * PER_BATCH, 3, 32, 32)
    assert train_set.images.dtype == torch.uint8 and len(test_set) == TEST_IMAGES
    data, labels = written["data_batch_2"]
    i = PER_BATCH + 7  # the 8th image of the second batch
    row = torch.from_numpy(data[7].astype(np.int64))
    for c, y, x in [(0, 0, 0), (1, 5, 31), (2, 31, 3)]:
        assert int(train_set.images[i, c, y, x]) == int(row[c * 1024 + y * 32 + x])
    assert int(train_set.labels[i]) == labels[7]
    assert test_set.labels.tolist() == written["test_batch"][1]


def test_official_checksums_are_checked_unless_disabled(tiny_cifar10, tmp_path, capsys):
    root, _ = tiny_cifar10
    with pytest.raises(FileNotFoundError, match="--unverified-data"):
        cifar.load_cifar10(root, train=True)
    with pytest.raises(SystemExit):
        train.main(
            ["--recipe", "fp32", "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "o")]
        )
    assert "no CIFAR10 training batches: CIFAR10 (its python version) is expected in" in (
        capsys.readouterr().err
    )


def test_augmentation_is_torchvision_random_crop_then_flip():
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    got = cifar.random_crop_flip(images, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    top, left = torch.randint(0, 9, (6,), generator=g), torch.randint(0, 9, (6,), generator=g)
    flip = torch.rand(6, generator=g) < 0.5
    assert 0 < int(flip.sum()) < 6
    for i in range(6):
        want = TF.crop(TF.pad(images[i], [4]), int(top[i]), int(left[i]), 32, 32)
        if flip[i]:
            want = TF.hflip(want)
        assert torch.equal(got[i], want)


def test_ranks_see_disjoint_shards_and_their_own_augmentation():
    n = 64
    split = cifar.Split(torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8), torch.arange(n))
    seen, firsts = [], []
    for rank in range(2):
        batches = list(cifar.training_batches(split, 8, seed=3, epoch=1, rank=rank, world_size=2))
        assert [len(b[1]) for b in batches] == [8] * 4
        seen.append(torch.cat([b[1] for b in batches]))
        firsts.append(batches[0])
    assert set(seen[0].tolist()).isdisjoint(seen[1].tolist())
    assert sorted(seen[0].tolist() + seen[1].tolist()) == list(range(n))
    again = next(cifar.training_batches(split, 8, seed=3, epoch=1, rank=0, world_size=2))
    assert torch.equal(again[0], firsts[0][0])  # a function of (seed, epoch, rank) only
    other_epoch = next(cifar.training_batches(split, 8, seed=3, epoch=2, rank=0, world_size=2))
    assert not torch.equal(other_epoch[1], firsts[0][1])
    shards = [cifar.eval_shard(split, r, 3).labels.tolist() for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(n))


def test_neighbouring_seeds_do_not_see_each_others_data_orders_an_epoch_apart():
    """torch's DistributedSampler permutes epoch e with seed + e: given the run's seed directly,
    seed s + 1 would train on seed s's orders one epoch later. The orders are DistributedSampler's
    for the hashed order_seed, and those of neighbouring seeds are unrelated."""
    from torch.utils.data import DistributedSampler

    n = 64
    split = cifar.Split(torch.zeros(n, 3, 32, 32, dtype=torch.uint8), torch.arange(n))

    def order(seed, epoch):
        batches = cifar.training_batches(split, n, seed=seed, epoch=epoch, rank=0, world_size=1)
        return next(batches)[1].tolist()

    for seed in range(4):
        for epoch in range(3):
            assert order(seed, epoch + 1) != order(seed + 1, epoch)
        sampler = DistributedSampler(range(n), 1, 0, shuffle=True, seed=cifar.order_seed(seed))
        sampler.set_epoch(2)
        assert order(seed, 2) == list(sampler)


# Recipe definitions


def test_recipes_quantise_what_the_qpytorch_examples_quantise():
    half, rows = (Float(5, 10), "stochastic"), (BlockFloat(8, dim=0), "stochastic")
    for name, fmt in [("fp16", half), ("block8", (BlockFloat(8), "stochastic")), ("swalp", rows)]:
        q = recipes.RECIPES[name].quantization
        assert [q.weight, q.activation, q.error, q.grad, q.momentum] == [fmt] * 5, name
        assert q.acc is None and q.loss_scale == 1
    ibm8 = recipes.RECIPES["ibm8"].quantization
    e5m2 = (Float(5, 2, saturate=True), "nearest")
    assert [ibm8.weight, ibm8.activation, ibm8.error, ibm8.grad] == [e5m2] * 4
    assert ibm8.momentum == ibm8.acc == (Float(6, 9), "stochastic") and ibm8.loss_scale == 1000
    assert recipes.RECIPES["fp32"].quantization is None
    swalp = recipes.RECIPES["swalp"]
    assert swalp.default_swa_start(swalp.epochs) == 200 and swalp.swa_lr == 0.01
    assert {r.model for r in recipes.RECIPES.values()} == {"vgg16", "vgg7", "preresnet20"}


def test_ibm8_accumulators_start_from_the_unrounded_initial_weights():
    """QPyTorch's OptimLP starts every accumulator as p.detach().clone(), unrounded: the first
    update is added to the float32 initial weight and only then rounded into e6m9. After
    prepare() the recipe's accumulators are those weights bit for bit, and the weights are
    them rounded to nearest e5m2 (torch.float8_e5m2, the initial weights being far below its
    largest value)."""
    recipe = recipes.RECIPES["ibm8"]
    torch.manual_seed(0)
    net = build_model("preresnet20", width=0.25)
    initial = [p.detach().clone() for p in net.parameters()]
    _, optimizer = recipe.prepare(net, recipe.lr)
    assert len(optimizer.accumulators) == len(initial)
    for p, w0 in zip(net.parameters(), initial):
        assert torch.equal(optimizer.accumulators[p], w0)
        assert torch.equal(p.detach(), w0.to(torch.float8_e5m2).float())


@pytest.mark.parametrize(
    "name, model, quantised, untouched",
    [
        ("fp16", "vgg16", 15, []),  # the 15 ReLUs
        ("swalp", "vgg16", 15, ["classifier.6"]),  # 13 convs, 2 of the 3 linears
        ("ibm8", "preresnet20", 30, ["layer2.0.downsample.0", "layer3.0.downsample.0"]),
    ],
)
def test_quantisers_sit_where_the_qpytorch_models_put_them(name, model, quantised, untouched):
    recipe = recipes.RECIPES[name]
    net = build_model(model, width=0.25, **dict(recipe.model_options))
    recipe.prepare(net, recipe.lr)
    rows = {n: done for n, _, done in injected(net)}
    assert len(rows) == quantised and not set(untouched) & set(rows)
    if name == "ibm8":
        # 1 stem conv + 18 branch convs + 10 ReLU modules + fc; the 16-bit edges
        assert rows["conv1"]["input"].format == Float(6, 9)
        assert rows["fc"]["output"].format == rows["fc"]["error"].format == Float(6, 9)
        assert rows["layer1.0.conv2"]["output"].format == Float(5, 2, saturate=True)


def test_schedules_follow_the_qpytorch_examples():
    fp16, wage, swalp = (recipes.RECIPES[n] for n in ("fp16", "wage", "swalp"))
    lr = [fp16.lr * fp16.lr_factor(e, 200, None, fp16.lr) for e in (0, 100, 120, 180, 199)]
    assert lr == pytest.approx([0.05, 0.05, 0.05 * (1 - 0.99 * 0.1 / 0.4), 0.0005, 0.0005])
    lr = [wage.lr * wage.lr_factor(e, 300, None, wage.lr) for e in (0, 199, 200, 249, 250, 299)]
    assert lr == [8, 8, 1, 1, 0.125, 0.125]
    lr = [swalp.lr * swalp.lr_factor(e, 300, 200, swalp.lr) for e in (0, 100, 199, 200, 299)]
    assert lr == pytest.approx([0.05, 0.05, 0.0005, 0.01, 0.01])


def test_swalp_averaging_rate_stays_the_examples_swa_lr_whatever_the_initial_rate():
    """--lr scales the Wilson part of SWALP's schedule; the averaging phase trains at 0.01, the
    example's separate --swa_lr, as experiments/README.md says."""
    swalp = recipes.RECIPES["swalp"]
    for lr in (0.05, 0.1, 0.025):
        rates = [lr * swalp.lr_factor(e, 300, 200, lr) for e in (0, 150, 199, 200, 299)]
        assert rates[:3] == pytest.approx([lr, lr * (1 - 0.99 * 0.25 / 0.4), lr * 0.01])
        assert rates[3:] == pytest.approx([0.01, 0.01])


# WAGE


def test_wage_shift_divides_by_the_power_of_two_at_or_above_the_peak():
    assert recipes.wage_shift(torch.tensor([0.5, -0.25])).tolist() == [1.0, -0.5]
    assert recipes.wage_shift(torch.tensor([-0.3, 0.1])).tolist() == pytest.approx([-0.6, 0.2])
    assert recipes.wage_shift(torch.tensor([3.0])).tolist() == [0.75]
    assert recipes.wage_shift(torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "shape, scale, limit",
    [
        ((128, 3, 3, 3), 2.0, 0.75),  # fan-in 27: sqrt(3/27) = 1/3, 0.75 / (1/3) = 2.25
        ((128, 128, 3, 3), 16.0, 0.75),  # fan-in 1152: ratio 14.7
        ((1024, 8192), 32.0, 0.75),  # fan-in 8192: ratio 39.2
    ],
)
def test_wage_initialisation_and_layer_scales(shape, scale, limit):
    w = torch.empty(shape)
    assert recipes.wage_init_(w) == scale
    assert float(w.abs().max()) <= limit and float(w.abs().max()) > 0.9 * limit


def test_wage_update_equals_clip_then_subtract():
    """WAGE's rule acc <- clip(acc) - Q(lr * shift(g) / 128) from the unclipped initial weights
    (QPyTorch's order) and lpsim's (clip at initialisation, then subtract and clip) give the same
    training: after every step clip(acc) is lpsim's accumulator and the ternary weights agree."""

    def tiny():
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, bias=False),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 10, bias=False),
        )

    torch.manual_seed(0)
    model, twin = tiny(), tiny()
    start = torch.get_rng_state()
    model, opt = recipes.RECIPES["wage"].prepare(model, 8.0)
    torch.set_rng_state(start)
    reference = [m.weight.detach() for m in twin if isinstance(m, (nn.Conv2d, nn.Linear))]
    for w in reference:  # the same draws as prepare(): QPyTorch's unclipped initial accumulators
        recipes.wage_init_(w)
    assert any(float(w.abs().max()) > 0.5 for w in reference)
    params, ternary = list(model.parameters()), Fixed(2, 1, symmetric=True)
    x, y = torch.rand(16, 3, 8, 8) * 2 - 1, torch.randint(0, 10, (16,))
    for step in range(4):
        lr = 8.0 if step < 2 else 1.0
        opt.param_groups[0]["lr"] = lr
        loss, _ = recipes.RECIPES["wage"].criterion(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in params]
        state = torch.get_rng_state()
        opt.step()
        torch.set_rng_state(state)  # the reference draws the same seeds, in parameter order
        for i, g in enumerate(grads):
            q = lpsim.quantize(
                recipes.wage_shift(g) * (lr / 128),
                Fixed(8, 7, clamp=False, symmetric=True),
                "stochastic",
            )
            reference[i] = reference[i].clamp(-0.5, 0.5) - q
        for acc, ref in zip(params, reference):
            assert torch.equal(acc.detach(), ref.clamp(-0.5, 0.5)), step
            assert torch.equal(
                lpsim.quantize(acc.detach(), ternary, "nearest"),
                lpsim.quantize(ref, ternary, "nearest"),
            )
        assert any(not torch.equal(ref, ref.clamp(-0.5, 0.5)) for ref in reference)


def test_wage_rejects_models_with_biases_and_non_power_of_two_rates():
    with pytest.raises(ValueError, match="no biases, no batch norm"):
        recipes.RECIPES["wage"].prepare(build_model("vgg16", width=0.125), 8.0)
    with pytest.raises(ValueError, match="power of two"):
        recipes.RECIPES["wage"].prepare(build_model("vgg7", width=0.125), 3.0)


def test_wage_activations_are_8_bit_fixed_point_and_weights_ternary():
    torch.manual_seed(1)
    model = build_model("vgg7", width=0.125)
    recipes.RECIPES["wage"].prepare(model, 8.0)
    seen = []
    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    model(torch.rand(4, 3, 32, 32) * 2 - 1)
    act = Fixed(8, 7, symmetric=True)
    assert len(seen) == 7 and all(representable(a, act) for a in seen)
    conv = model.features[0]
    scale = conv.parametrizations.weight[0].scale
    assert set((conv.weight.detach() * scale).unique().tolist()) <= {-0.5, 0.0, 0.5}


# Weight averaging


def test_weight_average_is_the_mean_and_batch_norm_is_recomputed():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    average = WeightAverage(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    snapshots = []
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.normal_()
        snapshots.append([p.detach().clone() for p in net.parameters()])
        average.update(net)
    assert average.count == 3
    for p, *values in zip(average.model.parameters(), *snapshots):
        assert torch.allclose(p, torch.stack(values).mean(0), atol=1e-6)
    batches = [torch.randn(8, 3, 4, 4) + 2 for _ in range(3)]
    average.recompute_batch_norm(batches)
    with torch.no_grad():
        features = torch.cat([average.model[0](b) for b in batches])
    bn = average.model[1]
    assert torch.allclose(bn.running_mean, features.mean((0, 2, 3)), atol=1e-5)
    with pytest.raises(ValueError, match="different parameters"):
        average.update(nn.Sequential(nn.Conv2d(3, 4, 1)))


def test_weight_average_is_qpytorchs_moving_average_bit_for_bit():
    """examples/SWALP's utils.moving_average, op for op in float32: param1 *= 1 - a, then
    param1 += param2 * a with a = 1 / (n + 1)."""
    torch.manual_seed(0)
    net = nn.Linear(7, 5)
    average = WeightAverage(nn.Linear(7, 5))
    reference = [p.detach().clone() for p in average.model.parameters()]
    for n in range(5):
        with torch.no_grad():
            for p in net.parameters():
                p.normal_()
        average.update(net)
        alpha = 1.0 / (n + 1)
        for ref, p in zip(reference, net.parameters()):
            ref *= 1.0 - alpha
            ref += p.detach() * alpha
        assert all(tensors_equal(a, b) for a, b in zip(average.model.parameters(), reference))
    assert average.count == 5


# End to end through the command line


def read_log(out_dir: pathlib.Path) -> list[dict]:
    with open(out_dir / train.LOG, newline="") as f:
        return list(csv.DictReader(f))


def weight_format(recipe) -> object | None:
    q = recipes.RECIPES[recipe].quantization
    return None if q is None else q.weight[0]


@pytest.mark.parametrize("recipe", list(recipes.RECIPES))
def test_every_recipe_trains_end_to_end_through_the_cifar10_reader(recipe, tiny_cifar10, tmp_path):
    root, _ = tiny_cifar10
    history = train.main(run_args(root, tmp_path, recipe, "--epochs", "2"))
    log = read_log(tmp_path)
    assert [row["epoch"] for row in log] == ["1", "2"] and len(history) == 2
    for row in log:
        for key in ("train_loss", "train_error", "test_loss", "test_error"):
            assert math.isfinite(float(row[key])), (key, row)
    averaged = [row["swa_test_error"] != "" for row in log]
    assert averaged == ([False, True] if recipe == "swalp" else [False, False])
    state = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)
    assert state["epoch"] == 2 and state["config"]["recipe"] == recipe
    fmt = weight_format(recipe)
    weights = {
        k: v
        for k, v in state["model"].items()
        if k.endswith("weight") or k.endswith("bias") or k.endswith("original")
    }
    if fmt is not None:  # every stored weight is a value of the recipe's weight format
        assert all(representable(v, fmt) for v in weights.values())
    if recipe == "ibm8":
        assert all(representable(a, Float(6, 9)) for a in state["optimizer"]["accumulators"])
    if recipe == "wage":  # accumulators clipped to the ternary range
        assert all(float(v.abs().max()) <= 0.5 for v in weights.values())


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("swalp", ["--swa-start", "1"]),  # SWA state, dropout, block formats per row
        ("ibm8", []),  # accumulators, loss scaling, batch norm
        ("wage", []),  # its schedule changes across the interruption
    ],
)
def test_resume_continues_bit_identically(recipe, extra, tiny_cifar10, tmp_path):
    root, _ = tiny_cifar10
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    train.main(run_args(root, straight, recipe, "--epochs", "3", *extra))
    train.main(run_args(root, pieces, recipe, "--epochs", "3", "--stop-after", "2", *extra))
    assert len(read_log(pieces)) == 2
    train.main(run_args(root, pieces, recipe, "--epochs", "3", "--resume", *extra))
    a = torch.load(straight / train.CHECKPOINT, weights_only=True)
    b = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    for key in ("model", "optimizer", "scheduler", "swa", "rng", "epoch"):
        assert tensors_equal(a[key], b[key]), key
    assert without_times(a["history"]) == without_times(b["history"])
    assert without_times(read_log(straight)) == without_times(read_log(pieces))


def test_resume_refuses_another_runs_checkpoint(tiny_cifar10, tmp_path):
    root, _ = tiny_cifar10
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--stop-after", "1"))
    with pytest.raises(SystemExit, match="belongs to another run.*'seed': \\(0, 1\\)"):
        train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--resume", "--seed", "1"))


def test_resume_refuses_to_switch_between_eager_and_compiled_training(tiny_cifar10, tmp_path):
    """Inductor draws stochastic rounding's random numbers its own way: a run resumed compiled
    after eager epochs would be neither run, so --compile is one of the settings a resume keeps
    (refused before any compilation)."""
    root, _ = tiny_cifar10
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--stop-after", "1"))
    with pytest.raises(SystemExit, match="'compile': \\(False, True\\)"):
        train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--resume", "--compile"))


def test_resume_refuses_a_checkpoint_of_another_device_type(tiny_cifar10, tmp_path):
    """Stochastic rounding draws from the generator of the device that trains, and a checkpoint
    holds only that device type's generator: a GPU run resumed on the CPU (--device auto where
    CUDA is missing), or a CPU run on a GPU, would continue with another random stream. The
    device type is one of the settings a resume keeps; a checkpoint written without it counts as
    trained where its random state says (no CUDA generator state: the CPU), so it resumes."""
    root, _ = tiny_cifar10
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    train.main(run_args(root, straight, "fp16", "--epochs", "2"))
    train.main(run_args(root, pieces, "fp16", "--epochs", "2", "--stop-after", "1"))
    state = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    assert state["config"]["device"] == "cpu" and state["rng"]["cuda"] is None
    state["config"]["device"] = "cuda"  # as written by a GPU run
    torch.save(state, pieces / train.CHECKPOINT)
    with pytest.raises(SystemExit, match="'device': \\('cuda', 'cpu'\\)"):
        train.main(run_args(root, pieces, "fp16", "--epochs", "2", "--resume"))
    del state["config"]["device"]  # a checkpoint from before the key: its random state says cpu
    torch.save(state, pieces / train.CHECKPOINT)
    train.main(run_args(root, pieces, "fp16", "--epochs", "2", "--resume"))
    a = torch.load(straight / train.CHECKPOINT, weights_only=True)
    b = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    assert tensors_equal(a["model"], b["model"]) and tensors_equal(a["rng"], b["rng"])


def test_deterministic_kernels_are_a_setting_a_gpu_resume_keeps(
    tiny_cifar10, tmp_path, monkeypatch
):
    """On a GPU, --deterministic picks other kernels, which sum in other orders: a GPU run resumed
    with it switched would continue as neither run, so it is one of the settings a resume keeps
    there. On the CPU it changes nothing, and a CPU run resumes with or without it."""
    root, _ = tiny_cifar10
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--stop-after", "1"))
    state = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)
    assert state["config"]["deterministic"] is None  # a CPU run: not a setting
    state["config"].update(device="cuda", threads=None, deterministic=False)  # as a GPU run's
    state["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    torch.save(state, gpu / train.CHECKPOINT)
    # Only the settings are checked here, which need no GPU.
    monkeypatch.setattr(train, "choose_device", lambda *args: torch.device("cuda", 0))
    p = train.parser()
    resume = run_args(root, gpu, "fp32", "--epochs", "2", "--resume")
    with pytest.raises(SystemExit, match="'deterministic': \\(False, True\\)"):
        train.Run(p.parse_args([*resume, "--deterministic"]), p)
    assert train.Run(p.parse_args(resume), p).config["deterministic"] is False
    monkeypatch.undo()
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--resume", "--deterministic"))


def test_a_cpu_run_resumes_with_the_thread_count_it_began_with(tiny_cifar10, tmp_path, monkeypatch):
    """torch's CPU kernels sum in an order that depends on the thread count, so a resume in a
    process with another count (another machine, another OMP_NUM_THREADS) would continue with
    other bits: the checkpoint records the count, every epoch of the run trains with it, and the
    caller's count is left as it was."""
    root, _ = tiny_cifar10
    seen = []
    train_epoch = train.train_epoch

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return train_epoch(*args, **kwargs)

    monkeypatch.setattr(train, "train_epoch", counting)
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--stop-after", "1"))
    assert torch.load(tmp_path / train.CHECKPOINT, weights_only=True)["config"]["threads"] == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--resume"))
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)  # the next tests' count (main leaves the caller's, 2)


def test_resume_refuses_a_checkpoint_whose_data_orders_came_from_the_seed_itself(
    tiny_cifar10, tmp_path
):
    """Checkpoints written before the orders took order_seed(seed) have no data_order: resuming
    one would silently continue with other data orders, so it is refused."""
    root, _ = tiny_cifar10
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--stop-after", "1"))
    state = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)
    assert state["config"]["data_order"] == "order_seed"
    del state["config"]["data_order"]
    torch.save(state, tmp_path / train.CHECKPOINT)
    with pytest.raises(SystemExit, match="'data_order': \\(None, 'order_seed'\\)"):
        train.main(run_args(root, tmp_path, "fp32", "--epochs", "2", "--resume"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipe", "fp8", "--fake-data", "8"], "unknown recipe 'fp8'; choose from fp32, fp16"),
        (["--fake-data", "8"], "--recipe is required"),
        (["--recipe", "fp32"], "give either --data-dir (CIFAR10) or --fake-data N"),
        (["--recipe", "fp32", "--fake-data", "8", "--data-dir", "x"], "give either --data-dir"),
        (["--recipe", "fp32", "--fake-data", "8", "--epochs", "0"], "--epochs: must be a positive"),
        (["--recipe", "fp32", "--fake-data", "8", "--batch-size", "-4"], "--batch-size: must be a"),
        (
            ["--recipe", "fp32", "--fake-data", "8", "--lr", "nan"],
            "--lr: must be a positive number",
        ),
        (
            ["--recipe", "wage", "--fake-data", "8", "--lr", "3"],
            "WAGE's learning rate must be a power",
        ),
        (
            ["--recipe", "swalp", "--fake-data", "8", "--epochs", "3", "--swa-start", "3"],
            "--swa-start must lie between 1 and epochs - 1 = 2",
        ),
        (
            ["--recipe", "fp16", "--fake-data", "8", "--swa-start", "3"],
            "recipe fp16 does not average weights",
        ),
        (["--recipe", "fp32", "--fake-data", "8", "--seed", "-1"], "--seed: must be an integer"),
        (
            ["--recipe", "fp32", "--fake-data", "8", "--seed", str(2**70)],
            f"--seed: must be an integer from 0 to 2**32 - 1 = {2**32 - 1}, got {2**70}",
        ),
        (["--recipe", "fp32", "--fake-data", "8", "--device", "tpu"], "--device"),
        (["--recipe", "fp32", "--fake-data", "8", "--resume"], "--resume: no checkpoint at"),
    ],
)
def test_bad_arguments_give_clear_errors(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main([*argv, "--out-dir", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_an_existing_checkpoint_is_not_overwritten(tmp_path, capsys):
    (tmp_path / train.CHECKPOINT).write_bytes(b"")
    with pytest.raises(SystemExit):
        train.main(["--recipe", "fp32", "--fake-data", "8", "--out-dir", str(tmp_path)])
    assert "exists: pass --resume" in capsys.readouterr().err


def test_cuda_device_without_a_gpu_is_an_error(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        train.main(
            ["--recipe", "fp32", "--fake-data", "8", "--device", "cuda", "--out-dir", str(tmp_path)]
        )
    assert "no CUDA device is available" in capsys.readouterr().err


def test_fake_data_run_and_recipe_listing(tmp_path, capsys):
    history = train.main(
        [
            "--recipe",
            "block8",
            "--fake-data",
            "40",
            "--epochs",
            "1",
            "--batch-size",
            "20",
            "--width",
            "0.125",
            "--out-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert len(history) == 1 and math.isfinite(float(history[0]["test_loss"]))
    train.main(["--list-recipes"])
    listing = capsys.readouterr().out
    assert all(f"{name} " in listing for name in recipes.RECIPES)


def test_summary_reports_no_fake_unverified_or_unfinished_run_as_a_result(tiny_cifar10, tmp_path):
    root, _ = tiny_cifar10
    runs = tmp_path / "runs"
    train.main(run_args(root, runs / "swalp", "swalp", "--epochs", "2"))
    train.main(run_args(root, runs / "wage", "wage", "--epochs", "2", "--stop-after", "1"))
    train.main(
        [
            "--recipe",
            "fp32",
            "--fake-data",
            "16",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--width",
            "0.125",
            "--out-dir",
            str(runs / "fp32"),
            "--no-progress",
        ]
    )
    text = summarize.main(["--runs", str(runs), "--out", str(tmp_path / "results" / "t.md")])
    rows = {r["run"]: r for r in summarize.collect(runs)}
    assert rows["swalp"]["status"] == "not a result: data cifar10-unverified"
    assert rows["swalp"]["epochs"] == "2/2" and rows["swalp"]["swa_test_error"]
    assert rows["swalp"]["test_error"] == read_log(runs / "swalp")[-1]["test_error"]
    assert (
        rows["wage"]["epochs"] == "1/2" and rows["fp32"]["status"] == "not a result: data fake:16"
    )
    assert all(r["status"] != "result" for r in rows.values())
    assert (tmp_path / "results" / "t.md").read_text() == text + "\n"


@pytest.mark.parametrize("name", ["fp16", "block8", "swalp"])
def test_evaluation_rounds_stochastically_as_the_examples_quantisers_do(name):
    # QPyTorch's quantiser modules round as in training whatever the module's mode, so its
    # examples' test errors are measured with stochastic activations (and SWALP's SGD-LP model).
    recipe = recipes.RECIPES[name]
    torch.manual_seed(0)
    model = build_model(recipe.model, width=0.0625, **dict(recipe.model_options))
    model, _ = recipe.prepare(model, recipe.lr)
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    logits = {}
    with torch.no_grad():
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            logits.setdefault(seed, []).append(model(x))
    assert torch.equal(logits[1][0], logits[1][1])
    assert not torch.equal(logits[1][0], logits[2][0])


def test_summary_reports_a_run_only_in_its_recipes_own_configuration_as_a_result(tmp_path):
    # Finished runs on the verified release (what train.py writes: a checkpoint's config and a
    # log with one row per epoch); only the one with the recipe's own settings is a result.
    def write_run(name: str, **changes) -> None:
        recipe = recipes.RECIPES["swalp"]
        config = {
            "recipe": recipe.name,
            "epochs": recipe.epochs,
            "schedule_epochs": recipe.epochs,
            "batch_size": recipe.batch_size,
            "lr": recipe.lr,
            "seed": 0,
            "swa_start": 200,  # 2/3 of 300 epochs, as examples/SWALP/example.sh
            "width": 1.0,
            "world_size": 1,
            "data": "cifar10",
        }
        config.update(changes)
        folder = tmp_path / name
        folder.mkdir()
        torch.save({"config": config}, folder / train.CHECKPOINT)
        rows = [{c: "" for c in train.COLUMNS} | {"epoch": e + 1} for e in range(config["epochs"])]
        with open(folder / train.LOG, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=train.COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    write_run("published")
    write_run("short", epochs=3, schedule_epochs=3, swa_start=2)
    write_run("extended", epochs=310)
    write_run("other_lr", lr=0.1)
    write_run("other_batch", batch_size=256)
    write_run("other_swa_start", swa_start=150)
    write_run("narrow", width=0.5)
    rows = {r["run"]: r for r in summarize.collect(tmp_path)}
    assert rows["published"]["status"] == "result"
    assert [r for r in rows if rows[r]["status"] == "result"] == ["published"]
    assert "epochs 3 (recipe: 300)" in rows["short"]["status"]
    assert "lr 0.1 (recipe: 0.05)" in rows["other_lr"]["status"]


def test_summary_reports_no_run_in_several_processes_as_a_result(tiny_cifar10, tmp_path):
    """Every process of a torchrun run draws the same random numbers, so that its stochastic
    rounding rounds the weights as the others do: the processes' shares of the batch get the same
    dropout masks and stochastic-rounding draws (one process draws anew for each image), and
    block8's shared exponents, WAGE's shifts and ibm8's batch norms span one share. Such a run is
    another simulation than the recipe's, and the summary says so. The shares' draws are checked
    on a recipe's model: rank 1's share gets rank 0's draws."""

    def config(name: str, world_size: int) -> dict:
        recipe = recipes.RECIPES[name]
        return {
            "recipe": name,
            "epochs": recipe.epochs,
            "batch_size": recipe.batch_size,
            "lr": recipe.lr,
            "swa_start": recipe.default_swa_start(recipe.epochs),
            "width": 1.0,
            "world_size": world_size,
            "data": "cifar10",
        }

    for name, recipe in recipes.RECIPES.items():
        assert summarize.departures(config(name, 1)) == []
        assert summarize.departures(config(name, 2)) == [f"2 processes: {recipe.multi_process}"]
        assert recipe.multi_process
    recipe = recipes.RECIPES["fp16"]
    torch.manual_seed(0)
    model, _ = recipe.prepare(build_model("vgg16", width=0.0625), recipe.lr)
    model.train()
    x = torch.randn(4, 3, 32, 32)
    x[2:] = x[:2]  # the global batch: two shares of the same two images
    ranks = []
    for share in (x[:2], x[2:]):  # every rank starts its step from the same generator state
        torch.manual_seed(1)
        ranks.append(model(share))
    torch.manual_seed(1)
    one = model(x)  # one process: the same images get other masks and draws
    assert torch.equal(ranks[0], ranks[1]) and not torch.equal(one[:2], one[2:])


# What the command line promises


def test_a_swalp_run_too_short_to_average_names_the_epochs_it_needs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(
            ["--recipe", "swalp", "--fake-data", "8", "--epochs", "1", "--out-dir", str(tmp_path)]
        )
    err = capsys.readouterr().err
    assert "needs --epochs 2 or more, got 1" in err and "--swa-start must lie" not in err


@pytest.mark.parametrize("epochs, start", [(2, 1), (3, 2), (4, 2), (30, 20), (300, 200)])
def test_the_swa_start_scales_with_the_epochs_and_leaves_an_epoch_on_each_side(epochs, start):
    assert recipes.RECIPES["swalp"].default_swa_start(epochs) == start


def test_missing_data_message_names_the_directory_and_download(tmp_path, capsys):
    data = tmp_path / "data"
    with pytest.raises(SystemExit):
        train.main(["--recipe", "fp32", "--data-dir", str(data), "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert f"expected in {(data / 'cifar-10-batches-py').resolve()}" in err
    assert "pass --download to fetch it there" in err and "download=True" not in err


def test_download_flag_makes_torchvision_fetch_into_the_data_dir(tmp_path, monkeypatch):
    import torchvision

    fetched = []

    def download(self):  # torchvision's CIFAR10.download, without the network
        fetched.append(pathlib.Path(self.root))
        if not (pathlib.Path(self.root) / "cifar-10-batches-py").exists():
            write_tiny_cifar10(pathlib.Path(self.root))

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", download)
    data = tmp_path / "data"
    history = train.main(run_args(data, tmp_path / "run", "fp32", "--epochs", "1", "--download"))
    assert fetched == [data, data] and len(history) == 1  # the training and the test split


def test_unverified_data_applies_only_to_the_data_dir(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(
            ["--recipe", "fp32", "--fake-data", "8", "--unverified-data", "--epochs", "1"]
            + ["--width", "0.0625", "--no-progress", "--out-dir", str(tmp_path)]
        )
    assert "--unverified-data reads CIFAR10 from --data-dir" in capsys.readouterr().err
    assert not (tmp_path / train.CHECKPOINT).exists()


def test_readme_names_the_download_option_where_it_says_where_cifar10_comes_from():
    """The README's CIFAR10 section says where DATA comes from: with --download the trainer
    fetches it (test_download_flag_makes_torchvision_fetch_into_the_data_dir), so the README
    may not say that nothing is downloaded."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Reproducing CIFAR10") :]
    section = section[: section.index("\n## ", 1)]
    assert "`--download`" in section and "(nothing is downloaded)" not in section


def test_download_applies_only_to_the_data_dir(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(
            ["--recipe", "fp32", "--fake-data", "8", "--download", "--out-dir", str(tmp_path)]
        )
    assert "--download fetches CIFAR10 into --data-dir" in capsys.readouterr().err


def test_resuming_a_finished_run_says_so_and_how_to_extend_it(tiny_cifar10, tmp_path, capsys):
    root, _ = tiny_cifar10
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "1"))
    capsys.readouterr()
    for again in ([], ["--epochs", "1"]):  # the epochs come from the checkpoint unless given
        history = train.main(run_args(root, tmp_path, "fp32", "--resume", *again))
        out = capsys.readouterr().out
        assert "already finished its 1 epoch" in out and "--resume --epochs M with M > 1" in out
        assert len(history) == 1 and len(read_log(tmp_path)) == 1


def test_resuming_a_finished_run_restores_a_log_that_missed_its_last_epoch(tiny_cifar10, tmp_path):
    """train.py writes the checkpoint, then the log: stopped between the two after the last
    epoch, the log lacks that epoch and summarize would call the run unfinished. --resume on the
    finished run writes the log again from the checkpoint's history."""
    root, _ = tiny_cifar10
    out = tmp_path / "run"  # summarize reads every run below tmp_path, this one only
    train.main(run_args(root, out, "fp32", "--epochs", "2"))
    complete = read_log(out)
    lines = (out / train.LOG).read_text().splitlines(keepends=True)
    (out / train.LOG).write_text("".join(lines[:-1]))  # the log as of epoch 1
    train.main(run_args(root, out, "fp32", "--epochs", "2", "--resume"))
    assert read_log(out) == complete
    rows = {r["run"]: r for r in summarize.collect(tmp_path)}
    assert rows["run"]["epochs"] == "2/2"


def test_resuming_a_finished_run_redraws_curves_that_missed_its_last_epoch(tiny_cifar10, tmp_path):
    """The curves are drawn after the log: stopped between the two after the last epoch, the
    run has no curves of that epoch. --resume on the finished run draws them again."""
    root, _ = tiny_cifar10
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "1"))
    (tmp_path / train.CURVES).unlink()
    train.main(run_args(root, tmp_path, "fp32", "--epochs", "1", "--resume"))
    assert (tmp_path / train.CURVES).is_file()


@pytest.mark.parametrize("recipe, final_lr", [("fp32", 0.05 * 0.01), ("swalp", 0.01)])
def test_resume_with_more_epochs_trains_them_at_the_rate_the_schedule_ended_on(
    recipe, final_lr, tiny_cifar10, tmp_path, capsys
):
    root, _ = tiny_cifar10
    train.main(run_args(root, tmp_path, recipe, "--epochs", "2"))
    before = read_log(tmp_path)
    with pytest.raises(SystemExit):
        train.main(run_args(root, tmp_path, recipe, "--resume", "--epochs", "1"))
    assert "--epochs can only grow" in capsys.readouterr().err
    history = train.main(run_args(root, tmp_path, recipe, "--resume", "--epochs", "4"))
    log = read_log(tmp_path)
    assert len(history) == 4 and [row["epoch"] for row in log] == ["1", "2", "3", "4"]
    assert without_times(log[:2]) == without_times(before)
    assert [float(row["lr"]) for row in log[2:]] == pytest.approx([final_lr] * 2)
    state = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)
    assert state["epoch"] == 4 and state["config"]["epochs"] == 4
    assert state["config"]["schedule_epochs"] == 2
    if recipe == "swalp":  # averaging goes on: epochs 2, 3 and 4 are in the average
        assert state["swa"]["count"] == 3 and all(row["swa_test_error"] for row in log[1:])
    assert "the schedule spans the first 2" in capsys.readouterr().out


def test_curves_are_plotted_after_every_epoch(tiny_cifar10, tmp_path):
    root, _ = tiny_cifar10
    curves = tmp_path / train.CURVES
    train.main(run_args(root, tmp_path, "swalp", "--epochs", "2", "--stop-after", "1"))
    assert curves.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    curves.unlink()
    train.main(run_args(root, tmp_path, "swalp", "--epochs", "2", "--resume"))
    assert curves.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert not list(tmp_path.glob("*.tmp"))


# The training benchmark


def test_training_benchmark_times_every_recipe_against_float32(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_training
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = bench_training.main(
        [
            "--models",
            "vgg16,vgg7",
            "--width",
            "0.125",
            "--batch-size",
            "2",
            "--repeat",
            "1",
            "--warmup",
            "1",
            "--no-compile",
            "--device",
            "cpu",
        ]
    )
    assert [(r["model"], r["recipe"]) for r in rows] == [
        ("vgg16", "fp16"),
        ("vgg16", "block8"),
        ("vgg16", "swalp"),
        ("vgg16", "ibm8"),
        ("vgg7", "wage"),
    ]
    assert all(r["ratio"] > 0 and r["mode"] == "eager" for r in rows)
    printed = capsys.readouterr().out
    assert "| vgg7 | wage |" in printed and "timed alternately with float32" in printed
    with pytest.raises(SystemExit):
        bench_training.main(["--recipes", "fp8"])
    assert "unknown recipe 'fp8'" in capsys.readouterr().err


def test_ibm8_and_swalp_deviations_name_what_their_papers_do_differently():
    """The ibm8 recipe sums products in float32 (QPyTorch's example does too), where Wang et al.
    accumulate in FP16 chunks; the swalp recipe follows QPyTorch's example, whose placement,
    blocks and initialisation differ from the SWALP authors' code. Both say so."""
    ibm8 = " ".join(recipes.IBM8.deviations)
    assert "chunk-based accumulation" in ibm8 and "Wang et al." in ibm8
    assert recipes.IBM8.quantization.loss_scale == 1000.0
    swalp = " ".join(recipes.SWALP.deviations)
    assert "stevenygd/SWALP" in swalp and "after every ReLU" in swalp
    assert recipes.SWALP.placement is recipes.after_weight_layers_but_last
    assert dict(recipes.SWALP.model_options)["conv_init"] == "fan_in"
    assert recipes.SWALP.quantization.activation == (BlockFloat(8, dim=0), "stochastic")


def test_block8_follows_qpytorchs_block_baseline_script():
    """block8's source is the script QPyTorch ships (sample_scripts/block_baseline.sh: VGG16LP,
    200 epochs, lr 0.05, wd 5e-4, 8-bit block floating point per tensor, stochastic)."""
    r = recipes.BLOCK8
    assert r.source == "examples/lp_train/sample_scripts/block_baseline.sh"
    assert (r.model, r.epochs, r.lr, r.weight_decay, r.batch_size) == (
        "vgg16",
        200,
        0.05,
        5e-4,
        128,
    )
    for category in ("weight", "activation", "error", "grad", "momentum"):
        assert getattr(r.quantization, category) == (BlockFloat(8), "stochastic")


def test_wage_inputs_are_mapped_to_minus_one_to_one_as_in_the_example():
    """QPyTorch's examples/WAGE reads images with ToTensor ([0, 1]) and its training and test
    loops (utils.train_epoch, utils.eval) map them with input_v * 2 - 1: the recipe's inputs are
    that, bit for bit, and its deviations claim no difference there."""
    images = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(1, 3, 16, 16)
    x = train.to_inputs(recipes.WAGE, images)
    example = TF.to_tensor(images[0].permute(1, 2, 0).numpy())[None] * 2 - 1
    assert torch.equal(x, example)
    assert (x.min().item(), x.max().item()) == (-1.0, 1.0)
    assert not any("[0, 1]" in d or "input" in d.lower() for d in recipes.WAGE.deviations)


def test_ibm8_deviations_name_its_tie_rule_and_e6m9_range_where_qpytorch_differs():
    """QPyTorch's float quantiser rounds ties away from zero and keeps e6m9's top exponent finite,
    saturating (docs/migrating-from-qtorch.md; tests/test_qtorch_claims.py checks QPyTorch
    itself): 1.125 becomes 1.25 in its e5m2 and 5e9 stays finite in its e6m9. The ibm8 recipe's
    formats give 1.0 and Inf, and its deviations say so."""
    ibm8 = recipes.IBM8.quantization
    e5m2, rule = ibm8.weight
    assert rule == "nearest" and lpsim.quantize(torch.tensor([1.125]), e5m2, rule).item() == 1.0
    e6m9, _ = ibm8.momentum
    assert recipes.IBM8_EDGE == (e6m9, "nearest")
    assert lpsim.quantize(torch.tensor([5e9]), e6m9, "nearest").item() == math.inf
    assert lpsim.quantize(torch.tensor([2.0**31 * (2 - 2**-9)]), e6m9).item() < math.inf
    said = " ".join(recipes.IBM8.deviations)
    assert "ties to even" in said and "away from zero" in said
    assert "overflows to Inf" in said and "saturates there" in said


@pytest.mark.parametrize("name", ["fp16", "wage"])
def test_each_process_backpropagates_the_errors_of_one_process_on_the_whole_batch(name):
    """Under torchrun each process differentiates its share of the batch: the errors at its
    logits must be those one process training on the whole batch computes for those images, bit
    for bit, for any number of processes (3 here); the processes' gradients are then summed.
    With the cross-entropy's mean over the share they were world_size times larger, which the
    recipes' error formats round otherwise where world_size is not a power of two."""
    recipe = recipes.RECIPES[name]
    torch.manual_seed(0)
    logits = torch.randn(6, 10)
    labels = torch.randint(0, 10, (6,))
    batch_sums = shares_backpropagate_the_whole_batch(
        lambda x, t: recipe.criterion(x, t)[0], recipe.criterion, logits, labels, 3
    )
    logged = sum(float(s) for s in batch_sums)
    assert logged == pytest.approx(float(recipe.criterion(logits, labels)[1]), rel=1e-6)

"""The character-level GPT experiment (experiments/gpt): the corpus and its batches, the model's
products, what every recipe quantises, that every recipe learns, the trainer's bit-exact resume,
its argument errors, the comparison of all recipes, and two gloo processes."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from support import (  # noqa: E402
    run_two_gloo_processes,
    shares_backpropagate_the_whole_batch,
    tensors_equal,
    without_times,
)

import lpsim  # noqa: E402
from experiments.gpt import recipes, results, train  # noqa: E402
from experiments.gpt.data import TRAIN_FRACTION, corpus_text, load_corpus  # noqa: E402
from experiments.gpt.model import GPT, GPTConfig  # noqa: E402
from lpsim import Float  # noqa: E402
from lpsim.delayed_scaling import DelayedScaling  # noqa: E402
from lpsim.nn import injected  # noqa: E402
from lpsim.scaled import Scaled, preset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TINY = [
    "--steps",
    "6",
    "--batch-size",
    "4",
    "--context",
    "16",
    "--width",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--eval-every",
    "3",
    "--val-windows",
    "4",
    "--threads",
    "1",
    "--no-progress",
]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def tiny_model(corpus, width=16, layers=1, heads=2, context=16) -> GPT:
    return GPT(GPTConfig(corpus.vocab_size, context, layers, width, heads))


# The corpus


def test_corpus_is_the_help_topics_in_key_order_split_90_10(corpus):
    from pydoc_data.topics import topics

    assert corpus.text == "".join(topics[k] for k in sorted(topics)) == corpus_text()
    assert list(corpus.vocabulary) == sorted(set(corpus.text))
    assert corpus.decode(corpus.tokens[:500]) == corpus.text[:500]
    assert corpus.split == int(TRAIN_FRACTION * len(corpus.text))
    assert torch.equal(torch.cat([corpus.train, corpus.validation]), corpus.tokens)
    assert corpus.fingerprint == load_corpus(corpus.text).fingerprint


def test_training_batches_are_windows_drawn_from_seed_and_step(corpus):
    inputs, targets = corpus.training_batch(7, 5, 32, seed=3)
    again = corpus.training_batch(7, 5, 32, seed=3)
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
    assert not torch.equal(inputs, corpus.training_batch(8, 5, 32, seed=3)[0])
    assert not torch.equal(inputs, corpus.training_batch(7, 5, 32, seed=4)[0])
    generator = torch.Generator().manual_seed((3 * 0x9E3779B1 + 7) % 2**32)
    starts = torch.randint(0, corpus.split - 32, (5,), generator=generator)
    for row, start in enumerate(starts.tolist()):
        assert torch.equal(inputs[row], corpus.train[start : start + 32])
        assert torch.equal(targets[row], corpus.train[start + 1 : start + 33])  # shifted by one
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (5, 32)


def test_validation_windows_are_fixed_and_span_the_split(corpus):
    inputs, targets = corpus.validation_windows(9, 20)
    assert torch.equal(inputs, corpus.validation_windows(9, 20)[0])
    assert torch.equal(inputs[0], corpus.validation[:20])
    assert torch.equal(targets[-1], corpus.validation[-20:])  # the last start leaves the target
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_corpus_refuses_windows_it_cannot_hold(corpus):
    with pytest.raises(ValueError, match="context must lie between 1 and"):
        corpus.training_batch(0, 2, len(corpus.validation), seed=0)
    with pytest.raises(ValueError, match="seed must lie in"):
        corpus.training_batch(0, 2, 8, seed=-1)


# The model


def test_logits_depend_only_on_earlier_tokens(corpus):
    torch.manual_seed(0)
    model = tiny_model(corpus, context=12)
    tokens = corpus.training_batch(0, 2, 12, seed=0)[0]
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % corpus.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :7], b[:, :7]) and not torch.equal(a[:, 7:], b[:, 7:])


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_every_product_is_a_linear_or_scaled_dot_product_attention(corpus):
    layers = 2
    model = tiny_model(corpus, layers=layers)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 4 * layers + 1 and linears[-1] == recipes.HEAD
    with _Calls() as mode:
        model(corpus.training_batch(0, 2, 16, seed=0)[0])
    products = {torch.matmul, torch.mm, torch.bmm, torch.einsum, torch.addmm, torch.baddbmm}
    products |= {torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm}
    assert not products & set(mode.calls)
    assert mode.calls.count(F.linear) == 4 * layers + 1
    assert mode.calls.count(F.scaled_dot_product_attention) == layers


def test_initialisation_is_gpt2s(corpus):
    torch.manual_seed(0)
    model = tiny_model(corpus, width=64, layers=2)
    std = lambda t: float(t.detach().std())  # noqa: E731
    assert abs(std(model.blocks[0].mlp.hidden.weight) - 0.02) < 0.002
    assert abs(std(model.blocks[1].mlp.output.weight) - 0.01) < 0.001  # 0.02 / sqrt(2 * 2)
    assert abs(std(model.token_embedding.weight) - 0.02) < 0.003
    biases = [m.bias.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(not b.any() for b in biases)
    with pytest.raises(ValueError, match="heads \\(3\\) must divide width \\(16\\)"):
        GPTConfig(10, heads=3, width=16)


# The recipes


def layer_settings(model) -> dict:
    return {name: done for name, _, done in injected(model)}


def test_fp8_recipes_quantise_every_linear_but_the_head(corpus):
    model, optimizer, functions = build("fp8-current", corpus)
    done = layer_settings(model)
    assert recipes.HEAD not in done and len(done) == 4
    e4m3, e5m2 = preset("fp8_e4m3_tensor"), preset("fp8_e5m2_tensor")
    for settings in done.values():
        assert settings["input"].format == e4m3 and settings["error"].format == e5m2
        assert [s.format for _, s in settings["weight"]] == [e4m3]
        assert settings["output"] is None and not settings["bias"]
    assert type(optimizer) is torch.optim.AdamW
    assert functions["attention.scores"].input[0] == e4m3
    assert functions["attention.context"].error[0] == e5m2
    delayed, _, functions = build("fp8-delayed", corpus)
    for settings in layer_settings(delayed).values():
        scaling = settings["input"].format
        assert isinstance(scaling, DelayedScaling) and scaling.history_length == 16
        assert scaling.reduction == "max" and scaling.element == e4m3.element
        assert settings["error"].format.element == e5m2.element
    assert isinstance(functions["attention.scores"].weight[0], DelayedScaling)


def test_mxfp8_blocks_along_each_products_reduction(corpus):
    model, optimizer, functions = build("mxfp8", corpus)
    for settings in layer_settings(model).values():
        for spec in (settings["input"], settings["error"], *(s for _, s in settings["weight"])):
            assert isinstance(spec.format, Scaled) and spec.format.block == 32
            assert spec.format.axis == -1
    scores, context = functions["attention.scores"], functions["attention.context"]
    for product in (scores, context):
        assert product.input[0].axis == -1 and product.weight[0].axis == -2  # q, p; k^T, v
        assert product.error[0].axis == -1 and product.input[0].block == 32
    assert type(optimizer) is torch.optim.AdamW


@pytest.mark.parametrize("name, block", [("mxfp4", 32), ("nvfp4", 16)])
def test_fp4_recipes_quantise_each_backward_operand_along_its_products_reduction(
    name, block, corpus
):
    model, optimizer, functions = build(name, corpus)
    done = layer_settings(model)
    assert recipes.HEAD not in done and len(done) == 4
    for settings in done.values():
        assert settings["error"] is None  # each backward product quantises the error itself
        input_grad, weight_grad = settings["operands"]
        assert input_grad.error.rounding.is_stochastic and weight_grad.error.rounding.is_stochastic
        assert weight_grad.transform == recipes.HADAMARD and input_grad.transform is None
        for spec in (settings["input"], input_grad.error, weight_grad.error, weight_grad.other):
            assert spec.format.block == block and spec.format.axis == -1
    weights = [s.format.block for settings in done.values() for _, s in settings["weight"]]
    assert set(weights) == {32 if name == "mxfp4" else (16, 16)}
    if name == "mxfp4":  # stochastic operands take round-up scales: none saturates
        assert input_grad.other.rounding.is_stochastic
        assert {input_grad.error.format.scale_rule, weight_grad.other.format.scale_rule} == {
            "rceil"
        }
    else:  # NVFP4's 16x16 weight tiles serve the input gradient as they are
        assert input_grad.other is None and not weight_grad.other.rounding.is_stochastic
    for product in (functions["attention.scores"], functions["attention.context"]):
        error_format, error_rounding = product.error
        assert error_format == input_grad.error.format and error_rounding == "stochastic"
    assert type(optimizer) is torch.optim.AdamW


def test_bf16_recipes_keep_every_weight_in_bfloat16_without_a_master_copy(corpus):
    for name, rounding in (("bf16-nearest", "nearest"), ("bf16-stochastic", "stochastic")):
        model, optimizer, functions = build(name, corpus)
        assert isinstance(optimizer, lpsim.optim.AdamW) and functions is None
        assert all(g["weight_format"] == Float(8, 7) for g in optimizer.param_groups)
        assert all(g["rounding"] == rounding for g in optimizer.param_groups)
        for p in model.parameters():
            assert torch.equal(p, p.to(torch.bfloat16).float())
        done = layer_settings(model)
        assert len(done) == 5 and recipes.HEAD in done  # every Linear, the head too
        for settings in done.values():
            assert {settings[k].format for k in ("input", "output", "error")} == {Float(8, 7)}


def test_hopper_recipes_sum_every_product_on_the_tensor_core(corpus):
    for name, model_name in (("fp8-hopper", "H100/e4m3"), ("fp8-hopper-promoted", "DeepSeek-V3")):
        recipe = recipes.RECIPES[name]
        assert recipe.cpu_only
        mac = recipes.scaled_operands_mac(model_name)
        # The preset's tensor core, but each scaled operand aligned by its own exponent.
        assert mac.tensor_core.operands is None
        assert dataclasses.replace(mac.tensor_core, operands=Float(4, 3, special="fn")) == (
            lpsim.mac.preset(model_name).tensor_core
        )
        model, _, functions = build(name, corpus)
        for settings in layer_settings(model).values():
            assert settings["macs"] == (mac, mac, mac)  # forward, input and weight gradients
        fp8 = recipes.RECIPES["fp8-current"].functions
        assert functions == {k: dataclasses.replace(v, mac=mac) for k, v in fp8.items()}


def build(name, corpus, **shape):
    torch.manual_seed(0)
    return recipes.RECIPES[name].build(
        tiny_model(corpus, **shape), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), seed=0
    )


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_every_recipe_learns_a_repeated_batch(name, corpus):
    model, optimizer, _ = build(name, corpus)
    context, _ = train.functions_context(model, recipes.RECIPES[name])
    inputs, targets = corpus.training_batch(0, 4, 16, seed=0)
    losses = []
    for _ in range(12):
        with context():
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.8 * losses[0], losses


def test_learning_rate_warms_up_then_follows_a_cosine_to_a_tenth():
    steps, warmup = 100, 5
    factors = [train.lr_factor(s, steps, warmup) for s in range(steps)]
    assert factors[:5] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert factors[-1] == pytest.approx(train.FINAL_LR_FACTOR)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[52] == pytest.approx(0.55)  # halfway through the cosine


def test_the_last_step_after_the_warmup_takes_a_tenth_of_the_peak_rate():
    """The schedule as the trainer's docstring states it, for every run length up to 60 steps:
    a warmup of ceil(5% of the steps) steps at (step + 1) / warmup, then a half cosine whose
    last step is at 10% of the peak (two steps: warmup 1, and the second step, the cosine's
    only one, at 10%)."""
    for steps in range(1, 61):
        warmup = max(1, math.ceil(steps * 5 / 100))
        assert train.Settings("fp32", steps, 1, 1, 1, 1, 1, 1.0, 0, 1, 1, 1, "").warmup == warmup
        factors = [train.lr_factor(s, steps, warmup) for s in range(steps)]
        assert factors[:warmup] == [(s + 1) / warmup for s in range(warmup)]
        if steps > warmup:
            assert factors[warmup] == 1.0 or steps == warmup + 1
            assert factors[-1] == pytest.approx(train.FINAL_LR_FACTOR, abs=1e-15), steps
    assert train.lr_factor(1, 2, 1) == train.FINAL_LR_FACTOR


# The trainer


@pytest.mark.parametrize("name", ["bf16-stochastic", "fp8-delayed", "mxfp4"])
def test_resume_continues_bit_identically(name, tmp_path):
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    train.main(["--recipe", name, *TINY, "--out-dir", str(straight)])
    train.main(["--recipe", name, *TINY, "--out-dir", str(pieces), "--stop-after", "4"])
    assert torch.load(pieces / train.CHECKPOINT, weights_only=True)["step"] == 4
    train.main(["--recipe", name, "--out-dir", str(pieces), "--resume", "--no-progress"])
    a = torch.load(straight / train.CHECKPOINT, weights_only=True)
    b = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    for key in ("model", "optimizer", "scheduler", "rng", "functions", "step", "settings"):
        assert tensors_equal(a[key], b[key]), key
    assert a["step"] == 6 and [int(r["step"]) for r in a["history"]] == [0, 3, 6]
    assert without_times(a["history"]) == without_times(b["history"])
    log = results.read_log(pieces / train.LOG)
    assert without_times(log) == without_times(results.read_log(straight / train.LOG))
    assert (pieces / train.CURVES).is_file()


def test_resume_takes_the_thread_count_from_the_checkpoint(tmp_path, capsys):
    """A run started on one thread (--threads 1, as --short's) and resumed without --threads
    trains on one thread again, bit for bit the run never interrupted (it took torch's default
    thread count, on which torch's CPU kernels give other bits); another --threads is refused."""
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    train.main(["--recipe", "fp32", *TINY, "--out-dir", str(straight)])
    train.main(["--recipe", "fp32", *TINY, "--out-dir", str(pieces), "--stop-after", "2"])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's choice in the resuming process
    try:
        capsys.readouterr()
        train.main(["--recipe", "fp32", "--out-dir", str(pieces), "--resume", "--no-progress"])
        assert "(1 process on cpu, 1 thread)" in capsys.readouterr().out
        assert torch.get_num_threads() == 2  # the caller's count, as it was
    finally:
        torch.set_num_threads(threads)  # the next tests' (main no longer leaves it at 1)
    a = torch.load(straight / train.CHECKPOINT, weights_only=True)
    b = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    assert a["settings"]["threads"] == b["settings"]["threads"] == 1
    assert tensors_equal(a["model"], b["model"]) and tensors_equal(a["optimizer"], b["optimizer"])
    with pytest.raises(SystemExit, match="'threads': \\(1, 2\\)"):
        train.main(["--recipe", "fp32", "--out-dir", str(pieces), "--resume", "--threads", "2"])


def test_resume_refuses_a_checkpoint_of_another_device_type(tmp_path):
    """Stochastic rounding draws from the generator of the device that trains, and a checkpoint
    holds only that device type's generator state: a GPU run resumed on the CPU (--device auto
    where CUDA is missing), or a CPU run on a GPU, would continue with another random stream. The
    device type is one of the settings a resume keeps; a checkpoint written without it counts as
    trained where its random state says (no CUDA generator state: the CPU), and resumes."""
    name = "bf16-stochastic"
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    train.main(["--recipe", name, *TINY, "--out-dir", str(straight)])
    train.main(["--recipe", name, *TINY, "--out-dir", str(pieces), "--stop-after", "4"])
    state = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    assert state["settings"]["device"] == "cpu" and state["rng"]["cuda"] is None
    state["settings"]["device"] = "cuda"  # as written by a GPU run
    torch.save(state, pieces / train.CHECKPOINT)
    resume = ["--recipe", name, "--out-dir", str(pieces), "--resume", "--no-progress"]
    with pytest.raises(SystemExit, match="'device': \\('cuda', 'cpu'\\)"):
        train.main(resume)
    del state["settings"]["device"]  # a checkpoint from before the key: its random state says cpu
    torch.save(state, pieces / train.CHECKPOINT)
    train.main(resume)
    a = torch.load(straight / train.CHECKPOINT, weights_only=True)
    b = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    assert tensors_equal(a["model"], b["model"]) and tensors_equal(a["rng"], b["rng"])
    state["rng"]["cuda"] = torch.zeros(16, dtype=torch.uint8)  # an older GPU run's checkpoint
    torch.save(state, pieces / train.CHECKPOINT)
    with pytest.raises(SystemExit, match="'device': \\('cuda', 'cpu'\\)"):
        train.main(resume)


def test_a_random_state_is_restored_only_on_its_own_device_type():
    """A checkpoint's random state holds the generator of the device type that trained: restoring
    it on another type is refused instead of leaving that type's generator as it was."""
    from experiments.runs import rng_state, set_rng_state

    state = rng_state(torch.device("cpu"))
    with pytest.raises(ValueError, match="taken on a cpu device and cannot be restored on cuda"):
        set_rng_state(torch.device("cuda"), state)
    with pytest.raises(ValueError, match="taken on a cuda device and cannot be restored on cpu"):
        set_rng_state(torch.device("cpu"), {**state, "cuda": torch.zeros(16, dtype=torch.uint8)})
    drawn = torch.rand(4)
    set_rng_state(torch.device("cpu"), state)
    assert torch.equal(torch.rand(4), drawn)


def test_resume_refuses_other_settings_and_finished_runs_say_so(tmp_path, capsys):
    train.main(["--recipe", "fp32", *TINY, "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="belongs to another run.*'seed': \\(0, 1\\)"):
        train.main(["--recipe", "fp32", "--out-dir", str(tmp_path), "--resume", "--seed", "1"])
    history = train.main(["--recipe", "fp32", "--out-dir", str(tmp_path), "--resume"])
    assert "has finished its 6 steps" in capsys.readouterr().out and len(history) == 3


def test_resuming_a_finished_run_restores_a_log_and_curves_that_missed_its_last_evaluation(
    tmp_path,
):
    """The trainer writes the checkpoint, then the log, then the curves: stopped between them
    after the last evaluation, the log lacks that row (and the curves that point). --resume on
    the finished run writes both again from the checkpoint's history."""
    train.main(["--recipe", "fp32", *TINY, "--out-dir", str(tmp_path)])
    complete = results.read_log(tmp_path / train.LOG)
    assert [int(r["step"]) for r in complete] == [0, 3, 6]
    lines = (tmp_path / train.LOG).read_text().splitlines(keepends=True)
    (tmp_path / train.LOG).write_text("".join(lines[:-1]))  # the log as of step 3
    (tmp_path / train.CURVES).unlink()
    train.main(["--recipe", "fp32", "--out-dir", str(tmp_path), "--resume", "--no-progress"])
    assert results.read_log(tmp_path / train.LOG) == complete
    assert (tmp_path / train.CURVES).is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipe", "fp4"], "unknown recipe 'fp4'; choose from fp32, bf16-nearest"),
        ([], "--recipe is required"),
        (["--recipe", "fp32", "--steps", "0"], "--steps: must be a positive integer"),
        (["--recipe", "fp32", "--batch-size", "-2"], "--batch-size: must be a positive"),
        (["--recipe", "fp32", "--lr", "inf"], "--lr: must be a positive number"),
        (["--recipe", "fp32", "--seed", "-1"], "--seed: must be an integer from 0"),
        (["--recipe", "fp32", "--width", "30", "--heads", "4"], "--heads 4 must divide --width 30"),
        (["--recipe", "fp32", "--context", "10000000"], "--context: context must lie between"),
        (["--recipe", "fp32", "--device", "tpu"], "--device"),
        (["--recipe", "fp32", "--resume"], "--resume: no checkpoint at"),
    ],
)
def test_bad_arguments_name_the_parameter(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main([*argv, "--out-dir", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_fp4_recipes_refuse_steps_whose_tokens_their_hadamard_transform_cannot_group(
    tmp_path, capsys
):
    """The FP4 recipes' weight-gradient transform mixes groups of 16 tokens: a step of 7 tokens
    is refused before anything trains, naming the settings (it failed in the first backward
    pass, after step 0's checkpoint, with the transform's own message)."""
    for name in ("mxfp4", "nvfp4"):
        out = tmp_path / name
        with pytest.raises(SystemExit):
            train.main(
                [
                    "--recipe",
                    name,
                    *TINY,
                    "--batch-size",
                    "1",
                    "--context",
                    "7",
                    "--out-dir",
                    str(out),
                ]
            )
        error = capsys.readouterr().err
        assert "--batch-size 1 / 1 process(es) times --context 7, must be a multiple of 16" in error
        assert not out.exists()
    odd = ["--batch-size", "2", "--context", "8", "--steps", "1", "--eval-every", "1"]
    history = train.main(["--recipe", "nvfp4", *TINY, *odd, "--out-dir", str(tmp_path / "16")])
    assert [int(r["step"]) for r in history] == [0, 1]


def test_batches_must_split_over_the_processes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        train.main(["--recipe", "fp32", "--batch-size", "5", "--out-dir", str(tmp_path)])
    assert "--batch-size 5 is not divisible by the 2 processes" in capsys.readouterr().err


def test_an_existing_checkpoint_is_not_overwritten(tmp_path, capsys):
    (tmp_path / train.CHECKPOINT).write_bytes(b"")
    with pytest.raises(SystemExit):
        train.main(["--recipe", "fp32", "--out-dir", str(tmp_path)])
    assert "exists: pass --resume" in capsys.readouterr().err


def test_tensor_core_recipes_need_the_cpu(tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("the refusal needs a GPU to refuse")
    with pytest.raises(SystemExit):
        train.main(["--recipe", "fp8-hopper", "--device", "cuda", "--out-dir", str(tmp_path)])
    assert "runs on the CPU only: use --device cpu" in capsys.readouterr().err


def test_all_recipes_give_the_table_and_the_plot(tmp_path, capsys):
    runs = train.main(["--recipe", "all", *TINY, "--out-dir", str(tmp_path)])
    assert list(runs) == list(recipes.RECIPES) and all(runs.values())
    table = (tmp_path / train.TABLE).read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(recipes.RECIPES)
    fp32 = rows[0].split("|")
    assert fp32[4].strip() == "+0.0000" and fp32[6].strip() == "1.0x"
    assert "--recipe all --steps 6 --batch-size 4 --context 16" in table
    assert (tmp_path / train.PLOT).stat().st_size > 0
    for name in recipes.RECIPES:
        assert (tmp_path / name / train.CHECKPOINT).is_file()
    with pytest.raises(SystemExit):  # the runs exist: --resume or another directory
        train.main(["--recipe", "all", *TINY, "--out-dir", str(tmp_path)])
    assert "checkpoints exist" in capsys.readouterr().err
    again = train.main(["--recipe", "all", "--resume", "--out-dir", str(tmp_path)])
    assert without_times(again["fp32"]) == without_times(runs["fp32"])


def test_recipe_all_resume_starts_the_missing_runs_with_the_saved_runs_settings(tmp_path, corpus):
    """--recipe all --resume after an interrupted --recipe all: the runs without a checkpoint
    train with the settings of those that have one (they started from DEFAULTS, 4 layers of
    width 128 for 5000 steps, under a table labelled with the saved runs' settings), and
    checkpoints of different settings, which one comparison cannot hold, are refused."""
    first = ["--recipe", "fp32", *TINY, "--stop-after", "1"]
    train.main([*first, "--out-dir", str(tmp_path / "fp32")])
    saved = torch.load(tmp_path / "fp32" / train.CHECKPOINT, weights_only=True)["settings"]
    p = train.parser()
    args = p.parse_args(["--recipe", "all", "--resume", "--out-dir", str(tmp_path)])
    runs = train.plan(train.Session(args, p, corpus))
    assert list(runs) == list(recipes.RECIPES)
    for name, run in runs.items():
        assert dataclasses.asdict(run.settings) == {**saved, "recipe": name}, name
    other = ["--recipe", "mxfp8", *TINY, "--steps", "5", "--stop-after", "1"]
    train.main([*other, "--out-dir", str(tmp_path / "mxfp8")])
    with pytest.raises(SystemExit, match="other settings.*'steps': \\(6, 5\\)"):
        train.plan(train.Session(args, p, corpus))


def test_a_comparison_trained_in_several_processes_says_what_it_is_not(
    tmp_path, corpus, monkeypatch
):
    """Every process of a torchrun run draws the same random numbers, and a per-tensor scale spans
    one process's share of the batch: gpt.md from such a run names the launcher and the process
    count, and says which recipes were not their one-process simulation and why (it read as
    "Written by python -m experiments.gpt.train --recipe all", the single-process table)."""
    history = [{"step": 0, "validation_loss": "4.0", "tokens": 0, "train_seconds": "0"}]
    history += [{"step": 6, "validation_loss": "3.0", "tokens": 96, "train_seconds": "1"}]
    runs = {name: history for name in recipes.RECIPES}
    p = train.parser()
    args = p.parse_args(["--recipe", "all", *TINY, "--device", "cpu"])
    texts = {}
    for world_size in (1, 2):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        session = train.Session(args, p, corpus)
        values = {
            **train.DEFAULTS,
            **{k: v for k, v in session.requested.items() if k in train.DEFAULTS},
        }
        settings = train.Settings(
            recipe="fp32", world_size=world_size, corpus="x", threads=1, **values
        )
        out = tmp_path / str(world_size)
        train.write_comparison(session, runs, out, settings)
        texts[world_size] = (out / train.TABLE).read_text()
    assert "Written by `python -m experiments.gpt.train --recipe all --steps 6" in texts[1]
    assert "processes" not in texts[1].replace("1 process,", "")
    two = texts[2]
    assert "Written by `torchrun (2 processes) -m experiments.gpt.train --recipe all" in two
    differing = [n for n, r in recipes.RECIPES.items() if r.multi_process]
    assert set(differing) == {"fp8-current", "mxfp4", "nvfp4", "fp8-hopper", "fp8-hopper-promoted"}
    assert f"{', '.join(differing)} are not the recipes' one-process simulation" in two
    for name in differing:
        assert f"- `{name}`: {recipes.RECIPES[name].multi_process}" in two


@pytest.mark.parametrize("name", ["fp32", "mxfp8"])
def test_validation_loss_is_the_exact_mean_whatever_the_chunks(name, tmp_path, corpus):
    """The validation loss of recipes without a per-tensor scale does not depend on --batch-size
    (the chunks evaluation runs in), as experiments/README.md says: it is the mean of every
    position's float32 cross-entropy (torch's, window by window), summed exactly (Fraction) and
    rounded once, then divided by the count. A float32 sum per chunk made it differ by a few
    units in the 7th digit between batch sizes."""
    from fractions import Fraction

    recipe = recipes.RECIPES[name]
    p = train.parser()
    values = []
    for batch in (1, 3, 8, 16):
        argv = ["--recipe", name, *TINY, "--batch-size", str(batch), "--val-windows", "16"]
        session = train.Session(p.parse_args(argv), p, corpus)
        run = train.Run(session, recipe, tmp_path / "none", resume=False)
        torch.manual_seed(0)
        model, _, _ = recipe.build(
            tiny_model(corpus), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99), seed=0
        )
        context, _ = train.functions_context(model, recipe)
        windows = corpus.validation_windows(16, 16)
        values.append(train.evaluate(run, model, context, windows))
    model.eval()
    exact = Fraction(0)
    with torch.no_grad():
        for x, y in zip(*windows):
            with context():
                logits = model(x[None])
            losses = F.cross_entropy(logits[0], y, reduction="none")
            exact += sum(Fraction(float(v)) for v in losses)
    assert values == [float(exact) / (16 * 16)] * 4


def test_recipe_listing_names_every_recipe(capsys):
    train.main(["--list-recipes"])
    listing = capsys.readouterr().out
    assert [line.split()[0] for line in listing.splitlines()] == list(recipes.RECIPES)


def test_the_short_options_help_names_every_setting_it_changes():
    """--help's line for --short lists the whole configuration: a setting it changes without
    saying (heads, the evaluation interval, the validation windows) read as the default's."""
    text = " ".join(train.parser().format_help().split())
    options = text[text.index("options:") :]  # past the usage line
    short = options[options.index("--short") : options.index("--steps")]
    s = train.SHORT
    for phrase in (
        f"{s['layers']} layers",
        f"width {s['width']}",
        f"{s['heads']} heads",
        f"context {s['context']}",
        f"batch {s['batch_size']}",
        f"{s['steps']} steps",
        "lr 3e-3",
        f"every {s['eval_every']} steps",
        f"{s['val_windows']} validation windows",
        "one thread",
    ):
        assert phrase in short, phrase
    assert s["lr"] == 3e-3 and train.SHORT_THREADS == 1


def test_two_gloo_processes_keep_identical_weights(tmp_path):
    args = ["--recipe", "bf16-stochastic", *TINY, "--device", "cpu", "--out-dir", str(tmp_path)]
    stdout = run_two_gloo_processes("experiments.gpt.train", args)
    assert "(2 processes on cpu" in stdout
    state = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)
    assert state["settings"]["world_size"] == 2
    digests = state["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert [int(r["step"]) for r in state["history"]] == [0, 3, 6]


def test_each_process_backpropagates_the_errors_of_one_process_on_the_whole_batch():
    """Under torchrun each process differentiates its share of the batch: the errors flowing
    back through its model must be those one process training on the whole batch computes for
    those rows, bit for bit (the recipes round them), for any number of processes. With the
    mean over its own share they were world_size times larger: rounded otherwise by every error
    format where world_size is not a power of two (3 here)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 5, 7)
    targets = torch.randint(0, 7, (6, 5))
    means = shares_backpropagate_the_whole_batch(
        lambda x, t: F.cross_entropy(x.flatten(0, 1), t.flatten()),
        train.step_loss,
        logits,
        targets,
        3,
    )
    for rank, mean in enumerate(means):
        rows = slice(2 * rank, 2 * rank + 2)
        expected = F.cross_entropy(logits[rows].flatten(0, 1), targets[rows].flatten())
        assert torch.equal(mean, expected)


def test_two_processes_take_the_gradient_of_the_whole_batch(tmp_path):
    """DistributedDataParallel sums the processes' gradients, each of its share's loss over the
    whole batch: the first step's gradient (AdamW's first moment, 0.1 g, unclipped) is one
    process's on the whole batch, up to the order of float32 sums."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["--recipe", "fp32", *TINY, "--device", "cpu", "--stop-after", "1"]
    train.main([*args, "--out-dir", str(one)])
    run_two_gloo_processes("experiments.gpt.train", [*args, "--out-dir", str(two)])
    a = torch.load(one / train.CHECKPOINT, weights_only=True)["optimizer"]["state"]
    b = torch.load(two / train.CHECKPOINT, weights_only=True)["optimizer"]["state"]
    norm = math.sqrt(sum(float(s["exp_avg"].square().sum()) for s in a.values())) / 0.1
    assert norm < 1  # unclipped
    for key in a:
        torch.testing.assert_close(b[key]["exp_avg"], a[key]["exp_avg"], rtol=1e-4, atol=1e-9)


def test_two_processes_resumed_between_evaluations_log_the_ranks_mean_training_loss(tmp_path):
    """A two-process run resumed from a checkpoint written between two evaluations (--stop-after)
    logs the training loss of the uninterrupted run: the mean over both ranks' batches of the
    steps before the checkpoint too (every rank restarted from rank 0's partial sum, so those
    steps counted rank 0's batches only)."""
    args = ["--recipe", "fp32", *TINY, "--device", "cpu"]
    straight, pieces = tmp_path / "straight", tmp_path / "pieces"
    run_two_gloo_processes("experiments.gpt.train", [*args, "--out-dir", str(straight)])
    first = [*args, "--out-dir", str(pieces), "--stop-after", "2"]
    run_two_gloo_processes("experiments.gpt.train", first)
    resume = ["--recipe", "fp32", "--device", "cpu", "--no-progress", "--resume"]
    run_two_gloo_processes("experiments.gpt.train", [*resume, "--out-dir", str(pieces)])
    a = torch.load(straight / train.CHECKPOINT, weights_only=True)
    b = torch.load(pieces / train.CHECKPOINT, weights_only=True)
    assert tensors_equal(a["model"], b["model"])
    assert without_times(a["history"]) == without_times(b["history"])


def test_settings_round_trip_through_the_checkpoint():
    settings = train.Settings(recipe="fp32", world_size=1, corpus="x", **train.DEFAULTS)
    assert train.Settings(**dataclasses.asdict(settings)) == settings
    assert settings.warmup == 250 and train.command_line(settings) == "--recipe all"


def test_the_tables_command_line_gives_the_runs_learning_rate():
    """gpt.md names the command that trains its runs: a learning rate of more than six
    significant digits is written in full (it was written with :g, 0.00123457 for 0.0012345678,
    another run), and the command line parsed back gives the same settings."""
    values = {**train.DEFAULTS, "lr": 0.0012345678, "steps": 7}
    settings = train.Settings(recipe="fp32", world_size=1, corpus="x", **values)
    words = train.command_line(settings).split()
    assert words[words.index("--lr") + 1] == "0.0012345678"
    args = train.parser().parse_args(words)
    assert {k: getattr(args, k) for k in ("lr", "steps")} == {"lr": 0.0012345678, "steps": 7}


def test_the_tables_command_line_keeps_deterministic_kernels():
    """A comparison trained with --deterministic names the flag in its command line (a flag, not
    a value), and parsed back the command asks for it; without it the flag is absent."""
    values = {**train.DEFAULTS, "deterministic": True}
    settings = train.Settings(recipe="fp32", world_size=1, corpus="x", **values)
    words = train.command_line(settings).split()
    assert "--deterministic" in words and train.parser().parse_args(words).deterministic is True
    plain = dataclasses.replace(settings, deterministic=None)
    assert train.parser().parse_args(train.command_line(plain).split()).deterministic is None


def test_deterministic_kernels_are_chosen_on_a_gpu_only_and_put_back_after():
    """--deterministic turns on torch's deterministic algorithms and turns off cuDNN's benchmark
    for a CUDA run, and puts the caller's settings back when the run ends; on a CPU, where torch's
    kernels give the same bits for a fixed thread count, it changes nothing."""
    from experiments.runs import kernels_chosen

    before = (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    with kernels_chosen(torch.device("cuda"), True):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cudnn.benchmark
    assert (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()) == before
    with kernels_chosen(torch.device("cuda"), False):
        assert torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled() == before[1]
    with kernels_chosen(torch.device("cpu"), True):
        assert (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()) == (
            before
        )
    assert (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()) == before


def test_a_cpu_run_records_deterministic_as_not_set(tmp_path):
    """On a CPU --deterministic changes nothing, and the checkpoint records it as not set (None):
    a CPU run resumed with or without the flag is the same run."""
    train.main(
        [
            "--recipe",
            "fp32",
            *TINY,
            "--device",
            "cpu",
            "--stop-after",
            "1",
            "--deterministic",
            "--out-dir",
            str(tmp_path),
        ]
    )
    saved = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)["settings"]
    assert saved["deterministic"] is None
    history = train.main(["--recipe", "fp32", "--out-dir", str(tmp_path), "--resume"])
    assert int(history[-1]["step"]) == 6


def test_recipes_named_after_publications_state_their_deviations():
    """mxfp4 quantises the forward products Tseng et al. keep in BF16, nvfp4 the layers NVIDIA
    keeps in BF16, fp8-hopper-promoted uses per-tensor E4M3/E5M2 operands rather than DeepSeek-V3's
    1x128/128x128 E4M3 tiles; each recipe's deviations say so, and the code does what they say."""
    from lpsim.scaled import preset

    mxfp4 = " ".join(recipes.RECIPES["mxfp4"].deviations)
    assert "keep the forward products in higher precision (BF16)" in mxfp4
    assert recipes.MXFP4_LINEAR.input == (preset("mxfp4_e2m1"), "nearest")
    nvfp4 = " ".join(recipes.RECIPES["nvfp4"].deviations)
    assert "BF16" in nvfp4 and "every Linear but the head" in nvfp4
    promoted = recipes.RECIPES["fp8-hopper-promoted"]
    assert "1x128" in " ".join(promoted.deviations)
    model = GPT(GPTConfig(vocab_size=8, context=4, width=8, layers=1, heads=1))
    linear = next(v for k, v in promoted.layers(model).items() if k != recipes.HEAD and v)
    assert linear.input == (preset("fp8_e4m3_tensor"), "nearest")
    assert linear.error == (preset("fp8_e5m2_tensor"), "nearest")
    assert "reduction axis" in " ".join(recipes.RECIPES["mxfp8"].deviations)
    assert recipes.RECIPES["fp32"].deviations == ()


# Diagnostics on the GPT


def test_shadow_reference_inside_the_attention_context_is_torchs_float32_gpt(corpus):
    """Shadow.compare called inside the recipe's quantize_functions context (so that the
    simulated model's attention products are quantised) runs the reference with every call
    torch's own: its loss and gradients are the plain GPT's on the same weights, bit for bit,
    and the context's delayed scalers are left as they were."""
    torch.manual_seed(0)
    plain = tiny_model(corpus)
    model, _, _ = recipes.RECIPES["fp8-delayed"].build(
        GPT(plain.config), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), seed=0
    )
    model.load_state_dict(plain.state_dict(), strict=False)
    context, mode = train.functions_context(model, recipes.RECIPES["fp8-delayed"])
    inputs, targets = corpus.training_batch(0, 4, 16, seed=0)

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    with context():  # one training step: the attention sites get their scalers
        loss_fn(model(inputs)).backward()
    scalers = {k: v.clone() for k, v in mode.scalers.state_dict().items()}
    shadow = lpsim.diagnostics.Shadow(model)
    with context():
        report = shadow.compare(inputs, loss_fn)
    after = mode.scalers.state_dict()
    assert after.keys() == scalers.keys()
    assert all(torch.equal(after[k], v) for k, v in scalers.items())
    assert report.reference_loss == loss_fn(plain(inputs)).item()
    with context():
        simulated = loss_fn(model(inputs)).item()
    assert report.simulated_loss == simulated != report.reference_loss
    block = plain.blocks[0]
    with torch.no_grad():
        x = plain.token_embedding(inputs) + plain.position_embedding(torch.arange(16))
        attention = block.attention(block.attention_norm(x)).double()
    row = next(r for r in report.modules if r.module == "blocks.0.attention.output")
    assert row.reference_activation_norm == math.sqrt(float(attention.square().sum()))


def test_a_shadow_made_inside_the_attention_context_leaves_the_context_as_it_was(corpus):
    """A Shadow made while the context is active deep-copies the model with the context's hooks
    on its modules: the copies must not enter the context's running stack (the next forward of
    a config with a module selector failed with a KeyError, and calls were sited at the
    reference's modules)."""
    torch.manual_seed(0)
    plain = tiny_model(corpus)
    model = GPT(plain.config)
    model.load_state_dict(plain.state_dict())
    e4m3 = (Float(4, 3), "nearest")
    config = {("attention.scores", "blocks.*"): lpsim.nn.LayerQuantization(input=e4m3, weight=e4m3)}
    inputs, targets = corpus.training_batch(0, 4, 16, seed=0)

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    functions = lpsim.nn.quantize_functions(model, config)
    with functions:
        expected = model(inputs)
    with functions:
        report = lpsim.diagnostics.Shadow(model).compare(inputs, loss_fn)
        after = model(inputs)
    assert torch.equal(after, expected) and report.simulated_loss == loss_fn(expected).item()
    assert report.reference_loss == loss_fn(plain(inputs)).item()
    assert not torch.equal(expected, plain(inputs))  # the context quantises


# The trainer against quantisers placed by hand


class _QuantiseError(torch.autograd.Function):
    """The identity forward; the gradient rounded by ``round(grad)`` backward."""

    @staticmethod
    def forward(ctx, x, round):
        ctx.round = round
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.round(grad), None


def _hand_placed_forward(model, tokens, operand, error):
    """The GPT's forward with the quantisers the FP8 and scaled recipes' docs place, by hand:
    every Linear but the head rounds its input and weight by ``operand(x, site)`` and its error
    by ``error(grad, site)``; the scores product q k^T and the context product p v round q, k^T,
    p and v by ``operand`` and their errors by ``error``; float32 products, scale after the scores
    product, causal mask, float32 softmax. ``site`` names the tensor ("blocks.0.mlp.hidden.input",
    "blocks.0.attention.scores.weight", "blocks.0.attention.context.error", ...)."""

    def q(x, site):  # straight-through rounding
        return x + (operand(x.detach(), site) - x).detach()

    def e(y, site):
        return _QuantiseError.apply(y, lambda grad: error(grad, site + ".error"))

    def linear(name, layer, x):
        y = F.linear(q(x, name + ".input"), q(layer.weight, name + ".weight"), layer.bias)
        return e(y, name)

    length = tokens.shape[1]
    x = model.token_embedding(tokens) + model.position_embedding(torch.arange(length))
    mask = torch.ones(length, length, dtype=torch.bool).triu(1)
    for i, block in enumerate(model.blocks):
        at = f"blocks.{i}.attention"
        attention = block.attention
        h = block.attention_norm(x)
        batch, _, width = h.shape
        shape = (batch, length, attention.heads, width // attention.heads)
        qs, ks, vs = (
            t.reshape(shape).transpose(1, 2)
            for t in linear(f"{at}.qkv", attention.qkv, h).split(width, 2)
        )
        scores = q(qs, f"{at}.scores.input") @ q(ks.transpose(-2, -1), f"{at}.scores.weight")
        scores = e(scores, f"{at}.scores")
        scores = (scores * (1 / math.sqrt(width // attention.heads))).masked_fill(mask, -math.inf)
        p = torch.softmax(scores, -1)
        context = e(q(p, f"{at}.context.input") @ q(vs, f"{at}.context.weight"), f"{at}.context")
        context = context.transpose(1, 2).reshape(batch, length, width)
        x = x + linear(f"{at}.output", attention.output, context)
        mlp = f"blocks.{i}.mlp"
        hidden = F.gelu(linear(f"{mlp}.hidden", block.mlp.hidden, block.mlp_norm(x)))
        x = x + linear(f"{mlp}.output", block.mlp.output, hidden)
    return model.head(model.final_norm(x))


@pytest.mark.parametrize("name", ["fp8-current", "mxfp8"])
def test_trainer_runs_are_the_hand_placed_recipes_bit_for_bit(name, tmp_path, corpus):
    """What the results table's losses come from: the trainer's run (clipping, schedule,
    evaluations between the steps) ends on the weights of a loop written from the docs, with
    the quantisers placed by hand, torch's AdamW, clip_grad_norm_ and the documented schedule."""
    train.main(["--recipe", name, *TINY, "--out-dir", str(tmp_path)])
    saved = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)["model"]
    e4m3, e5m2 = ("mxfp8_e4m3", "mxfp8_e5m2") if name == "mxfp8" else ("fp8_e4m3", "fp8_e5m2")
    if name != "mxfp8":
        e4m3, e5m2 = e4m3 + "_tensor", e5m2 + "_tensor"
    forward, error = (preset(e4m3), "nearest"), (preset(e5m2), "nearest")
    second = (dataclasses.replace(preset(e4m3), axis=-2), "nearest") if name == "mxfp8" else forward

    def operand(x, site):  # k^T and v: blocks along their axis -2, each product's reduction
        weight = site.endswith(("scores.weight", "context.weight"))
        return lpsim.quantize(x, *(second if weight else forward))

    def rounded_error(grad, site):
        return lpsim.quantize(grad, *error)

    _train_by_hand_and_compare(corpus, operand, rounded_error, saved)


def _train_by_hand_and_compare(corpus, operand, rounded_error, saved) -> None:
    """TINY's six steps written from the docs (seed 0, _hand_placed_forward with these
    roundings, torch's AdamW with the weight-decay groups, clip_grad_norm_ at 1, the schedule:
    linear warm-up over ceil(5%) of the steps, then a cosine from 1 to 0.1), and the weights
    they end on compared bit for bit with the trainer's checkpoint ``saved``."""
    torch.manual_seed(0)
    model = tiny_model(corpus)
    optimizer = torch.optim.AdamW(recipes.parameter_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.99))
    steps, warmup = 6, 1  # ceil(5% of 6)
    for step in range(steps):
        for group in optimizer.param_groups:
            progress = min(1.0, (step - warmup) / (steps - 1 - warmup))
            cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
            group["lr"] = 1e-3 * ((step + 1) / warmup if step < warmup else cosine)
        inputs, targets = corpus.training_batch(step, 4, 16, 0)
        logits = _hand_placed_forward(model, inputs, operand, rounded_error)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    for key, value in model.state_dict().items():
        original = key.replace("weight", "parametrizations.weight.original")
        assert torch.equal(saved[original if original in saved else key], value), key


def test_bf16_nearest_run_is_the_documented_arithmetic_bit_for_bit(tmp_path, corpus):
    """What the table's bf16-nearest row comes from: the trainer's run ends on the weights of a
    loop written from recipes.py's docstring: every parameter a bfloat16 value, every Linear
    (the head too) with bfloat16 inputs, outputs and errors (round to nearest), attention and
    the rest float32, torch's clipping and schedule, and AdamW's update (torch's moments and
    terms, decay on the matrices) added exactly to the weight and rounded once to nearest
    bfloat16 (gfloat's rounding of the float64 sum)."""
    from gfloat import round_ndarray
    from gfloat.formats import format_info_bfloat16

    train.main(["--recipe", "bf16-nearest", *TINY, "--out-dir", str(tmp_path)])
    saved = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)["model"]

    def bf16(x):
        return x.to(torch.bfloat16).float()

    def to_bf16(x64):  # float64 -> bfloat16 values, one rounding to nearest even
        return torch.from_numpy(round_ndarray(format_info_bfloat16, x64.numpy())).float()

    def linear(layer, x):
        x = x + (bf16(x.detach()) - x).detach()
        y = F.linear(x, layer.weight, layer.bias)
        return _QuantiseError.apply(y + (bf16(y.detach()) - y).detach(), bf16)

    def forward(model, tokens):
        length = tokens.shape[1]
        x = model.token_embedding(tokens) + model.position_embedding(torch.arange(length))
        for block in model.blocks:
            attention, h = block.attention, block.attention_norm(x)
            batch, _, width = h.shape
            shape = (batch, length, attention.heads, width // attention.heads)
            q, k, v = (
                t.reshape(shape).transpose(1, 2) for t in linear(attention.qkv, h).split(width, 2)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + linear(attention.output, y.transpose(1, 2).reshape(batch, length, width))
            x = x + linear(block.mlp.output, F.gelu(linear(block.mlp.hidden, block.mlp_norm(x))))
        return linear(model.head, model.final_norm(x))

    torch.manual_seed(0)
    model = tiny_model(corpus)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(bf16(p))
    groups = recipes.parameter_groups(model, 0.1)
    moments = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()}
    steps, warmup = 6, 1
    for step in range(steps):
        lr = 1e-3 * train.lr_factor(step, steps, warmup)
        inputs, targets = corpus.training_batch(step, 4, 16, 0)
        loss = F.cross_entropy(forward(model, inputs).flatten(0, 1), targets.flatten())
        model.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            for group in groups:
                for p in group["params"]:
                    m, v = moments[p]
                    m.lerp_(p.grad, 0.1)
                    v.mul_(0.99).addcmul_(p.grad, p.grad, value=0.01)
                    denom = v.sqrt().div_((1 - 0.99 ** (step + 1)) ** 0.5).add_(1e-8)
                    decay = lr * group["weight_decay"]
                    term = torch.addcdiv(p * -decay, m, denom, value=-lr / (1 - 0.9 ** (step + 1)))
                    p.copy_(to_bf16(p.double() + term.double()))
    for key, value in model.state_dict().items():
        assert torch.equal(saved[key], value), key


class _DelayedScalerModel:
    """Delayed scaling as lpsim.delayed_scaling's docstring states it, written with ml_dtypes:
    y = x * scale in float32, rounded to nearest even onto the saturating FP8 format, times
    1 / scale; then amax = max |x| enters a history of 16 (oldest out) and scale = fp8 max /
    the history's largest amax (scale 1 at the first call)."""

    def __init__(self, dtype, largest: float):
        self.dtype, self.largest = dtype, largest
        self.history = torch.zeros(16)
        self.scale = self.inverse = torch.tensor(1.0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * self.scale).clamp(-self.largest, self.largest).numpy()
        rounded = torch.from_numpy(y.astype(self.dtype).astype(np.float32)) * self.inverse
        self.history = torch.cat([self.history[1:], x.abs().max().reshape(1)])
        self.scale = torch.tensor(self.largest) / self.history.max()
        self.inverse = 1 / self.scale
        return rounded


def test_fp8_delayed_run_is_delayed_scaling_placed_by_hand_bit_for_bit(tmp_path, corpus):
    """What the table's fp8-delayed row comes from: the trainer's run (evaluations in eval mode
    between the steps recording nothing) ends on the weights of a loop with one delayed scaler
    per tensor, written from the docs (E4M3 Linear inputs and weights and attention's q, k^T, p,
    v; E5M2 errors; history 16, max), torch's AdamW, clipping and schedule."""
    import ml_dtypes

    train.main(["--recipe", "fp8-delayed", *TINY, "--out-dir", str(tmp_path)])
    saved = torch.load(tmp_path / train.CHECKPOINT, weights_only=True)["model"]
    scalers = {}

    def scaler(site, dtype, largest):
        return scalers.setdefault(site, _DelayedScalerModel(dtype, largest))

    def operand(x, site):
        return scaler(site, ml_dtypes.float8_e4m3fn, 448.0)(x)

    def rounded_error(grad, site):
        return scaler(site, ml_dtypes.float8_e5m2, 57344.0)(grad)

    _train_by_hand_and_compare(corpus, operand, rounded_error, saved)
    assert len(scalers) == 4 * 3 + 2 * 3  # four Linear layers, two attention products

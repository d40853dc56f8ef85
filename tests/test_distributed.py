"""Quantised training under DistributedDataParallel (2 processes, gloo, CPU) keeps the ranks'
weights identical: every rank draws the same random words from the same seeds."""

import contextlib
import copy
import datetime
import functools
import io
import math
import os
import socket
import traceback

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support import tensors_equal
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import lpsim
from lpsim import Float
from lpsim.delayed_scaling import DelayedScaling
from lpsim.diagnostics.recorder import Recorder
from lpsim.diagnostics.shadow import Shadow
from lpsim.nn import LayerQuantization, Quantizer, inject, report
from lpsim.optim import SGD, AdamW, DynamicLossScaler, FusedAdam, FusedSGD, OptimLP


def _train_classifier(ddp, opt, steps, rank) -> None:
    """Steps of _classifier_on_grid's model on rank's own batches (8 x 6 inputs, 3 classes)."""
    for step in steps:
        data = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 6, generator=data)
        y = torch.randint(0, 3, (8,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def _classifier_on_grid(fmt):
    """A small classifier (seed 0) whose parameters are rounded to nearest into fmt."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16))
    model.append(nn.ReLU()).append(nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            lpsim.quantize_(p, fmt, "nearest")
    return model


def _train_on_rank_batches(ddp, opt, rank, steps=3, shape=(8, 6), classes=3):
    """``steps`` SGD steps of a classifier under DDP, each rank on its own random batches."""
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(*shape, generator=data)
        y = torch.randint(0, classes, (shape[0],), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same initial weights and the same random stream on every rank
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        e5m2, bf16 = Float(5, 2), Float(8, 7)
        inject(model, {nn.Linear: LayerQuantization(weight=e5m2, output=bf16, error=e5m2)})
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = OptimLP(
            torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9),
            weight=e5m2,
            grad=e5m2,
            momentum=bf16,
            acc=Float(6, 9),
        )
        _train_on_rank_batches(ddp, opt, rank, steps=5, shape=(16, 10), classes=4)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        if rank == 0:
            results.put(
                (
                    bool(torch.equal(gathered[0], gathered[1])),
                    bool(torch.equal(lpsim.quantize(flat, e5m2, "nearest"), flat)),
                )
            )
    finally:
        # Both ranks leave together: a rank that tears gloo down while the other still talks to
        # it can abort the process ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


def test_ddp_ranks_keep_identical_quantised_weights():
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = mp.start_processes(
        _worker, args=(2, _free_port(), results), nprocs=2, start_method="spawn", join=False
    )
    identical, quantised = results.get(timeout=300)
    assert identical and quantised
    try:
        while not workers.join():
            pass
    except mp.ProcessExitedException as error:
        # On a loaded machine gloo occasionally aborts a process while it tears down ("terminate
        # called without an active exception", about 1 run in 20 here), after the results above
        # were sent. Any other failure of a worker is a failure of the test.
        if error.signal_name != "SIGABRT":
            raise


def _gloo_process(rank: int, world: int, port: int, results, work, args) -> None:
    """One rank: work(rank, *args) in a gloo process group, its value sent to the parent as bytes
    (a tensor sent as itself is shared through a file that may vanish when its process ends,
    before it is read); a failure is sent as its traceback at once, without waiting for the
    other rank (which the parent then ends)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        saved = io.BytesIO()
        torch.save(work(rank, *args), saved)
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise
    results.put((rank, saved.getvalue(), ""))
    dist.barrier()  # see _worker
    dist.destroy_process_group()


def _spawn_two(work, *args):
    """work(rank, *args) in 2 gloo processes; their values by rank.

    Raises:
        AssertionError: a rank failed (its traceback is the message).
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = mp.start_processes(
        _gloo_process,
        args=(2, _free_port(), results, work, args),
        nprocs=2,
        start_method="spawn",
        join=False,
    )
    got = {}
    for _ in range(2):
        rank, saved, failure = results.get(timeout=300)
        if saved is None:
            for process in workers.processes:
                process.kill()
            raise AssertionError(f"rank {rank} failed:\n{failure}")
        got[rank] = torch.load(io.BytesIO(saved), weights_only=True)
    try:
        while not workers.join():
            pass
    except mp.ProcessExitedException as error:
        if error.signal_name != "SIGABRT":  # see test_ddp_ranks_keep_identical_quantised_weights
            raise
    return got


def _flat_state(state) -> torch.Tensor:
    """Every number in a (nested) state_dict, as float64, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return state.detach().double().flatten()
    if isinstance(state, dict):
        parts = [_flat_state(state[k]) for k in sorted(state, key=str)]
    elif isinstance(state, (list, tuple)):
        parts = [_flat_state(v) for v in state]
    elif isinstance(state, (int, float)) and not isinstance(state, bool):
        parts = [torch.tensor([float(state)], dtype=torch.float64)]
    else:
        parts = []
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _make_optimizer(kind: str, params, e5m2, bf16):
    if kind == "OptimLP":
        sgd = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return OptimLP(sgd, weight=e5m2, grad=e5m2, momentum=bf16, acc=Float(6, 9))
    if kind == "FusedSGD":
        return FusedSGD(
            params, lr=0.05, momentum=0.9, weight_format=e5m2, grad_format=e5m2, state_format=bf16
        )
    if kind == "FusedAdam":
        return FusedAdam(params, lr=0.01, weight_format=e5m2, grad_format=e5m2, state_format=bf16)
    if kind == "SGD":
        return SGD(params, lr=0.05, momentum=0.9, weight_format=e5m2, state_format=bf16)
    return AdamW(params, lr=0.01, weight_format=e5m2, state_format=bf16)


def _scaled_training(rank: int, kinds) -> dict:
    """Per optimizer kind: 4 iterations of 2 micro-batches (the first under no_sync), stochastic
    rounding of weights, inputs, outputs and errors, each rank its own batches, a
    DynamicLossScaler watching a saturating error format whose errors overflow on rank 1 only in
    iteration 1. Returns {kind: (all the state as float64, the skipped steps, a draw of the random
    stream afterwards)}."""
    got = {}
    for kind in kinds:
        torch.manual_seed(0)
        e5m2, bf16 = Float(5, 2), Float(8, 7)
        saturating = Float(5, 2, saturate=True)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        spec = LayerQuantization(weight=e5m2, input=bf16, output=bf16, error=saturating)
        inject(model, {nn.Linear: spec})
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = _make_optimizer(kind, ddp.parameters(), e5m2, bf16)
        scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
        scaler.watch_model(model)
        data = torch.Generator().manual_seed(100 + rank)
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                x = torch.randn(8, 6, generator=data)
                y = torch.randint(0, 3, (8,), generator=data)
                boost = 2.0**16 if (step, rank) == (1, 1) else 1.0  # e5m2's max is 57344
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    loss = nn.functional.cross_entropy(ddp(x), y) * boost
                    scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        state = [model.state_dict(), opt.state_dict(), scaler.state_dict()]
        got[kind] = (_flat_state(state), scaler.skipped_steps, torch.rand(()))
    return got


def test_ddp_loss_scaler_overflow_on_one_rank_skips_the_step_on_every_rank():
    """A watched (saturating) error format overflows on rank 1 only: every rank skips that step
    and backs off, as torch.amp.GradScaler's ranks all skip when one rank's gradient is not finite
    (the all-reduce spreads it), and the weights, optimizer states, scaler states and random
    streams stay identical, for every optimizer, with no_sync accumulation and stochastic
    rounding everywhere."""
    kinds = ("OptimLP", "FusedSGD", "FusedAdam", "SGD", "AdamW")
    got = _spawn_two(_scaled_training, kinds)
    for kind in kinds:
        (state0, skipped0, draw0), (state1, skipped1, draw1) = got[0][kind], got[1][kind]
        assert skipped0 == skipped1 == 1, kind
        assert torch.equal(state0, state1), kind
        assert torch.equal(draw0, draw1), kind


def _uneven_scaled_training(rank: int) -> dict:
    """Two epochs under Join: rank 0 has 4 batches (the third's gradients not finite), rank 1 has
    1. Once with Join([ddp, DynamicLossScaler]), once with Join([ddp]) and torch.amp.GradScaler
    (whose non-finite gradients reach every rank through the all-reduce). Returns the scales
    after each iteration, the skipped steps and the weights of each, and the scalers' last scale."""
    from torch.distributed.algorithms.join import Join

    got = {}
    for kind in ("lpsim", "torch"):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        if kind == "lpsim":
            scaler = DynamicLossScaler(init_scale=2.0**4, growth_interval=1)
            joinables, scale = [ddp, scaler], scaler.get_scale
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
            joinables, scale = [ddp], scaler.get_scale
        data = torch.Generator().manual_seed(100 + rank)
        batches = [torch.randn(8, 4, generator=data) for _ in range((4, 1)[rank])]
        if rank == 0:
            batches[2][0, 0] = math.inf
        scales, weights = [], []
        for _ in range(2):
            with Join(joinables):
                for x in batches:
                    opt.zero_grad()
                    scaler.scale(ddp(x).square().mean()).backward()
                    scaler.step(opt)
                    scaler.update()
                    scales.append(scale())
            weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        skipped = scaler.skipped_steps if kind == "lpsim" else None
        got[kind] = (scales, skipped, weights, scale())
    return got


def test_ddp_join_with_uneven_inputs_shadows_the_loss_scalers_overflow_all_reduce():
    """Under Join([ddp, scaler]) a rank that has run out of batches shadows the overflow
    all-reduce of every step() of the ranks still training (without it gloo aborts on the
    mismatched collective), and takes the scaler's state from the last rank to join: both ranks
    leave every epoch with the same scale and skipped steps, and the run equals one with
    torch.amp.GradScaler, whose non-finite gradients the all-reduce spreads."""
    got = _spawn_two(_uneven_scaled_training)
    scales, skipped, weights, last = got[0]["lpsim"]
    torch_scales, _, torch_weights, _ = got[0]["torch"]
    # init 16, growth_interval 1: grow, grow, back off (the third batch), grow; then again
    assert scales == [32.0, 64.0, 32.0, 64.0, 128.0, 256.0, 128.0, 256.0] == torch_scales
    assert skipped == 2
    assert torch.equal(weights[0], torch_weights[0])
    scales1, skipped1, weights1, last1 = got[1]["lpsim"]
    assert (last1, skipped1) == (last, skipped) == (256.0, 2)
    assert torch.equal(weights1[0], weights[0]) and torch.equal(weights1[1], weights[1])
    # torch's GradScaler on the joined rank keeps the scale of its own last step (32, not 64)
    # into the second epoch, where the ranks' gradients then average two different scales
    assert got[1]["torch"][0][0] == 32.0 and got[1]["torch"][3] != 256.0


def test_loss_scaler_refuses_a_bad_reduce_overflow_or_process_group():
    with pytest.raises(TypeError, match="reduce_overflow must be a bool"):
        DynamicLossScaler(reduce_overflow=1)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        DynamicLossScaler(process_group="world")


def _scaler_around_overlapping_zero(rank: int) -> dict:
    """What DynamicLossScaler's unscale_() and step() do with a ZeroRedundancyOptimizer made with
    overlap_with_ddp=True (DDP's communication hook steps it in the backward pass; torch refuses
    that hook under gloo, but not the optimizer), given it or an OptimLP around it, and with one
    made without overlap."""
    got = {}
    for kind in ("overlap", "OptimLP around overlap", "no overlap"):
        model = _classifier_on_grid(Float(5, 2))
        ddp = nn.parallel.DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.SGD, lr=0.05, overlap_with_ddp=kind != "no overlap"
        )
        opt = OptimLP(zero, weight=Float(5, 2)) if kind.startswith("OptimLP") else zero
        scaler = DynamicLossScaler(init_scale=2.0**10)
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
        scaler.scale(ddp(x).square().mean()).backward()
        for method in ("unscale_", "step"):
            try:
                getattr(scaler, method)(opt)
                got[kind, method] = "accepted"
            except ValueError as error:
                got[kind, method] = str(error)
    return got


def test_loss_scaler_refuses_an_optimizer_that_steps_in_the_backward_pass():
    """A ZeroRedundancyOptimizer made with overlap_with_ddp=True is stepped by DDP's
    communication hook during the backward pass (its step() does nothing), with the gradients of
    the scaled loss: DynamicLossScaler used to accept it, unscale the gradients after the update
    and "skip" steps that had been taken, silently (5 SGD steps with an initial scale of 2^10 gave
    weights up to 1549 where the scale 1 gives at most 0.41, over gloo with torch's backend
    check bypassed). unscale_() and step() now raise ValueError for it, and for an OptimLP
    around it; without overlap they take it as before."""
    got = _spawn_two(_scaler_around_overlapping_zero)
    for rank in (0, 1):
        for kind in ("overlap", "OptimLP around overlap"):
            for method in ("unscale_", "step"):
                refused = got[rank][kind, method]
                assert "made with overlap_with_ddp=True updates the parameters" in refused
        assert got[rank]["no overlap", "unscale_"] == "accepted"
        assert got[rank]["no overlap", "step"] == "accepted"


def _delayed_scaling(rank: int) -> dict:
    """Each rank quantises its own tensors with DelayedScaling: a Quantizer alone (reduced and
    not), and an injected model under DDP whose input, output and error scalers are made after it
    was wrapped (so DDP never broadcasts them), with a Recorder attached on rank 0 only and an
    example pass of lpsim.nn.report on rank 0 only."""
    e4m3, e5m2 = Float(4, 3, special="fn"), Float(5, 2)
    data = torch.Generator().manual_seed(100 + rank)
    both = dist.new_group([0, 1])
    reduced = Quantizer(
        forward=(DelayedScaling(e4m3, history_length=4, amax_group=both), "nearest")
    )
    reduced = copy.deepcopy(reduced)  # the copy reduces over the same group
    alone = Quantizer(forward=(DelayedScaling(e4m3, reduce_amax=False), "nearest"))
    local_amaxes, outputs = [], []
    for step in range(6):
        x = torch.randn(5, 7, generator=data) * 2.0 ** (4 * rank - step)
        local_amaxes.append(x.abs().amax())
        outputs.append(reduced(x))
        alone(x)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    scaling = DelayedScaling(e4m3, history_length=8)
    spec = LayerQuantization(
        input=scaling, output=scaling, error=DelayedScaling(e5m2), rounding="stochastic"
    )
    inject(model, {nn.Linear: spec})
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    recorder = Recorder(model, opt).attach() if rank == 0 else None  # one rank only
    for step in range(3):
        if (step, rank) == (1, 0):  # an example pass outside the run, on one rank only
            report(model, example=torch.randn(2, 6))
        x = torch.randn(8, 6, generator=data) * (1 + 7 * rank)
        y = torch.randint(0, 3, (8,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    scalers = {k: v for k, v in model.state_dict().items() if "lpsim_scalers" in k}
    if recorder is not None:
        recorder.detach()
    recorded = [] if recorder is None else sorted({r[1:3] for r in recorder.records})
    return {
        "local_amaxes": torch.stack(local_amaxes),
        "reduced": reduced.forward_scaler.state_dict(),
        "outputs": outputs,
        "alone": alone.forward_scaler.state_dict(),
        "model_scalers": scalers,
        "weights": _flat_state(model.state_dict()),
        "recorded": recorded,
    }


def test_ddp_delayed_scaling_scales_from_the_amax_of_all_ranks():
    """As Transformer Engine's DelayedScaling(reduce_amax=True): every rank's history holds the
    largest amax of all ranks, and its scale is e4m3's 448 over the history's largest entry, in
    float32; the ranks' scalers (inputs, outputs and errors of a DDP model too) and weights stay
    identical, a Recorder attached on rank 0 only recording there alone and changing nothing, and
    an example pass of report() on rank 0 alone (outside the run) reducing nothing. With
    reduce_amax=False each rank keeps its own amaxes."""
    got = _spawn_two(_delayed_scaling)
    amaxes = torch.maximum(got[0]["local_amaxes"], got[1]["local_amaxes"]).float()
    history = amaxes.flip(0)[:4]  # newest first, the last 4 of 6
    want_scale = torch.tensor(448.0) / history.max()
    for rank in (0, 1):
        state = got[rank]["reduced"]
        assert torch.equal(state["amax_history"], history), rank
        assert torch.equal(state["scale"], want_scale), rank
        assert torch.equal(state["scale_inverse"], 1 / want_scale), rank
        own = got[rank]["local_amaxes"].float()
        assert torch.equal(got[rank]["alone"]["amax_history"][:6], own.flip(0)), rank
    for out0, out1 in zip(got[0]["outputs"], got[1]["outputs"]):
        assert not torch.equal(out0, out1)  # each rank its own tensors, with the same scales
    assert not torch.equal(got[0]["alone"]["scale"], got[1]["alone"]["scale"])
    scalers0, scalers1 = got[0]["model_scalers"], got[1]["model_scalers"]
    assert any(".error." in k for k in scalers0) and any(".input." in k for k in scalers0)
    assert tensors_equal(scalers0, scalers1)
    assert torch.equal(got[0]["weights"], got[1]["weights"])  # rank 0's Recorder changed nothing
    assert ("0", "error") in got[0]["recorded"] and got[1]["recorded"] == []


def test_delayed_scaling_refuses_a_bad_reduce_amax_or_amax_group():
    e4m3 = Float(4, 3, special="fn")
    with pytest.raises(TypeError, match="DelayedScaling.reduce_amax must be a bool"):
        DelayedScaling(e4m3, reduce_amax="yes")
    with pytest.raises(TypeError, match="DelayedScaling.amax_group must be a torch.distributed"):
        DelayedScaling(e4m3, amax_group=0)


def _injected_after_wrapping(rank: int) -> dict:
    """The same training of a 4-layer model, each rank its own batches, with the quantisers
    placed three ways: inject() before DistributedDataParallel wraps the model; inject() into the
    model after it was wrapped (find_unused_parameters=True); and a recipe applied to the wrapper
    itself (find_unused_parameters=False). Returns the parameters of each, by name."""
    e5m2, bf16 = Float(5, 2), Float(8, 7)
    spec = LayerQuantization(weight=e5m2, bias=bf16, output=bf16, error=e5m2)
    got = {}
    for way in ("before", "after", "recipe"):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)
        )
        model.append(nn.ReLU()).append(nn.Linear(8, 3))
        if way == "before":
            inject(model, {nn.Linear: spec})
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=way == "after")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if way == "after":
            inject(model, {nn.Linear: spec})
        elif way == "recipe":
            _, opt = lpsim.recipes.BFLOAT16.apply(ddp, opt)
        _train_on_rank_batches(ddp, opt, rank)
        got[way] = {n.replace("module.", ""): p.detach() for n, p in ddp.named_parameters()}
    return got


def test_ddp_model_injected_after_wrapping_reduces_its_gradients():
    """inject() (and Recipe.apply) into a model already wrapped by DistributedDataParallel keeps
    DDP's gradient all-reduce: torch's parametrisation used to set each quantised parameter to
    itself, which gives it a new gradient accumulator, so DDP's hooks (registered on the old one)
    never ran: a torch error without find_unused_parameters and, with it, unreduced gradients
    and ranks whose weights parted. Now the ranks stay identical, and injecting after wrapping
    trains as injecting before it, bit for bit."""
    got = _spawn_two(_injected_after_wrapping)
    for way in ("before", "after", "recipe"):
        assert tensors_equal(got[0][way], got[1][way]), way
    assert tensors_equal(got[0]["after"], got[0]["before"])


def _bfloat16_with_float32_accumulators(rank: int) -> dict:
    """A bfloat16 model under DDP, trained by OptimLP around torch's SGD with float32
    accumulators (wider than the parameters), each rank its own batches; after the second step
    the optimizer reloads its own state_dict. Returns each step's gradients and the parameters,
    accumulators and momentum buffers at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).bfloat16()
    ddp = nn.parallel.DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    opt = OptimLP(sgd, weight=Float(8, 7), acc=Float(8, 23), rounding="stochastic")
    data = torch.Generator().manual_seed(100 + rank)
    grads = []
    for step in range(4):
        x = torch.randn(8, 6, generator=data).bfloat16()
        y = torch.randint(0, 3, (8,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x).float(), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        if step == 1:
            opt.load_state_dict(opt.state_dict())
    return {
        "grads": grads,
        "weights": [p.detach() for p in model.parameters()],
        "accumulators": [opt.accumulators[p] for p in model.parameters()],
        "momentum": [opt.state[p]["momentum_buffer"] for p in model.parameters()],
    }


def test_ddp_reduces_gradients_of_parameters_with_wider_accumulators():
    """OptimLP with accumulators wider than their parameters (bfloat16 weights, float32
    accumulators) under DDP: every step's gradients are all-reduced, so they and the weights,
    accumulators and (float32) momentum buffers stay identical across ranks. OptimLP used to give
    each parameter its accumulator as data for the wrapped step (p.data = acc, another dtype),
    which gave the parameter a new gradient accumulator node: DDP's all-reduce hooks never ran
    after the first step, and each rank silently trained on its own gradients."""
    got = _spawn_two(_bfloat16_with_float32_accumulators)
    for step, (g0, g1) in enumerate(zip(got[0]["grads"], got[1]["grads"])):
        assert tensors_equal(g0, g1), step
    for key in ("weights", "accumulators", "momentum"):
        assert tensors_equal(got[0][key], got[1][key]), key
    assert all(m.dtype == torch.float32 for m in got[0]["momentum"])
    assert all(w.dtype == torch.bfloat16 for w in got[0]["weights"])


def _zero_sharded(rank: int) -> dict:
    """Each optimizer under DDP, plain and inside torch's ZeroRedundancyOptimizer, 3 steps with
    each rank's own batches, the parameters rounded into e5m2 before the optimizer is built.
    Round to nearest everywhere (and OptimLP with a DelayedScaling weight format, reduce_amax
    False), and lpsim.optim.SGD with stochastic rounding. Returns, per (kind, sharded), the
    parameters (with the delayed-scaling histories) and a draw of torch's generator."""
    e5m2, bf16 = Float(5, 2), Float(8, 7)
    delayed = DelayedScaling(Float(4, 3, special="fn"), history_length=4, reduce_amax=False)
    near = {"rounding": "nearest"}
    kinds = {
        "SGD": (SGD, dict(lr=0.05, momentum=0.9, weight_format=e5m2, state_format=bf16, **near)),
        "AdamW": (AdamW, dict(lr=0.01, weight_format=e5m2, state_format=bf16, **near)),
        "FusedSGD": (
            FusedSGD,
            dict(lr=0.05, momentum=0.9, weight_format=e5m2, grad_format=e5m2, **near),
        ),
        "FusedAdam": (FusedAdam, dict(lr=0.01, weight_format=e5m2, state_format=bf16, **near)),
        "OptimLP": (
            lambda params: OptimLP(
                torch.optim.SGD(params, lr=0.05, momentum=0.9),
                weight=e5m2,
                grad=e5m2,
                momentum=bf16,
                acc=Float(6, 9),
                rounding="nearest",
            ),
            {},
        ),
        "OptimLP-delayed": (
            lambda params: OptimLP(torch.optim.SGD(params, lr=0.05), weight=(delayed, "nearest")),
            {},
        ),
        "SGD-stochastic": (SGD, dict(lr=0.05, momentum=0.9, weight_format=e5m2)),
    }
    got = {}
    for kind, (make, options) in kinds.items():
        for sharded in (False, True):
            model = _classifier_on_grid(e5m2)
            ddp = nn.parallel.DistributedDataParallel(model)
            if sharded:
                opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=make, **options)
                local = opt.optim
            else:
                opt = local = make(ddp.parameters(), **options)
            _train_on_rank_batches(ddp, opt, rank)
            histories = {
                i: local.scalers[p]["weight"].amax_history
                for i, p in enumerate(model.parameters())
                if kind == "OptimLP-delayed" and p in local.scalers
            }
            params = [p.detach() for p in model.parameters()]
            got[kind, sharded] = (params, histories, torch.rand(()))
    return got


def test_zero_redundancy_optimizer_shards_round_as_documented():
    """docs/training.md on torch's ZeroRedundancyOptimizer: with deterministic rules and the
    parameters rounded first, every lpsim optimizer gives the unsharded optimizer's bits, OptimLP's
    DelayedScaling with reduce_amax=False the unsharded amax histories (each parameter's on the
    rank that rounds it), and the ranks' weights stay identical; lpsim.optim.SGD with stochastic
    rounding keeps them identical and the ranks' generators together."""
    got = _spawn_two(_zero_sharded)
    kinds = {kind for kind, _ in got[0]}
    for kind in kinds:
        for sharded in (False, True):
            params0, _, draw0 = got[0][kind, sharded]
            params1, _, draw1 = got[1][kind, sharded]
            assert tensors_equal(params0, params1), (kind, sharded)
            assert torch.equal(draw0, draw1), (kind, sharded)
        if kind != "SGD-stochastic":
            assert tensors_equal(got[0][kind, True][0], got[0][kind, False][0]), kind
    plain = got[0]["OptimLP-delayed", False][1]
    sharded = {**got[0]["OptimLP-delayed", True][1], **got[1]["OptimLP-delayed", True][1]}
    assert len(plain) == 6 and tensors_equal(sharded, plain)


def _zero_resumed(rank: int) -> dict:
    """Each optimizer with stochastic rounding inside ZeroRedundancyOptimizer under DDP: 4 steps
    in one go, and 2 steps, a checkpoint (model, consolidated optimizer state, generator) made on
    rank 0 and loaded by both ranks into new objects, then 2 more. Returns both runs' parameters,
    by kind."""
    e5m2, bf16 = Float(5, 2), Float(8, 7)
    kinds = {
        "SGD": (SGD, dict(lr=0.05, momentum=0.9, weight_format=e5m2, state_format=bf16)),
        "AdamW": (AdamW, dict(lr=0.01, weight_format=e5m2, state_format=bf16)),
        "FusedSGD": (FusedSGD, dict(lr=0.05, momentum=0.9, weight_format=e5m2, grad_format=e5m2)),
        "FusedAdam": (FusedAdam, dict(lr=0.01, weight_format=e5m2, state_format=bf16)),
    }

    def build(kind):
        model = _classifier_on_grid(e5m2)
        ddp = nn.parallel.DistributedDataParallel(model)
        make, options = kinds[kind]
        return model, ddp, ZeroRedundancyOptimizer(ddp.parameters(), make, **options)

    got = {}
    for kind in kinds:
        model, ddp, opt = build(kind)
        _train_classifier(ddp, opt, range(4), rank)
        whole = [p.detach() for p in model.parameters()]
        model, ddp, opt = build(kind)
        _train_classifier(ddp, opt, range(2), rank)
        opt.consolidate_state_dict(to=0)
        saved = [None]
        if rank == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            buffer = io.BytesIO()
            torch.save({**state, "generator": torch.get_rng_state()}, buffer)
            saved = [buffer.getvalue()]
        dist.broadcast_object_list(saved, src=0)
        checkpoint = torch.load(io.BytesIO(saved[0]), weights_only=True)
        torch.manual_seed(1 + rank)  # the new objects draw from another stream
        model, ddp, opt = build(kind)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        torch.set_rng_state(checkpoint["generator"])
        _train_classifier(ddp, opt, range(2, 4), rank)
        got[kind] = (whole, [p.detach() for p in model.parameters()])
    return got


def test_zero_redundancy_optimizer_resumes_from_rank_0_checkpoint():
    """A ZeroRedundancyOptimizer run of SGD, AdamW, FusedSGD or FusedAdam with stochastic rounding,
    checkpointed on rank 0 (its consolidated state) and resumed on both ranks, continues bit for
    bit as the uninterrupted run, on every rank."""
    got = _spawn_two(_zero_resumed)
    for kind in got[0]:
        for rank in (0, 1):
            whole, resumed = got[rank][kind]
            assert tensors_equal(resumed, whole), (kind, rank)
        assert tensors_equal(got[0][kind][0], got[1][kind][0]), kind


def _resumed_from_rank_0(rank: int, kinds, path: str) -> dict:
    """Per optimizer kind, under DDP with stochastic rounding of weights, outputs and errors,
    DelayedScaling inputs and a DynamicLossScaler (an overflow on rank 1 only in step 3): 5 steps
    in one go, and 2 steps, a checkpoint of rank 0 (model, optimizer, scaler, torch's generator)
    loaded by both ranks into new objects, then 3 more. Returns both runs' states."""
    e5m2, bf16 = Float(5, 2), Float(8, 7)
    e4m3 = Float(4, 3, special="fn")

    def build(kind):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        spec = LayerQuantization(
            weight=e5m2,
            input=DelayedScaling(e4m3, history_length=4),
            output=bf16,
            error=Float(5, 2, saturate=True),
            rounding="stochastic",
        )
        inject(model, {nn.Linear: spec})
        ddp = nn.parallel.DistributedDataParallel(model)
        if kind == "OptimLP":
            sgd = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
            opt = OptimLP(sgd, weight=e5m2, grad=e5m2, momentum=bf16, acc=Float(6, 9))
        elif kind == "FusedAdam":
            opt = FusedAdam(
                ddp.parameters(), lr=0.01, weight_format=e5m2, state_format=bf16, acc_format=bf16
            )
        else:
            opt = AdamW(ddp.parameters(), lr=0.01, weight_format=e5m2, state_format=bf16)
        scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
        scaler.watch_model(model)
        return model, ddp, opt, scaler

    def train(ddp, opt, scaler, steps):
        for step in steps:
            data = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 6, generator=data)
            y = torch.randint(0, 3, (8,), generator=data)
            opt.zero_grad()
            boost = 2.0**16 if (step, rank) == (3, 1) else 1.0
            scaler.scale(nn.functional.cross_entropy(ddp(x), y) * boost).backward()
            scaler.step(opt)
            scaler.update()

    def everything(model, opt, scaler):
        state = [model.state_dict(), opt.state_dict(), scaler.state_dict()]
        return _flat_state(state), scaler.skipped_steps, torch.rand(())

    got = {}
    for kind in kinds:
        model, ddp, opt, scaler = build(kind)
        train(ddp, opt, scaler, range(5))
        whole = everything(model, opt, scaler)
        model, ddp, opt, scaler = build(kind)
        train(ddp, opt, scaler, range(2))
        checkpoint = os.path.join(path, f"{kind}.pt")
        if rank == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            state.update(scaler=scaler.state_dict(), generator=torch.get_rng_state())
            torch.save(state, checkpoint)
        dist.barrier()
        torch.manual_seed(1 + rank)  # the new objects draw from another stream
        model, ddp, opt, scaler = build(kind)
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        scaler.load_state_dict(saved["scaler"])
        torch.set_rng_state(saved["generator"])
        train(ddp, opt, scaler, range(2, 5))
        got[kind] = (whole, everything(model, opt, scaler))
    return got


def test_ddp_run_resumed_from_rank_0_checkpoint_continues_bit_for_bit(tmp_path):
    """A DDP run with stochastic rounding everywhere, delayed scaling (its scalers made after DDP
    wrapped the model, and loaded from the checkpoint) and dynamic loss scaling, saved on rank 0
    and loaded on both ranks, continues as the uninterrupted run: model, optimizer and scaler
    states, skipped steps and the random stream, bit for bit on every rank."""
    kinds = ("OptimLP", "FusedAdam", "AdamW")
    got = _spawn_two(_resumed_from_rank_0, kinds, str(tmp_path))
    for kind in kinds:
        for rank in (0, 1):
            (state, skipped, draw), (state_r, skipped_r, draw_r) = got[rank][kind]
            assert torch.equal(state_r, state), (kind, rank)
            assert skipped == skipped_r == 1, (kind, rank)
            assert torch.equal(draw_r, draw), (kind, rank)
        assert torch.equal(got[0][kind][0][0], got[1][kind][0][0]), kind


def _shadowed_on_rank_0(rank: int) -> dict:
    """Training under DDP (stochastic rounding, DelayedScaling inputs, BatchNorm), with and
    without a Shadow of the wrapped model compared on rank 0 alone before step 1. Returns the
    state at the end of each run and rank 0's report."""
    e5m2, bf16 = Float(5, 2), Float(8, 7)
    got = {}
    for shadowed in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        spec = LayerQuantization(
            weight=e5m2,
            input=DelayedScaling(Float(4, 3, special="fn")),
            output=bf16,
            error=e5m2,
            rounding="stochastic",
        )
        inject(model, {nn.Linear: spec})
        ddp = nn.parallel.DistributedDataParallel(model)
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        opt = OptimLP(sgd, weight=e5m2, grad=e5m2, momentum=bf16)
        data = torch.Generator().manual_seed(100 + rank)
        report = None
        for step in range(3):
            x = torch.randn(8, 6, generator=data)
            y = torch.randint(0, 3, (8,), generator=data)
            if shadowed and step == 1 and rank == 0:
                loss = functools.partial(nn.functional.cross_entropy, target=y)
                report = Shadow(model).compare(x, loss_fn=loss).table()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        state = [model.state_dict(), opt.state_dict()]
        got[shadowed] = (_flat_state(state), torch.rand(()), report)
    return got


def test_shadow_compare_on_one_rank_leaves_the_ddp_run_unchanged():
    """Shadow.compare of the model inside DDP, on rank 0 alone, changes nothing of the run (its
    passes reduce no amax and make no collective): each rank's state (weights, BatchNorm
    statistics, delayed-scaling histories, optimizer) and random stream equal the run without
    it."""
    got = _spawn_two(_shadowed_on_rank_0)
    assert "Linear" in got[0][True][2] and got[1][True][2] is None
    for rank in (0, 1):
        assert torch.equal(got[rank][True][0], got[rank][False][0]), rank
        assert torch.equal(got[rank][True][1], got[rank][False][1]), rank


class _Twins(nn.Module):
    """Two parameters of 256 elements with the same values (and, under the loss below, the same
    gradients); ZeroRedundancyOptimizer gives each rank one of them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.full((256,), 1.25))
        self.b = nn.Parameter(torch.full((256,), 1.25))

    def loss(self) -> torch.Tensor:
        c = torch.linspace(-1, 1, 256)
        return (self.a * c).sum() + (self.b * c).sum()


def _twin_steps(model: _Twins, opt, steps: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    for _ in range(steps):
        opt.zero_grad()
        model.loss().backward()
        opt.step()
    return model.a.detach().clone(), model.b.detach().clone()


_TWIN_KINDS = {
    "SGD": (SGD, dict(lr=0.01, weight_format=Float(5, 2))),
    "AdamW": (AdamW, dict(lr=0.01, weight_format=Float(5, 2), weight_decay=0.0)),
    "FusedSGD": (FusedSGD, dict(lr=0.01, weight_format=Float(5, 2), rounding="stochastic")),
    "FusedAdam": (FusedAdam, dict(lr=0.01, weight_format=Float(5, 2), rounding="stochastic")),
    "OptimLP": (
        lambda params: OptimLP(
            torch.optim.SGD(params, lr=0.01), weight=Float(5, 2), rounding="stochastic"
        ),
        {},
    ),
}


def _zero_random_streams(rank: int) -> dict:
    """Stochastic rounding of the twins by each optimizer, unsharded and inside
    ZeroRedundancyOptimizer (each rank steps one twin); for SGD and AdamW, the sharded state
    consolidated on rank 0 and loaded there into an unsharded optimizer, which steps on; and
    torch's SGD's and AdamW's state_dicts loaded into ZeroRedundancyOptimizer around lpsim's (round
    to nearest), against the unsharded lpsim optimizer loading the same."""
    got = {}
    for kind, (make, options) in _TWIN_KINDS.items():
        for sharded in (False, True):
            torch.manual_seed(0)
            model = _Twins()
            nn.parallel.DistributedDataParallel(model)  # broadcasts; the twins start equal
            if sharded:
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=make, **options)
            else:
                opt = make(model.parameters(), **options)
            got["twins", kind, sharded] = _twin_steps(model, opt)
            if sharded and kind in ("SGD", "AdamW"):
                opt.consolidate_state_dict(to=0)
                if rank == 0:
                    resumed = make(model.parameters(), **options)
                    resumed.load_state_dict(opt.state_dict())
                    got["resumed", kind] = _twin_steps(model, resumed, steps=1)
    e5m2 = Float(5, 2)
    torch_kinds = {
        "SGD": (torch.optim.SGD, SGD, dict(lr=0.05, momentum=0.9)),
        "AdamW": (torch.optim.AdamW, AdamW, dict(lr=0.01)),
    }
    for kind, (torch_class, lpsim_class, options) in torch_kinds.items():
        model = _classifier_on_grid(e5m2)
        ddp = nn.parallel.DistributedDataParallel(model)
        _train_on_rank_batches(ddp, torch_class(ddp.parameters(), **options), rank, steps=1)
        saved = copy.deepcopy(model.state_dict())
        for sharded in (False, True):
            model.load_state_dict(saved)
            opt = torch_class(ddp.parameters(), **options)
            _train_on_rank_batches(ddp, opt, rank, steps=1)
            state = copy.deepcopy(opt.state_dict())
            with torch.no_grad():  # on the grid before a shard joins (docs/training.md)
                for p in model.parameters():
                    lpsim.quantize_(p, e5m2, "nearest")
            lp = dict(options, weight_format=e5m2, rounding="nearest")
            if sharded:
                opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=lpsim_class, **lp)
            else:
                opt = lpsim_class(ddp.parameters(), **lp)
            opt.load_state_dict(state)
            _train_on_rank_batches(ddp, opt, rank, steps=2)
            got["from torch", kind, sharded] = [p.detach().clone() for p in model.parameters()]
    # torch's Adam (L2 weight decay) continued by FusedAdam inside ZeroRedundancyOptimizer.
    model = _classifier_on_grid(e5m2)
    ddp = nn.parallel.DistributedDataParallel(model)
    adam = torch.optim.Adam(ddp.parameters(), lr=0.01, weight_decay=0.1)
    _train_on_rank_batches(ddp, adam, rank, steps=1)
    for decoupled in (True, False):
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=FusedAdam, lr=0.01, decoupled=decoupled
        )
        opt.load_state_dict(copy.deepcopy(adam.state_dict()))
        try:
            _train_on_rank_batches(ddp, opt, rank, steps=1)
            got["Adam into FusedAdam", decoupled] = "stepped"
        except ValueError as error:
            got["Adam into FusedAdam", decoupled] = str(error)
    return got


def test_zero_redundancy_optimizer_random_streams_as_documented():
    """docs/training.md on ZeroRedundancyOptimizer with stochastic rounding: every optimizer's
    shards on the two ranks round with the same random words (two parameters with the same values
    and gradients, one per rank, stay equal, where the unsharded optimizer moves them apart).
    SGD's and AdamW's consolidated state, loaded into an unsharded optimizer, numbers the
    parameters apart again: its stream numbers repeated (each rank numbered its shard from 0),
    and the loaded optimizer rounded the two parameters with the same words, silently. A torch
    SGD's or AdamW's state_dict loaded into ZeroRedundancyOptimizer around lpsim's continues that
    run as the unsharded lpsim optimizer does (round to nearest); it used to fail at the first
    step, the states lacking the numbers (KeyError 'index') and AdamW's step being a tensor.
    torch's Adam state_dict (L2 weight decay) loaded into ZeroRedundancyOptimizer around a
    FusedAdam made with decoupled=True used to step as AdamW, silently; it now raises ValueError
    naming both options, and with decoupled=False it steps."""
    got = _spawn_two(_zero_random_streams)
    for kind in _TWIN_KINDS:
        a, b = got[0]["twins", kind, False]
        assert not torch.equal(a, b) and not torch.equal(a, torch.full_like(a, 1.25)), kind
        a, b = got[0]["twins", kind, True]
        assert torch.equal(a, b), kind  # the same words on both ranks
        assert tensors_equal(got[0]["twins", kind, True], got[1]["twins", kind, True]), kind
    for kind in ("SGD", "AdamW"):
        a, b = got[0]["resumed", kind]
        assert not torch.equal(a, b), kind
        for rank in (0, 1):
            sharded = got[rank]["from torch", kind, True]
            assert tensors_equal(sharded, got[rank]["from torch", kind, False]), (kind, rank)
    for rank in (0, 1):
        refused = got[rank]["Adam into FusedAdam", True]
        assert "decoupled (True) and decoupled_weight_decay (False," in refused, rank
        assert got[rank]["Adam into FusedAdam", False] == "stepped", rank


def _zero_resumed_with_stochastic_accumulators(rank: int) -> dict:
    """FusedSGD and FusedAdam with a stochastic acc_format inside ZeroRedundancyOptimizer (the
    shards differ in size: 1 and 5 parameters): 4 steps in one go, and 2 steps, rank 0's
    checkpoint loaded by both ranks, 2 more, once with rank 0's generator on both ranks and once
    with each rank's own. Returns, per kind, the uninterrupted parameters and both resumed ones."""
    e5m2, bf16 = Float(5, 2), Float(8, 7)
    kinds = {
        "FusedSGD": (FusedSGD, dict(lr=0.05, momentum=0.9, weight_format=e5m2)),
        "FusedAdam": (FusedAdam, dict(lr=0.01, weight_format=e5m2, state_format=bf16)),
    }

    def build(kind):
        model = _classifier_on_grid(e5m2)
        ddp = nn.parallel.DistributedDataParallel(model)
        make, options = kinds[kind]
        acc = dict(acc_format=Float(6, 9), rounding="stochastic")
        return model, ddp, ZeroRedundancyOptimizer(ddp.parameters(), make, **options, **acc)

    got = {}
    for kind in kinds:
        model, ddp, opt = build(kind)
        _train_classifier(ddp, opt, range(4), rank)
        got[kind, "whole"] = [p.detach().clone() for p in model.parameters()]
        model, ddp, opt = build(kind)
        _train_classifier(ddp, opt, range(2), rank)
        opt.consolidate_state_dict(to=0)
        generators = [None, None]
        dist.all_gather_object(generators, torch.get_rng_state())
        saved = [None]
        if rank == 0:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
            saved = [buffer.getvalue()]
        dist.broadcast_object_list(saved, src=0)
        for generator in ("rank 0's", "own"):
            checkpoint = torch.load(io.BytesIO(saved[0]), weights_only=True)
            torch.manual_seed(1 + rank)
            model, ddp, opt = build(kind)
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["opt"])
            torch.set_rng_state(generators[0 if generator == "rank 0's" else rank])
            _train_classifier(ddp, opt, range(2, 4), rank)
            got[kind, generator] = [p.detach().clone() for p in model.parameters()]
    return got


def test_zero_redundancy_optimizer_resumes_stochastic_accumulators_with_each_ranks_generator():
    """docs/training.md: FusedSGD and FusedAdam draw one seed per accumulator they make with a
    stochastic rule, so shards of different sizes leave the ranks' generators apart; a run
    resumed with rank 0's generator on every rank then parts from the uninterrupted run (rank 1
    draws other seeds than it drew there, and its shard reaches every rank), while each rank's own
    generator continues it bit for bit."""
    got = _spawn_two(_zero_resumed_with_stochastic_accumulators)
    for kind in ("FusedSGD", "FusedAdam"):
        for rank in (0, 1):
            assert tensors_equal(got[rank][kind, "own"], got[rank][kind, "whole"]), (kind, rank)
        assert tensors_equal(got[0][kind, "rank 0's"], got[1][kind, "rank 0's"]), kind
        assert not tensors_equal(got[0][kind, "rank 0's"], got[0][kind, "whole"]), kind
        assert tensors_equal(got[0][kind, "whole"], got[1][kind, "whole"]), kind


def _e5m2_by_ml_dtypes(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(t.detach().numpy().astype(ml_dtypes.float8_e5m2).astype(np.float32))


def _batchnorm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_sync_batchnorm_conversion_before_inject_is_quantised_after_it_is_dropped():
    """docs/training.md: inject() into a model converted by convert_sync_batchnorm quantises its
    SyncBatchNorm (selected by nn.SyncBatchNorm; nn.BatchNorm1d selects nothing there), its
    output rounded as ml_dtypes rounds it; converted after inject(), the SyncBatchNorm has none
    of the BatchNorm's output quantiser, and a quantised weight makes torch raise TypeError.
    (Without a process group SyncBatchNorm computes as BatchNorm.)"""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    spec = LayerQuantization(output=Float(5, 2), rounding="nearest")
    plain = nn.SyncBatchNorm.convert_sync_batchnorm(_batchnorm_model())
    want = _e5m2_by_ml_dtypes(plain[:2](x))
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(_batchnorm_model())
    with pytest.raises(ValueError, match="BatchNorm1d: matches no module"):
        inject(copy.deepcopy(converted), {nn.BatchNorm1d: spec})
    inject(converted, {nn.SyncBatchNorm: spec})
    assert torch.equal(converted[:2](x), want)
    after = _batchnorm_model()
    inject(after, {nn.BatchNorm1d: spec})
    after = nn.SyncBatchNorm.convert_sync_batchnorm(after)
    assert isinstance(after[1], nn.SyncBatchNorm)
    assert torch.equal(after[:2](x), plain[:2](x))  # unquantised: the quantiser was dropped
    assert "full precision" in report(after).splitlines()[3]
    weighted = _batchnorm_model()
    inject(weighted, {nn.BatchNorm1d: LayerQuantization(weight=Float(5, 2))})
    with pytest.raises(TypeError, match="cannot assign"):
        nn.SyncBatchNorm.convert_sync_batchnorm(weighted)


class _InPlaceDictNet(nn.Module):
    """A convolution, a BatchNorm and an in-place ReLU on channels_last inputs, with a dict of two
    heads for output (a key with a "." in it), and optionally a layer the forward never uses."""

    def __init__(self, unused: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(64, 3)
        self.aux = nn.Linear(64, 2)
        if unused:
            self.unused = nn.Linear(2, 2)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x))).flatten(1)
        return {"logits": self.fc(h), "aux.x": self.aux(h)}


def _oracle_model(kind: str, unused: bool = False):
    """(model, optimizer, loss of (output, labels), batch of (step, rank, micro)) of each kind."""
    e5m2, bf16 = Float(5, 2), Float(8, 7)
    torch.manual_seed(0)
    if kind == "in-place":
        model = _InPlaceDictNet(unused)
        spec = LayerQuantization(weight=e5m2, input=bf16, output=bf16, error=e5m2)
        config = {
            (nn.Conv2d, nn.Linear): spec,
            nn.ReLU: LayerQuantization(output=e5m2),
            nn.BatchNorm2d: LayerQuantization(weight=bf16, output=bf16, error=bf16),
        }
        inject(model, config, unmatched="ignore")
        model = model.to(memory_format=torch.channels_last)
        opt = FusedSGD(
            model.parameters(), lr=0.05, momentum=0.9, weight_format=e5m2, grad_format=e5m2
        )

        def loss(out, y):
            return nn.functional.cross_entropy(out["logits"], y) + out["aux.x"].pow(2).mean()

        def batch(step, rank, micro):
            data = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(4, 3, 6, 6, generator=data).to(memory_format=torch.channels_last)
            return x, torch.randint(0, 3, (4,), generator=data)

        return model, opt, loss, batch
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(inplace=True))
    model.extend([nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "MAC":
        mac = lpsim.MAC(accumulator=Float(8, 10), product=bf16, rounding="stochastic")
        inject(model, {nn.Linear: LayerQuantization(weight=e5m2, error=e5m2, mac=mac)})
        opt = OptimLP(opt, weight=e5m2, rounding="stochastic")
    else:
        model, opt = getattr(lpsim.recipes, kind).apply(model, opt)

    def batch(step, rank, micro):
        data = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        x = torch.randn(8, 8, generator=data) * (1 + 5 * rank)
        return x, torch.randint(0, 3, (8,), generator=data)

    return model, opt, nn.functional.cross_entropy, batch


def _ddp_against_one_process(rank: int, runs) -> dict:
    """Each run (kind, DDP options, micro-batches per step): 2 steps under DDP (all but the last
    micro-batch under no_sync), each rank its own batches; and, on each rank alone, the same 2
    steps computed by one process as DDP defines them: each rank's passes from the same
    generator state and from rank 0's buffers (which DDP broadcasts before each forward pass),
    the gradients summed over the micro-batches and averaged over the ranks (g0 / 2 + g1 / 2),
    rank 0's buffers kept. Returns both states and an evaluation pass of each."""
    got = {}
    for name, (kind, options, micros) in runs.items():
        unused = options.get("find_unused_parameters", False)
        model, opt, loss_of, batch = _oracle_model(kind, unused)
        ddp = nn.parallel.DistributedDataParallel(model, **options)
        for step in range(2):
            opt.zero_grad()
            for micro in range(micros):
                x, y = batch(step, rank, micro)
                last = micro == micros - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss_of(ddp(x), y).backward()
            opt.step()
        ddp.eval()
        with torch.no_grad():
            evaluated = ddp(batch(99, 0, 0)[0])
        got[name, "ddp"] = (model.state_dict(), evaluated, torch.rand(()))

        model, opt, loss_of, batch = _oracle_model(kind, unused)
        params = list(model.parameters())
        for step in range(2):
            opt.zero_grad()
            sums = [[None] * len(params) for _ in range(2)]
            for micro in range(micros):
                generator = torch.get_rng_state()
                buffers = copy.deepcopy(list(model.buffers()))
                kept = None
                for r in (0, 1):
                    torch.set_rng_state(generator)
                    with torch.no_grad():
                        for b, saved in zip(model.buffers(), buffers):
                            b.copy_(saved)
                    for p in params:
                        p.grad = None
                    x, y = batch(step, r, micro)
                    loss_of(model(x), y).backward()
                    for i, p in enumerate(params):
                        if p.grad is not None:
                            s = sums[r][i]
                            sums[r][i] = p.grad.clone() if s is None else s + p.grad
                    if r == 0:
                        kept = copy.deepcopy(list(model.buffers()))
                with torch.no_grad():
                    for b, saved in zip(model.buffers(), kept):
                        b.copy_(saved)
            for p, g0, g1 in zip(params, *sums):
                p.grad = None if g0 is None else g0 / 2 + g1 / 2
            opt.step()
        model.eval()
        with torch.no_grad():
            evaluated = model(batch(99, 0, 0)[0])
        got[name, "one process"] = (model.state_dict(), evaluated, torch.rand(()))
    return got


def test_ddp_training_equals_one_process_averaging_the_ranks_gradients():
    """Injected models under DDP give every rank the state one process computes from the same
    batches, averaging the ranks' gradients as DDP does, bit for bit (weights, BatchNorm
    statistics, optimizer-facing parameters, an eval pass and the random stream): in-place ReLUs
    (their quantised results copied into the caller's tensor), channels_last activations, a dict
    output whose key holds a ".", weights quantised in training and rounded to nearest in eval,
    stochastic rounding everywhere, with find_unused_parameters and gradient_as_bucket_view under
    no_sync accumulation, and with static_graph (which torch does not combine with no_sync);
    and the MXFP8 and NVFP4 recipes and a stochastic non-native MAC."""
    runs = {
        "unused, bucket view, no_sync": (
            "in-place",
            dict(find_unused_parameters=True, gradient_as_bucket_view=True),
            2,
        ),
        "static graph": ("in-place", dict(static_graph=True), 1),
        "MXFP8": ("MXFP8", {}, 1),
        "NVFP4": ("NVFP4", {}, 1),
        "MAC": ("MAC", {}, 1),
    }
    got = _spawn_two(_ddp_against_one_process, runs)
    for name in runs:
        want = got[0][name, "one process"]
        assert tensors_equal(got[1][name, "one process"], want), name
        for rank in (0, 1):
            assert tensors_equal(got[rank][name, "ddp"], want), (name, rank)


def _optimlp_around_zero(rank: int) -> dict:
    """OptimLP around torch's SGD (momentum 0.9), plain and inside ZeroRedundancyOptimizer: with
    weight, grad and an accumulator of the parameters' dtype (round to nearest), 3 steps each;
    with a momentum format, a bfloat16 model with float32 accumulators and the BLOCK8 recipe,
    what OptimLP (or Recipe.apply) raises around the sharded one; and around one made with
    overlap_with_ddp=True, what OptimLP with a grad or acc format or a grad_scaling (given, or
    assigned before a step) raises."""
    e5m2 = Float(5, 2)
    got = {}
    for sharded in (False, True):
        model = _classifier_on_grid(e5m2)
        ddp = nn.parallel.DistributedDataParallel(model)
        options = dict(lr=0.05, momentum=0.9)
        if sharded:
            inner = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, **options)
        else:
            inner = torch.optim.SGD(ddp.parameters(), **options)
        opt = OptimLP(inner, weight=e5m2, grad=e5m2, acc=Float(6, 4), rounding="nearest")
        _train_on_rank_batches(ddp, opt, rank)
        got[sharded] = [p.detach().clone() for p in model.parameters()]
    refused = {
        "momentum": lambda model, zero: OptimLP(zero, weight=e5m2, momentum=Float(3, 1)),
        "wide": lambda model, zero: OptimLP(zero, weight=e5m2, acc=Float(8, 23)),
        "BLOCK8": lpsim.recipes.BLOCK8.apply,
    }
    for kind, make in refused.items():
        model = _classifier_on_grid(e5m2)
        if kind == "wide":
            model = model.bfloat16()
        ddp = nn.parallel.DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
        try:
            make(model, zero)
            got[kind] = "accepted"
        except ValueError as error:
            got[kind] = str(error)
        got[kind, "injected"] = any(True for _ in lpsim.nn.injected(model))
    # overlap_with_ddp=True: DDP's communication hook steps the optimizer in the backward pass
    # (torch refuses that hook under gloo, but not the optimizer), and its step() does nothing.
    overlapped = {
        "weight": dict(weight=e5m2),
        "grad": dict(weight=e5m2, grad=e5m2),
        "acc": dict(weight=e5m2, acc=Float(6, 4)),
        "grad_scaling": dict(weight=e5m2, grad_scaling=1e-3),
    }
    for kind, options in overlapped.items():
        model = _classifier_on_grid(e5m2)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, lr=0.05, overlap_with_ddp=True
        )
        try:
            opt = OptimLP(zero, rounding="nearest", **options)
        except ValueError as error:
            got["overlap", kind] = str(error)
            continue
        got["overlap", kind] = "accepted"
        opt.grad_scaling = 0.5  # assigned after construction: refused by the step
        try:
            opt.step()
            got["overlap", kind, "step"] = "stepped"
        except ValueError as error:
            got["overlap", kind, "step"] = str(error)
    return got


def test_optimlp_refuses_the_state_a_zero_redundancy_optimizer_keeps_out_of_its_reach():
    """OptimLP around a ZeroRedundancyOptimizer (rather than inside it) rounds weights,
    gradients and accumulators of the parameters' dtype as around the unsharded optimizer, bit
    for bit; a momentum format or an accumulator wider than its parameter raises ValueError
    naming it. Both used to be accepted and do nothing, silently: the shard's momentum buffers
    live in the local optimizer, never rounded, and a wide accumulator's stand-in was never
    stepped (the local optimizer updated the parameter, which the stale accumulator overwrote).
    Recipe.apply raises likewise and leaves the model without quantisers. A
    ZeroRedundancyOptimizer made with overlap_with_ddp=True updates the parameters in DDP's
    backward pass and its step() does nothing, so OptimLP around it used to round the gradients
    and scale them by grad_scaling after the update, silently: 5 steps with grad=Float(3, 1), or
    with grad_scaling=1/1000, gave the very weights of rounding the weights alone (where around
    the ZeroRedundancyOptimizer without overlap they differ by up to 2^-7 and 2^-6); now a grad
    or acc format or a grad_scaling other than 1 raises ValueError there, and rounding only the
    weights is accepted."""
    got = _spawn_two(_optimlp_around_zero)
    for rank in (0, 1):
        assert tensors_equal(got[rank][True], got[rank][False]), rank
        assert "OptimLP momentum: cannot reach the optimizer state" in got[rank]["momentum"]
        assert "OptimLP acc: cannot reach the wider accumulator" in got[rank]["wide"]
        assert "ZeroRedundancyOptimizer" in got[rank]["BLOCK8"]
        assert not got[rank]["BLOCK8", "injected"]
        assert got[rank]["overlap", "weight"] == "accepted"
        for kind in ("grad", "acc"):
            refused = got[rank]["overlap", kind]
            assert f"OptimLP {kind}: a ZeroRedundancyOptimizer made with overlap" in refused
        assert "OptimLP grad_scaling: 0.001 cannot scale" in got[rank]["overlap", "grad_scaling"]
        assert "OptimLP grad_scaling: 0.5 cannot scale" in got[rank]["overlap", "weight", "step"]

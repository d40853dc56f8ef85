"""What the experiments' trainers (experiments.cifar10.train, experiments.gpt.train) share: the
types of their numeric arguments, the device a process trains on (under torchrun too), the sums
and the weight check across ranks, the GPU kernels chosen (deterministic or not), the random
state a checkpoint keeps, and files written in one rename."""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import math
import os
import pathlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "positive_int",
    "positive_float",
    "seed_int",
    "choose_device",
    "all_reduce_sum",
    "weights_digest",
    "rank_digests",
    "sum_gradients",
    "threads_kept",
    "kernels_chosen",
    "process_group",
    "rng_state",
    "rng_device_type",
    "set_rng_state",
    "write_atomically",
    "write_csv",
]


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


MAX_SEED = 2**32 - 1  # the largest --seed: torch's generators and the seeds derived from it fit


def seed_int(text: str) -> int:
    """argparse type: a seed, an integer from 0 to MAX_SEED."""
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"must be an integer from 0 to 2**32 - 1 = {MAX_SEED}, got {text}"
        )
    return value


def choose_device(
    name: str, parser: argparse.ArgumentParser, world_size: int, local_rank: int
) -> torch.device:
    """The device --device ``name`` (auto, cpu, cuda or cuda:K) names: under torchrun
    (world_size > 1) a CUDA process takes the GPU of its local rank, else cuda is cuda:0. A bad
    name, or a CUDA device the machine lacks, ends the program through ``parser.error``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"--device: unknown device {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
        if world_size > 1 or device.index is None:
            device = torch.device("cuda", local_rank if world_size > 1 else 0)
        if device.index >= torch.cuda.device_count():
            parser.error(
                f"--device: no {device} (this machine has {torch.cuda.device_count()} CUDA devices)"
            )
    elif device.type != "cpu":
        parser.error(f"--device must be auto, cpu or cuda[:K], got {name!r}")
    return device


def all_reduce_sum(values: Sequence, device: torch.device, distributed: bool) -> list[float]:
    """``values`` summed over the ranks (themselves when not distributed), in float64."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if distributed:
        dist.all_reduce(t)
    return t.tolist()


def sum_gradients(process_group, bucket):  # (torch checks the annotations: none)
    """A DistributedDataParallel communication hook: the bucket's gradients summed over the
    processes (DistributedDataParallel's own hook averages them): for a loss whose errors are
    one process's on the whole batch (experiments.gpt.train.step_loss,
    experiments.cifar10.recipes.CifarRecipe.criterion)."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


@contextlib.contextmanager
def threads_kept():
    """Context: the caller's CPU thread count (torch.get_num_threads) put back on exit, so that a
    trainer may set its run's own count and a caller in the same process keeps its setting."""
    caller = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(caller)


@contextlib.contextmanager
def kernels_chosen(device: torch.device, deterministic: bool | None):
    """Context: on a CUDA ``device``, with ``deterministic`` torch's deterministic algorithms
    (warn_only: an op without a deterministic kernel warns instead of stopping the run;
    CUBLAS_WORKSPACE_CONFIG set where unset) and cuDNN's benchmark off, else cuDNN's benchmark
    on; the caller's settings put back on exit. On a CPU nothing: torch's CPU kernels give the
    same bits run after run for a fixed thread count."""
    if device.type != "cuda":
        yield
        return
    benchmark = torch.backends.cudnn.benchmark
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)


@contextlib.contextmanager
def process_group(device: torch.device, distributed: bool):
    """Context: with ``distributed``, torch.distributed's default process group (NCCL on a CUDA
    ``device``, made the current device; gloo on the CPU), destroyed on exit; else nothing."""
    if not distributed:
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def weights_digest(model: nn.Module) -> int:
    """A 63-bit hash of the bits of every parameter."""
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def rank_digests(
    model: nn.Module, device: torch.device, world_size: int, when: str = ""
) -> list[int]:
    """Every rank's weights_digest.

    Raises:
        RuntimeError: the ranks' weights differ (``when``, such as " after this epoch", is put
            in the message).
    """
    mine = weights_digest(model)
    if world_size == 1:
        return [mine]
    gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64, device=device))
    digests = [int(d) for d in gathered]
    if len(set(digests)) != 1:
        raise RuntimeError(
            f"the ranks' weights differ{when} (digests {digests}): every rank must draw the same "
            "stochastic-rounding seeds"
        )
    return digests


def rng_state(device: torch.device) -> dict:
    """torch's CPU generator state, and ``device``'s when it is a CUDA device."""
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def rng_device_type(state: dict) -> str:
    """The type of device ("cpu" or "cuda") of which rng_state returned ``state``: cuda where it
    holds a CUDA generator state."""
    return "cpu" if state["cuda"] is None else "cuda"


def set_rng_state(device: torch.device, state: dict) -> None:
    """Restore what rng_state(device) returned.

    Raises:
        ValueError: ``state`` was taken for another device type. It holds the generator state
            of its own device type only, and a run that draws its random numbers from the other
            one would continue with a stream neither the run nor its checkpoint had.
    """
    if rng_device_type(state) != device.type:
        raise ValueError(
            f"the random state was taken on a {rng_device_type(state)} device and cannot be "
            f"restored on {device}: it holds the generator state of its own device type only"
        )
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def write_atomically(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """write(tmp) to a temporary file beside ``path``, then put it in place in one rename."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_csv(path: pathlib.Path, rows: list[dict], columns: Sequence[str]) -> None:
    """``rows`` as a CSV file with a header of ``columns``, written atomically."""

    def write(tmp: pathlib.Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)

    write_atomically(path, write)

"""Train a CIFAR10 recipe of the QPyTorch paper with lpsim.

    python -m experiments.cifar10.train --recipe swalp --data-dir DATA [--download] [--epochs N]
        [--batch-size B] [--lr LR] [--seed S] [--device auto|cpu|cuda|cuda:K] [--out-dir DIR]
        [--resume]
    torchrun --nproc_per_node=G -m experiments.cifar10.train --recipe swalp --data-dir DATA ...

DATA holds cifar-10-batches-py (the python version of CIFAR10, read by
torchvision.datasets.CIFAR10); --download fetches it there first. Under torchrun each process
trains on its shard of every epoch with DistributedDataParallel (NCCL on GPUs, gloo on CPUs);
--batch-size is the global batch.

Every epoch writes DIR/checkpoint.pt (model, optimizer with its accumulators, scheduler, weight
average, random-number state, history), DIR/log.csv (one row per epoch) and DIR/curves.png (error
and loss against the epoch). --resume continues from the checkpoint and gives the same bits as a
run that was never interrupted; it takes the number of epochs (and SWALP's start) from the
checkpoint unless given. --resume --epochs M with M above the run's epochs extends it: the
learning-rate schedule keeps the length the run began with, and the added epochs train at the rate
it ends on (SWALP's averaging goes on). The recipes and
their sources are listed by --list-recipes and described in experiments/cifar10/recipes.py;
python -m experiments.cifar10.summarize tabulates the final test errors of finished runs.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from experiments.cifar10 import data as cifar
from experiments.cifar10.models import build_model
from experiments.cifar10.recipes import RECIPES, CifarRecipe, describe
from experiments.cifar10.swa import WeightAverage
from experiments.runs import (
    all_reduce_sum,
    choose_device,
    kernels_chosen,
    positive_float,
    positive_int,
    process_group,
    rank_digests,
    rng_device_type,
    rng_state,
    seed_int,
    set_rng_state,
    sum_gradients,
    threads_kept,
    write_atomically,
    write_csv,
)

CHECKPOINT = "checkpoint.pt"
LOG = "log.csv"
CURVES = "curves.png"
COLUMNS = (
    "epoch",
    "lr",
    "train_loss",
    "train_error",
    "test_loss",
    "test_error",
    "swa_test_loss",
    "swa_test_error",
    "train_seconds",
    "test_seconds",
)
# Settings that must be equal for --resume to continue the same run. The epochs may grow; the
# length of the learning-rate schedule (schedule_epochs, the run's first --epochs) never changes.
# data_order names how the epochs' orders follow from the seed (a checkpoint without it took them
# from DistributedSampler seeded with the seed itself, and would continue with other orders).
# compile: Inductor draws the random numbers of stochastic rounding its own way, so a run resumed
# compiled (or eager) after eager (or compiled) epochs would be neither run.
# device: the type of device that trains (cpu or cuda). Stochastic rounding draws its seeds from
# that device's generator, and the checkpoint holds the generator of its own device type only: a
# CPU run resumed on a GPU (--device auto on a machine with one) would draw from a CUDA generator
# freshly seeded, and a GPU run resumed on the CPU from the CPU generator's state, neither run's
# stream. A checkpoint without it trained where its random state says (a CUDA generator state:
# cuda).
# deterministic: on a GPU, --deterministic picks other kernels (cuDNN's benchmark off, torch's
# deterministic algorithms), which sum in other orders: a run resumed with it switched would be
# neither run. It changes nothing on a CPU, where it is recorded as None.
RUN_KEYS = (
    "recipe",
    "batch_size",
    "lr",
    "seed",
    "swa_start",
    "width",
    "world_size",
    "data",
    "data_order",
    "compile",
    "device",
    "deterministic",
)
DATA_ORDER = "order_seed"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.cifar10.train",
        description="Train a CIFAR10 recipe of the QPyTorch paper with lpsim.",
    )
    p.add_argument("--recipe", help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--list-recipes", action="store_true", help="list the recipes and exit")
    p.add_argument("--data-dir", type=pathlib.Path, help="directory holding cifar-10-batches-py")
    p.add_argument(
        "--download",
        action="store_true",
        help="first download CIFAR10 into DATA_DIR with torchvision (about 170 MB; "
        "skipped when it is there)",
    )
    p.add_argument(
        "--unverified-data",
        action="store_true",
        help="read CIFAR10-format batches without comparing them to the official "
        "release's MD5 sums (re-packed copies, test fixtures)",
    )
    p.add_argument(
        "--fake-data",
        type=positive_int,
        metavar="N",
        help="train on N random images (torchvision FakeData) instead, for timing",
    )
    p.add_argument(
        "--epochs",
        type=positive_int,
        help="default: the recipe's, or with --resume the checkpoint's; with --resume a "
        "larger number extends the run at the rate its schedule ended on",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        help="global batch size, split evenly over processes (default: the recipe's)",
    )
    p.add_argument(
        "--lr", type=positive_float, help="initial learning rate (default: the recipe's)"
    )
    p.add_argument(
        "--swa-start",
        type=int,
        metavar="EPOCH",
        help="first epoch (from 0) averaged, for recipes with weight averaging: "
        "1 to epochs - 1 (default: 2/3 of the epochs, kept in that range)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="0 to 2**32 - 1 (default: 0)")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when available), cpu, cuda or cuda:K; under torchrun each "
        "process takes the GPU of its local rank",
    )
    p.add_argument(
        "--out-dir",
        type=pathlib.Path,
        help="where the checkpoint and log go (default: out/cifar10/<recipe>)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT_DIR/checkpoint.pt (a finished run: only with a larger --epochs)",
    )
    p.add_argument(
        "--stop-after",
        type=positive_int,
        metavar="N",
        help="end this invocation after N epochs (checkpoint written; continue with "
        "--resume); the schedule still spans --epochs",
    )
    p.add_argument(
        "--width",
        type=positive_float,
        default=1.0,
        help="channel multiplier of the model (1: the published network)",
    )
    p.add_argument("--compile", action="store_true", help="train the torch.compile'd model")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic GPU kernels where torch has them (needed for "
        "bit-identical resumes on GPUs; CPU runs are deterministic for a fixed "
        "thread count)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


class Run:
    """Everything a training invocation needs, settled from the arguments and the environment."""

    def __init__(self, args: argparse.Namespace, p: argparse.ArgumentParser):
        if args.recipe is None:
            p.error("--recipe is required (see --list-recipes)")
        if args.recipe not in RECIPES:
            p.error(f"unknown recipe {args.recipe!r}; choose from {', '.join(RECIPES)}")
        if (args.data_dir is None) == (args.fake_data is None):
            p.error("give either --data-dir (CIFAR10) or --fake-data N")
        if args.download and args.data_dir is None:
            p.error("--download fetches CIFAR10 into --data-dir; it does not apply to --fake-data")
        if args.unverified_data and args.data_dir is None:
            p.error(
                "--unverified-data reads CIFAR10 from --data-dir without its checksums; it does "
                "not apply to --fake-data"
            )
        self.recipe: CifarRecipe = RECIPES[args.recipe]
        self.args = args
        self.out_dir = args.out_dir or pathlib.Path("out") / "cifar10" / self.recipe.name
        self.checkpoint = self.out_dir / CHECKPOINT
        if args.resume and not self.checkpoint.is_file():
            p.error(f"--resume: no checkpoint at {self.checkpoint}")
        if not args.resume and self.checkpoint.exists():
            p.error(
                f"{self.checkpoint} exists: pass --resume to continue that run, or choose "
                "another --out-dir"
            )
        # The checkpoint (on the CPU: generator states must stay there), under --resume.
        self.saved = (
            torch.load(self.checkpoint, map_location="cpu", weights_only=True)
            if args.resume
            else None
        )
        saved = None
        if self.saved is not None:
            saved = {
                "schedule_epochs": self.saved["config"]["epochs"],
                "device": rng_device_type(self.saved["rng"]),
                **self.saved["config"],
            }
        self.epochs = args.epochs or (saved["epochs"] if saved else self.recipe.epochs)
        # The epochs the learning-rate schedule spans: the run's first --epochs. Epochs added by
        # --resume --epochs train at the rate the schedule ends on.
        self.schedule_epochs = saved["schedule_epochs"] if saved else self.epochs
        if saved and self.epochs < saved["epochs"]:
            p.error(
                f"--resume --epochs {self.epochs}: the run in {self.out_dir} has "
                f"{saved['epochs']} epochs, and --epochs can only grow"
            )
        self.batch_size = args.batch_size or self.recipe.batch_size
        self.lr = args.lr or self.recipe.lr
        try:
            self.recipe.check_lr(self.lr)
        except ValueError as error:
            p.error(str(error))
        self.swa_start = None
        if self.recipe.swa_start is not None:
            if self.schedule_epochs < 2:
                p.error(
                    f"recipe {self.recipe.name} trains at least one epoch before averaging "
                    f"and averages at least one: it needs --epochs 2 or more, got "
                    f"{self.schedule_epochs}"
                )
            if args.swa_start is not None:
                self.swa_start = args.swa_start
            elif saved and saved["recipe"] == self.recipe.name:
                self.swa_start = saved["swa_start"]
            else:
                self.swa_start = self.recipe.default_swa_start(self.schedule_epochs)
            if not 0 < self.swa_start < self.schedule_epochs:
                p.error(
                    f"--swa-start must lie between 1 and epochs - 1 = "
                    f"{self.schedule_epochs - 1}, got {self.swa_start}"
                )
        elif args.swa_start is not None:
            p.error(
                f"recipe {self.recipe.name} does not average weights; --swa-start applies to "
                f"{', '.join(r.name for r in RECIPES.values() if r.swa_start)}"
            )
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.batch_size % self.world_size:
            p.error(
                f"--batch-size {self.batch_size} is not divisible by the {self.world_size} "
                "processes"
            )
        self.local_batch = self.batch_size // self.world_size
        self.device = choose_device(args.device, p, self.world_size, self.local_rank)
        # torch's CPU kernels sum in an order that depends on the thread count, so a CPU run
        # trains (and resumes) with the count it began with; a checkpoint written before the count
        # was recorded resumes with the process's.
        self.threads = torch.get_num_threads()
        if saved and self.device.type == "cpu" and saved.get("threads"):
            self.threads = saved["threads"]
        if args.fake_data:
            self.data_name = f"fake:{args.fake_data}"
        else:
            self.data_name = "cifar10-unverified" if args.unverified_data else "cifar10"
        self.config = {
            "recipe": self.recipe.name,
            "epochs": self.epochs,
            "schedule_epochs": self.schedule_epochs,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "seed": args.seed,
            "swa_start": self.swa_start,
            "width": args.width,
            "world_size": self.world_size,
            "data": self.data_name,
            "data_order": DATA_ORDER,
            "compile": args.compile,
            "device": self.device.type,
            "deterministic": args.deterministic if self.device.type == "cuda" else None,
            "threads": self.threads if self.device.type == "cpu" else None,
        }
        if saved:
            different = {
                k: (saved.get(k), self.config[k])
                for k in RUN_KEYS
                if saved.get(k) != self.config[k]
            }
            if different:
                raise SystemExit(
                    f"--resume: {self.checkpoint} belongs to another run; settings "
                    f"that differ (saved, now): {different}"
                )

    @property
    def finished(self) -> bool:
        """Whether --resume found a run that has already trained all its epochs."""
        return self.saved is not None and self.saved["epoch"] >= self.epochs

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main_process(self) -> bool:
        return self.rank == 0


_MOMENTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def to_inputs(recipe: CifarRecipe, images: torch.Tensor) -> torch.Tensor:
    """uint8 images to the network's float inputs: [0, 1], then normalised or mapped to [-1, 1]."""
    x = images.float().div_(255)
    if recipe.inputs == "symmetric":
        return x.mul_(2).sub_(1)
    if x.device not in _MOMENTS:  # made once per device: no host-to-device copy per batch
        _MOMENTS[x.device] = tuple(
            torch.tensor(v, device=x.device).view(1, 3, 1, 1) for v in (cifar.MEAN, cifar.STD)
        )
    mean, std = _MOMENTS[x.device]
    return (x - mean) / std


def train_epoch(
    run: Run, net: nn.Module, model: nn.Module, optimizer, train: cifar.Split, epoch: int
) -> tuple[float, float]:
    """One epoch on this rank's shard; returns (mean loss, error %) over all ranks."""
    recipe = run.recipe
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    seen = 0
    batches = cifar.training_batches(
        train,
        run.local_batch,
        seed=run.args.seed,
        epoch=epoch,
        rank=run.rank,
        world_size=run.world_size,
    )
    total = math.ceil(math.ceil(len(train) / run.world_size) / run.local_batch)
    bar = tqdm(
        batches,
        total=total,
        desc=f"epoch {epoch + 1}/{run.epochs}",
        leave=False,
        disable=True if (run.args.no_progress or not run.main_process) else None,
    )
    for images, labels in bar:
        logits = net(to_inputs(recipe, images))
        loss, batch_loss = recipe.criterion(logits, labels, run.world_size)
        optimizer.zero_grad(set_to_none=True)
        (loss * recipe.loss_scale).backward()
        optimizer.step()
        loss_sum += batch_loss.double()
        correct += (logits.detach().argmax(1) == labels).sum()
        seen += len(labels)
    loss_total, correct_total, count = all_reduce_sum(
        [loss_sum, correct, seen], run.device, run.distributed
    )
    return loss_total / count, 100.0 * (1.0 - correct_total / count)


@torch.no_grad()
def evaluate(run: Run, model: nn.Module, test: cifar.Split) -> tuple[float, float]:
    """(mean loss, error %) of model on the whole test set, each rank evaluating its shard. The
    random numbers of stochastic quantisers come from a fork of the generators, so evaluation
    leaves the training stream untouched."""
    shard = cifar.eval_shard(test, run.rank, run.world_size)
    devices = [run.device] if run.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
        correct = torch.zeros((), dtype=torch.int64, device=run.device)
        for start in range(0, len(shard), run.local_batch):
            images = shard.images[start : start + run.local_batch]
            labels = shard.labels[start : start + run.local_batch]
            logits = model(to_inputs(run.recipe, images))
            loss_sum += run.recipe.criterion(logits, labels)[1].double()
            correct += (logits.argmax(1) == labels).sum()
    loss_total, correct_total, count = all_reduce_sum(
        [loss_sum, correct, len(shard)], run.device, run.distributed
    )
    return loss_total / count, 100.0 * (1.0 - correct_total / count)


def update_average(
    run: Run, average: WeightAverage, model: nn.Module, train: cifar.Split, epoch: int
) -> None:
    """Fold the weights into the average and recompute its batch-norm statistics on this rank's
    shard of the training data (averaged over ranks), under forked generators."""
    average.update(model)
    devices = [run.device] if run.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        batches = (
            to_inputs(run.recipe, images)
            for images, _ in cifar.training_batches(
                train,
                run.local_batch,
                seed=run.args.seed,
                epoch=epoch,
                rank=run.rank,
                world_size=run.world_size,
            )
        )
        average.recompute_batch_norm(batches)
    if run.distributed:
        for m in average.model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                for buffer in (m.running_mean, m.running_var):
                    dist.all_reduce(buffer)
                    buffer.div_(run.world_size)


def plot_curves(path: pathlib.Path, history: list[dict], title: str) -> None:
    """The training and test error (%) and loss of every epoch in ``history`` (rows of the log),
    and the averaged weights' test error and loss where there are some, as a PNG written with
    matplotlib's Agg backend (no display needed) and put in place atomically."""
    import matplotlib  # noqa: PLC0415  (imported on first use: the trainer runs without a plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, quantity in zip(axes, ("error", "loss")):
        for prefix, label, style in (
            ("train_", "training", "--"),
            ("test_", "test", "-"),
            ("swa_test_", "test, averaged weights", "-"),
        ):
            points = [
                (int(row["epoch"]), float(row[prefix + quantity]))
                for row in history
                if row[prefix + quantity] != ""
            ]
            if points:
                epochs, values = zip(*points)
                ax.plot(epochs, values, style, marker="o", markersize=3, label=label)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("error (%)" if quantity == "error" else "loss (mean per image)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def load_data(run: Run) -> tuple[cifar.Split, cifar.Split]:
    args = run.args
    if args.fake_data:
        size = args.fake_data
        train = cifar.fake_cifar10(size, first=args.seed * 2 * size)
        test = cifar.fake_cifar10(max(1, size // 5), first=(args.seed * 2 + 1) * size)
    else:
        verify = not args.unverified_data
        train = cifar.load_cifar10(args.data_dir, train=True, verify=verify, download=args.download)
        test = cifar.load_cifar10(args.data_dir, train=False, verify=verify, download=args.download)
    return train.to(run.device), test.to(run.device)


def _fmt(value, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def train(run: Run, train_set: cifar.Split, test_set: cifar.Split) -> list[dict]:
    """Train (or continue) the run; returns the history, one dict per completed epoch."""
    recipe, args = run.recipe, run.args
    torch.manual_seed(args.seed)
    options = dict(recipe.model_options)
    model = build_model(recipe.model, width=args.width, **options).to(run.device)
    model, optimizer = recipe.prepare(model, run.lr)
    # Epochs past the schedule's length (added by --resume --epochs) keep the rate it ends on.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda e: recipe.lr_factor(
            min(e, run.schedule_epochs), run.schedule_epochs, run.swa_start, run.lr
        ),
    )
    average = None
    if run.swa_start is not None:
        average = WeightAverage(
            build_model(recipe.model, width=args.width, **options).to(run.device)
        )
    net = model
    if run.distributed:
        ids = [run.device.index] if run.device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        net.register_comm_hook(None, sum_gradients)  # see CifarRecipe.criterion
    if args.compile:
        net = torch.compile(net)

    start, history = 0, []
    if run.saved is not None:
        state = run.saved  # on the CPU; load_state_dict moves it
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if average is not None:
            average.load_state_dict(state["swa"])
        set_rng_state(run.device, state["rng"])
        start, history = state["epoch"], state["history"]

    if run.main_process:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        print(
            f"{recipe.name}: {recipe.summary}\n  {run.epochs} epochs, batch {run.batch_size} "
            f"({run.world_size} process{'es' if run.distributed else ''} on {run.device})"
            + (f", {torch.get_num_threads()} CPU threads" if run.device.type == "cpu" else "")
            + f", lr {run.lr:g}, seed {args.seed}, {len(train_set)} training and {len(test_set)} "
            f"test images; {'resuming after epoch ' + str(start) if start else 'from scratch'}"
            + (
                f"; the schedule spans the first {run.schedule_epochs}, later epochs train at "
                "the rate it ends on"
                if run.epochs > run.schedule_epochs
                else ""
            ),
            flush=True,
        )
    stop = run.epochs if args.stop_after is None else min(run.epochs, start + args.stop_after)
    for epoch in range(start, stop):
        lr = optimizer.param_groups[0]["lr"]
        began = time.perf_counter()
        train_loss, train_error = train_epoch(run, net, model, optimizer, train_set, epoch)
        if run.distributed:  # batch-norm statistics as rank 0 has them, as DDP's next step will
            for buffer in model.buffers():
                dist.broadcast(buffer, 0)
        trained = time.perf_counter()
        test_loss, test_error = evaluate(run, model, test_set)
        swa_loss = swa_error = None
        if average is not None and epoch >= run.swa_start:
            update_average(run, average, model, train_set, epoch)
            swa_loss, swa_error = evaluate(run, average.model, test_set)
        scheduler.step()
        digests = rank_digests(model, run.device, run.world_size, " after this epoch")
        history.append(
            {
                "epoch": epoch + 1,
                "lr": f"{lr:.6g}",
                "train_loss": _fmt(train_loss, 6),
                "train_error": _fmt(train_error, 4),
                "test_loss": _fmt(test_loss, 6),
                "test_error": _fmt(test_error, 4),
                "swa_test_loss": _fmt(swa_loss, 6),
                "swa_test_error": _fmt(swa_error, 4),
                "train_seconds": f"{trained - began:.2f}",
                "test_seconds": f"{time.perf_counter() - trained:.2f}",
            }
        )
        if run.main_process:
            state = {
                "config": run.config,
                "epoch": epoch + 1,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "swa": None if average is None else average.state_dict(),
                "rng": rng_state(run.device),
                "history": history,
                "rank_digests": digests,
            }
            write_atomically(run.checkpoint, lambda tmp, state=state: torch.save(state, tmp))
            write_csv(run.out_dir / LOG, history, COLUMNS)
            plot_curves(run.out_dir / CURVES, history, f"{recipe.name} ({run.out_dir})")
            row = history[-1]
            swa = f"  swa test error {row['swa_test_error']}%" if swa_error is not None else ""
            print(
                f"epoch {epoch + 1:3d}/{run.epochs}  lr {row['lr']}  train loss "
                f"{row['train_loss']} error {row['train_error']}%  test loss {row['test_loss']} "
                f"error {row['test_error']}%{swa}  ({row['train_seconds']} s + "
                f"{row['test_seconds']} s)",
                flush=True,
            )
        if run.distributed:
            dist.barrier()
    return history


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser()
    args = p.parse_args(argv)
    if args.list_recipes:
        print(describe())
        return []
    run = Run(args, p)
    if run.finished:
        last = run.saved["history"][-1]
        if run.main_process:
            # The checkpoint is written before the log and the curves: an invocation stopped
            # between them after the last epoch left them without that epoch, which no later
            # epoch rewrites.
            write_csv(run.out_dir / LOG, run.saved["history"], COLUMNS)
            plot_curves(
                run.out_dir / CURVES, run.saved["history"], f"{run.recipe.name} ({run.out_dir})"
            )
            print(
                f"{run.checkpoint}: this run already finished its {run.epochs} "
                f"epoch{'s' if run.epochs > 1 else ''} (last test error {last['test_error']}%); "
                f"nothing to do. To train longer, pass --resume --epochs M with M > "
                f"{run.epochs}: the added epochs train at the learning rate its schedule ended "
                "on.",
                flush=True,
            )
        return run.saved["history"]
    try:
        data = load_data(run)
    except FileNotFoundError as error:
        p.error(str(error))
    except OSError as error:  # --download without a connection, or unreadable files
        p.error(
            f"could not {'fetch CIFAR10 into' if args.download else 'read CIFAR10 from'} "
            f"{args.data_dir}: {error}"
        )
    with threads_kept():
        torch.set_num_threads(run.threads)
        with (
            process_group(run.device, run.distributed),
            kernels_chosen(run.device, run.args.deterministic),
        ):
            return train(run, *data)


if __name__ == "__main__":
    main(sys.argv[1:])

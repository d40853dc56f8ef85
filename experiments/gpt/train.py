"""Train the character-level GPT under a low-precision recipe, or under all of them.

    python -m experiments.gpt.train --recipe NAME|all [--short] [--steps N] [--batch-size B]
        [--context T] [--width W] [--layers L] [--heads H] [--lr LR] [--seed S]
        [--device auto|cpu|cuda|cuda:K] [--out-dir DIR] [--resume] [--eval-every N]
        [--val-windows N] [--stop-after N] [--threads N] [--deterministic] [--no-progress]
        [--list-recipes]
    torchrun --nproc_per_node=G -m experiments.gpt.train --recipe NAME ...

The corpus, the model and the recipes are described in experiments/gpt/data.py, model.py and
recipes.py. Optimisation: AdamW with betas (0.9, 0.99), eps 1e-8, weight decay 0.1 on the matrices
and embeddings (none on biases and LayerNorms), gradients clipped to a global norm of 1 before
every step, and the learning rate warmed up linearly over the first 5% of the steps (rounded up)
to --lr, then down a half cosine to 10% of it at the last step. The loss is the mean cross-entropy
over every position of the batch (nats per character).

Two configurations (each setting can be overridden):

- the default (for a GPU): 4 layers, width 128, 4 heads, context 128, batch 64, 5000 steps,
  lr 1e-3, evaluated every 250 steps on 256 validation windows;
- ``--short`` (every recipe on one CPU thread, ``--recipe all`` in about 4 minutes on an idle
  2-core machine, twice that on a loaded one): 2 layers,
  width 32, 2 heads, context 64, batch 8, 300 steps, lr 3e-3, evaluated every 50 steps on 64
  validation windows, one thread unless --threads says otherwise.

Every evaluation (and step 0, before training) writes in DIR (default out/gpt/NAME):
checkpoint.pt (model with its quantisers' state, optimizer, scheduler, torch's generator states,
the delayed scalers of the attention quantisers, history, settings), log.csv (one row per
evaluation) and curves.png. ``--resume`` continues from the checkpoint with the same bits as a run
never interrupted (tested on the CPU; on a GPU not tried, and it needs --deterministic, torch's
deterministic kernels: some of the others, the fused attention's backward among them, add in an
order that can change between runs); settings not given are taken from the checkpoint, the
thread count included (--threads, torch's choice when the run started, or 1 with --short), and
given ones must equal it, the device type (cpu or cuda) among them: stochastic rounding draws
from the generator of the device that trains, the only one the checkpoint holds.
``--stop-after N`` ends an invocation after N steps (a checkpoint is written). Resuming a
finished run trains nothing and writes its log.csv and curves.png again from the checkpoint.

``--recipe all`` trains every recipe in turn, each in DIR/NAME (default out/gpt/NAME), then writes
gpt.md (the table: final validation loss, gap to fp32, training tokens per second and simulation
overhead) and gpt.png (every recipe's validation loss) in DIR (default docs/results). With
``--resume`` it continues the runs that have a checkpoint and starts the others with their
settings (the checkpoints must agree on them).

Under torchrun each process trains with DistributedDataParallel (NCCL on GPUs, gloo on CPUs) on
its share of every global batch (--batch-size is the global batch: every process draws the same
windows and keeps its rows; its loss is its share's summed cross-entropy over the positions of the
whole batch, and the processes' gradients are summed, so that its errors are one process's; see
step_loss) and evaluates its share of the validation windows; stochastic
rounding draws the same seeds on every process, and the weights are checked to be identical on
all ranks after every evaluation. Delayed scalers all-reduce (MAX) each amax over the processes
before recording it, as Transformer Engine does, so every rank holds the same histories and
scales; a resumed multi-process run restarts every rank's scalers from rank 0's, which are theirs.
Such a run is not every recipe's one-process simulation (GPTRecipe.multi_process says where it
differs), and the gpt.md it writes says so.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import lpsim
from experiments.gpt import results
from experiments.gpt.data import MAX_SEED, MAX_STEP, Corpus, load_corpus
from experiments.gpt.model import GPT, GPTConfig
from experiments.gpt.recipes import RECIPES, GPTRecipe, describe
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
    set_rng_state,
    sum_gradients,
    threads_kept,
    write_atomically,
)

CHECKPOINT = "checkpoint.pt"
LOG = "log.csv"
CURVES = "curves.png"
TABLE = "gpt.md"
PLOT = "gpt.png"
ALL = "all"

BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1
GRADIENT_CLIP = 1.0  # largest global gradient norm
WARMUP_FRACTION = 0.05
FINAL_LR_FACTOR = 0.1  # the cosine ends at this fraction of --lr

DEFAULTS = dict(
    steps=5000,
    batch_size=64,
    context=128,
    width=128,
    layers=4,
    heads=4,
    lr=1e-3,
    seed=0,
    eval_every=250,
    val_windows=256,
)
# The settings of a run (what --resume must find unchanged): DEFAULTS', the thread count, which
# changes the bits of torch's CPU kernels (default: torch's choice when the run starts), and on a
# GPU --deterministic, whose kernels sum in other orders (recorded None on a CPU, where it changes
# nothing).
SETTINGS = (*DEFAULTS, "threads", "deterministic")
SHORT = dict(
    steps=300,
    batch_size=8,
    context=64,
    width=32,
    layers=2,
    heads=2,
    lr=3e-3,
    eval_every=50,
    val_windows=64,
)
SHORT_THREADS = 1


def seed_int(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {MAX_SEED}, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.gpt.train",
        description="Train a character-level GPT under a low-precision recipe with lpsim.",
    )
    p.add_argument("--recipe", help=f"one of: {', '.join(RECIPES)}, or {ALL} (each in turn)")
    p.add_argument("--list-recipes", action="store_true", help="list the recipes and exit")
    p.add_argument(
        "--short",
        action="store_true",
        help="the short configuration (2 layers, width 32, 2 heads, context 64, batch 8, 300 "
        "steps, lr 3e-3, evaluated every 50 steps on 64 validation windows, one thread): every "
        "recipe in about 4 minutes on one idle CPU thread",
    )
    p.add_argument("--steps", type=positive_int, help="training steps (default 5000)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        help="global batch in windows, split evenly over processes (default 64)",
    )
    p.add_argument("--context", type=positive_int, help="characters per window (default 128)")
    p.add_argument("--width", type=positive_int, help="residual channels (default 128)")
    p.add_argument("--layers", type=positive_int, help="transformer blocks (default 4)")
    p.add_argument("--heads", type=positive_int, help="attention heads, dividing --width (4)")
    p.add_argument("--lr", type=positive_float, help="peak learning rate (default 1e-3)")
    p.add_argument("--seed", type=seed_int, help="initialisation, batches and rounding (0)")
    p.add_argument(
        "--eval-every", type=positive_int, help="steps between evaluations (default 250)"
    )
    p.add_argument(
        "--val-windows",
        type=positive_int,
        help="validation windows, evenly spaced over the validation split (default 256)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when available), cpu, cuda or cuda:K; under torchrun each process "
        "takes the GPU of its local rank",
    )
    p.add_argument(
        "--out-dir",
        type=pathlib.Path,
        help="where the checkpoint and log go (default out/gpt/<recipe>); with --recipe all, "
        "the runs go to OUT_DIR/<recipe> and the table and plot to OUT_DIR (default: runs in "
        "out/gpt, table and plot in docs/results)",
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/checkpoint.pt")
    p.add_argument(
        "--stop-after",
        type=positive_int,
        metavar="N",
        help="end this invocation after N steps (checkpoint written; continue with --resume)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch's CPU threads (default: torch's choice; 1 with --short; with --resume, the "
        "checkpoint's)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="deterministic GPU kernels where torch has them (needed for bit-identical resumes "
        "on GPUs; CPU runs are deterministic for a fixed thread count); with --resume, the "
        "checkpoint's",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


@dataclass(frozen=True)
class Settings:
    """The settings of one run (see DEFAULTS and SHORT), the processes, the corpus and the CPU
    threads."""

    recipe: str
    steps: int
    batch_size: int
    context: int
    width: int
    layers: int
    heads: int
    lr: float
    seed: int
    eval_every: int
    val_windows: int
    world_size: int
    corpus: str  # Corpus.fingerprint
    threads: int | None = None  # torch's CPU threads (None: not recorded, an older checkpoint)
    # The type of device that trains, "cpu" or "cuda": stochastic rounding draws from its
    # generator, and a checkpoint holds that device type's generator state only (None: not
    # recorded, an older checkpoint, whose random state says it).
    device: str | None = None
    # On a GPU, whether torch's deterministic kernels train (--deterministic); None on a CPU and
    # in an older checkpoint (which trained without them).
    deterministic: bool | None = None

    @property
    def warmup(self) -> int:
        return max(1, math.ceil(WARMUP_FRACTION * self.steps))

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size, self.context, self.layers, self.width, self.heads)


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """The learning rate of (0-based) ``step`` as a fraction of the peak: (step + 1) / warmup
    during the warmup, then a half cosine from 1 down to FINAL_LR_FACTOR at the last step (a
    cosine of one step, the last, is at FINAL_LR_FACTOR)."""
    if step < warmup:
        return (step + 1) / warmup
    span = steps - 1 - warmup  # the steps after the cosine's first, which has progress 0
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    return FINAL_LR_FACTOR + (1 - FINAL_LR_FACTOR) * 0.5 * (1 + math.cos(math.pi * progress))


class Session:
    """What every run of one invocation shares: the arguments, the processes, the device, the
    corpus."""

    def __init__(self, args: argparse.Namespace, p: argparse.ArgumentParser, corpus: Corpus):
        self.args, self.parser, self.corpus = args, p, corpus
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = choose_device(args.device, p, self.world_size, self.local_rank)
        self.requested = {k: getattr(args, k) for k in SETTINGS if getattr(args, k) is not None}
        if args.short:
            self.requested = {**SHORT, "threads": SHORT_THREADS, **self.requested}

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main_process(self) -> bool:
        return self.rank == 0

    def say(self, text: str) -> None:
        if self.main_process:
            print(text, flush=True)


class Run:
    """One recipe's run: its settings (from the arguments, --short, and under --resume the
    checkpoint), its directory and its saved state."""

    def __init__(self, session: Session, recipe: GPTRecipe, out_dir: pathlib.Path, resume: bool):
        p, args = session.parser, session.args
        self.session, self.recipe, self.out_dir = session, recipe, out_dir
        self.checkpoint = out_dir / CHECKPOINT
        self.saved = None
        if resume:
            if self.checkpoint.is_file():
                self.saved = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
            elif args.recipe != ALL:
                p.error(f"--resume: no checkpoint at {self.checkpoint}")
        elif self.checkpoint.exists():
            p.error(
                f"{self.checkpoint} exists: pass --resume to continue that run, or choose "
                "another --out-dir"
            )
        if recipe.cpu_only and session.device.type != "cpu":
            p.error(
                f"--recipe {recipe.name} computes its products with lpsim.mac, which runs on the "
                f"CPU only: use --device cpu (got {session.device})"
            )
        wanted = {
            **session.requested,
            "recipe": recipe.name,
            "world_size": session.world_size,
            "corpus": session.corpus.fingerprint,
            "device": session.device.type,
        }
        if session.device.type != "cuda":
            wanted["deterministic"] = None  # it changes nothing on a CPU
        elif self.saved is None:
            wanted.setdefault("deterministic", False)
        if self.saved is not None:
            # A checkpoint written before the device type was recorded trained where its random
            # state says.
            saved = {"device": rng_device_type(self.saved["rng"]), **self.saved["settings"]}
            # (A checkpoint older than a setting holds no value for it.)
            different = {
                k: (saved[k], v) for k, v in wanted.items() if k in saved and saved[k] != v
            }
            if different:
                raise SystemExit(
                    f"--resume: {self.checkpoint} belongs to another run; settings that differ "
                    f"(saved, now): {different}"
                )
            self.settings = Settings(**saved)
        else:
            self.settings = Settings(**{**DEFAULTS, "threads": torch.get_num_threads(), **wanted})
        s = self.settings
        if s.steps > MAX_STEP + 1:
            p.error(f"--steps must be at most {MAX_STEP + 1}, got {s.steps}")
        if s.width % s.heads:
            p.error(f"--heads {s.heads} must divide --width {s.width} (channels per head)")
        try:
            session.corpus.check_context(s.context)
        except ValueError as error:
            p.error(f"--context: {error}")
        if s.batch_size % session.world_size:
            p.error(
                f"--batch-size {s.batch_size} is not divisible by the {session.world_size} "
                "processes"
            )
        self.local_batch = s.batch_size // session.world_size
        transform = recipe.token_transform
        if transform is not None and self.local_batch * s.context % transform.size:
            p.error(
                f"--recipe {recipe.name} transforms its weight gradients' operands in groups of "
                f"{transform.size} tokens: the tokens of a step on one process, --batch-size "
                f"{s.batch_size} / {session.world_size} process(es) times --context {s.context}, "
                f"must be a multiple of {transform.size}"
            )

    @property
    def finished(self) -> bool:
        return self.saved is not None and self.saved["step"] >= self.settings.steps


# Optimizer states in checkpoints. lpsim's optimizers keep their formats (Float, ...) in their
# parameter groups; torch.load(weights_only=True) refuses such objects, so checkpoints keep the
# groups' plain values only and the rest comes from the optimizer the recipe rebuilds.
_PLAIN = (bool, int, float, str, type(None))


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if _plain(v)} for g in state["param_groups"]]
    return {**state, "param_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    groups = [
        {**{k: v for k, v in live.items() if k != "params"}, **saved}
        for live, saved in zip(optimizer.param_groups, state["param_groups"])
    ]
    optimizer.load_state_dict({**state, "param_groups": groups})


def functions_context(model: nn.Module, recipe: GPTRecipe):
    """(context, mode): ``context()`` returns the context every forward pass runs in, and
    ``mode`` is the lpsim.nn.quantize_functions object it enters (one per run, entered at every
    forward, so that the amax histories of delayed scaling carry over), or None for recipes
    without a functions config (which run in a null context)."""
    if recipe.functions is None:
        return contextlib.nullcontext, None
    mode = lpsim.nn.quantize_functions(model, recipe.functions)
    return (lambda: mode), mode


def functions_state(mode) -> dict | None:
    """The state of a quantize_functions object (its delayed scalers); None without one."""
    return None if mode is None else mode.state_dict()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Every position's cross-entropy (float32, flattened)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def step_loss(
    logits: torch.Tensor, targets: torch.Tensor, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, mean) of one process's share of a step's batch: ``loss``, to differentiate, is the
    share's summed cross-entropy over the positions of the whole global batch (world_size times
    the share's), so that the errors flowing back through the model are those of one process
    training on the whole batch, bit for bit, for every world size; DistributedDataParallel then
    sums the processes' gradients (sum_gradients) instead of averaging them. (The mean of each
    share, differentiated and averaged, gives the same gradients, but errors world_size times
    larger, which every recipe's error formats round otherwise where world_size is not a power
    of two.) ``mean``, the share's mean cross-entropy, is what the log averages."""
    total = cross_entropy_sum(logits, targets)
    loss = total / (targets.numel() * world_size)
    mean = loss.detach() if world_size == 1 else total.detach() / targets.numel()
    return loss, mean


@torch.no_grad()
def evaluate(run: Run, model: nn.Module, context, windows) -> float:
    """Mean cross-entropy (nats per character) over the validation windows, each rank taking a
    strided share, evaluated in chunks of run.local_batch windows (a per-tensor current scale is
    taken over a chunk, so such recipes' losses depend on the batch and the process count); in
    eval mode (stochastic rules replaced by nearest) and inside a fork of torch's generators, so
    evaluating never shifts the training stream. The mean is the exact sum of every position's
    float32 loss (math.fsum, over the windows of every rank in order) divided by their count,
    so that neither the chunks nor the processes change how the losses are added."""
    session = run.session
    inputs, targets = windows
    count, length = targets.shape
    inputs = inputs[session.rank :: session.world_size].to(session.device)
    targets = targets[session.rank :: session.world_size].to(session.device)
    devices = [session.device] if session.device.type == "cuda" else []
    # This rank's per-position losses, padded to the share of the rank with the most windows.
    share = -(-count // session.world_size)
    losses = torch.zeros(share, length, dtype=torch.float32, device=session.device)
    with torch.random.fork_rng(devices=devices):
        model.eval()
        try:
            for start in range(0, len(inputs), run.local_batch):
                x = inputs[start : start + run.local_batch]
                with context():
                    logits = model(x)
                y = targets[start : start + run.local_batch]
                losses[start : start + len(x)] = cross_entropy(logits, y).view(y.shape)
        finally:
            model.train()
    if session.distributed:
        gathered = [torch.empty_like(losses) for _ in range(session.world_size)]
        dist.all_gather(gathered, losses)
        # Window w was rank w % world_size's (w // world_size)-th.
        losses = torch.stack(
            [gathered[w % session.world_size][w // session.world_size] for w in range(count)]
        )
    return math.fsum(losses[:count].double().flatten().tolist()) / (count * length)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Interval:
    """The training steps since the last log row: their summed loss (float64, this rank's batch
    means), their count and the seconds they took (this rank's)."""

    def __init__(self, state: dict | None, device: torch.device):
        state = state or {"loss_sum": 0.0, "steps": 0, "seconds": 0.0}
        self.loss_sum = torch.tensor(state["loss_sum"], dtype=torch.float64, device=device)
        self.steps, self.seconds = state["steps"], state["seconds"]

    def state(self, session: Session) -> dict:
        """What every rank resumes from (the checkpoint holds rank 0's): the loss sum as the mean
        of the ranks' sums, so that after resuming the ranks' sums add up to those of a run never
        interrupted. An all-reduce under torchrun: every rank calls it."""
        (loss_sum,) = all_reduce_sum([self.loss_sum], session.device, session.distributed)
        return {
            "loss_sum": loss_sum / session.world_size,
            "steps": self.steps,
            "seconds": self.seconds,
        }


def train(run: Run) -> list[dict]:
    """Train (or continue) one run; returns its history (one dict per log row)."""
    session, recipe, s = run.session, run.recipe, run.settings
    device, corpus = session.device, session.corpus
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    model = GPT(s.model_config(corpus.vocab_size)).to(device)
    model, optimizer, _ = recipe.build(
        model, lr=s.lr, weight_decay=WEIGHT_DECAY, betas=BETAS, seed=s.seed
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, s.steps, s.warmup)
    )
    net = model
    if session.distributed:
        ids = [device.index] if device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        net.register_comm_hook(None, sum_gradients)  # see step_loss

    context, mode = functions_context(model, recipe)
    windows = corpus.validation_windows(s.val_windows, s.context)

    start, history, interval = 0, [], Interval(None, device)
    if run.saved is not None:
        state = run.saved
        model.load_state_dict(state["model"])
        load_optimizer_state(optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(device, state["rng"])
        if state["functions"] is not None and mode is not None:
            mode.load_state_dict(state["functions"])
        start, history = state["step"], state["history"]
        interval = Interval(state["interval"], device)

    def record(step: int, evaluate_now: bool) -> None:
        """Evaluate (when asked), log, and write the checkpoint after ``step`` steps."""
        nonlocal interval
        if evaluate_now:
            began = time.perf_counter()
            validation = evaluate(run, model, context, windows)
            eval_seconds = time.perf_counter() - began
            (train_sum,) = all_reduce_sum([interval.loss_sum], session.device, session.distributed)
            train_loss = train_sum / session.world_size / interval.steps if interval.steps else None
            tokens = step * s.batch_size * s.context
            history.append(
                {
                    "step": step,
                    "lr": f"{s.lr * lr_factor(max(step - 1, 0), s.steps, s.warmup):.6g}",
                    "train_loss": "" if train_loss is None else f"{train_loss:.6f}",
                    "validation_loss": f"{validation:.6f}",
                    "tokens": tokens,
                    "train_seconds": f"{interval.seconds:.3f}",
                    "eval_seconds": f"{eval_seconds:.3f}",
                }
            )
            interval = Interval(None, device)
        digests = rank_digests(model, session.device, session.world_size)
        interval_state = interval.state(session)
        if session.main_process:
            state = {
                "settings": asdict(s),
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer_state(optimizer),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(device),
                "functions": functions_state(mode),
                "history": history,
                "interval": interval_state,
                "rank_digests": digests,
            }
            write_atomically(run.checkpoint, lambda tmp: torch.save(state, tmp))
            results.write_log(run.out_dir / LOG, history)
            if evaluate_now:
                results.plot_run(run.out_dir / CURVES, history, f"{recipe.name} ({run.out_dir})")
                row = history[-1]
                train_text = f"train loss {row['train_loss']}  " if row["train_loss"] else ""
                session.say(
                    f"{recipe.name}: step {step}/{s.steps}  lr {row['lr']}  {train_text}"
                    f"validation loss {row['validation_loss']}  ({row['train_seconds']} s + "
                    f"{row['eval_seconds']} s)"
                )
        if session.distributed:
            dist.barrier()

    if session.main_process:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    session.say(
        f"{recipe.name}: {recipe.summary}\n  {s.layers} layers, width {s.width}, {s.heads} heads, "
        f"context {s.context}; {s.steps} steps of batch {s.batch_size} ({session.world_size} "
        f"process{'es' if session.distributed else ''} on {device}, {torch.get_num_threads()} "
        f"thread{'s' if torch.get_num_threads() > 1 else ''}), lr {s.lr}, seed {s.seed}; "
        f"{'resuming after step ' + str(start) if start else 'from scratch'}"
    )
    if start == 0 and not history:
        record(0, evaluate_now=True)
    stop = (
        s.steps
        if session.args.stop_after is None
        else min(s.steps, start + session.args.stop_after)
    )
    bar = tqdm(
        range(start, stop),
        initial=start,
        total=s.steps,
        desc=recipe.name,
        leave=False,
        disable=True if (session.args.no_progress or not session.main_process) else None,
    )
    row_start = session.rank * run.local_batch
    for step in bar:
        inputs, targets = corpus.training_batch(step, s.batch_size, s.context, s.seed)
        inputs = inputs[row_start : row_start + run.local_batch].to(device)
        targets = targets[row_start : row_start + run.local_batch].to(device)
        _synchronize(device)
        began = time.perf_counter()
        with context():
            logits = net(inputs)
        loss, mean = step_loss(logits, targets, session.world_size)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), GRADIENT_CLIP)
        optimizer.step()
        scheduler.step()
        interval.loss_sum += mean.double()
        _synchronize(device)
        interval.seconds += time.perf_counter() - began
        interval.steps += 1
        done = step + 1
        if done % s.eval_every == 0 or done == s.steps:
            record(done, evaluate_now=True)
        elif done == stop:
            record(done, evaluate_now=False)
    bar.close()
    return history


def command_line(settings: Settings) -> str:
    """The arguments of ``--recipe all`` that give these settings: --short where it applies, and
    every setting that differs from the configuration's own."""
    short = all(getattr(settings, k) == v for k, v in SHORT.items())
    base = {**DEFAULTS, **SHORT, "threads": SHORT_THREADS} if short else DEFAULTS
    words = ["--recipe", ALL] + (["--short"] if short else [])
    for key in SETTINGS:
        value = getattr(settings, key)
        if value is True:  # a flag
            words.append(f"--{key}")
        elif value is not None and value is not False and value != base.get(key):
            words += [f"--{key.replace('_', '-')}", str(value)]  # a float's shortest round trip
    return " ".join(words)


def multi_process_lines(world_size: int, names: list[str]) -> list[str]:
    """The paragraph gpt.md gives a comparison trained in several processes (none for one): such
    a run is not the one-process simulation of the recipes (``names``) whose multi_process says
    what differs."""
    if world_size == 1:
        return []
    differing = [name for name in names if RECIPES[name].multi_process]
    lines = [
        f"Trained in {world_size} processes (DistributedDataParallel, each on its share of every "
        "batch), which adds the processes' weight gradients in float32 in another order than one "
        "process sums them"
        + (
            f"; and {', '.join(differing)} are not the recipes' one-process simulation:"
            if differing
            else "; no recipe computes anything else."
        ),
        "",
    ]
    lines += [f"- `{name}`: {RECIPES[name].multi_process}" for name in differing]
    return lines + ([""] if differing else [])


def write_comparison(session: Session, runs: dict, out_dir: pathlib.Path, settings) -> None:
    """gpt.md and gpt.png in out_dir, from every recipe's history."""
    summaries = {name: r.summary for name, r in RECIPES.items()}
    s = settings
    characters = s.steps * s.batch_size * s.context
    threads = torch.get_num_threads() if s.threads is None else s.threads
    launcher = "python" if s.world_size == 1 else f"torchrun ({s.world_size} processes)"
    lines = [
        "# Character-level GPT under low-precision recipes",
        "",
        f"Written by `{launcher} -m experiments.gpt.train {command_line(s)}` "
        "(experiments/README.md describes the recipes and the configurations).",
        "",
        *multi_process_lines(s.world_size, [n for n, h in runs.items() if h is not None]),
        f"Model: {s.layers} layers, width {s.width}, {s.heads} heads, context {s.context}. "
        f"Training: {s.steps} steps of {s.batch_size} windows ({characters:,} characters), "
        f"AdamW at peak rate {s.lr}, seed {s.seed}. Validation: {s.val_windows} "
        f"windows of the last 10% of the corpus (Python {platform.python_version()}'s "
        f"pydoc topics, fingerprint {s.corpus}), mean cross-entropy in nats per character.",
        "",
        f"Speed: training tokens per second on {session.device} ({session.world_size} "
        f"process{'es' if session.distributed else ''}, {threads} "
        f"thread{'s' if threads > 1 else ''} each), forward, backward and "
        "optimizer step; overhead is fp32's tokens per second over the recipe's. Gap: the "
        "recipe's final validation loss minus fp32's.",
        "",
        *results.comparison_table(runs, summaries),
        "",
    ]
    skipped = [name for name, h in runs.items() if h is None]
    if skipped:
        lines += [
            f"Not run on {session.device}: {', '.join(skipped)} (lpsim.mac computes on the CPU "
            "only).",
            "",
        ]
    out_dir.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines)
    write_atomically(out_dir / TABLE, lambda tmp: tmp.write_text(text))
    results.plot_comparison(
        out_dir / PLOT,
        runs,
        f"validation loss, {s.layers} layers, width {s.width}, {s.steps} steps",
    )
    session.say(f"wrote {out_dir / TABLE} and {out_dir / PLOT}")


def inherit_saved_settings(session: Session, base: pathlib.Path) -> None:
    """For ``--recipe all --resume``: the settings of the runs in ``base`` that have a checkpoint
    (which must agree) become the requested settings of every run where not given, so that the
    runs it starts train as the ones it continues and the comparison compares like with like
    (without a checkpoint to take them from, a run started from DEFAULTS).

    Raises:
        SystemExit: the checkpoints' settings differ, apart from their recipe.
    """
    saved = {}
    for name in RECIPES:
        path = base / name / CHECKPOINT
        if path.is_file():
            settings = torch.load(path, map_location="cpu", weights_only=True)["settings"]
            saved[path] = {k: v for k, v in settings.items() if k in SETTINGS}
    if not saved:
        return
    (first_path, first), *others = saved.items()
    for path, settings in others:
        different = {k: (first[k], v) for k, v in settings.items() if first.get(k) != v}
        if different:
            raise SystemExit(
                f"--resume: {first_path} and {path} belong to runs of other settings, which one "
                f"comparison cannot hold; settings that differ: {different}"
            )
    session.requested = {**first, **session.requested}


def plan(session: Session) -> dict[str, Run | None]:
    """The runs this invocation makes, by recipe name, every setting checked before anything
    trains (None: a recipe --recipe all skips on this device)."""
    args = session.args
    if args.recipe != ALL:
        out_dir = args.out_dir or pathlib.Path("out") / "gpt" / args.recipe
        return {args.recipe: Run(session, RECIPES[args.recipe], out_dir, args.resume)}
    base = args.out_dir or pathlib.Path("out") / "gpt"
    if not args.resume:
        existing = [str(base / n / CHECKPOINT) for n in RECIPES if (base / n / CHECKPOINT).exists()]
        if existing:
            session.parser.error(
                f"checkpoints exist: {', '.join(existing)}; pass --resume to continue those "
                "runs, or choose another --out-dir"
            )
    else:
        inherit_saved_settings(session, base)
    runs: dict[str, Run | None] = {}
    for name, recipe in RECIPES.items():
        skipped = recipe.cpu_only and session.device.type != "cpu"
        runs[name] = None if skipped else Run(session, recipe, base / name, args.resume)
    return runs


def run_all(session: Session, runs: dict[str, Run | None]) -> dict[str, list[dict] | None]:
    """Train (or take the finished history of) every planned run in turn, then, when all have
    finished, write the comparison; returns each recipe's history (None: not run)."""
    histories: dict[str, list[dict] | None] = {}
    for name, run in runs.items():
        if run is None:
            session.say(f"{name}: skipped on {session.device} (lpsim.mac runs on the CPU only)")
            histories[name] = None
        elif run.finished:
            session.say(f"{run.checkpoint}: this run has finished its {run.settings.steps} steps")
            histories[name] = run.saved["history"]
            if session.main_process:
                # The checkpoint is written before the log and the curves: an invocation
                # stopped between them after the last evaluation left them without it, which
                # no later evaluation rewrites.
                results.write_log(run.out_dir / LOG, histories[name])
                results.plot_run(run.out_dir / CURVES, histories[name], f"{name} ({run.out_dir})")
        else:
            with kernels_chosen(session.device, run.settings.deterministic):
                histories[name] = train(run)
    if session.args.recipe != ALL:
        return histories
    settings = next(run.settings for run in runs.values() if run is not None)
    unfinished = [
        n for n, h in histories.items() if h is not None and int(h[-1]["step"]) < settings.steps
    ]
    if unfinished:
        session.say(f"not finished: {', '.join(unfinished)}; no comparison written")
    elif session.main_process:
        results_dir = session.args.out_dir or pathlib.Path("docs") / "results"
        write_comparison(session, histories, results_dir, settings)
    return histories


def main(argv: list[str] | None = None):
    """The command line (see the module docstring). Returns the history of the run (a list of
    log rows), or with --recipe all a dict of every recipe's history (None: not run); None for
    --list-recipes."""
    p = parser()
    args = p.parse_args(argv)
    if args.list_recipes:
        print(describe())
        return None
    if args.recipe is None:
        p.error("--recipe is required (see --list-recipes)")
    if args.recipe != ALL and args.recipe not in RECIPES:
        p.error(f"unknown recipe {args.recipe!r}; choose from {', '.join(RECIPES)}, or {ALL}")
    with threads_kept():
        threads = args.threads or (SHORT_THREADS if args.short else None)
        if threads is not None:
            torch.set_num_threads(threads)
        session = Session(args, p, load_corpus())
        runs = plan(session)
        with process_group(session.device, session.distributed):
            histories = run_all(session, runs)
    return histories if args.recipe == ALL else histories[args.recipe]


if __name__ == "__main__":
    main(sys.argv[1:])

"""CIFAR10 images as tensors, the order each process sees them in, and the standard augmentation.

torchvision.datasets.CIFAR10 reads the pickled batches once; the whole set (150 MB as uint8) then
lives in one tensor on the training device, and batches are gathered from it by index. This keeps
every random choice explicit:

- the order of the training set in epoch e is DistributedSampler's permutation for
  (order_seed(seed), e), cut into one shard per process (so data order differs between ranks and
  needs no saved state). DistributedSampler permutes epoch e with the seed seed + e, so given the
  run's seed itself, runs seeded s and s + 1 would see the same orders one epoch apart; the
  hashed order_seed keeps the orders of different seeds unrelated;
- the augmentation of epoch e on rank r draws from its own generator seeded from (seed, e, r),
  never from torch's default generator, whose stream is left to the model (dropout and the seeds
  of stochastic rounding, which must be identical on every rank);
- the test set is split into strided shards without padding, so that summing over ranks counts
  every test image exactly once.

The augmentation is the standard one (torchvision RandomCrop(32, padding=4) then
RandomHorizontalFlip, on [0, 1] images, zero padding), applied to a whole batch on the device.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass

import numpy as np
import torch
import torchvision
from torch.utils.data import DistributedSampler

__all__ = [
    "Split",
    "load_cifar10",
    "fake_cifar10",
    "epoch_generator",
    "order_seed",
    "draw_crop_flip",
    "crop_flip",
    "random_crop_flip",
    "training_batches",
    "eval_shard",
    "UnverifiedCIFAR10",
    "MEAN",
    "STD",
]

# Per-channel mean and standard deviation of the CIFAR10 training set, as QPyTorch's examples use.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2023, 0.1994, 0.2010)


@dataclass
class Split:
    """Images as uint8 (N, 3, 32, 32) and labels as int64 (N,), on one device."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device) -> Split:
        return Split(self.images.to(device), self.labels.to(device))


def _as_split(images, labels) -> Split:
    x = torch.as_tensor(images).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    return Split(x, torch.as_tensor(labels, dtype=torch.int64))


class UnverifiedCIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10 reader with the comparison against the official MD5 sums replaced by
    a check that every batch file is present."""

    def _check_integrity(self) -> bool:
        return all(
            os.path.isfile(os.path.join(self.root, self.base_folder, name))
            for name, _ in self.train_list + self.test_list
        )

    def _load_meta(self) -> None:
        path = os.path.join(self.root, self.base_folder, self.meta["filename"])
        with open(path, "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}


def load_cifar10(
    root: str | os.PathLike, train: bool, verify: bool = True, download: bool = False
) -> Split:
    """One split of CIFAR10 as read by torchvision.datasets.CIFAR10(root) from
    root/cifar-10-batches-py (the python pickle batches of the official release).

    Args:
        verify: check the files against the official release's MD5 sums (torchvision's own
            check). False reads any data in the same layout (re-packed copies, test fixtures).
        download: first let torchvision download and unpack the release into root (about
            170 MB) unless the files are already there.

    Raises:
        FileNotFoundError: root does not hold the batches (or, with verify, not the official
            ones); the message names the directory where they are expected.
    """
    base = torchvision.datasets.CIFAR10
    folder = os.path.abspath(os.path.join(os.fspath(root), base.base_folder))
    reader = base if verify else UnverifiedCIFAR10
    try:
        dataset = reader(os.fspath(root), train=train, download=download)
    except (RuntimeError, FileNotFoundError) as error:
        names = [name for name, _ in base.train_list + base.test_list] + [base.meta["filename"]]
        missing = [name for name in names if not os.path.isfile(os.path.join(folder, name))]
        if not os.path.isdir(folder):
            reason = "which does not exist"
        elif missing:
            reason = f"which lacks {', '.join(missing)}"
        else:
            reason = None
        split = "training" if train else "test"
        if reason is not None:
            message = (
                f"no CIFAR10 {split} batches: CIFAR10 (its python version) is expected in "
                f"{folder}, {reason}; pass --download to fetch it there"
            )
        elif verify:
            message = (
                f"no CIFAR10 {split} batches in {folder}: the files differ from the "
                "official release's (MD5 sums); data other than the official release "
                "needs --unverified-data"
            )
        else:
            message = f"no CIFAR10 {split} batches in {folder}: {error}"
        raise FileNotFoundError(message) from error
    return _as_split(dataset.data, dataset.targets)


def fake_cifar10(size: int, first: int = 0) -> Split:
    """``size`` random 32x32 RGB images with random labels from torchvision.datasets.FakeData (for
    timing runs where CIFAR10 is not at hand; nothing can be learnt from them). Image i is drawn
    from seed first + i, so sets with disjoint [first, first + size) share no image."""
    fake = torchvision.datasets.FakeData(
        size=size, image_size=(3, 32, 32), num_classes=10, random_offset=first
    )
    images = np.stack([np.asarray(fake[i][0]) for i in range(size)])
    labels = [int(fake[i][1]) for i in range(size)]
    return _as_split(images, labels)


def epoch_generator(seed: int, epoch: int, rank: int) -> torch.Generator:
    """A CPU generator for the augmentation of one epoch on one rank, seeded from all three."""
    digest = hashlib.sha256(f"cifar10-augment/{seed}/{epoch}/{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def order_seed(seed: int) -> int:
    """DistributedSampler's seed for the run seed ``seed``: 62 bits of a hash of it (the sampler
    adds the epoch to it, which stays below 2**63)."""
    digest = hashlib.sha256(f"cifar10-order/{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def draw_crop_flip(n: int, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """(n, 3) int64 on the CPU: per image the crop's top and left offsets, uniform in
    [0, 2 * padding], then 1 to flip (probability 1/2), drawn from ``generator`` in that order."""
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    return torch.stack([top, left, flip.long()], 1)


def crop_flip(images: torch.Tensor, choices: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Each image zero-padded by ``padding`` on every side, cropped back to its size at its offsets,
    and flipped left-right where asked; ``choices`` as from draw_crop_flip, on the images'
    device. One gather, no host synchronisation."""
    n, c, h, w = images.shape
    device = images.device
    top, left, flip = choices[:, 0], choices[:, 1], choices[:, 2].bool()
    padded = torch.nn.functional.pad(images, (padding,) * 4)
    rows = top[:, None] + torch.arange(h, device=device)  # (n, h)
    cols = left[:, None] + torch.arange(w, device=device)  # (n, w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(n, device=device)[:, None, None, None]
    channel = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]


def random_crop_flip(
    images: torch.Tensor, generator: torch.Generator, padding: int = 4
) -> torch.Tensor:
    """The batch augmented as by torchvision's RandomCrop(size, padding) followed by
    RandomHorizontalFlip(): crop_flip with choices drawn from ``generator`` (on the CPU)."""
    choices = draw_crop_flip(len(images), generator, padding)
    return crop_flip(images, choices.to(images.device), padding)


def training_batches(
    split: Split, batch_size: int, *, seed: int, epoch: int, rank: int, world_size: int
):
    """The (uint8 images, labels) batches of one epoch for one rank: its shard of
    DistributedSampler's order for (order_seed(seed), epoch), in batches of ``batch_size`` (the
    last may be smaller), every image crop-flip augmented with choices drawn for the whole shard
    at once from epoch_generator(seed, epoch, rank). Every rank gets the same number of batches
    of the same sizes (DistributedSampler pads by repeating a few images). Order and choices
    reach the device in one transfer each per epoch."""
    sampler = DistributedSampler(
        range(len(split)),
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=order_seed(seed),
    )
    sampler.set_epoch(epoch)
    device = split.labels.device
    order = torch.tensor(list(sampler), dtype=torch.int64).to(device)
    choices = draw_crop_flip(len(order), epoch_generator(seed, epoch, rank)).to(device)
    for idx, chosen in zip(order.split(batch_size), choices.split(batch_size)):
        yield crop_flip(split.images[idx], chosen), split.labels[idx]


def eval_shard(split: Split, rank: int, world_size: int) -> Split:
    """Every world_size-th test image starting at rank: the shards are disjoint and cover the
    set."""
    return Split(split.images[rank::world_size], split.labels[rank::world_size])

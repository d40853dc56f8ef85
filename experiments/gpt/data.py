"""The character-level corpus: the text of Python's own help topics, with no download.

The text is ``pydoc_data.topics.topics`` (the pages ``help("if")``, ``help("FORMATTING")``, ...
show; a dict from topic names to strings) joined in sorted key order, about 465,000 characters in
Python 3.11. It ships with the interpreter, so the corpus needs no network, but it changes between
Python versions: ``Corpus.fingerprint`` (a hash of the text) tells runs on different corpora apart.

- Vocabulary: the sorted set of the text's characters; a character's token is its rank in it.
- Split: the first 90% of the characters train, the last 10% validate (contiguous, by position).
- Training batches: ``training_batch(step, ...)`` draws ``batch`` windows of ``context``
  characters at uniformly random starts in the training split, from a torch.Generator seeded by
  ``batch_key(seed, step)`` alone; the targets are the windows shifted by one character. A batch
  is therefore a function of (seed, step): resuming needs no saved data state, and under torchrun
  every process draws the same global batch and keeps its own rows.
- Validation: ``validation_windows`` evenly spaced windows of the validation split (the same for
  every run with the same context and count); the validation loss is the mean cross-entropy over
  every position of every window, in nats per character.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = [
    "Corpus",
    "load_corpus",
    "corpus_text",
    "batch_key",
    "TRAIN_FRACTION",
    "MAX_SEED",
    "MAX_STEP",
]

TRAIN_FRACTION = 0.9
MAX_SEED = 2**31 - 1
MAX_STEP = 2**32 - 1
_SEED_STRIDE = 0x9E3779B1  # odd (2**32 / the golden ratio): seeds start far apart in the keys


def batch_key(seed: int, step: int) -> int:
    """The seed of the generator that draws the batch of ``step``: (seed * 0x9E3779B1 + step)
    mod 2**32. torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so the key
    is made to fit them: within one run (one seed) every step up to 2**32 - 1 has its own key.
    Across seeds the keys are a shift apart: seeds fewer than 1,000 apart start at least
    1,954,453 keys apart (fewer than 10,946 apart, 341,411), so their runs share no batch, but
    some far seeds draw another's batches a few steps later (seed 244002641's step t is seed 0's
    step t + 1: 244002641 * 0x9E3779B1 = 1 mod 2**32)."""
    return (seed * _SEED_STRIDE + step) % 2**32


def corpus_text() -> str:
    """The values of pydoc_data.topics.topics joined in sorted key order."""
    from pydoc_data.topics import topics  # noqa: PLC0415  (a large module: loaded when needed)

    return "".join(topics[name] for name in sorted(topics))


@dataclass(frozen=True)
class Corpus:
    """A text as tokens, its vocabulary and its train/validation split.

    Attributes:
        text: the whole text.
        vocabulary: its distinct characters, sorted; token i is vocabulary[i].
        tokens: the text as token ids, int64 (len(text),).
        split: the number of training characters, floor(TRAIN_FRACTION * len(text)).
    """

    text: str
    vocabulary: str
    tokens: torch.Tensor
    split: int

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    @property
    def train(self) -> torch.Tensor:
        return self.tokens[: self.split]

    @property
    def validation(self) -> torch.Tensor:
        return self.tokens[self.split :]

    @cached_property
    def fingerprint(self) -> str:
        """The first 16 hex digits of the text's SHA-256 (UTF-8)."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.vocabulary)}
        return torch.tensor([index[c] for c in text], dtype=torch.int64)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.vocabulary[int(t)] for t in tokens)

    def check_context(self, context: int) -> None:
        """Raises ValueError when a window of ``context`` characters and its target do not fit
        the validation split (the shorter one)."""
        longest = len(self.validation) - 1
        if not 1 <= context <= longest:
            raise ValueError(
                f"context must lie between 1 and {longest} characters (the validation split "
                f"holds {len(self.validation)}), got {context}"
            )

    def training_batch(
        self, step: int, batch: int, context: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 (batch, context) each: windows of the training split at
        random starts drawn from a generator seeded by batch_key(seed, step); targets[b, t] is
        the character after inputs[b, t].

        Raises:
            ValueError: seed or step out of range, or a context the splits cannot hold.
        """
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must lie in [0, {MAX_SEED}], got {seed}")
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must lie in [0, {MAX_STEP}], got {step}")
        self.check_context(context)
        generator = torch.Generator().manual_seed(batch_key(seed, step))
        starts = torch.randint(0, self.split - context, (batch,), generator=generator)
        return _windows(self.train, starts, context)

    def validation_windows(self, count: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 (count, context) each: ``count`` windows of the validation
        split with evenly spaced starts from 0 to the last start that leaves room for the targets
        (overlapping only when count * context exceeds the split).

        Raises:
            ValueError: count < 1, or a context the splits cannot hold.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self.check_context(context)
        last = len(self.validation) - context - 1
        starts = torch.linspace(0, last, count, dtype=torch.float64).round().to(torch.int64)
        return _windows(self.validation, starts, context)


def _windows(tokens: torch.Tensor, starts: torch.Tensor, context: int):
    positions = starts[:, None] + torch.arange(context)
    return tokens[positions], tokens[positions + 1]


def load_corpus(text: str | None = None) -> Corpus:
    """The Corpus of ``text`` (default: corpus_text(), Python's help topics)."""
    text = corpus_text() if text is None else text
    if len(text) < 4:
        raise ValueError(f"the text must hold at least 4 characters, got {len(text)}")
    vocabulary = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocabulary)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.int64)
    return Corpus(text, vocabulary, tokens, int(TRAIN_FRACTION * len(text)))

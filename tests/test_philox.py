"""The random words: Philox4x32-10 reproduces the published known-answer vectors, and the words
the kernels draw are those of the reference definition, for both the per-element core function
and the vectorised group generator."""

import pytest
import torch

from lpsim import reference

# Random123's tests/kat_vectors, "philox4x32 10": counter (4 words), key (2 words) -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_reference_philox_matches_random123_known_answers(counter, key, expected):
    assert reference.philox4x32_10(counter, key) == expected


def _kernel_words(seed: int, offset: int, start: int, count: int, kernels: bool) -> list[int]:
    as_signed = seed - 2**64 if seed >= 2**63 else seed
    off = offset - 2**64 if offset >= 2**63 else offset
    words = torch.ops.lpsim.random_words(torch.tensor(as_signed), off, start, count, kernels)
    return [w & 0xFFFFFFFF for w in words.tolist()]


def test_first_word_is_the_known_answer():
    # Element 0 under seed 0, offset 0 is word 0 of counter (0, 0, 0, 0), key (0, 0).
    assert _kernel_words(0, 0, 0, 1, True) == [0x6627E8D5]


@pytest.mark.parametrize("kernels", [True, False], ids=["group-generator", "core-definition"])
@pytest.mark.parametrize(
    "seed,offset,start",
    [
        (0, 0, 0),
        (12345, 0, 200),  # crosses a group boundary
        (2**64 - 1, 2**64 - 1, 777),  # every key and offset bit set
        (0x0123456789ABCDEF, 5, 2**38 - 100),  # counters cross into their high word
        (7, 2**40, 2**45 + 3),
    ],
)
def test_kernel_words_equal_reference_words(kernels, seed, offset, start):
    count = 300
    want = [reference.random_word(seed, offset, start + i) for i in range(count)]
    assert _kernel_words(seed, offset, start, count, kernels) == want


def test_words_are_uniform_and_uncorrelated():
    # A coarse sanity check of the stream (the generator itself is published and tested):
    # 2**16 words: each of 16 bins within 5 sigma, and no correlation between neighbours.
    words = torch.tensor(_kernel_words(99, 0, 0, 2**16, True), dtype=torch.float64)
    counts = torch.bincount((words / 2**28).long(), minlength=16).double()
    expected = words.numel() / 16
    sigma = (expected * (1 - 1 / 16)) ** 0.5
    assert ((counts - expected).abs() < 5 * sigma).all()
    u = words / 2**32 - 0.5
    correlation = (u[1:] * u[:-1]).mean() / u.var()
    assert abs(correlation) < 5 / words.numel() ** 0.5

// Host check of the CUDA kernels' index arithmetic (csrc/cuda/pieces.h) against plain 64-bit
// division, and of the counter -> element mapping the kernels use (lpsim/philox.h). Built and run
// by tests/test_gpu_index_math.py; prints one line per failure and exits with the number of
// failures (capped), so that it needs no GPU.
#include <lpsim/philox.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/pieces.h"

namespace {

using lpsim::gpu::Divider;
using lpsim::gpu::Pieces;

int failures = 0;

void fail(const char* what, unsigned long long a, unsigned long long b, unsigned long long got,
          unsigned long long want) {
  if (failures < 20) {
    std::printf("FAIL %s (%llu, %llu): got %llu, want %llu\n", what, a, b, got, want);
  }
  ++failures;
}

void check_division(uint64_t d, uint64_t n) {
  const Divider divider = Divider::of(d);
  if (divider.div(n) != n / d) fail("div", n, d, divider.div(n), n / d);
  if (divider.mod(n) != n % d) fail("mod", n, d, divider.mod(n), n % d);
}

// Dividends that stress the multiply-high path: small ones, multiples of d and their neighbours,
// the edges of the 32-bit range, and random 32- and 64-bit values.
void check_divisor(uint64_t d, std::mt19937_64& rng) {
  for (uint64_t n = 0; n < 300; ++n) check_division(d, n);
  for (uint64_t k : {1ull, 2ull, 3ull, 1000ull, 0xFFFFFFFFull / (d ? d : 1)}) {
    const uint64_t m = k * d;
    for (uint64_t n : {m - 1, m, m + 1}) check_division(d, n);
  }
  for (uint64_t n : {0xFFFFFFFEull, 0xFFFFFFFFull, 0x100000000ull, 0x100000001ull, ~0ull}) {
    check_division(d, n);
  }
  for (int k = 0; k < 200; ++k) {
    check_division(d, rng() >> 32);
    check_division(d, rng());
  }
}

// Every element of [0, n) lies in piece piece_of(i), inside [start, stop) of that piece; the
// pieces are numbered in order and tile the range; the piece of element i is the naive one.
void check_pieces(const Pieces& pieces, uint64_t n, uint64_t row_len, uint64_t len,
                  uint64_t classes, const char* what) {
  const uint64_t per_row = (row_len + len - 1) / len;
  uint64_t expected_start = 0;
  uint64_t previous = ~0ull;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t naive = i / row_len * per_row + i % row_len / len;
    const uint64_t p = pieces.piece_of(i);
    if (p != naive) fail(what, i, row_len, p, naive);
    if (pieces.class_of(i) != naive % classes)
      fail(what, i, classes, pieces.class_of(i), naive % classes);
    if (p != previous) {
      if (pieces.start(p) != expected_start) fail(what, p, i, pieces.start(p), expected_start);
      expected_start = pieces.stop(p);
      previous = p;
    }
    if (i < pieces.start(p) || i >= pieces.stop(p)) fail(what, i, p, pieces.start(p), i);
  }
  if (n > 0 && expected_start != n) fail(what, n, row_len, expected_start, n);
}

// One thread per Philox counter: the elements philox_element_of(c, 0..3) of the counters covering
// [0, n) are each element of [0, n) once (and then some past n), and element i takes word
// philox_word_of(i) of counter philox_counter_of(i): the inverse of the CPU's mapping.
void check_counters(uint64_t n) {
  const uint64_t counters = lpsim::philox_counters_for(n);
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (uint64_t c = 0; c < counters; ++c) {
    for (int w = 0; w < 4; ++w) {
      const uint64_t i = lpsim::philox_element_of(c, w);
      const uint64_t counter = lpsim::philox_counter_of(i);
      if (counter != c) fail("counter_of", i, c, counter, c);
      if (lpsim::philox_word_of(i) != w) fail("word_of", i, c, lpsim::philox_word_of(i), w);
      if (i < n) ++seen[static_cast<size_t>(i)];
    }
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (seen[static_cast<size_t>(i)] != 1) fail("covered", i, n, seen[static_cast<size_t>(i)], 1);
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261122);
  for (uint64_t d = 1; d <= 2048; ++d) check_divisor(d, rng);
  for (int s = 11; s <= 40; ++s) {
    for (int64_t delta : {-1, 0, 1}) check_divisor((1ull << s) + delta, rng);
  }
  for (int k = 0; k < 2000; ++k) check_divisor((rng() >> (32 + rng() % 32)) | 1, rng);
  check_divisor(0xFFFFFFFFull, rng);
  check_divisor(0x100000000ull, rng);

  // Block layouts: block_size along rows (short last blocks included), one exponent per index
  // along a dimension, and the whole tensor.
  for (uint64_t row_len : {1ull, 2ull, 7ull, 32ull, 33ull, 100ull}) {
    for (uint64_t block : {1ull, 3ull, 8ull, 32ull, 64ull, 1000ull}) {
      const uint64_t n = row_len * 11;
      const uint64_t len = block < row_len ? block : row_len;
      const uint64_t count = n / row_len * ((row_len + len - 1) / len);
      check_pieces(Pieces::blocks(n, row_len, block), n, row_len, len, count, "blocks");
    }
  }
  for (uint64_t inner : {1ull, 3ull, 16ull, 17ull}) {
    for (uint64_t classes : {1ull, 2ull, 5ull, 64ull}) {
      const uint64_t n = inner * classes * 4;
      check_pieces(Pieces::along(inner, classes), n, inner, inner, classes, "along");
    }
  }
  check_pieces(Pieces::along(1000, 1), 1000, 1000, 1000, 1, "whole");

  for (uint64_t n : {0ull, 1ull, 63ull, 64ull, 255ull, 256ull, 257ull, 1000ull, 4096ull}) {
    check_counters(n);
  }

  std::printf("%d failures\n", failures);
  return failures > 100 ? 100 : failures;
}

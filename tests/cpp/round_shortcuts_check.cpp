// Host check of round_nearest_shortcut and round_stochastic_shortcut (lpsim/round.h), and of the
// forms of lpsim/in_range.h (both quantum shifts) on the inputs in their ranges, against
// round_to_grid<nearest> and round_to_grid<stochastic>, bit for bit, every input under both rules
// (stochastic with a random word per input and rbits 32, 1, 3, 8, 13 and 23 in turn): for each grid
// given on the command line and each container it fits, every bfloat16 and float16 value, the
// values within 64 units of every power of two, and float32 values: every one of the 2^32 for grids
// marked `all` (a few minutes per grid), else every 251st bit pattern; random float64 values. Built
// and run by tests/test_round_shortcuts.py (with `sample` for every grid). Each argument is one
// grid: the GridSpec fields in the order of lpsim/grid_spec.h (limits as hexadecimal floats),
// comma-separated, then `all` or `sample`. Prints per grid and container whether the shortcut
// applies and how many values were compared (and how many of them in in_range.h's range, and in
// its fixed part), one line per failure (capped), and "<n> failures" last.
//
// With the single argument `blocks`: BlockFloat's grids (block_grid) for several widths and block
// maxima (normal, subnormal, zero) in each container. Each input (as above, float32 every 4093rd
// pattern) is rounded by round_to_grid on the grid and on the same grid with keep = man_bits (the
// fixed-point grid written out: the block grid's keep only lets the shortcuts apply), which must
// agree, and by the shortcuts and forms where they apply.
#include <lpsim/grid_spec.h>
#include <lpsim/in_range.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace lpsim;

long long failures = 0;
// Inputs compared in the in_range.h forms' range, in its fixed part, and beyond its limits (the
// bounded form), per grid and container.
std::atomic<long long> in_range{0}, in_fixed_range{0}, beyond_range{0};

// A random word per input, from the input and a salt (any fixed function will do: the two forms
// must agree for every word).
LPSIM_INLINE uint32_t word_of(uint64_t v, uint32_t salt) {
  uint64_t z = (v + salt) * 0x9E3779B97F4A7C15ull;
  z ^= z >> 29;
  z *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint32_t>(z >> 32);
}

// The rbits whose masks the stochastic comparison runs under, one per input in turn.
constexpr int kRbits[] = {32, 1, 3, 8, 13, 23};

// Whether a shortcut and round_to_grid differ on input v: round to nearest, or with `stochastic`
// stochastic rounding with v's random word and the rbits v picks; got and want receive the two.
template <class C>
LPSIM_INLINE bool differ(uint64_t v, bool stochastic, const Grid<C>& g, typename C::word half_min,
                         typename C::word& got, typename C::word& want, long long& ranged,
                         long long& fixed, long long& beyond) {
  using W = typename C::word;
  const W u = static_cast<W>(v);
  const uint32_t random = word_of(v, 0x5bd1e995u);
  const uint32_t mask = random_mask(kRbits[v % 6]);
  // A form of lpsim/in_range.h at quantum bit s.
  auto form = [&](int32_t s) {
    return stochastic ? round_stochastic_at<C>(u, s, random, mask) : round_nearest_at<C>(u, s);
  };
  if (!stochastic) {
    got = round_nearest_shortcut<C>(u, g, half_min);
    want = round_to_grid<Rounding::nearest, C>(u, g, 0, 0);
  } else {
    got = round_stochastic_shortcut<C>(u, g, random, mask);
    want = round_to_grid<Rounding::stochastic, C>(u, g, random, mask);
  }
  // The forms of lpsim/in_range.h, for the inputs in their ranges.
  InRange<C> r;
  const Form f = got == want && make_in_range(g, r)
                     ? form_of<C>(u & C::abs_mask, range_key<C>(u, r), r)
                     : Form::shortcut;
  if (f == Form::bounded) {
    got = bounded<C>(form(r.shift), g);
    ++beyond;
  } else if (f != Form::shortcut) {
    got = form(in_range_shift<C>(u, r));
    ++ranged;
    if (got == want && f == Form::fixed) {
      got = form(r.shift);
      ++fixed;
    }
  }
  return got != want;
}

// The words begin, begin + stride, ... below end, each rounded by both rules: counts the
// mismatches, and looks for them one by one (to print them) only in blocks that have some.
template <class C>
long long compare_range(uint64_t begin, uint64_t end, uint64_t stride, const Grid<C>& g,
                        typename C::word half_min, long long& bad) {
  using W = typename C::word;
  constexpr uint64_t kBlock = 1 << 16;
  long long compared = 0;
  for (const bool stochastic : {false, true}) {
    for (uint64_t start = begin; start < end; start += kBlock * stride) {
      const uint64_t count = std::min(kBlock, (end - start + stride - 1) / stride);
      uint64_t mismatches = 0;
      W got, want;
      long long ranged = 0, fixed = 0, beyond = 0;
      for (uint64_t i = 0; i < count; ++i) {
        mismatches += differ<C>(start + i * stride, stochastic, g, half_min, got, want, ranged,
                                fixed, beyond);
      }
      in_range += ranged;
      in_fixed_range += fixed;
      beyond_range += beyond;
      compared += static_cast<long long>(count);
      if (mismatches == 0) continue;
      for (uint64_t i = 0; i < count; ++i) {
        const uint64_t v = start + i * stride;
        if (differ<C>(v, stochastic, g, half_min, got, want, ranged, fixed, beyond) && bad++ < 10) {
          std::printf("  input %llx (%s, rbits %d): shortcut %llx, round_to_grid %llx\n",
                      (unsigned long long)v, stochastic ? "stochastic" : "nearest", kRbits[v % 6],
                      (unsigned long long)got, (unsigned long long)want);
        }
      }
    }
  }
  return compared;
}

// Every word in [0, end) with the given stride, split over the machine's threads.
template <class C>
long long compare_words(uint64_t end, uint64_t stride, const Grid<C>& g) {
  const typename C::word half_min = pow2_bits<C>(g.qmin - 1);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t per = (end / stride / threads + 1) * stride;
  std::vector<long long> compared(threads, 0), bad(threads, 0);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const uint64_t begin = t * per;
      compared[t] =
          compare_range<C>(begin, std::min(end, begin + per), stride, g, half_min, bad[t]);
    });
  }
  long long total = 0;
  for (unsigned t = 0; t < threads; ++t) {
    pool[t].join();
    total += compared[t];
    failures += bad[t];
  }
  return total;
}

// The values within `span` units of every power of two, of both signs.
template <class C>
long long compare_powers_of_two(const Grid<C>& g, int span) {
  using W = typename C::word;
  const W half_min = pow2_bits<C>(g.qmin - 1);
  long long compared = 0, bad = 0;
  // The powers of two: every exponent field, then the container's subnormal ones.
  std::vector<W> powers;
  for (int e = 0; e < (1 << C::exp_bits); ++e) powers.push_back(W(e) << C::man_bits);
  for (int b = 0; b < C::man_bits; ++b) powers.push_back(W(1) << b);
  for (const W base : powers) {
    for (int d = -span; d <= span; ++d) {
      if ((d < 0 && base < W(-d)) || (d > 0 && base + W(d) > C::abs_mask)) continue;
      const W a = static_cast<W>(base + d);
      compared += compare_range<C>(a, uint64_t(a) + 1, 1, g, half_min, bad);
      compared +=
          compare_range<C>(a | C::sign_mask, uint64_t(a | C::sign_mask) + 1, 1, g, half_min, bad);
    }
  }
  failures += bad;
  return compared;
}

template <class C>
void check(const char* name, const GridSpec& spec, bool all) {
  Grid<C> g;
  if (make_grid<C>(spec, g) != nullptr) {
    std::printf("  %s: does not fit\n", name);
    return;
  }
  if (!shortcut_applies(g)) {
    std::printf("  %s: shortcut does not apply\n", name);
    return;
  }
  in_range = 0;
  in_fixed_range = 0;
  beyond_range = 0;
  long long compared = compare_powers_of_two<C>(g, 64);
  if constexpr (C::word_bits == 32 && sizeof(typename C::storage) == 2) {
    compared += compare_words<C>(uint64_t(1) << 16, 1, g);
  } else if constexpr (C::word_bits == 32) {
    compared += compare_words<C>(uint64_t(1) << 32, all ? 1 : 251, g);
  } else {  // float64: random values at every exponent
    std::mt19937_64 random(1);
    const typename C::word half_min = pow2_bits<C>(g.qmin - 1);
    long long bad = 0;
    for (int i = 0; i < (1 << 22); ++i) {
      const uint64_t v = random();
      compared += compare_range<C>(v, v + 1, 1, g, half_min, bad);
    }
    failures += bad;
  }
  std::printf("  %s: compared %lld, in range %lld, fixed %lld, bounded %lld\n", name, compared,
              in_range.load(), in_fixed_range.load(), beyond_range.load());
}

// The same rounding by round_to_grid on block grid g and on g with keep = man_bits, over the words
// begin, begin + stride, ... below end; counts the disagreements (printing a few).
template <class C>
long long compare_keep(const Grid<C>& g, uint64_t end, uint64_t stride, long long& bad) {
  using W = typename C::word;
  Grid<C> wide = g;
  wide.keep = C::man_bits;
  long long compared = 0;
  for (uint64_t v = 0; v < end; v += stride) {
    const W u = static_cast<W>(v);
    const uint32_t random = word_of(v, 0x2545F491u);
    const uint32_t mask = random_mask(kRbits[v % 6]);
    const W pairs[2][2] = {{round_to_grid<Rounding::nearest, C>(u, g, 0, 0),
                            round_to_grid<Rounding::nearest, C>(u, wide, 0, 0)},
                           {round_to_grid<Rounding::stochastic, C>(u, g, random, mask),
                            round_to_grid<Rounding::stochastic, C>(u, wide, random, mask)}};
    for (const auto& pair : pairs) {
      if (pair[0] != pair[1] && bad++ < 10) {
        std::printf("  input %llx: keep %d gives %llx, keep %d %llx\n", (unsigned long long)v,
                    g.keep, (unsigned long long)pair[0], C::man_bits, (unsigned long long)pair[1]);
      }
    }
    compared += 2;
  }
  return compared;
}

template <class C>
void check_blocks(const char* name) {
  using W = typename C::word;
  // Every 16-bit value; every 4093rd float32 bit pattern.
  constexpr bool kHalf = sizeof(typename C::storage) == 2;
  const uint64_t end = uint64_t(1) << (kHalf ? 16 : 32);
  const uint64_t stride = kHalf ? 1 : 4093;
  const int widths[] = {3, 5, 8};
  // Block maxima: zero, a subnormal, the smallest normal, just above one, a large normal, the
  // largest finite value.
  const W maxima[] = {W(0),
                      W(3),
                      W(1) << C::man_bits,
                      W(C::bias) << C::man_bits | W(5),
                      W((1 << C::exp_bits) - 4) << C::man_bits,
                      C::inf_bits - 1};
  for (const int wl : widths) {
    if (wl > C::man_bits + 2) continue;
    for (const W m : maxima) {
      const Grid<C> g = block_grid<C>(m, wl);
      in_range = 0;
      in_fixed_range = 0;
      beyond_range = 0;
      long long bad = 0;
      long long compared = compare_keep<C>(g, end, stride, bad);
      failures += bad;
      if (shortcut_applies(g)) {
        const W half_min = pow2_bits<C>(g.qmin - 1);
        long long shortcut_bad = 0;
        compared += compare_range<C>(0, end, stride, g, half_min, shortcut_bad);
        failures += shortcut_bad;
      }
      std::printf(
          "  %s wl %d max %llx: keep %d, shortcut %s, compared %lld, in range %lld, "
          "fixed %lld, bounded %lld\n",
          name, wl, (unsigned long long)m, g.keep, shortcut_applies(g) ? "yes" : "no", compared,
          in_range.load(), in_fixed_range.load(), beyond_range.load());
    }
  }
}

GridSpec parse(const std::string& text) {
  std::stringstream in(text);
  std::string field;
  std::vector<std::string> f;
  while (std::getline(in, field, ',')) f.push_back(field);
  if (f.size() != 10) {
    std::fprintf(stderr, "expected 10 grid fields, got %zu in %s\n", f.size(), text.c_str());
    std::exit(2);
  }
  GridSpec s;
  s.keep = std::stoll(f[0]);
  s.qmin = std::stoll(f[1]);
  s.emin = std::stoll(f[2]);
  s.subnormals = f[3] == "1";
  s.pos_limit = std::strtod(f[4].c_str(), nullptr);
  s.neg_limit = std::strtod(f[5].c_str(), nullptr);
  s.saturate = f[6] == "1";
  s.has_inf = f[7] == "1";
  s.unsigned_zero = f[8] == "1";
  s.code_parity = f[9] == "1";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "blocks") {
    std::printf("block grids\n");
    check_blocks<Float32Container>("float32");
    check_blocks<BFloat16Container>("bfloat16");
    check_blocks<Float16Container>("float16");
    std::printf("%lld failures\n", failures);
    return failures == 0 ? 0 : 1;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const GridSpec spec = parse(argv[i]);
    const bool all = std::string(argv[i + 1]) == "all";
    std::printf("grid %s\n", argv[i]);
    check<Float32Container>("float32", spec, all);
    check<BFloat16Container>("bfloat16", spec, all);
    check<Float16Container>("float16", spec, all);
    check<Float64Container>("float64", spec, all);
  }
  std::printf("%lld failures\n", failures);
  return failures == 0 ? 0 : 1;
}

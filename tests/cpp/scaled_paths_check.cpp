// Host check of the scaled formats' vectorised paths (csrc/cpu/scaled.cpp) against the element
// as scaled.h defines it, element by element, for the same random word and rbits, every rule:
// - power-of-two scales: rounding x onto the element grid shifted by the scale, in the tensor's
//   container (shifted_element_grid) or, for the 16-bit containers, in float32
//   (shifted_arithmetic_element), against x / 2^e rounded in float64 and multiplied back (exact
//   for every container but float64, where values whose x / 2^e underflows are left out), and
//   scaled_element (what the CUDA kernels run) against both;
// - Float scales: float_scaled_element (the element grid in float32, branch-free conversions)
//   against the float64 element grid and convert_exact, and float_scale_factors against the
//   formula with and without a tensor scale written out;
// - to_arithmetic and from_arithmetic against convert_exact, for every float16 value.
// Built and run by tests/test_scaled.py with the formats' op arguments on the command line (one
// format per argument: the quantize_scaled op's element grid, scale grid, scale rule, tensor
// scale, element emax, precision and max, and whether it fits bfloat16 and float16 tensors,
// space-separated); prints one line per failure (capped), how many comparisons each path made, and
// "<n> failures" last. The test suite runs a sample (every fifth 16-bit value, a few thousand
// random and edge float32 and float64 values, at the exponents where the paths change and a few
// values at every exponent); `full` as the first argument compares every 16-bit value and 60000
// float32 values at every exponent (minutes).
#include <lpsim/scaled.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "dispatch.h"  // with_rounding: the run-time rule to its template instance

namespace {

using namespace lpsim;
using F64 = Float64Container;

int failures = 0;
long long compared_container = 0, compared_arithmetic = 0, compared_float = 0;
long long inexact_float64 = 0;  // float64 values whose x / 2^e float64 does not hold

void fail(const char* what, int format, unsigned long long u, long long e, int rule, int rbits,
          unsigned long long got, unsigned long long want) {
  if (failures < 30) {
    std::printf("FAIL %s format %d u=%#llx e/amax=%lld rule %d rbits %d: got %#llx, want %#llx\n",
                what, format, u, e, rule, rbits, got, want);
  }
  ++failures;
}

// A real number as printed by Python's float.hex (or "inf"): strtod reads both exactly.
double read_real(std::istringstream& in) {
  std::string token;
  in >> token;
  return std::strtod(token.c_str(), nullptr);
}

GridSpec read_grid(std::istringstream& in) {
  GridSpec g;
  int subnormals, saturate, has_inf, unsigned_zero, code_parity;
  in >> g.keep >> g.qmin >> g.emin >> subnormals;
  g.pos_limit = read_real(in);
  g.neg_limit = read_real(in);
  in >> saturate >> has_inf >> unsigned_zero >> code_parity;
  g.subnormals = subnormals != 0;
  g.saturate = saturate != 0;
  g.has_inf = has_inf != 0;
  g.unsigned_zero = unsigned_zero != 0;
  g.code_parity = code_parity != 0;
  return g;
}

// Whether the format read last fits bfloat16 and float16 tensors (lpsim.formats.check_fits).
int fits_bfloat16 = 0, fits_float16 = 0;

ScaledSpec read_spec(const char* text) {
  std::istringstream in(text);
  ScaledSpec s;
  s.element = read_grid(in);
  s.scale = read_grid(in);
  int rule, two_level;
  in >> rule >> two_level >> s.element_emax >> s.element_precision;
  s.element_max = read_real(in);
  in >> fits_bfloat16 >> fits_float16;
  s.rule = static_cast<ScaleRule>(rule);
  s.two_level = two_level != 0;
  s.tensor = s.tensor_reciprocal = 1;
  return s;
}

// The rules, with the rbits of the stochastic ones.
struct RuleCase {
  Rounding rule;
  int rbits;
};
std::vector<RuleCase> rule_cases() {
  std::vector<RuleCase> cases;
  for (int r = 0; r < kNumRoundings; ++r) {
    const auto rule = static_cast<Rounding>(r);
    if (!is_stochastic(rule)) {
      cases.push_back({rule, 32});
    } else {
      for (int rbits : {1, 3, 8, 32}) cases.push_back({rule, rbits});
    }
  }
  return cases;
}

// The finite values of container C to try: every one for the 16-bit containers, else `count`
// random bit patterns (every binade alike) and the edges (zeros, the smallest subnormals, the
// normal boundary, the largest values), both signs.
template <class C>
std::vector<typename C::word> finite_values(std::mt19937_64& rng, int count) {
  using W = typename C::word;
  std::vector<W> values;
  if constexpr (C::word_bits == 32 && C::exp_bits + C::man_bits == 15) {
    for (uint32_t u = 0; u < 0x10000u; ++u) {
      if ((u & C::abs_mask) < C::inf_bits) values.push_back(u);
    }
  } else {
    const W edges[] = {0,
                       1,
                       2,
                       3,
                       C::man_mask,
                       C::man_mask + 1,
                       W(C::man_mask + 2),
                       W(W(1) << C::man_bits) * 2,
                       W(C::inf_bits - 1),
                       W(C::inf_bits - 2),
                       W(W(C::bias) << C::man_bits),
                       W((W(C::bias) << C::man_bits) | (W(1) << (C::man_bits - 1)))};
    for (W a : edges) {
      values.push_back(a);
      values.push_back(a | C::sign_mask);
    }
    while (static_cast<int>(values.size()) < count) {
      const W u = static_cast<W>(rng());
      if ((u & C::abs_mask) < C::inf_bits) values.push_back(u);
    }
  }
  return values;
}

// The random word of a comparison: any word will do, as long as both sides get the same one.
uint32_t word_of(std::mt19937_64& rng) { return static_cast<uint32_t>(rng() >> 17); }

// A power-of-two block's element as x / 2^e rounded in float64 and multiplied back in the
// arithmetic, then rounded to C (how scaled.h computed every one before shifted grids): exact for
// the 16- and 32-bit containers; for float64 where x / 2^e is (`exact`).
template <Rounding R, class C>
typename C::word float64_element(typename C::word u, int32_t e, const ElementGrids<C>& g,
                                 uint32_t random, uint32_t mask, bool& exact) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  const double x = real_of(convert_exact<F64, C>(u));
  const double y = mul_rn(x, pow2_double(-e));
  exact = mul_rn(y, pow2_double(e)) == x;
  const T q =
      static_cast<T>(real_of(round_to_grid<R, F64>(bits_of_real(y), g.element, random, mask)));
  typename K::word out = bits_of_real(mul_rn(q, pow2_real(e, T())));
  if constexpr (!std::is_same_v<K, C>) out = round_to_grid<Rounding::nearest, K>(out, g.own, 0, 0);
  return convert_exact<C, K>(out);
}

// Power-of-two scales 2^e, for the exponents `exponents` and the values `values` of C.
template <class C>
void check_power_of_two(int format, const ScaledSpec& s,
                        const std::vector<typename C::word>& values,
                        const std::vector<int32_t>& exponents, std::mt19937_64& rng) {
  using K = ScaledArithmetic<C>;
  const ElementGrids<C> grids = element_grids<C>(s);
  const std::vector<RuleCase> rules = rule_cases();
  for (const int32_t e : exponents) {
    Grid<C> in_container;
    Grid<K> in_arithmetic;
    const bool fits = shifted_element_grid<C>(grids.container, e, in_container);
    const bool fits_arithmetic = !fits && !std::is_same_v<K, C> &&
                                 shifted_element_grid<K>(grids.arithmetic, e, in_arithmetic);
    if (!fits && !fits_arithmetic) continue;  // the loops run float64_element's arithmetic
    BlockScale b;
    b.finite = true;
    b.exponent = e;
    b.reciprocal = b.decode = 1;
    for (const RuleCase& rc : rules) {
      const uint32_t mask = random_mask(rc.rbits);
      with_rounding(rc.rule, [&](auto tag) {
        constexpr Rounding R = decltype(tag)::value;
        for (const typename C::word u : values) {
          const uint32_t word = word_of(rng);
          bool exact;
          const auto want = float64_element<R, C>(u, e, grids, word, mask, exact);
          if (!exact) {
            ++inexact_float64;
            continue;
          }
          const auto got =
              fits ? round_to_grid<R, C>(u, in_container, word, mask)
                   : shifted_arithmetic_element<R, C>(u, in_arithmetic, grids.own, word, mask);
          if (got != want) fail("power of two", format, u, e, int(R), rc.rbits, got, want);
          // scaled_element, which the CUDA kernels run, is one of the two.
          const auto defined = scaled_element<R, C, true>(u, b, grids, word, mask);
          if (defined != got) fail("scaled_element", format, u, e, int(R), rc.rbits, defined, got);
          ++(fits ? compared_container : compared_arithmetic);
        }
      });
    }
  }
}

// Float scales, as scaled.h computed them before float_scale_factors and float_scaled_element:
// the element grid in float64, convert_exact, and the tensor scale applied only with two levels.
template <class C>
void old_factors(typename C::word amax, const ScaledSpec& s,
                 const Grid<ScaledArithmetic<C>>& scale_grid, RealOf<ScaledArithmetic<C>>& r,
                 RealOf<ScaledArithmetic<C>>& decode) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  const T smallest = pow2_real(static_cast<int32_t>(s.scale.emin), T());
  const T largest = static_cast<T>(s.scale.pos_limit);
  T d = div_rn(real_of(convert_exact<K, C>(amax)), static_cast<T>(s.element_max));
  if (s.two_level) d = div_rn(d, static_cast<T>(s.tensor));
  d = d < smallest ? smallest : (d > largest ? largest : d);
  const T scale = real_of(round_to_grid<Rounding::nearest, K>(bits_of_real(d), scale_grid, 0, 0));
  if (s.two_level) {
    r = div_rn(static_cast<T>(s.tensor_reciprocal), scale);
    decode = mul_rn(static_cast<T>(s.tensor), scale);
  } else {
    r = div_rn(T(1), scale);
    decode = scale;
  }
}

// The element of y rounded by rule R, decoded (times d, rounded to C) in the old way; a value of
// the format (the decoded element nearest y) comes back unchanged by every rule.
template <Rounding R, class C>
typename C::word old_float_element(typename C::word u, RealOf<ScaledArithmetic<C>> r,
                                   RealOf<ScaledArithmetic<C>> d, const ElementGrids<C>& g,
                                   uint32_t random, uint32_t mask) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  const double y = mul_rn(real_of(convert_exact<K, C>(u)), r);
  auto decoded = [&](auto rule, uint32_t word) {
    constexpr Rounding kRule = decltype(rule)::value;
    const T q =
        static_cast<T>(real_of(round_to_grid<kRule, F64>(bits_of_real(y), g.element, word, mask)));
    typename K::word out = bits_of_real(mul_rn(q, d));
    if constexpr (!std::is_same_v<K, C>) {
      out = round_to_grid<Rounding::nearest, K>(out, g.own, 0, 0);
    }
    return convert_exact<C, K>(out);
  };
  const auto nearest = decoded(std::integral_constant<Rounding, Rounding::nearest>{}, 0);
  return nearest == u ? u : decoded(std::integral_constant<Rounding, R>{}, random);
}

// Float scales: blocks whose largest magnitude is each of `amaxes`, the values `values` in them
// (values above amax too: they saturate), with a tensor scale from `tensor_amax` when the format
// has one.
template <class C>
void check_float_scales(int format, ScaledSpec s, const std::vector<typename C::word>& values,
                        const std::vector<typename C::word>& amaxes, typename C::word tensor_amax,
                        std::mt19937_64& rng) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  if (s.two_level) set_tensor_scale<C>(s, tensor_amax);
  if (s.tensor != s.tensor) return;
  Grid<K> scale_grid;
  make_grid<K>(s.scale, scale_grid);
  const ElementGrids<C> grids = element_grids<C>(s);
  const std::vector<RuleCase> rules = rule_cases();
  for (const typename C::word amax : amaxes) {
    T r, d, old_r, old_d;
    float_scale_factors<C>(amax, s, scale_grid, r, d);
    old_factors<C>(amax, s, scale_grid, old_r, old_d);
    if (bits_of_real(r) != bits_of_real(old_r) || bits_of_real(d) != bits_of_real(old_d)) {
      fail("factors", format, amax, 0, 0, 0, bits_of_real(r), bits_of_real(old_r));
      continue;
    }
    for (const RuleCase& rc : rules) {
      const uint32_t mask = random_mask(rc.rbits);
      with_rounding(rc.rule, [&](auto tag) {
        constexpr Rounding R = decltype(tag)::value;
        for (const typename C::word u : values) {
          const uint32_t word = word_of(rng);
          const auto want = old_float_element<R, C>(u, r, d, grids, word, mask);
          const auto got =
              float_scaled_element<R, C>(u, r, d, grids.arithmetic, grids.own, word, mask);
          if (got != want) fail("float scale", format, u, amax, int(R), rc.rbits, got, want);
        }
        compared_float += static_cast<long long>(values.size());
      });
    }
  }
}

void check_float16_conversions() {
  using C = Float16Container;
  using K = Float32Container;
  for (uint32_t u = 0; u < 0x10000u; ++u) {
    if ((u & C::abs_mask) > C::inf_bits) continue;  // NaN
    const uint32_t wide = convert_exact<K, C>(u);
    if ((u & C::abs_mask) < C::inf_bits && to_arithmetic<C>(u) != wide) {
      fail("to_arithmetic", 0, u, 0, 0, 0, to_arithmetic<C>(u), wide);
    }
    if (from_arithmetic<C>(wide) != u)
      fail("from_arithmetic", 0, wide, 0, 0, 0, from_arithmetic<C>(wide), u);
  }
}

// How much to compare: the test suite's quick run, or everything (`full` as the first argument).
struct Budget {
  int value_stride;  // every value_stride-th 16-bit value
  int random_float32, random_float64;
  bool every_exponent_for_all;  // else: the edges and where the shifted grid stops fitting
  int sample;                   // values tried at every exponent
  int float_values, float_blocks;
};
constexpr Budget kQuick{5, 4000, 1000, false, 48, 300, 12};
constexpr Budget kFull{1, 60000, 6000, true, 1500, 4000, 60};

template <class C>
void check_container(int format, const ScaledSpec& s, const Budget& budget, std::mt19937_64& rng) {
  using W = typename C::word;
  using K = ScaledArithmetic<C>;
  const int count = C::word_bits == 64 ? budget.random_float64 : budget.random_float32;
  std::vector<W> all = finite_values<C>(rng, count);
  std::vector<W> values;
  const size_t stride = C::exp_bits + C::man_bits == 15 ? budget.value_stride : 1;
  for (size_t i = 0; i < all.size(); i += stride) values.push_back(all[i]);
  if (s.rule != ScaleRule::amax) {
    const int32_t emin = static_cast<int32_t>(s.scale.emin);
    const int32_t emax = floor_log2(bits_of_real(s.scale.pos_limit));
    const ElementGrids<C> grids = element_grids<C>(s);
    // Where the shifted grid starts to fit C, and float32: the paths change there.
    int32_t fits = emax + 1, fits_arithmetic = emax + 1;
    for (int32_t e = emax; e >= emin; --e) {
      Grid<C> g;
      Grid<K> gk;
      if (shifted_element_grid<C>(grids.container, e, g)) fits = e;
      if (shifted_element_grid<K>(grids.arithmetic, e, gk)) fits_arithmetic = e;
    }
    std::vector<int32_t> spread;
    for (int32_t e = emin; e <= emax; ++e) {
      const bool edge = e < emin + 2 || e > emax - 2 || e == 0 || e == fits || e == fits - 1 ||
                        e == fits_arithmetic || e == fits_arithmetic - 1;
      if (edge || budget.every_exponent_for_all) spread.push_back(e);
    }
    check_power_of_two<C>(format, s, values, spread, rng);
    std::vector<W> sample;
    for (size_t i = 0; i < values.size(); i += values.size() / budget.sample + 1) {
      sample.push_back(values[i]);
    }
    std::vector<int32_t> every;
    for (int32_t e = emin; e <= emax; ++e) every.push_back(e);
    check_power_of_two<C>(format, s, sample, every, rng);
    return;
  }
  // Block maxima: a sample of the values' magnitudes.
  std::vector<W> amaxes;
  for (size_t i = 0; i < values.size(); i += values.size() / budget.float_blocks + 1) {
    amaxes.push_back(values[i] & C::abs_mask);
  }
  std::vector<W> sample;
  for (size_t i = 0; i < values.size(); i += values.size() / budget.float_values + 1) {
    sample.push_back(values[i]);
  }
  for (const W tensor_amax : {W(C::inf_bits - 1), W(W(C::bias) << C::man_bits), W(1)}) {
    check_float_scales<C>(format, s, sample, amaxes, tensor_amax, rng);
    if (!s.two_level) break;  // the same blocks again
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937_64 rng(20240611);
  check_float16_conversions();
  const bool full = argc > 1 && std::string(argv[1]) == "full";
  const Budget& budget = full ? kFull : kQuick;
  for (int f = full ? 2 : 1; f < argc; ++f) {
    const ScaledSpec s = read_spec(argv[f]);
    check_container<Float32Container>(f, s, budget, rng);
    check_container<Float64Container>(f, s, budget, rng);
    if (fits_bfloat16) check_container<BFloat16Container>(f, s, budget, rng);
    if (fits_float16) check_container<Float16Container>(f, s, budget, rng);
  }
  std::printf(
      "compared: %lld in the container, %lld in float32, %lld with Float scales; %lld float64 "
      "values skipped (x / 2^e inexact in float64)\n",
      compared_container, compared_arithmetic, compared_float, inexact_float64);
  std::printf("%d failures\n", failures);
  return failures > 100 ? 100 : failures;
}

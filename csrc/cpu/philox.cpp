// The CPU generator of the random words (loops.h: philox_group): the fastest of the AVX-512VL and
// AVX2 versions (philox_x86_lanes.h) that the CPU runs, else the scalar loop below; all give the
// words of lpsim/philox.h.
#include <lpsim/philox.h>

#include <cstring>

#include "cpu/loops.h"

namespace lpsim::cpu {

#if defined(__x86_64__) && defined(__GNUC__)
void philox_group_avx2(uint64_t group, const PhiloxKey& key, uint32_t* words);
void philox_group_avx512vl(uint64_t group, const PhiloxKey& key, uint32_t* words);
#endif

namespace {

void philox_group_scalar(uint64_t group, const PhiloxKey& key, uint32_t* words) {
  for (int l = 0; l < kGroupCounters; ++l) {
    const PhiloxWords out = philox_counter_words(group * kGroupCounters + l, key);
    for (int w = 0; w < 4; ++w) words[w * kGroupCounters + l] = out.w[w];
  }
}

using GroupGenerator = void (*)(uint64_t, const PhiloxKey&, uint32_t*);

struct Generator {
  const char* isa;
  GroupGenerator generate;
  bool runs;  // whether this CPU has the instructions
};

// Fastest first.
const Generator kGenerators[] = {
#if defined(__x86_64__) && defined(__GNUC__)
    {"avx512vl", philox_group_avx512vl,
     __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")},
    {"avx2", philox_group_avx2, static_cast<bool>(__builtin_cpu_supports("avx2"))},
#endif
    {"scalar", philox_group_scalar, true},
};

const Generator& pick_generator() {
  for (const Generator& g : kGenerators) {
    if (g.runs) return g;
  }
  return kGenerators[0];  // unreachable: the scalar loop always runs
}

const Generator& chosen = pick_generator();

}  // namespace

void philox_group(uint64_t group, const PhiloxKey& key, uint32_t* words) {
  chosen.generate(group, key, words);
}

const char* philox_group_isa() { return chosen.isa; }

bool philox_generators_agree(uint64_t group, const PhiloxKey& key) {
  uint32_t first[kGroupSize], other[kGroupSize];
  chosen.generate(group, key, first);
  for (const Generator& g : kGenerators) {
    if (!g.runs) continue;
    g.generate(group, key, other);
    if (std::memcmp(first, other, sizeof first) != 0) return false;
  }
  return true;
}

}  // namespace lpsim::cpu

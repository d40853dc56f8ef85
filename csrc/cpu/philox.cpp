// The CPU generator of the random words (loops.h: philox_group): the AVX2 version of
// philox_avx2.cpp where the CPU has AVX2, else the scalar loop below; both give the words of
// lpsim/philox.h.
#include <lpsim/philox.h>

#include "cpu/loops.h"

namespace lpsim::cpu {

#if defined(__x86_64__) && defined(__GNUC__)
void philox_group_avx2(uint64_t group, const PhiloxKey& key, uint32_t* words);
#endif

namespace {

void philox_group_scalar(uint64_t group, const PhiloxKey& key, uint32_t* words) {
  for (int l = 0; l < kGroupCounters; ++l) {
    const PhiloxWords out = philox_counter_words(group * kGroupCounters + l, key);
    for (int w = 0; w < 4; ++w) words[w * kGroupCounters + l] = out.w[w];
  }
}

using GroupGenerator = void (*)(uint64_t, const PhiloxKey&, uint32_t*);

GroupGenerator pick_generator() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2")) return philox_group_avx2;
#endif
  return philox_group_scalar;
}

const GroupGenerator generate_group = pick_generator();

}  // namespace

void philox_group(uint64_t group, const PhiloxKey& key, uint32_t* words) {
  generate_group(group, key, words);
}

const char* philox_group_isa() { return generate_group == philox_group_scalar ? "scalar" : "avx2"; }

}  // namespace lpsim::cpu

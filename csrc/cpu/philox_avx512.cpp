// The AVX-512VL generator of the random words: philox_x86_lanes.h compiled for AVX2 with
// AVX-512F and AVX-512VL (256-bit vectors, three-way XORs and two-source permutes).
//
// The target pragma comes before every include (see philox_avx2.cpp).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,avx512f,avx512vl")
#define LPSIM_PHILOX_AVX512VL 1
#include "cpu/philox_x86_lanes.h"

namespace lpsim::cpu {

void philox_group_avx512vl(uint64_t group, const PhiloxKey& key, uint32_t* words) {
  philox_group_lanes(group, key, words);
}

}  // namespace lpsim::cpu
#endif

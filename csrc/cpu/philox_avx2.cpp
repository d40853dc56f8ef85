// The AVX2 generator of the random words: philox_x86_lanes.h compiled for AVX2.
//
// The target pragma comes before every include so that the template's instantiation here is
// compiled for AVX2; this file instantiates it only on its own lane type (in an unnamed
// namespace), so no symbol compiled for AVX2 can be picked up by the portable code.
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define LPSIM_PHILOX_AVX512VL 0
#include "cpu/philox_x86_lanes.h"

namespace lpsim::cpu {

void philox_group_avx2(uint64_t group, const PhiloxKey& key, uint32_t* words) {
  philox_group_lanes(group, key, words);
}

}  // namespace lpsim::cpu
#endif

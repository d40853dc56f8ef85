// How the CPU ops run their work: at::parallel_for's tasks, each with IEEE subnormals.
//
// torch.set_flush_denormal(True) sets flush-to-zero (FTZ: subnormal results become zero) and
// denormals-are-zero (DAZ: subnormal inputs read as zero) in the calling thread's floating-point
// control register. The rounding core is integer code, but some loops compute with floats (the
// MAC's float32 lanes and float64 sums, the scaled formats' Float scales, the conversions of
// operands to float64), and under those flags they would lose the subnormals of the simulated
// format, and differ between the calling thread and the pool's threads (which keep their own
// mode). So every task runs with both flags cleared and restores the thread's mode after: the
// results depend on no floating-point mode of the caller.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace lpsim {

// Clears FTZ and DAZ for its lifetime (x86-64: MXCSR bits 15 and 6; AArch64: FPCR's FZ, bit 24).
class IeeeSubnormals {
 public:
  IeeeSubnormals() {
#if defined(__x86_64__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~0x8040u);
#elif defined(__aarch64__)
    saved_ = __builtin_aarch64_get_fpcr();
    __builtin_aarch64_set_fpcr(saved_ & ~(1u << 24));
#endif
  }
  ~IeeeSubnormals() {
#if defined(__x86_64__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __builtin_aarch64_set_fpcr(saved_);
#endif
  }
  IeeeSubnormals(const IeeeSubnormals&) = delete;
  IeeeSubnormals& operator=(const IeeeSubnormals&) = delete;

 private:
  unsigned saved_ = 0;
};

// at::parallel_for(begin, end, grain, f), each task under IeeeSubnormals.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t task_begin, int64_t task_end) {
    const IeeeSubnormals mode;
    f(task_begin, task_end);
  });
}

}  // namespace lpsim

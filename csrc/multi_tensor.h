// What the multi-tensor ops share (quantize_grid_many_ in multi_tensor_ops.cpp, the optimizer steps
// in optim_step_ops.cpp): one parallel region over the elements of a list of tensors, cut into work
// items of at most cpu::kGrain elements that each lie inside one tensor and start on a multiple of
// kGrain (hence on a random-word group boundary, as the single-tensor ops' tasks do).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/loops.h"
#include "parallel.h"

namespace lpsim {

// Elements [begin, end) of tensor number `tensor`.
struct Span {
  size_t tensor;
  int64_t begin;
  int64_t end;
};

// Calls f(Span) once for every work item over tensors of numels[0], numels[1], ... elements, from
// at::parallel_for's threads. Empty tensors have no work item.
template <class F>
void for_each_span(const std::vector<int64_t>& numels, const F& f) {
  std::vector<int64_t> first(numels.size() + 1, 0);  // first work item of each tensor
  for (size_t t = 0; t < numels.size(); ++t) {
    first[t + 1] = first[t] + (numels[t] + cpu::kGrain - 1) / cpu::kGrain;
  }
  lpsim::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      // The last tensor whose first item is <= item: empty tensors before it are skipped.
      const size_t t = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), item) -
                                           first.begin() - 1);
      const int64_t start = (item - first[t]) * cpu::kGrain;
      f(Span{t, start, std::min(numels[t], start + cpu::kGrain)});
    }
  });
}

}  // namespace lpsim

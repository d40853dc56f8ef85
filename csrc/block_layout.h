// Which elements share an exponent in a BlockFloat format: plain C++, read by the op files and the
// CUDA launchers (cuda/quantize.h).
#pragma once

#include <cstdint>

namespace lpsim {

// Which elements of a (contiguous) tensor share an exponent in a BlockFloat format.
struct BlockLayout {
  bool by_size;        // blocks of block_size consecutive elements along rows of row_len
  int64_t row_len;     // by_size: the size of the last dimension
  int64_t block_size;  // by_size
  int64_t classes;     // otherwise: element i takes exponent number (i / inner) % classes
  int64_t inner;       //   (one class: the whole tensor; one per index along dim)

  // The number of exponents of a tensor of n elements.
  int64_t blocks(int64_t n) const {
    if (!by_size) return classes;
    return n / row_len * ((row_len + block_size - 1) / block_size);
  }
};

}  // namespace lpsim

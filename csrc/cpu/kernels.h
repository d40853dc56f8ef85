// CPU loops over the rounding core. Plain C++ on raw pointers (no torch headers), so that this
// translation unit can be compiled in several instruction-set versions; ops.cpp checks the tensors
// and splits the work across threads with at::parallel_for. Every function handles one contiguous
// range of the flattened tensor, indexed by the element's logical position i (which also selects
// its random word), so the result does not depend on how the work is split.
#pragma once

#include <cstdint>

#include <lpsim/grid_spec.h>
#include <lpsim/philox.h>

namespace lpsim::cpu {

enum class Dtype : int32_t { float32, float64, bfloat16, float16 };

// y[i] = round(x[i]) on a fixed grid, for i in [begin, end). x and y may be the same array.
void quantize_grid(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t begin,
                   int64_t end, const GridSpec& grid, const RandomSpec& random);

// Block floating point with shared exponents by class: element i belongs to class (i / inner) % classes
// and uses the block grid of class_max_abs[class] (container bits of that class's largest finite
// magnitude). One class is one exponent for the whole tensor; `dim` blocks use one class per index.
void quantize_block_classes(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t begin,
                            int64_t end, int64_t inner, int64_t classes,
                            const uint64_t* class_max_abs, int32_t wl, const RandomSpec& random);

// Running maximum of the finite magnitudes of x[begin, end) per class (see above), into max_abs.
void max_abs_classes(Dtype dtype, const void* x, int64_t begin, int64_t end, int64_t inner,
                     int64_t classes, uint64_t* max_abs);

// Block floating point with blocks of block_size consecutive elements along rows of row_len
// (the last block of a row may be shorter), for the blocks numbered [block_begin, block_end) in
// row-major order: each block's largest magnitude is found and the block rounded in one pass.
void quantize_blocks(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t block_begin,
                     int64_t block_end, int64_t row_len, int64_t block_size, int32_t wl,
                     const RandomSpec& random);

// The random words of one group of kGroupSize elements, in the layout of lpsim/philox.h:
// words[64 w + l] = word w of counter 64 group + l. Uses the fastest generator this CPU runs.
void philox_group(uint64_t group, const PhiloxKey& key, uint32_t* words);

// Name of the generator philox_group uses on this CPU ("avx2" or "scalar"), for benchmarks.
const char* philox_group_isa();

}  // namespace lpsim::cpu

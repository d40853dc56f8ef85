// CPU loops of the scaled-format ops over the core's definitions (lpsim/scaled.h). Plain C++ on raw
// pointers, like every loop file (loops.h); scaled_ops.cpp checks the tensors and splits the work.
// A group's positions are numbered row-major within its tile; position p holds the `inner`
// consecutive elements of one (row, column) of the tile (ScaledLayout).
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/rounding_statistics.h>
#include <lpsim/scaled.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// How the op splits the groups into tasks: task t is group t / (slices * chunks), its inner
// indices [i0, min(i0 + width, inner)) with i0 = (t / chunks % slices) * width, and its positions
// [p0, p0 + chunk) with p0 = (t % chunks) * chunk.
struct ScaledTasks {
  int64_t width, slices;
  int64_t chunk, chunks;
};

// The elements of the tasks [begin, end), rounded into y. With `scales`, block (g, i) (group g,
// inner index i) has scale scales[g * inner + i]; without (nullptr), each task holds whole blocks
// (chunks = 1) and their scales are found from its elements, while they are in cache.
void scaled_quantize(Dtype dtype, Rounding rounding, const void* x, void* y,
                     const ScaledLayout& layout, const ScaledTasks& tasks, int64_t begin,
                     int64_t end, const ScaledSpec& spec, const RandomSpec& random,
                     const BlockScale* scales);

// Running maximum of the magnitude bits of the elements at positions [p0, p1) of group g, for the
// inner indices [i0, i1): into amax[0, i1 - i0).
void scaled_max_abs(Dtype dtype, const void* x, const ScaledLayout& layout, int64_t g, int64_t p0,
                    int64_t p1, int64_t i0, int64_t i1, uint64_t* amax);

// Running maximum of the magnitude bits of the elements of groups [g0, g1), for all their inner
// indices: group g's into amax[g * inner, (g + 1) * inner).
void scaled_groups_max_abs(Dtype dtype, const void* x, const ScaledLayout& layout, int64_t g0,
                           int64_t g1, uint64_t* amax);

// Running maximum of the magnitude bits of x[begin, end), into *amax (the tensor scale's amax).
void max_abs_bits(Dtype dtype, const void* x, int64_t begin, int64_t end, uint64_t* amax);

// The tensor scale of spec (spec.two_level) from the tensor's largest magnitude bits.
void set_tensor_scale(Dtype dtype, ScaledSpec& spec, uint64_t amax);

// scales[k] = the scale of a block whose largest magnitude bits are amax[k], for k in [0, count).
void block_scales(Dtype dtype, const ScaledSpec& spec, const uint64_t* amax, int64_t count,
                  BlockScale* scales);

// bounds[k] = the statistics bounds of a block with scale scales[k] (lpsim/scaled_statistics.h),
// for k in [0, count).
void block_statistics_bounds(Dtype dtype, const ScaledSpec& spec, const BlockScale* scales,
                             int64_t count, double element_smallest_normal,
                             StatisticsBounds* bounds);

}  // namespace lpsim::cpu

// The private op that switches mac_matmul's lane loop (cpu/mac_lanes.h) off and on, for the tests
// that compare it with the scalar loop: torch.ops.lpsim._mac_lanes(False) returns the previous
// setting. Nothing in lpsim calls it.
#include <torch/library.h>

#include "cpu/mac_lanes.h"

namespace lpsim {
namespace {

bool mac_lanes(bool enabled) { return cpu::set_mac_lanes(enabled); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) { m.def("_mac_lanes(bool enabled) -> bool", &mac_lanes); }

}  // namespace lpsim

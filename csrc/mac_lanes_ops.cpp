// The private op that switches mac_matmul's lane loop (cpu/mac_lanes.h) off and on, for the tests
// that compare it with the scalar loop: torch.ops.lpsim._mac_lanes(False) returns the previous
// setting. Nothing in lpsim calls it. torch.ops.lpsim._mac_float_tiles() counts the tiles of the
// lane loop's float32 form, so that its tests can show they reach it.
#include <torch/library.h>

#include "cpu/mac_lanes.h"

namespace lpsim {
namespace {

bool mac_lanes(bool enabled) { return cpu::set_mac_lanes(enabled); }
int64_t mac_float_tiles() { return cpu::mac_float_tiles(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  m.def("_mac_lanes(bool enabled) -> bool", &mac_lanes);
  m.def("_mac_float_tiles() -> int", &mac_float_tiles);
}

}  // namespace lpsim

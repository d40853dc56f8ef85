// The update ops: schemas (a fragment of the lpsim library), argument checks, and the torch glue
// around the CPU loops (cpu/update.h) and the CUDA launchers (cuda/update.h).
//
//   sr_add, sr_add_        a + b computed exactly, rounded once onto a Float or Fixed grid
//   sr_addc, sr_addc_      a + (value * t1) * t2 or a + (value * t1) / t2, the term computed in
//                          float32 (float64 if an operand is float64; addcmul's last product
//                          exact), the sum exact, rounded once (lpsim/update.h's AddcOperands)
//   value_words            test hook: the value-keyed random words
//
// The ops take a's dtype as the container and draw position- or value-keyed words (randomness 0
// or 1). lpsim/update.py validates formats; the checks here guard against direct calls.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <lpsim/philox.h>
#include <torch/library.h>

#include <string>

#include "checks.h"
#include "cpu/loops.h"
#include "cpu/update.h"
#include "parallel.h"

#if defined(LPSIM_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/update.h"
#endif

namespace lpsim {
namespace {

// ---- Checks

// TypeError / ValueError for codes other than 0 (position) and 1 (value).
Randomness randomness_of(int64_t code) {
  TORCH_CHECK(code == 0 || code == 1,
              "lpsim: randomness code must be 0 (position) or 1 (value), got ", code);
  return static_cast<Randomness>(code);
}

// The container of operand `b` (named `name` in messages) of an update of `a`: b must have a's
// shape and device, and a's dtype, float32 or float64.
Dtype operand_of(const at::Tensor& a, const at::Tensor& b, const char* name) {
  container_of(a);
  const at::ScalarType t = b.scalar_type();
  TORCH_CHECK_TYPE(t == a.scalar_type() || t == at::kFloat || t == at::kDouble, "lpsim: ", name,
                   " must have the dtype of a (", a.scalar_type(), "), float32 or float64, got ",
                   t);
  TORCH_CHECK(b.sizes() == a.sizes(), "lpsim: ", name, " must have the shape of a, ", a.sizes(),
              ", got ", b.sizes());
  TORCH_CHECK(b.device() == a.device(), "lpsim: ", name, " must be on the device of a");
  return container_of(b);
}

// One update y[i] = round(x[i] + term(i)), i < n, over contiguous arrays on one device: the term is
// b[i] (sr_add) or (value * t1[i]) * t2[i], (value * t1[i]) / t2[i] with `divide` (sr_addc).
struct Update {
  Dtype a;        // container of x and y
  Dtype operand;  // container of b, or of t1 and t2
  const void* x;
  void* y;
  int64_t n;
  const void* b;
  const void* t1;
  const void* t2;
  double value;
  bool divide;
  GridSpec grid;
  Rounding rounding;
  RandomSpec random;
  Randomness randomness;
};

// The checked description of an update of `a`, operands not yet filled in.
Update make_update(const at::Tensor& a, const at::Tensor& operand, const char* name,
                   const GridSpec& grid, int64_t rounding, int64_t rbits, const Seed& seed,
                   int64_t offset, int64_t randomness) {
  Update u{};
  u.a = container_of(a);
  u.operand = operand_of(a, operand, name);
  u.grid = sum_grid_spec(u.a, grid);
  u.rounding = rounding_of(rounding);
  u.random = random_spec(u.rounding, rbits, seed, offset);
  u.randomness = randomness_of(randomness);
  return u;
}

// ---- The op variants around a device's kernel

// A device's kernels: run an update whose tensors live on that device.
using UpdateKernel = void (*)(const at::Tensor& a, const Update& update);

// An operand of an update written into `buffer`, as the kernel reads it: contiguous, and a copy
// where it shares memory with the buffer without being it (b = a[:-1] in the update of a[1:]): the
// kernel writes each element after reading the operand's element of the same index only, so such
// an operand would be read partly updated. With the copy the update uses the values before it, as
// a = sr_add(a, b) does. An operand that is the buffer itself needs no copy.
at::Tensor read_before_write(const at::Tensor& operand, const at::Tensor& buffer) {
  const at::Tensor contiguous = operand.contiguous();
  const at::MemOverlapStatus overlap = at::get_overlap_status(buffer, contiguous);
  const bool shared =
      overlap == at::MemOverlapStatus::Partial || overlap == at::MemOverlapStatus::TooHard;
  return shared ? contiguous.clone() : contiguous;
}

// dst = a + b rounded (dst may be a): contiguous copies where needed, then the kernel.
template <UpdateKernel kernel>
void add_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& dst, Update u) {
  Destination out(dst);
  const at::Tensor x = a.contiguous(), bc = read_before_write(b, out.buffer);
  u.x = x.const_data_ptr();
  u.y = out.buffer.data_ptr();
  u.n = x.numel();
  u.b = bc.const_data_ptr();
  if (u.n > 0) kernel(a, u);
  out.finish();
}

// dst = a + (value * t1) op t2 rounded (dst may be a).
template <UpdateKernel kernel>
void addc_into(const at::Tensor& a, const at::Tensor& t1, const at::Tensor& t2, double value,
               bool divide, const at::Tensor& dst, Update u) {
  operand_of(a, t2, "tensor2");
  TORCH_CHECK_TYPE(t1.scalar_type() == t2.scalar_type(),
                   "lpsim: tensor1 and tensor2 must have one dtype, got ", t1.scalar_type(),
                   " and ", t2.scalar_type());
  Destination out(dst);
  const at::Tensor x = a.contiguous(), c1 = read_before_write(t1, out.buffer),
                   c2 = read_before_write(t2, out.buffer);
  u.x = x.const_data_ptr();
  u.y = out.buffer.data_ptr();
  u.n = x.numel();
  u.t1 = c1.const_data_ptr();
  u.t2 = c2.const_data_ptr();
  u.value = value;
  u.divide = divide;
  if (u.n > 0) kernel(a, u);
  out.finish();
}

#define LPSIM_UPDATE_ARGS \
  LPSIM_GRID_PARAMS()     \
  int64_t rounding, int64_t rbits, const Seed &seed, int64_t offset, int64_t randomness
#define LPSIM_UPDATE_CALL(operand, label)                                                      \
  make_update(a, operand, label, GridSpec{LPSIM_GRID_VALUES()}, rounding, rbits, seed, offset, \
              randomness)

template <UpdateKernel kernel>
at::Tensor sr_add_op(const at::Tensor& a, const at::Tensor& b, LPSIM_UPDATE_ARGS) {
  at::Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  add_into<kernel>(a, b, y, LPSIM_UPDATE_CALL(b, "b"));
  return y;
}

template <UpdateKernel kernel>
void sr_add_inplace_op(const at::Tensor& a, const at::Tensor& b, LPSIM_UPDATE_ARGS) {
  add_into<kernel>(a, b, a, LPSIM_UPDATE_CALL(b, "b"));
}

template <UpdateKernel kernel>
at::Tensor sr_addc_op(const at::Tensor& a, const at::Tensor& t1, const at::Tensor& t2, double value,
                      bool divide, LPSIM_UPDATE_ARGS) {
  at::Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  addc_into<kernel>(a, t1, t2, value, divide, y, LPSIM_UPDATE_CALL(t1, "tensor1"));
  return y;
}

template <UpdateKernel kernel>
void sr_addc_inplace_op(const at::Tensor& a, const at::Tensor& t1, const at::Tensor& t2,
                        double value, bool divide, LPSIM_UPDATE_ARGS) {
  addc_into<kernel>(a, t1, t2, value, divide, a, LPSIM_UPDATE_CALL(t1, "tensor1"));
}

// Register the four update ops of one dispatch key with its kernels.
template <UpdateKernel add, UpdateKernel addc>
void register_update_ops(torch::Library& m) {
  m.impl("sr_add", sr_add_op<add>);
  m.impl("sr_add_", sr_add_inplace_op<add>);
  m.impl("sr_addc", sr_addc_op<addc>);
  m.impl("sr_addc_", sr_addc_inplace_op<addc>);
}

// ---- CPU: the elements split across threads in whole groups of random words (any split gives
// the same result, since every word depends on its index only).

void add_kernel_cpu(const at::Tensor&, const Update& u) {
  lpsim::parallel_for(0, u.n, cpu::kGrain, [&](int64_t begin, int64_t end) {
    cpu::add_rounded(u.a, u.operand, u.rounding, u.randomness, u.x, u.b, u.y, begin, end, u.grid,
                     u.random);
  });
}

void addc_kernel_cpu(const at::Tensor&, const Update& u) {
  lpsim::parallel_for(0, u.n, cpu::kGrain, [&](int64_t begin, int64_t end) {
    cpu::addc_rounded(u.a, u.operand, u.divide, u.value, u.rounding, u.randomness, u.x, u.t1, u.t2,
                      u.y, begin, end, u.grid, u.random);
  });
}

// Test hook: value_word for operands given as the int64 views of float64 bits, under (seed,
// offset).
at::Tensor value_words_cpu(const at::Tensor& a_bits, const at::Tensor& b_bits,
                           const at::Tensor& seed, int64_t offset) {
  TORCH_CHECK(a_bits.scalar_type() == at::kLong && b_bits.scalar_type() == at::kLong &&
                  a_bits.sizes() == b_bits.sizes(),
              "lpsim: value_words takes two int64 tensors of one shape");
  const RandomSpec r = random_spec(Rounding::stochastic, 32, seed, offset);
  const ValueKey key = make_value_key(r.seed, r.offset);
  const at::Tensor ac = a_bits.contiguous(), bc = b_bits.contiguous();
  at::Tensor words = at::empty(a_bits.sizes(), a_bits.options());
  const int64_t* ap = ac.const_data_ptr<int64_t>();
  const int64_t* bp = bc.const_data_ptr<int64_t>();
  int64_t* w = words.data_ptr<int64_t>();
  for (int64_t i = 0; i < ac.numel(); ++i) {
    w[i] = value_word(static_cast<uint64_t>(ap[i]), static_cast<uint64_t>(bp[i]), key);
  }
  return words;
}

// ---- CUDA: the kernels run on a's device, on its current stream.

#if defined(LPSIM_WITH_CUDA)
cudaStream_t stream_of(const at::Tensor& a) {
  return c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
}

void add_kernel_cuda(const at::Tensor& a, const Update& u) {
  const c10::cuda::CUDAGuard guard(a.device());
  gpu::add_rounded(u.a, u.operand, u.rounding, u.randomness, u.x, u.b, u.y, u.n, u.grid, u.random,
                   stream_of(a));
}

void addc_kernel_cuda(const at::Tensor& a, const Update& u) {
  const c10::cuda::CUDAGuard guard(a.device());
  gpu::addc_rounded(u.a, u.operand, u.divide, u.value, u.rounding, u.randomness, u.x, u.t1, u.t2,
                    u.y, u.n, u.grid, u.random, stream_of(a));
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  const std::string update = grid_schema() + ", " + kRandomSchema + ", int randomness";
  const auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  def("sr_add(Tensor a, Tensor b, " + update + ") -> Tensor");
  def("sr_add_(Tensor(a!) a, Tensor b, " + update + ") -> ()");
  const std::string addc = "Tensor t1, Tensor t2, float value, bool divide, " + update;
  def("sr_addc(Tensor a, " + addc + ") -> Tensor");
  def("sr_addc_(Tensor(a!) a, " + addc + ") -> ()");
  def("value_words(Tensor a_bits, Tensor b_bits, Tensor seed, int offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) {
  register_update_ops<add_kernel_cpu, addc_kernel_cpu>(m);
  m.impl("value_words", value_words_cpu);
}

#if defined(LPSIM_WITH_CUDA)
TORCH_LIBRARY_IMPL(lpsim, CUDA, m) { register_update_ops<add_kernel_cuda, addc_kernel_cuda>(m); }
#endif

}  // namespace lpsim

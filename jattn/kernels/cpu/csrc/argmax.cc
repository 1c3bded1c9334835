// XLA FFI handler of the greedy pick: jnp.argmax over the last axis of float32 logits.
//
// Exported (loaded with ctypes, registered by jattn.kernels.cpu._library):
//   JattnCpuArgmax: x [rows..., V] float32 -> int32 [rows...], per row the index of the
//   first NaN if the row holds one, else of the first largest value (jnp.argmax's answer;
//   -0.0 and 0.0 tie, as ==). XLA's CPU argmax, a reduction over (value, index) pairs,
//   takes about 25x as long on decoding's [16, 8192] logits (bench_serving.py's greedy
//   pick row).
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "isa_target.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" const char* jattn_cpu_isa();  // ffi.cc: the instruction set the kernels run with

namespace jattn {

namespace argmax_generic {
constexpr int W = 4;
#include "argmax_impl.h"
}  // namespace argmax_generic

#if JATTN_X86_TARGETS
JATTN_TARGET_AVX2
namespace argmax_avx2 {
constexpr int W = 8;
#include "argmax_impl.h"
}  // namespace argmax_avx2
JATTN_TARGET_END

JATTN_TARGET_AVX512
namespace argmax_avx512 {
constexpr int W = 16;
#include "argmax_impl.h"
}  // namespace argmax_avx512
JATTN_TARGET_END
#endif

namespace {

// The row kernel of the attention kernels' instruction set (JATTN_CPU_ISA included).
int32_t (*row_argmax())(const float*, int64_t) {
  static const auto chosen = [] {
    const std::string name = jattn_cpu_isa();
#if JATTN_X86_TARGETS
    if (name == "avx512") return &argmax_avx512::row_argmax;
    if (name == "avx2") return &argmax_avx2::row_argmax;
#endif
    return &argmax_generic::row_argmax;
  }();
  return chosen;
}

ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() < 1)
    return ffi::Error::InvalidArgument("jattn argmax: x must be [rows..., V] with V >= 1");
  const int64_t n = dims.back(), rows = static_cast<int64_t>(x.element_count()) / n;
  if (static_cast<int64_t>(out->element_count()) != rows || n > (int64_t{1} << 31) - 1)
    return ffi::Error::InvalidArgument("jattn argmax: the output must be int32 [rows...]");
  const float* data = x.typed_data();
  int32_t* result = out->typed_data();
  const auto row = row_argmax();
  for (int64_t r = 0; r < rows; ++r) result[r] = row(data + r * n, n);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnCpuArgmax, jattn::Argmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [rows..., V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // int32 [rows...]

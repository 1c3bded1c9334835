// The kernels built for avx2 (8-float vectors), chosen at run time when the CPU has it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "isa_target.h"

#if JATTN_X86_TARGETS
JATTN_TARGET_AVX2
#define JATTN_ISA avx2
#define JATTN_ISA_NAME "avx2"
#define JATTN_W 8
#define JATTN_MR 6
#define JATTN_WIDE_MR 0
#include "attention_impl.h"
JATTN_TARGET_END

namespace jattn {
const Isa* isa_avx2() { return &avx2::kIsa; }
}  // namespace jattn
#else
namespace jattn {
const Isa* isa_avx2() { return nullptr; }
}  // namespace jattn
#endif

// The kernels built for avx512 (16-float vectors), chosen at run time when the CPU has it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "isa_target.h"

#if JATTN_X86_TARGETS
JATTN_TARGET_AVX512
#define JATTN_ISA avx512
#define JATTN_ISA_NAME "avx512"
#define JATTN_W 16
#define JATTN_MR 12
#define JATTN_WIDE_MR 6
#define JATTN_SCALEF 1
#include <immintrin.h>
#include "attention_impl.h"
JATTN_TARGET_END

namespace jattn {
const Isa* isa_avx512() { return &avx512::kIsa; }
}  // namespace jattn
#else
namespace jattn {
const Isa* isa_avx512() { return nullptr; }
}  // namespace jattn
#endif

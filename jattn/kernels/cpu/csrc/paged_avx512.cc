// The paged attention kernel built for avx512, chosen when the attention kernels are.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa_target.h"
#include "paged.h"

#if JATTN_X86_TARGETS
JATTN_TARGET_AVX512
#define JATTN_ISA avx512
#define JATTN_ISA_NAME "avx512"
#define JATTN_W 16
#include "paged_impl.h"
JATTN_TARGET_END

namespace jattn {
const PagedIsa* paged_isa_avx512() { return &avx512::kPagedIsa; }
}  // namespace jattn
#else
namespace jattn {
const PagedIsa* paged_isa_avx512() { return nullptr; }
}  // namespace jattn
#endif

// The paged attention kernel built for avx2, chosen when the attention kernels are.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa_target.h"
#include "paged.h"

#if JATTN_X86_TARGETS
JATTN_TARGET_AVX2
#define JATTN_ISA avx2
#define JATTN_ISA_NAME "avx2"
#define JATTN_W 8
#include "paged_impl.h"
JATTN_TARGET_END

namespace jattn {
const PagedIsa* paged_isa_avx2() { return &avx2::kPagedIsa; }
}  // namespace jattn
#else
namespace jattn {
const PagedIsa* paged_isa_avx2() { return nullptr; }
}  // namespace jattn
#endif

// The portable build of the paged attention kernel (4-float vectors).
#define JATTN_ISA generic
#define JATTN_ISA_NAME "generic"
#define JATTN_W 4
#include "paged_impl.h"

namespace jattn {
const PagedIsa* paged_isa_generic() { return &generic::kPagedIsa; }
}  // namespace jattn

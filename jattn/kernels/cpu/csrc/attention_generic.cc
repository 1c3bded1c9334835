// The portable build of the kernels (4-float vectors: SSE2 on x86-64, NEON on arm64).
#define JATTN_ISA generic
#define JATTN_ISA_NAME "generic"
#define JATTN_W 4
#define JATTN_MR 6
#define JATTN_WIDE_MR 0
#include "attention_impl.h"

namespace jattn {
const Isa* isa_generic() { return &generic::kIsa; }
}  // namespace jattn

// The target pragmas of the per-instruction-set builds, in one place: JATTN_TARGET_AVX2 and
// JATTN_TARGET_AVX512 open a region whose functions compile for that instruction set (what
// the CPU must have before a region's code runs: ffi.cc's cpu_has), JATTN_TARGET_END closes
// it. GCC and Clang on x86-64 only; JATTN_X86_TARGETS says whether they exist here.
#ifndef JATTN_KERNELS_CPU_ISA_TARGET_H_
#define JATTN_KERNELS_CPU_ISA_TARGET_H_

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JATTN_X86_TARGETS 1
#if defined(__clang__)
#define JATTN_TARGET_AVX2                                                                   \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,bmi2\"))), apply_to = function)")
#define JATTN_TARGET_AVX512                                                                 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi2\"))), apply_to = function)")
#define JATTN_TARGET_END _Pragma("clang attribute pop")
#else
#define JATTN_TARGET_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,bmi2\")")
#define JATTN_TARGET_AVX512 \
  _Pragma("GCC push_options")  \
      _Pragma("GCC target(\"avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi2\")")
#define JATTN_TARGET_END _Pragma("GCC pop_options")
#endif
#else
#define JATTN_X86_TARGETS 0
#endif

#endif  // JATTN_KERNELS_CPU_ISA_TARGET_H_

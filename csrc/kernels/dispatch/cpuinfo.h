/* CPU features as cpuid and xgetbv report them (dispatch/cpuinfo.c). */
#ifndef CPUMOE_DISPATCH_CPUINFO_H
#define CPUMOE_DISPATCH_CPUINFO_H

#include <stddef.h>
#include <stdint.h>

/* Every feature the tiers can require (cpumoe/tiers.h), with its name in
 * cpumoe_cpu_features(). */
#define CM_FOR_EACH_CPU_FEATURE(X) \
  X(AVX, "avx")                    \
  X(AVX2, "avx2")                  \
  X(FMA, "fma")                    \
  X(F16C, "f16c")                  \
  X(AVX_VNNI, "avx-vnni")          \
  X(AVX512F, "avx512f")            \
  X(AVX512DQ, "avx512dq")          \
  X(AVX512BW, "avx512bw")          \
  X(AVX512VL, "avx512vl")          \
  X(AVX512VNNI, "avx512vnni")      \
  X(AVX512VBMI, "avx512vbmi")      \
  X(AVX512BF16, "avx512bf16")      \
  X(AVX512FP16, "avx512fp16")      \
  X(AMX_TILE, "amx-tile")          \
  X(AMX_BF16, "amx-bf16")          \
  X(AMX_INT8, "amx-int8")

enum {
#define CM_FEATURE_INDEX(id, name) CM_FEATURE_INDEX_##id,
  CM_FOR_EACH_CPU_FEATURE(CM_FEATURE_INDEX)
#undef CM_FEATURE_INDEX
      CM_FEATURE_COUNT
};

#define CM_FEATURE(id) (UINT64_C(1) << CM_FEATURE_INDEX_##id)

/* The features this CPU has and whose register state the OS saves on a context switch
 * (a feature whose registers the OS does not save is unusable): a CM_FEATURE mask. On
 * Linux the AMX tile data also needs the process's permission, asked for here once
 * (arch_prctl ARCH_REQ_XCOMP_PERM); if the kernel refuses, the AMX features are left out
 * and `note` (of `note_size` bytes, "" otherwise) says why. */
uint64_t cm_detect_cpu_features(char *note, size_t note_size);

#endif

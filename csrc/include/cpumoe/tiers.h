/*
 * The ISA tiers, written once. This list makes the cpumoe_isa enum and the tier names
 * (cpumoe.h), the cpuid ladder and each tier's kernel table (csrc/kernels/dispatch/), each
 * tier's compiler flags (tools/kernel_build.py parses the rows), the tier-isolation check
 * (tools/check_tier_isolation.py) and the tier lists of the tests.
 *
 *   X(ENUM, name, id, parent, numerics, flags, features)
 *
 *   ENUM, id  cpumoe_isa value CPUMOE_ISA_<ENUM> = id: public and stable, never renumbered.
 *             Ids are dense (0 .. count - 1); a new tier takes the next free id.
 *   name      the suffix of its kernel files (*-<name>.c), its name in CPUMOE_ISA and
 *             cpumoe.isa().
 *   parent    the tier it builds on: it runs only where its parent runs; its compiler flags
 *             and its kernel table start from the parent's (a tier overrides only the
 *             kernels it improves). scalar is its own parent.
 *   numerics  its numerics class: tiers of one class give bit-identical results
 *             (docs/NUMERICS.md).
 *   flags     compiler flags beyond the parent's, for its *-<name>.c files only.
 *   features  CPU features beyond the parent's (CM_FEATURE names of dispatch/cpuinfo.h;
 *             the OS must also save their registers).
 *
 * Rows are in rank order, worst first: the best tier a CPU supports is the last row whose
 * features (and its ancestors') the CPU has. Keep each row on one line: the build parses it.
 */
#ifndef CPUMOE_TIERS_H
#define CPUMOE_TIERS_H

/* clang-format off */
#define CPUMOE_FOR_EACH_TIER(X) \
  X(SCALAR, scalar, 0, scalar, "fp32-chain", "", 0) \
  X(AVX2, avx2, 1, scalar, "fp32-chain", "-mavx2 -mfma -mf16c", CM_FEATURE(AVX) | CM_FEATURE(AVX2) | CM_FEATURE(FMA) | CM_FEATURE(F16C)) \
  X(AVX2VNNI, avx2vnni, 5, avx2, "fp32-chain", "-mavxvnni", CM_FEATURE(AVX_VNNI)) \
  X(AVX512, avx512, 2, avx2, "fp32-chain", "-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mprefer-vector-width=512", CM_FEATURE(AVX512F) | CM_FEATURE(AVX512BW) | CM_FEATURE(AVX512VL) | CM_FEATURE(AVX512DQ) | CM_FEATURE(AVX512VNNI)) \
  X(AVX512BF16, avx512bf16, 3, avx512, "fp32-chain-daz", "-mavx512bf16 -mavx512vbmi", CM_FEATURE(AVX512BF16) | CM_FEATURE(AVX512VBMI)) \
  X(AMX, amx, 4, avx512bf16, "amx-bf16", "-mamx-tile -mamx-bf16 -mamx-int8", CM_FEATURE(AMX_TILE) | CM_FEATURE(AMX_BF16) | CM_FEATURE(AMX_INT8))
/* clang-format on */

#endif /* CPUMOE_TIERS_H */

/*
 * CPU feature probe: cpuid for what the CPU implements, xgetbv for what the OS
 * saves on context switch (a feature whose registers the OS does not save is
 * unusable). Compiled with baseline flags: it must run on any x86-64.
 */
#define _GNU_SOURCE /* syscall() */
#include <cpuid.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "dispatch/cpuinfo.h"

static uint64_t read_xcr0(void) {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

/* Sets `feature` in *mask when `bit` of `reg` is set. */
static void add_if(uint64_t *mask, unsigned int reg, int bit, uint64_t feature) {
  if ((reg >> bit) & 1) *mask |= feature;
}

/* Linux keeps the 8 KiB of tile data out of a thread's signal frame and context switches
 * until the process asks for it; a tile instruction before that faults (SIGILL). Returns
 * 1 when granted, else 0 with the reason in note. */
static int request_amx_permission(char *note, size_t note_size) {
#ifdef __linux__
  enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) return 1;
  snprintf(note, note_size,
           "amx not used: Linux refused the tile data permission "
           "(arch_prctl ARCH_REQ_XCOMP_PERM: %s)",
           strerror(errno));
  return 0;
#else
  snprintf(note, note_size, "amx not used: no way to ask this OS for the tile data permission");
  return 0;
#endif
}

uint64_t cm_detect_cpu_features(char *note, size_t note_size) {
  uint64_t cpu = 0;
  if (note_size) note[0] = '\0';
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 0;
  const unsigned int max_leaf = eax;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const int osxsave = (ecx >> 27) & 1;
  add_if(&cpu, ecx, 12, CM_FEATURE(FMA));
  add_if(&cpu, ecx, 28, CM_FEATURE(AVX));
  add_if(&cpu, ecx, 29, CM_FEATURE(F16C));
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const unsigned int max_sub = eax;
    add_if(&cpu, ebx, 5, CM_FEATURE(AVX2));
    add_if(&cpu, ebx, 16, CM_FEATURE(AVX512F));
    add_if(&cpu, ebx, 17, CM_FEATURE(AVX512DQ));
    add_if(&cpu, ebx, 30, CM_FEATURE(AVX512BW));
    add_if(&cpu, ebx, 31, CM_FEATURE(AVX512VL));
    add_if(&cpu, ecx, 1, CM_FEATURE(AVX512VBMI));
    add_if(&cpu, ecx, 11, CM_FEATURE(AVX512VNNI));
    add_if(&cpu, edx, 22, CM_FEATURE(AMX_BF16));
    add_if(&cpu, edx, 23, CM_FEATURE(AVX512FP16));
    add_if(&cpu, edx, 24, CM_FEATURE(AMX_TILE));
    add_if(&cpu, edx, 25, CM_FEATURE(AMX_INT8));
    if (max_sub >= 1) {
      __cpuid_count(7, 1, eax, ebx, ecx, edx);
      add_if(&cpu, eax, 4, CM_FEATURE(AVX_VNNI));
      add_if(&cpu, eax, 5, CM_FEATURE(AVX512BF16));
    }
  }
  /* Register state the OS saves (XCR0), per register family. */
  const uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  const int os_avx = (xcr0 & 0x6) == 0x6;         /* XMM and YMM state */
  const int os_avx512 = (xcr0 & 0xe6) == 0xe6;    /* plus opmask, ZMM_Hi256, Hi16_ZMM */
  const int os_amx = (xcr0 & 0x60000) == 0x60000; /* XTILECFG, XTILEDATA */
  const uint64_t avx_family = CM_FEATURE(AVX) | CM_FEATURE(AVX2) | CM_FEATURE(FMA) |
                              CM_FEATURE(F16C) | CM_FEATURE(AVX_VNNI);
  const uint64_t avx512_family = CM_FEATURE(AVX512F) | CM_FEATURE(AVX512DQ) | CM_FEATURE(AVX512BW) |
                                 CM_FEATURE(AVX512VL) | CM_FEATURE(AVX512VNNI) |
                                 CM_FEATURE(AVX512VBMI) | CM_FEATURE(AVX512BF16) |
                                 CM_FEATURE(AVX512FP16);
  const uint64_t amx_family = CM_FEATURE(AMX_TILE) | CM_FEATURE(AMX_BF16) | CM_FEATURE(AMX_INT8);
  uint64_t usable = cpu;
  if (!os_avx) usable &= ~(avx_family | avx512_family | amx_family);
  if (!os_avx512) usable &= ~avx512_family;
  if (!os_amx) usable &= ~amx_family;
  if ((usable & amx_family) == amx_family && !request_amx_permission(note, note_size))
    usable &= ~amx_family;
  return usable;
}

/*
 * CPU feature probe: cpuid for what the CPU implements, xgetbv for what the OS
 * saves on context switch (a feature whose registers the OS does not save is
 * unusable). Compiled with baseline flags: it must run on any x86-64.
 */
#include <cpuid.h>
#include <stdint.h>
#include <string.h>

#include "dispatch/cpuinfo.h"

static uint64_t read_xcr0(void) {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

cm_cpu_features cm_detect_cpu_features(void) {
  cm_cpu_features f;
  memset(&f, 0, sizeof f);
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
  const unsigned int max_leaf = eax;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const int osxsave = (ecx >> 27) & 1;
  f.fma = (ecx >> 12) & 1;
  f.avx = (ecx >> 28) & 1;
  f.f16c = (ecx >> 29) & 1;
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    f.avx2 = (ebx >> 5) & 1;
    f.avx512f = (ebx >> 16) & 1;
    f.avx512dq = (ebx >> 17) & 1;
    f.avx512bw = (ebx >> 30) & 1;
    f.avx512vl = (ebx >> 31) & 1;
    f.avx512vnni = (ecx >> 11) & 1;
    f.avx512fp16 = (edx >> 23) & 1;
    f.amx_bf16 = (edx >> 22) & 1;
    f.amx_tile = (edx >> 24) & 1;
    f.amx_int8 = (edx >> 25) & 1;
    const unsigned int max_sub = eax;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, eax, ebx, ecx, edx);
      f.avx512bf16 = (eax >> 5) & 1;
    }
  }
  if (osxsave) {
    const uint64_t xcr0 = read_xcr0();
    f.os_avx = (xcr0 & 0x6) == 0x6;         /* XMM and YMM state */
    f.os_avx512 = (xcr0 & 0xe6) == 0xe6;    /* plus opmask, ZMM_Hi256, Hi16_ZMM */
    f.os_amx = (xcr0 & 0x60000) == 0x60000; /* XTILECFG, XTILEDATA */
  }
  return f;
}

int cm_cpu_supports_avx2_tier(const cm_cpu_features *f) {
  return f->os_avx && f->avx && f->avx2 && f->fma && f->f16c;
}

int cm_cpu_supports_avx512_tier(const cm_cpu_features *f) {
  return cm_cpu_supports_avx2_tier(f) && f->os_avx512 && f->avx512f && f->avx512bw && f->avx512vl &&
         f->avx512dq && f->avx512vnni;
}

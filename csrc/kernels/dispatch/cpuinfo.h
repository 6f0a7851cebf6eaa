/* CPU features as cpuid and xgetbv report them (dispatch/cpuinfo.c). */
#ifndef CPUMOE_DISPATCH_CPUINFO_H
#define CPUMOE_DISPATCH_CPUINFO_H

typedef struct cm_cpu_features {
  unsigned char avx, avx2, fma, f16c;
  unsigned char avx512f, avx512dq, avx512bw, avx512vl, avx512vnni, avx512bf16, avx512fp16;
  unsigned char amx_tile, amx_bf16, amx_int8;
  unsigned char os_avx, os_avx512, os_amx; /* register state enabled by the OS (XCR0) */
} cm_cpu_features;

cm_cpu_features cm_detect_cpu_features(void);
int cm_cpu_supports_avx2_tier(const cm_cpu_features *f);
int cm_cpu_supports_avx512_tier(const cm_cpu_features *f);

#endif

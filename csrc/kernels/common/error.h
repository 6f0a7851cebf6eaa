/* Error reporting of the C core: a per-thread message behind cpumoe_last_error(). */
#ifndef CPUMOE_COMMON_ERROR_H
#define CPUMOE_COMMON_ERROR_H

#include "cpumoe/cpumoe.h"

/* Formats the calling thread's message and returns `status`, so that a check
 * reads `if (bad) return cm_fail(CPUMOE_EINVAL, "...", ...);` */
cpumoe_status cm_fail(cpumoe_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif

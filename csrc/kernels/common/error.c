/* Per-thread error message of the C core (see common/error.h). */
#include "common/error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char cm_error_message[512];

cpumoe_status cm_fail(cpumoe_status status, const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(cm_error_message, sizeof cm_error_message, fmt, args);
  va_end(args);
  return status;
}

const char *cpumoe_last_error(void) {
  return cm_error_message;
}

#ifdef CPUMOE_CHECK_PRECONDITIONS
#include <stdio.h>
#include <stdlib.h>

#include "common/ukernels.h"

void cm_precondition_failed(const char *condition, const char *file, int line) {
  fprintf(stderr, "cpumoe: kernel precondition failed: %s (%s:%d)\n", condition, file, line);
  abort();
}
#endif

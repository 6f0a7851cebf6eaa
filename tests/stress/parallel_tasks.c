/*
 * Stress test of cm_parallel_tasks (csrc/kernels/common/parallel.c), built with
 * ThreadSanitizer by tests/test_parallel_stress.py: stages of 0..4999 tasks on 1..9 pthread
 * workers, every task of uneven length; each task must run exactly once, and the claims
 * (one CAS on a packed segment word, from its front by the owner and from its back by
 * thieves) must be free of data races.
 *
 * Usage: parallel_tasks [STAGES]   (default 1000); prints "ok" and exits 0, else 1.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/parallel.h"

#define MAX_TASKS 5000
#define MAX_WORKERS 9

typedef struct worker_job {
  int64_t worker;
  cpumoe_worker_fn fn;
  void *arg;
} worker_job;

static void *thread_main(void *p) {
  const worker_job *job = (const worker_job *)p;
  job->fn(job->arg, job->worker);
  return NULL;
}

/* worker w on its own thread, worker 0 on the caller's */
static void run_on_pthreads(void *ctx, int64_t n, cpumoe_worker_fn fn, void *arg) {
  (void)ctx;
  pthread_t threads[MAX_WORKERS];
  worker_job jobs[MAX_WORKERS];
  if (n > MAX_WORKERS) abort();
  for (int64_t w = 1; w < n; w++) {
    jobs[w] = (worker_job){w, fn, arg};
    if (pthread_create(&threads[w], NULL, thread_main, &jobs[w]) != 0) abort();
  }
  fn(arg, 0);
  for (int64_t w = 1; w < n; w++) pthread_join(threads[w], NULL);
}

static _Atomic int runs[MAX_TASKS];

static void count_task(void *ctx, int64_t t) {
  (void)ctx;
  atomic_fetch_add_explicit(&runs[t], 1, memory_order_relaxed);
  for (volatile int64_t spin = 0; spin < (t * 7919) % 300; spin++) {
  }
}

int main(int argc, char **argv) {
  const int stages = argc > 1 ? atoi(argv[1]) : 1000;
  srand(1);
  for (int s = 0; s < stages; s++) {
    const int64_t n = rand() % MAX_TASKS, workers = 1 + rand() % MAX_WORKERS;
    for (int64_t t = 0; t < n; t++) atomic_store(&runs[t], 0);
    const cpumoe_runner runner = {run_on_pthreads, NULL, workers};
    cm_parallel_tasks(&runner, n, count_task, NULL);
    for (int64_t t = 0; t < n; t++)
      if (atomic_load(&runs[t]) != 1) {
        printf("stage %d: %lld tasks on %lld workers: task %lld ran %d times\n", s, (long long)n,
               (long long)workers, (long long)t, atomic_load(&runs[t]));
        return 1;
      }
  }
  printf("ok\n");
  return 0;
}

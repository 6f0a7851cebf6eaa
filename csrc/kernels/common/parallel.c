/* Work distribution inside the core (see common/parallel.h). */
#include "common/parallel.h"

#include <stdatomic.h>

int64_t cm_worker_count(const cpumoe_runner *runner, int64_t limit) {
  int64_t n = runner && runner->run && runner->num_threads > 0 ? runner->num_threads : 1;
  return n < limit ? n : limit;
}

void cm_run_workers(const cpumoe_runner *runner, int64_t n, cpumoe_worker_fn worker, void *arg) {
  if (runner && runner->run && n > 1)
    runner->run(runner->runner_ctx, n, worker, arg);
  else
    for (int64_t w = 0; w < n; w++) worker(arg, w);
}

typedef struct task_queue {
  atomic_llong next;
  int64_t n_tasks, workers;
  cm_task_fn fn;
  void *ctx;
} task_queue;

/* Claims a run of consecutive tasks: a share of what is left, remaining / (2 workers) but at
 * least one, so that the runs shrink toward the end and the workers finish together. Within
 * a run a worker walks adjacent weight tiles, so the kernels' read-ahead past the end of a
 * tile fetches the worker's own next one, not one the other worker has already read.
 * Qwen3, 2 threads, one process alternating with one task per claim, medians of 3 x 48
 * calls (M=1), 3 x 12 (M=64), 3 x 6 (M=512): M=1 int4 0.93-0.99 vs 1.21-1.26 ms, int8
 * 1.52-1.56 vs 1.77-1.83 ms, fp8 2.04 vs 2.34-2.36 ms, bf16 3.05-3.21 vs 3.31-3.46 ms;
 * int4 M=64 21.5-22.2 vs 27.6-28.8 ms; int8 M=512 57.0-63.9 vs 64.9-72.7 ms.
 * Returns the first task and sets *count, or -1 if none is left. */
static int64_t claim_run(task_queue *q, int64_t *count) {
  long long first = atomic_load_explicit(&q->next, memory_order_relaxed);
  int64_t n;
  do {
    if (first >= q->n_tasks) return -1;
    n = (q->n_tasks - (int64_t)first) / (2 * q->workers);
    if (n < 1) n = 1;
  } while (!atomic_compare_exchange_weak_explicit(&q->next, &first, first + n, memory_order_relaxed,
                                                  memory_order_relaxed));
  *count = n;
  return (int64_t)first;
}

static void drain_queue(void *arg, int64_t worker) {
  (void)worker;
  task_queue *q = (task_queue *)arg;
  int64_t count;
  for (int64_t first; (first = claim_run(q, &count)) >= 0;)
    for (int64_t t = first; t < first + count; t++) q->fn(q->ctx, t);
  /* orders the worker's streaming stores (bias_scale_stream) before the stage ends */
  atomic_thread_fence(memory_order_seq_cst);
}

void cm_parallel_tasks(const cpumoe_runner *runner, int64_t n_tasks, cm_task_fn fn, void *ctx) {
  if (n_tasks <= 0) return;
  task_queue q = {
      .n_tasks = n_tasks, .workers = cm_worker_count(runner, n_tasks), .fn = fn, .ctx = ctx};
  atomic_init(&q.next, 0);
  cm_run_workers(runner, q.workers, drain_queue, &q);
}

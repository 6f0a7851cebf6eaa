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
 * tile fetches the worker's own next one (Qwen3 M=1, one process, alternating with one task
 * per claim, 3 x 48 calls each: medians int4 1.95-1.97 vs 2.07-2.08 ms, int8 2.61-2.72 vs
 * 2.72-2.84 ms, fp8 3.50-3.71 vs 3.62-3.83 ms, bf16 6.12-6.18 vs 6.26-6.33 ms; int4 M=64
 * 32.7-39.0 vs 34.8-41.4 ms; int8 M=512 90.9-91.7 vs 93.7-95.3 ms; Mixtral int8 M=1 and
 * bf16 M=512 within noise). Returns the first task and sets *count, or -1 if none is left. */
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

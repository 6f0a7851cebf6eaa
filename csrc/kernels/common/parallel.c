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
  int64_t n_tasks;
  cm_task_fn fn;
  void *ctx;
} task_queue;

static void drain_queue(void *arg, int64_t worker) {
  (void)worker;
  task_queue *q = (task_queue *)arg;
  for (;;) {
    const int64_t t = (int64_t)atomic_fetch_add_explicit(&q->next, 1, memory_order_relaxed);
    if (t >= q->n_tasks) break;
    q->fn(q->ctx, t);
  }
  /* orders the worker's streaming stores (bias_scale_stream) before the stage ends */
  atomic_thread_fence(memory_order_seq_cst);
}

void cm_parallel_tasks(const cpumoe_runner *runner, int64_t n_tasks, cm_task_fn fn, void *ctx) {
  if (n_tasks <= 0) return;
  task_queue q = {.n_tasks = n_tasks, .fn = fn, .ctx = ctx};
  atomic_init(&q.next, 0);
  cm_run_workers(runner, cm_worker_count(runner, n_tasks), drain_queue, &q);
}

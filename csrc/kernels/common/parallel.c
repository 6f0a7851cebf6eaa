/* Work distribution inside the core (see common/parallel.h). */
#include "common/parallel.h"

#include <sched.h>
#include <stdatomic.h>

/* Pause-spins before a worker waiting at a stage's end starts yielding the CPU. With as many
 * threads as cores, spinning only and yielding after 256 spins time the same; with more
 * threads than cores, spinning workers hold the cores that the workers they wait for need,
 * and yielding avoids that (docs/PERFORMANCE-HISTORY.md). */
#define CM_STAGE_WAIT_SPINS 256

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

/* Each worker owns one contiguous segment of the tasks, [next, end), packed in one atomic
 * word (next in the low 32 bits, end in the high) so that one CAS claims from either end. */
typedef struct task_queue {
  _Atomic uint64_t *segment; /* [workers] */
  int64_t base, workers;     /* task index = base + index within the segments */
  cm_task_fn fn;
  void *ctx;
} task_queue;

static uint64_t pack_segment(int64_t next, int64_t end) {
  return ((uint64_t)end << 32) | (uint64_t)(uint32_t)next;
}

/* Workers for a queue of n tasks: the runner's count, at most one segment each. */
static int64_t queue_workers(const cpumoe_runner *runner, int64_t n) {
  const int64_t workers = cm_worker_count(runner, n);
  return workers < CM_MAX_WORKERS ? workers : CM_MAX_WORKERS;
}

/* Splits tasks [0, n) into the workers' equal segments. */
static void init_segments(_Atomic uint64_t *segment, int64_t workers, int64_t n) {
  for (int64_t w = 0; w < workers; w++)
    atomic_init(&segment[w], pack_segment(n * w / workers, n * (w + 1) / workers));
}

/* Claims a run of consecutive tasks of segment s, or returns -1 if it is empty. Its owner
 * takes a quarter of what is left from the front, a thief half of it from the back. So a
 * worker walks its own segment front to back in adjacent runs: its kernels' read-ahead past
 * a tile's end fetches the tile it runs next, and the stream breaks only where it steals
 * once its segment is done (from the back, so owner and thief do not meet until the end).
 * Runs, not single tasks, keep claims cheap (one atomic per run); adjacent runs keep each
 * worker's weight stream unbroken (A/B figures: docs/PERFORMANCE-HISTORY.md). */
static int64_t claim_run(task_queue *q, int64_t s, int steal, int64_t *count) {
  uint64_t v = atomic_load_explicit(&q->segment[s], memory_order_relaxed);
  for (;;) {
    const int64_t next = (int64_t)(uint32_t)v, end = (int64_t)(v >> 32);
    if (next >= end) return -1;
    int64_t n = (end - next) / (steal ? 2 : 4);
    if (n < 1) n = 1;
    const uint64_t claimed = steal ? pack_segment(next, end - n) : pack_segment(next + n, end);
    if (atomic_compare_exchange_weak_explicit(&q->segment[s], &v, claimed, memory_order_relaxed,
                                              memory_order_relaxed)) {
      *count = n;
      return steal ? end - n : next;
    }
  }
}

/* Runs the runs of tasks claimed from segment s; returns how many tasks that was. */
static int64_t run_claims(task_queue *q, int64_t s, int steal) {
  int64_t count, ran = 0;
  for (int64_t first; (first = claim_run(q, s, steal, &count)) >= 0; ran += count)
    for (int64_t t = first; t < first + count; t++) q->fn(q->ctx, q->base + t);
  return ran;
}

/* The worker's own segment, then the others' from the back; returns the tasks it ran. */
static int64_t drain(task_queue *q, int64_t worker) {
  int64_t ran = run_claims(q, worker, 0);
  for (int64_t k = 1; k < q->workers; k++) ran += run_claims(q, (worker + k) % q->workers, 1);
  return ran;
}

static void drain_queue(void *arg, int64_t worker) {
  drain((task_queue *)arg, worker);
  /* orders the worker's streaming stores (bias_scale_stream, copy_stream) before the stage
   * ends */
  atomic_thread_fence(memory_order_seq_cst);
}

void cm_parallel_tasks(const cpumoe_runner *runner, int64_t n_tasks, cm_task_fn fn, void *ctx) {
  _Atomic uint64_t segment[CM_MAX_WORKERS];
  task_queue q = {
      .segment = segment, .workers = queue_workers(runner, n_tasks), .fn = fn, .ctx = ctx};
  /* a segment bound holds 32 bits: more tasks than that (no op has them) go in rounds */
  for (q.base = 0; q.base < n_tasks; q.base += INT32_MAX) {
    init_segments(segment, q.workers, n_tasks - q.base < INT32_MAX ? n_tasks - q.base : INT32_MAX);
    cm_run_workers(runner, q.workers, drain_queue, &q);
  }
}

/* The stages of one cm_parallel_stages call: a queue and a count of finished tasks each. */
typedef struct stage_chain {
  task_queue queue[CM_MAX_STAGES];
  int64_t tasks[CM_MAX_STAGES];
  _Atomic int64_t finished[CM_MAX_STAGES];
  _Atomic uint64_t segment[CM_MAX_STAGES][CM_MAX_WORKERS];
  int stages;
  void (*worker_exit)(void);
} stage_chain;

/* Waits until the stage's count of finished tasks is complete: a few hundred pause-spins
 * (the wait at a stage's end is usually a task or two), then yielding the CPU between looks,
 * so that with more workers than cores the workers being waited for get to run. */
static void wait_for_stage(_Atomic int64_t *finished, int64_t tasks) {
  for (int spins = 0; atomic_load_explicit(finished, memory_order_acquire) < tasks;) {
    if (spins < CM_STAGE_WAIT_SPINS) {
      spins++;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      sched_yield();
    }
  }
}

/* Every worker drains each stage in turn and waits for the tasks the others claimed of it
 * before it starts the next. A worker waits only for tasks that a running worker has
 * claimed, so the chain completes even when the runner runs its workers one after another
 * (the first then runs every task; the others find nothing left). */
static void run_chain(void *arg, int64_t worker) {
  stage_chain *c = (stage_chain *)arg;
  for (int s = 0; s < c->stages; s++) {
    task_queue *q = &c->queue[s];
    const int64_t ran = drain(q, worker);
    /* publishes the stage's writes, streaming stores (bias_scale_stream, copy_stream)
     * included */
    atomic_thread_fence(memory_order_seq_cst);
    if (ran) atomic_fetch_add_explicit(&c->finished[s], ran, memory_order_release);
    wait_for_stage(&c->finished[s], c->tasks[s]);
  }
  if (c->worker_exit) c->worker_exit();
}

typedef struct worker_exit_job {
  void (*fn)(void);
} worker_exit_job;

static void exit_worker(void *arg, int64_t worker) {
  (void)worker;
  ((const worker_exit_job *)arg)->fn();
}

void cm_parallel_stages(const cpumoe_runner *runner, const cm_stage *stages, int n_stages,
                        void *ctx, void (*worker_exit)(void)) {
  int64_t most = 0;
  for (int s = 0; s < n_stages; s++) most = stages[s].tasks > most ? stages[s].tasks : most;
  if (n_stages > CM_MAX_STAGES || most > INT32_MAX) { /* no op has that many: stage by stage */
    for (int s = 0; s < n_stages; s++)
      cm_parallel_tasks(runner, stages[s].tasks, stages[s].fn, ctx);
    /* the runner's workers, as many as cm_parallel_tasks asked for */
    worker_exit_job job = {worker_exit};
    if (worker_exit)
      cm_run_workers(runner, cm_worker_count(runner, CM_MAX_WORKERS), exit_worker, &job);
    return;
  }
  stage_chain c;
  c.stages = n_stages;
  c.worker_exit = worker_exit;
  const int64_t workers = queue_workers(runner, most);
  for (int s = 0; s < n_stages; s++) {
    c.queue[s] =
        (task_queue){.segment = c.segment[s], .workers = workers, .fn = stages[s].fn, .ctx = ctx};
    c.tasks[s] = stages[s].tasks;
    atomic_init(&c.finished[s], 0);
    init_segments(c.segment[s], workers, stages[s].tasks);
  }
  cm_run_workers(runner, workers, run_chain, &c);
}

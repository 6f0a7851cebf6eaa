/*
 * Stress test of cm_parallel_tasks and cm_parallel_stages (csrc/kernels/common/parallel.c),
 * built with ThreadSanitizer by tests/test_parallel_stress.py.
 *   cm_parallel_tasks: stages of 0..4999 tasks on 1..9 pthread workers, every task of
 *   uneven length; each task must run exactly once, and the claims (one CAS on a packed
 *   segment word, from its front by the owner and from its back by thieves) must be free
 *   of data races.
 *   cm_parallel_stages: chains of 1..8 stages of 0..1999 tasks, on 1..9 workers that run
 *   on their own threads, all on the caller's thread one after another, or two to a
 *   thread; every task runs once and finds every task of the stage before it finished and
 *   its plain writes visible (ThreadSanitizer checks the last).
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

/* the workers one after another on the caller's thread */
static void run_serially(void *ctx, int64_t n, cpumoe_worker_fn fn, void *arg) {
  (void)ctx;
  for (int64_t w = 0; w < n; w++) fn(arg, w);
}

typedef struct pair_job {
  int64_t first, n;
  cpumoe_worker_fn fn;
  void *arg;
} pair_job;

static void *run_pair(void *p) {
  const pair_job *job = (const pair_job *)p;
  for (int64_t w = job->first; w < job->n; w += 2) job->fn(job->arg, w);
  return NULL;
}

/* even workers in turn on the caller's thread, odd ones in turn on a second thread */
static void run_two_threads(void *ctx, int64_t n, cpumoe_worker_fn fn, void *arg) {
  (void)ctx;
  pthread_t odd;
  pair_job jobs[2] = {{0, n, fn, arg}, {1, n, fn, arg}};
  if (pthread_create(&odd, NULL, run_pair, &jobs[1]) != 0) abort();
  run_pair(&jobs[0]);
  pthread_join(odd, NULL);
}

static _Atomic int runs[MAX_TASKS];

static void count_task(void *ctx, int64_t t) {
  (void)ctx;
  atomic_fetch_add_explicit(&runs[t], 1, memory_order_relaxed);
  for (volatile int64_t spin = 0; spin < (t * 7919) % 300; spin++) {
  }
}

#define CHAIN_TASKS 2000

typedef struct chain {
  int stages;
  int64_t tasks[CM_MAX_STAGES];
  _Atomic int runs[CM_MAX_STAGES][CHAIN_TASKS];
  int value[CM_MAX_STAGES][CHAIN_TASKS]; /* plain writes, read by the next stage */
  _Atomic int bad;
} chain;

static chain the_chain;

/* task t of stage s: runs once, after every task of stage s - 1 */
#define CHAIN_TASK(s)                                                               \
  static void chain_task_##s(void *ctx, int64_t t) {                                \
    chain *c = (chain *)ctx;                                                        \
    if (s > 0)                                                                      \
      for (int64_t u = 0; u < c->tasks[s > 0 ? s - 1 : 0]; u++)                     \
        if (c->value[s > 0 ? s - 1 : 0][u] != 1 + (int)u) atomic_store(&c->bad, 1); \
    atomic_fetch_add_explicit(&c->runs[s][t], 1, memory_order_relaxed);             \
    c->value[s][t] = 1 + (int)t;                                                    \
    for (volatile int64_t spin = 0; spin < (t * 7919 + s) % 200; spin++) {          \
    }                                                                               \
  }
CHAIN_TASK(0)
CHAIN_TASK(1)
CHAIN_TASK(2)
CHAIN_TASK(3)
CHAIN_TASK(4)
CHAIN_TASK(5)
CHAIN_TASK(6)
CHAIN_TASK(7)
static const cm_task_fn chain_tasks[CM_MAX_STAGES] = {chain_task_0, chain_task_1, chain_task_2,
                                                      chain_task_3, chain_task_4, chain_task_5,
                                                      chain_task_6, chain_task_7};

static int run_chains(int chains) {
  void (*const runners[3])(void *, int64_t, cpumoe_worker_fn, void *) = {
      run_on_pthreads, run_serially, run_two_threads};
  for (int i = 0; i < chains; i++) {
    chain *c = &the_chain;
    c->stages = 1 + rand() % CM_MAX_STAGES;
    cm_stage stages[CM_MAX_STAGES];
    for (int s = 0; s < c->stages; s++) {
      /* small stages often, as the op's one-token stages */
      c->tasks[s] = rand() % 3 == 0 ? rand() % 4 : rand() % CHAIN_TASKS;
      stages[s] = (cm_stage){c->tasks[s], chain_tasks[s]};
      for (int64_t t = 0; t < c->tasks[s]; t++) atomic_store(&c->runs[s][t], 0), c->value[s][t] = 0;
    }
    atomic_store(&c->bad, 0);
    const int64_t workers = 1 + rand() % MAX_WORKERS;
    const cpumoe_runner runner = {runners[i % 3], NULL, workers};
    cm_parallel_stages(&runner, stages, c->stages, c, NULL);
    for (int s = 0; s < c->stages; s++)
      for (int64_t t = 0; t < c->tasks[s]; t++)
        if (atomic_load(&c->runs[s][t]) != 1) {
          printf("chain %d (runner %d, %lld workers): stage %d task %lld ran %d times\n", i, i % 3,
                 (long long)workers, s, (long long)t, atomic_load(&c->runs[s][t]));
          return 1;
        }
    if (atomic_load(&c->bad)) {
      printf("chain %d (runner %d, %lld workers): a task ran before the stage before it ended\n", i,
             i % 3, (long long)workers);
      return 1;
    }
  }
  return 0;
}

int main(int argc, char **argv) {
  const int stages = argc > 1 ? atoi(argv[1]) : 1000;
  srand(1);
  if (run_chains(stages / 4)) return 1;
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

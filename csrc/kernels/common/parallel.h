/*
 * Work distribution inside the core. An op stage is a list of independent tasks
 * 0..n-1; cm_parallel_tasks asks the caller's runner for workers, gives each worker a
 * contiguous segment of the tasks, and each worker claims runs of consecutive tasks from
 * the front of its own segment, then steals runs from the back of the others' until none
 * is left (see parallel.c). A task's result never depends on which worker ran it, so
 * outputs are identical for any thread count. cm_parallel_stages runs several stages in one
 * request to the runner; a worker then waits only for tasks that other, running workers
 * have claimed, so it needs no more from the runner than cm_parallel_tasks does (workers
 * run one after another still finish).
 */
#ifndef CPUMOE_COMMON_PARALLEL_H
#define CPUMOE_COMMON_PARALLEL_H

#include <stdint.h>

#include "cpumoe/cpumoe.h"

#define CM_MAX_WORKERS 256

typedef void (*cm_task_fn)(void *ctx, int64_t task);

/* Workers to ask the runner for: its num_threads, at least 1, at most `limit`. */
int64_t cm_worker_count(const cpumoe_runner *runner, int64_t limit);

/* Calls worker(arg, w) for w in [0, n) through the runner (serially without one). */
void cm_run_workers(const cpumoe_runner *runner, int64_t n, cpumoe_worker_fn worker, void *arg);

/* Runs fn(ctx, t) once for every t in [0, n_tasks). */
void cm_parallel_tasks(const cpumoe_runner *runner, int64_t n_tasks, cm_task_fn fn, void *ctx);

#define CM_MAX_STAGES 8

typedef struct cm_stage {
  int64_t tasks;
  cm_task_fn fn;
} cm_stage;

/* cm_parallel_tasks for each stage in order, every task of a stage finished (its writes
 * visible) before any task of the next starts, in one request to the runner: the workers
 * wait for each other between stages instead of being started and joined once per stage,
 * which costs a small call most (docs/PERFORMANCE-HISTORY.md). Then every worker calls
 * worker_exit, if not NULL, on its own thread (to give back per-thread state, AMX tiles). */
void cm_parallel_stages(const cpumoe_runner *runner, const cm_stage *stages, int n_stages,
                        void *ctx, void (*worker_exit)(void));

#endif

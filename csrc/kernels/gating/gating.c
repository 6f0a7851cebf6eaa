/*
 * Routing ("gating") before the experts: each token's router logits -> its topk expert ids
 * and weights (cpumoe_gating in cpumoe/cpumoe.h states the math; docs/MATH.md, "Routing",
 * with SGLang's ops that call it).
 *
 * SHAPES    logits [M, E] (fp32, bf16 or fp16); bias [E] or none; out weights fp32 and
 *           ids int32 [M, topk]. E, topk and the group count are any that fit (SGLang's
 *           kernels serve a fixed list of E).
 * PER TOKEN (route_token)
 *           x = the row in fp32; score s[e] (softmax, sigmoid or sqrt-softplus: the active
 *           tier's elementwise kernels, which give the same bits on every tier); rank r[e]
 *           (x[e] unbiased, s[e] + bias[e] biased; NaN ranks as -inf); with groups, each
 *           group's score and the topk_groups best groups; the R best experts of those
 *           groups (best_k: sorted insertion for a small R, a heap beyond); weights s[id],
 *           the fused shared slot, scaling. Hash routing (a tid2eid table) takes the R ids
 *           from the token's table row instead of ranking (weigh_table_row).
 * ORDER     "before" is a total order: higher rank first, equal ranks by lower index; so the
 *           result never depends on the order candidates are visited in. Sums run in slot
 *           order (the softmax sum in expert order), fp32, from +0.
 * THREADS   tokens in T contiguous ranges, one task each with its own scratch slice
 *           (common/parallel.h); a token's result depends on nothing but its row, so it is
 *           the same for any T and any runner.
 * SCRATCH   a 16-bit bias in fp32 [E] (converted once per call); per task: x [E] (the widened
 *           row), s [E], r [E] (biased), group scores [2 G], chosen groups [topk_groups];
 *           nothing else is written but the outputs.
 */
#include <math.h>
#include <stdint.h>

#include "common/error.h"
#include "common/numeric.h"
#include "common/parallel.h"
#include "common/sizes.h"
#include "common/ukernels.h"

/* Fewest tokens a task takes: a token costs about a microsecond (E = 256), waking a worker
 * several, so small batches stay on the calling thread. Tasks per worker: ranges of equal
 * token counts, a few per worker so that a slow worker is helped (parallel.c steals). */
#define CM_GATING_MIN_TOKENS 16
#define CM_GATING_TASKS_PER_WORKER 4

/* ---- the order of candidates ----------------------------------------------------------- */

/* A rank as compared: NaN ranks as -inf. */
static inline float rank_of(float v) {
  return v != v ? -INFINITY : v;
}

/* (rank a, index ia) goes before (rb, ib): a higher rank, or the same rank and a lower index.
 * Ranks are never NaN here (rank_of), so this is a total order. */
static inline int goes_before(float a, int32_t ia, float b, int32_t ib) {
  return a > b || (a == b && ia < ib);
}

/* The k best of the candidates offered. Up to CM_GATING_SORTED_MAX of them are kept sorted,
 * best first (a new one is inserted: a few moves for the models' topk of 6 to 9); more are
 * kept in a heap whose root is the worst (O(log k) per insertion, whatever the order the
 * candidates come in), sorted at the end. Either way the worst kept is at `worst`, and a
 * candidate that does not beat it costs one comparison, inline in the callers' loops. */
#define CM_GATING_SORTED_MAX 32
typedef struct best_k {
  float *rank;
  int32_t *id;
  int64_t k, n, worst;
} best_k;

static best_k best_k_in(float *rank, int32_t *id, int64_t k) {
  return (best_k){
      .rank = rank, .id = id, .k = k, .n = 0, .worst = k > CM_GATING_SORTED_MAX ? 0 : k - 1};
}

static void sift_down(best_k *h, int64_t i, int64_t n) {
  for (;;) {
    int64_t worst = i;
    const int64_t l = 2 * i + 1, r = l + 1;
    if (l < n && goes_before(h->rank[worst], h->id[worst], h->rank[l], h->id[l])) worst = l;
    if (r < n && goes_before(h->rank[worst], h->id[worst], h->rank[r], h->id[r])) worst = r;
    if (worst == i) return;
    const float tr = h->rank[i];
    const int32_t ti = h->id[i];
    h->rank[i] = h->rank[worst], h->id[i] = h->id[worst];
    h->rank[worst] = tr, h->id[worst] = ti;
    i = worst;
  }
}

static void insert(best_k *h, float rank, int32_t id) {
  if (h->k <= CM_GATING_SORTED_MAX) { /* sorted: move the worse ones down one place */
    int64_t i = h->n < h->k ? h->n++ : h->k - 1;
    for (; i > 0 && goes_before(rank, id, h->rank[i - 1], h->id[i - 1]); i--)
      h->rank[i] = h->rank[i - 1], h->id[i] = h->id[i - 1];
    h->rank[i] = rank, h->id[i] = id;
  } else if (h->n < h->k) { /* heap, not full: sift the new entry up */
    int64_t i = h->n++;
    for (; i > 0; i = (i - 1) / 2) {
      const int64_t up = (i - 1) / 2;
      if (!goes_before(h->rank[up], h->id[up], rank, id)) break;
      h->rank[i] = h->rank[up], h->id[i] = h->id[up];
    }
    h->rank[i] = rank, h->id[i] = id;
  } else { /* heap, full, and the candidate beats the root (offer checked): replace it */
    h->rank[0] = rank, h->id[0] = id;
    sift_down(h, 0, h->n);
  }
}

static inline void offer(best_k *h, float rank, int32_t id) {
  if (h->n < h->k || goes_before(rank, id, h->rank[h->worst], h->id[h->worst])) insert(h, rank, id);
}

/* The kept entries best first (a heap is sorted: the worst goes to the end each round). */
static void sort_best_first(best_k *h) {
  if (h->k <= CM_GATING_SORTED_MAX) return;
  for (int64_t n = h->n; n > 1; n--) {
    const float tr = h->rank[0];
    const int32_t ti = h->id[0];
    h->rank[0] = h->rank[n - 1], h->id[0] = h->id[n - 1];
    h->rank[n - 1] = tr, h->id[n - 1] = ti;
    sift_down(h, 0, n - 1);
  }
}

/* ---- one token ------------------------------------------------------------------------- */

typedef struct gating_run {
  const cpumoe_gating_problem *p;
  const cm_elementwise_kernels *ew;
  const float *bias; /* the bias in fp32 [E], or NULL */
  char *scratch;
  size_t scratch_stride; /* bytes per task */
  int64_t tasks;
  int64_t routed; /* R: slots chosen by rank (topk without the fused shared slot) */
  int64_t group_size;
  float factor; /* f: the routed scaling factor when it scales the output, else 1 */
} gating_run;

/* The token's logits in fp32: the row itself, or widened into x. */
static const float *logits_row(const gating_run *g, int64_t m, float *x) {
  const cpumoe_gating_problem *p = g->p;
  const int64_t E = p->E;
  switch (p->logits_dtype) {
    case CPUMOE_DTYPE_BF16:
      g->ew->widen_bf16((size_t)E, (const uint16_t *)p->logits + m * E, x);
      return x;
    case CPUMOE_DTYPE_F16:
      g->ew->widen_f16((size_t)E, (const uint16_t *)p->logits + m * E, x);
      return x;
    default: return (const float *)p->logits + m * E;
  }
}

/* s[e] = the score of every expert. */
static void scores(const gating_run *g, const float *x, float *s) {
  const size_t E = (size_t)g->p->E;
  switch (g->p->score) {
    case CPUMOE_SCORE_SOFTMAX: {
      /* the max in 4 lanes (which the compiler keeps in one register); a NaN makes it NaN,
       * and the row's weights NaN. Which of two equal values (+0, -0) wins changes no exp. */
      float lane[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
      int nan = 0;
      size_t e = 0;
      for (; e + 4 <= E; e += 4)
        for (size_t l = 0; l < 4; l++) {
          lane[l] = x[e + l] > lane[l] ? x[e + l] : lane[l];
          nan |= x[e + l] != x[e + l];
        }
      for (; e < E; e++) {
        lane[0] = x[e] > lane[0] ? x[e] : lane[0];
        nan |= x[e] != x[e];
      }
      float mx = cm_maxf(cm_maxf(lane[0], lane[1]), cm_maxf(lane[2], lane[3]));
      mx = nan ? NAN : mx;
      g->ew->exp_shifted(E, x, mx, s);
      float sum = 0.0f;
      for (size_t e = 0; e < E; e++) sum += s[e];
      const float inv = 1.0f / sum;
      for (size_t e = 0; e < E; e++) s[e] *= inv;
      break;
    }
    case CPUMOE_SCORE_SIGMOID: g->ew->sigmoid(E, x, s); break;
    default: g->ew->sqrtsoftplus(E, x, s); break;
  }
}

/* A group's score: its best rank, or the sum of its two best (its one, for a group of one). */
static float group_score(const gating_run *g, const float *rank, int64_t group) {
  const float *r = rank + group * g->group_size;
  float best = -INFINITY, second = -INFINITY;
  for (int64_t e = 0; e < g->group_size; e++) {
    const float v = rank_of(r[e]);
    if (v > best)
      second = best, best = v;
    else if (v > second)
      second = v;
  }
  if (g->p->group_score == CPUMOE_GROUP_MAX || g->group_size == 1) return best;
  return rank_of(best + second); /* +inf + -inf is NaN: ranks as -inf */
}

/* Hash routing: the R ids of the token's table row, weights their scores; renormalized only
 * when their sum S is > 0 (the scores are never 0, so a NaN sum is what fails: the row keeps
 * its scores); the fused shared slot weighs the sum of the routed weights as they end, over
 * the routed scaling factor. */
static void weigh_table_row(const gating_run *g, int64_t m, const float *s, float *w, int32_t *id) {
  const cpumoe_gating_problem *p = g->p;
  const int64_t R = g->routed;
  const int32_t *row = p->tid2eid + m * R;
  float sum = 0.0f;
  for (int64_t j = 0; j < R; j++) {
    id[j] = row[j];
    w[j] = s[row[j]];
    sum += w[j];
  }
  const float c = p->renormalize && sum > 0.0f ? g->factor / sum : g->factor;
  float routed_sum = 0.0f;
  for (int64_t j = 0; j < R; j++) {
    w[j] *= c;
    routed_sum += w[j];
  }
  if (p->num_shared > 0) {
    id[p->topk - 1] = (int32_t)(p->E + m % p->num_shared);
    w[p->topk - 1] = routed_sum / p->routed_scaling_factor;
  }
}

static void route_token(const gating_run *g, int64_t m, float *x, float *s, float *rk,
                        float *gscore, int32_t *gsel) {
  const cpumoe_gating_problem *p = g->p;
  const int64_t E = p->E, topk = p->topk, R = g->routed;
  float *w = p->topk_weights + m * topk;
  int32_t *id = p->topk_ids + m * topk;
  if (m >= p->M_valid) { /* padding: no slot */
    for (int64_t j = 0; j < topk; j++) w[j] = 0.0f, id[j] = -1;
    return;
  }
  const float *xr = logits_row(g, m, x);
  scores(g, xr, s);
  if (p->tid2eid) {
    weigh_table_row(g, m, s, w, id);
    return;
  }
  const float *rank = xr;
  if (g->bias) {
    for (int64_t e = 0; e < E; e++) rk[e] = s[e] + g->bias[e];
    rank = rk;
  }

  /* the candidates: every expert, or those of the topk_groups best groups */
  best_k best = best_k_in(w, id, R); /* kept in the output row for now */
  if (p->topk_groups < p->groups) {
    for (int64_t grp = 0; grp < p->groups; grp++) gscore[grp] = group_score(g, rank, grp);
    best_k groups = best_k_in(gscore + p->groups, gsel, p->topk_groups);
    for (int64_t grp = 0; grp < p->groups; grp++) offer(&groups, gscore[grp], (int32_t)grp);
    for (int64_t i = 0; i < groups.n; i++)
      for (int64_t e = gsel[i] * g->group_size; e < (gsel[i] + 1) * g->group_size; e++)
        offer(&best, rank_of(rank[e]), (int32_t)e);
  } else {
    for (int64_t e = 0; e < E; e++) offer(&best, rank_of(rank[e]), (int32_t)e);
  }
  sort_best_first(&best);

  /* weights: the scores of the chosen, the fused shared slot, the scaling */
  float sum = 0.0f;
  for (int64_t j = 0; j < R; j++) {
    w[j] = s[id[j]];
    sum += w[j];
  }
  if (p->num_shared > 0) {
    id[topk - 1] = (int32_t)(E + m % p->num_shared);
    w[topk - 1] = sum / p->routed_scaling_factor;
  }
  const float c = p->renormalize ? g->factor / sum : g->factor;
  for (int64_t j = 0; j < topk; j++) w[j] *= c;
}

/* ---- tasks, scratch, checks ------------------------------------------------------------ */

static void gating_task(void *ctx, int64_t t) {
  const gating_run *g = (const gating_run *)ctx;
  const cpumoe_gating_problem *p = g->p;
  const int64_t E = p->E;
  char *base = g->scratch + (size_t)t * g->scratch_stride;
  float *x = (float *)base, *s = x + E, *rk = s + E, *gscore = rk + E;
  int32_t *gsel = (int32_t *)(gscore + 2 * p->groups);
  /* range t of T near-equal ranges: the first M % T hold one token more (no M * t product) */
  const int64_t q = p->M / g->tasks, r = p->M % g->tasks;
  const int64_t begin = q * t + (t < r ? t : r), end = begin + q + (t < r);
  for (int64_t m = begin; m < end; m++) route_token(g, m, x, s, rk, gscore, gsel);
}

/* Scratch bytes of one task, a multiple of 64: x, s, r [E], group scores and the ranks of
 * the chosen groups [2 G], chosen groups [topk_groups]; -1 if that overflows. */
static int64_t scratch_stride(const cpumoe_gating_problem *p) {
  const int64_t words = cm_size_product(3, p->E, 1) + 2 * p->groups + p->topk_groups;
  const int64_t bytes = cm_size_product(words, 4, 1);
  return bytes < 0 || bytes > PTRDIFF_MAX - 64 ? -1 : (bytes + 63) / 64 * 64;
}

static int64_t task_count(const cpumoe_gating_problem *p, const cpumoe_runner *runner) {
  const int64_t by_tokens = cm_ceil_div(p->M, CM_GATING_MIN_TOKENS);
  const int64_t by_workers = CM_GATING_TASKS_PER_WORKER * cm_worker_count(runner, CM_MAX_WORKERS);
  return by_tokens < by_workers ? by_tokens : by_workers;
}

static int is_float_dtype(cpumoe_dtype d) {
  return d == CPUMOE_DTYPE_F32 || d == CPUMOE_DTYPE_BF16 || d == CPUMOE_DTYPE_F16;
}

/* Every id of the hash table lies in [0, E): the weights read score[id]. */
static cpumoe_status check_table(const cpumoe_gating_problem *p, int64_t routed) {
  for (int64_t m = 0; m < p->M; m++)
    for (int64_t j = 0; j < routed; j++) {
      const int32_t e = p->tid2eid[m * routed + j];
      if (e < 0 || e >= p->E)
        return cm_fail(CPUMOE_EINVAL, "tid2eid[%lld, %lld] = %d lies outside [0, E = %lld)",
                       (long long)m, (long long)j, (int)e, (long long)p->E);
    }
  return CPUMOE_OK;
}

static cpumoe_status validate(const cpumoe_gating_problem *p) {
  if (!p) return cm_fail(CPUMOE_EINVAL, "problem is NULL");
  if (p->M < 0) return cm_fail(CPUMOE_EINVAL, "M must be >= 0, got %lld", (long long)p->M);
  if (p->M_valid < 0 || p->M_valid > p->M)
    return cm_fail(CPUMOE_EINVAL, "M_valid must lie in [0, M = %lld], got %lld", (long long)p->M,
                   (long long)p->M_valid);
  if (p->E < 1 || p->E > INT32_MAX)
    return cm_fail(CPUMOE_EINVAL, "E must lie in [1, 2^31 - 1], got %lld", (long long)p->E);
  if (p->score != CPUMOE_SCORE_SOFTMAX && p->score != CPUMOE_SCORE_SIGMOID &&
      p->score != CPUMOE_SCORE_SQRTSOFTPLUS)
    return cm_fail(CPUMOE_EINVAL, "unknown score function %d", (int)p->score);
  if (!is_float_dtype(p->logits_dtype))
    return cm_fail(CPUMOE_EINVAL, "logits must be float32, bfloat16 or float16");
  if (p->bias && !is_float_dtype(p->bias_dtype))
    return cm_fail(CPUMOE_EINVAL, "bias must be float32, bfloat16 or float16");
  if (p->groups < 1 || p->E % p->groups != 0)
    return cm_fail(CPUMOE_EINVAL, "groups = %lld must be at least 1 and divide E = %lld",
                   (long long)p->groups, (long long)p->E);
  if (p->topk_groups < 1 || p->topk_groups > p->groups)
    return cm_fail(CPUMOE_EINVAL, "topk_groups must lie in [1, groups = %lld], got %lld",
                   (long long)p->groups, (long long)p->topk_groups);
  if (p->group_score != CPUMOE_GROUP_MAX && p->group_score != CPUMOE_GROUP_TOP2_SUM)
    return cm_fail(CPUMOE_EINVAL, "unknown group score %d", (int)p->group_score);
  if (p->has_routed_scaling_factor &&
      (!isfinite(p->routed_scaling_factor) || p->routed_scaling_factor == 0.0f))
    return cm_fail(CPUMOE_EINVAL, "routed_scaling_factor must be finite and non-zero, got %g",
                   (double)p->routed_scaling_factor);
  if (p->scale_output && !p->has_routed_scaling_factor)
    return cm_fail(CPUMOE_EINVAL, "scale_output needs routed_scaling_factor");
  if (p->num_shared < 0 || p->num_shared > INT32_MAX - p->E + 1)
    return cm_fail(CPUMOE_EINVAL, "num_shared must lie in [0, 2^31 - E], got %lld",
                   (long long)p->num_shared);
  if (p->num_shared > 0 && !p->has_routed_scaling_factor)
    return cm_fail(CPUMOE_EINVAL,
                   "fused shared experts need routed_scaling_factor (the shared "
                   "slot's weight is the routed weights' sum divided by it)");
  const int64_t routed = p->topk - (p->num_shared > 0);
  const int64_t candidates = p->topk_groups * (p->E / p->groups);
  if (p->tid2eid && (p->bias || p->groups > 1))
    return cm_fail(CPUMOE_EINVAL, "hash routing (tid2eid) takes no bias and no groups");
  if (p->tid2eid && (p->topk < 1 || routed < 1))
    return cm_fail(CPUMOE_EINVAL, "topk = %lld must leave at least 1 routed slot%s",
                   (long long)p->topk,
                   p->num_shared > 0 ? " (the fused shared slot takes one)" : "");
  if (!p->tid2eid && (p->topk < 1 || routed < 1 || routed > candidates))
    return cm_fail(CPUMOE_EINVAL,
                   "topk = %lld must leave between 1 and %lld routed slots (the experts of the "
                   "%lld chosen groups%s)",
                   (long long)p->topk, (long long)candidates, (long long)p->topk_groups,
                   p->num_shared > 0 ? "; the fused shared slot takes one" : "");
  if (cm_size_product(p->M, p->E, 4) < 0 || cm_size_product(p->M, p->topk, 4) < 0 ||
      scratch_stride(p) < 0)
    return cm_fail(CPUMOE_EINVAL,
                   "sizes M=%lld E=%lld topk=%lld give more bytes than a tensor "
                   "can hold",
                   (long long)p->M, (long long)p->E, (long long)p->topk);
  if (p->M > 0 && (!p->logits || !p->topk_weights || !p->topk_ids))
    return cm_fail(CPUMOE_EINVAL, "logits, topk_weights and topk_ids must not be NULL");
  if (p->tid2eid) return check_table(p, routed);
  return CPUMOE_OK;
}

/* Bytes before the tasks' scratch: a 16-bit bias in fp32, converted once per call. */
static int64_t bias_bytes(const cpumoe_gating_problem *p) {
  return p->bias && p->bias_dtype != CPUMOE_DTYPE_F32 ? (p->E * 4 + 63) / 64 * 64 : 0;
}

size_t cpumoe_gating_workspace_size(const cpumoe_gating_problem *p, const cpumoe_runner *runner) {
  if (validate(p) != CPUMOE_OK) return 0;
  int64_t bytes = cm_size_product(task_count(p, runner), scratch_stride(p), 1);
  bytes = bytes < 0 || bytes > PTRDIFF_MAX / 2 ? -1 : bytes + bias_bytes(p);
  if (bytes < 0 || bytes > PTRDIFF_MAX - 64) {
    cm_fail(CPUMOE_EINVAL, "the routing scratch for E=%lld exceeds the address space",
            (long long)p->E);
    return 0;
  }
  return (size_t)bytes + 64; /* + alignment slack */
}

cpumoe_status cpumoe_gating(const cpumoe_gating_problem *p, void *workspace, size_t workspace_bytes,
                            const cpumoe_runner *runner) {
  const size_t need = cpumoe_gating_workspace_size(p, runner);
  if (need == 0) return CPUMOE_EINVAL; /* the message is set */
  if (p->M == 0) return CPUMOE_OK;
  if (!workspace || workspace_bytes < need)
    return cm_fail(CPUMOE_EWORKSPACE, "workspace of %zu bytes given, %zu needed", workspace_bytes,
                   need);
  char *ws = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
  const cm_elementwise_kernels *ew = &cm_active_config()->elementwise;
  const float *bias = p->bias_dtype == CPUMOE_DTYPE_F32 ? (const float *)p->bias : (float *)ws;
  if (p->bias && p->bias_dtype == CPUMOE_DTYPE_BF16)
    ew->widen_bf16((size_t)p->E, (const uint16_t *)p->bias, (float *)ws);
  else if (p->bias && p->bias_dtype == CPUMOE_DTYPE_F16)
    ew->widen_f16((size_t)p->E, (const uint16_t *)p->bias, (float *)ws);
  gating_run g = {
      .p = p,
      .ew = ew,
      .bias = p->bias ? bias : NULL,
      .scratch = ws + bias_bytes(p),
      .scratch_stride = (size_t)scratch_stride(p),
      .tasks = task_count(p, runner),
      .routed = p->topk - (p->num_shared > 0),
      .group_size = p->E / p->groups,
      .factor = p->scale_output ? p->routed_scaling_factor : 1.0f,
  };
  cm_parallel_tasks(runner, g.tasks, gating_task, &g);
  return CPUMOE_OK;
}

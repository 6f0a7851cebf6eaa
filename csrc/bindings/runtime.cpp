// The runner, workspace and output allocation the ops run the C core with, and the
// Python-level helpers of cpumoe._C (declared in runtime.h).
#include "runtime.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <thread>

#include "checks.h"

namespace cpumoe::bindings {
namespace {

// The runner's hook. at::parallel_for is an OpenMP region compiled into this file: without
// -fopenmp (setup.py) every worker would run on the calling thread.
void run_on_aten_threads(void * /*runner_ctx*/, int64_t n_workers, cpumoe_worker_fn worker,
                         void *arg) {
  at::parallel_for(0, n_workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) worker(arg, w);
  });
}

// One workspace per calling thread, grown on demand and kept: fresh pages are faulted in
// and zero-filled by the OS on first touch, which on every call would cost milliseconds for a
// 512-token Qwen3 layer. release_workspace() returns it to torch's allocator.
thread_local at::Tensor cached_workspace;

void *workspace_for(size_t bytes) {
  if (!cached_workspace.defined() || cached_workspace.nbytes() < bytes)
    cached_workspace =
        new_huge_page_tensor({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  return cached_workspace.data_ptr();
}

// The tier a Python caller names; `op` and `expected` shape the message for an unknown one.
cpumoe_isa isa_named(const std::string &name, const char *op, const char *expected) {
  const cpumoe_isa isa = cpumoe_isa_from_name(name.c_str());
  TORCH_CHECK(isa != CPUMOE_ISA_COUNT, op, ": unknown tier '", name, "'", expected);
  return isa;
}

}  // namespace

cpumoe_runner aten_runner() {
  return cpumoe_runner{run_on_aten_threads, nullptr, static_cast<int64_t>(at::get_num_threads())};
}

// Made by ATen's CPU factory directly. at::empty_like goes through the dispatcher, whose code
// is cold on every decode call (the weights stream through the caches between calls), and
// took about twice as long (docs/PERFORMANCE-HISTORY.md).
at::Tensor new_output_like(const at::Tensor &like) {
  return at::detail::empty_cpu(like.sizes(), like.scalar_type(), /*pin_memory=*/false,
                               at::MemoryFormat::Contiguous);
}

// Packed weights are streamed whole from memory on every call, so they are asked for
// transparent huge pages: fewer TLB misses and page walks in the stream. Measured on an AMX
// Xeon VM (docs/PERFORMANCE-HISTORY.md), a few percent at decode and prefill alike. So are
// the side tensors streamed with them (INT4's zero points and scales, MXFP4's packed
// scales). The workspace too: a tile load of an A panel reads 16 rows, each on its own 4 KiB
// page when the rows are 4 KiB or more apart.
// MADV_HUGEPAGE covers the 2 MiB-aligned interior of the allocation, before the first write
// faults its pages in; it is only advice (a kernel with THP "never", or a fragmented
// memory, gives 4 KiB pages and the same results).
constexpr uintptr_t kHugePageBytes = uintptr_t{2} << 20;

at::Tensor new_huge_page_tensor(at::IntArrayRef sizes, const at::TensorOptions &options) {
  at::Tensor t = at::empty(sizes, options.memory_format(at::MemoryFormat::Contiguous));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t last = (begin + t.nbytes()) & ~(kHugePageBytes - 1);
  if (last > first) madvise(reinterpret_cast<void *>(first), last - first, MADV_HUGEPAGE);
  return t;
}

void run_problem(const cpumoe_moe_problem &problem, const char *op) {
  if (problem.M == 0) return;
  const size_t bytes = cpumoe_fused_experts_workspace_size(&problem);
  TORCH_CHECK(bytes > 0, op, ": ", cpumoe_last_error());
  void *workspace = workspace_for(bytes);
  const cpumoe_runner runner = aten_runner();
  check_status(cpumoe_fused_experts(&problem, workspace, bytes, &runner), op);
}

void run_gating_problem(const cpumoe_gating_problem &problem, const char *op) {
  if (problem.M == 0) return;
  const cpumoe_runner runner = aten_runner();
  const size_t bytes = cpumoe_gating_workspace_size(&problem, &runner);
  TORCH_CHECK(bytes > 0, op, ": ", cpumoe_last_error());
  check_status(cpumoe_gating(&problem, workspace_for(bytes), bytes, &runner), op);
}

void run_linear_problem(const cpumoe_linear_problem &problem, const char *op) {
  if (problem.M == 0) return;
  const size_t bytes = cpumoe_linear_workspace_size(&problem);
  TORCH_CHECK(bytes > 0, op, ": ", cpumoe_last_error());
  const cpumoe_runner runner = aten_runner();
  check_status(cpumoe_linear(&problem, workspace_for(bytes), bytes, &runner), op);
}

std::string active_isa() {
  return cpumoe_isa_name(cpumoe_active_isa());
}

std::string best_isa() {
  return cpumoe_isa_name(cpumoe_best_supported_isa());
}

void set_isa(const std::string &name) {
  const cpumoe_isa isa = isa_named(name, "cpumoe.set_isa", " (expected scalar, avx2 or avx512)");
  check_status(cpumoe_set_isa_cap(isa), "cpumoe.set_isa");
}

std::string isa_reason() {
  return cpumoe_isa_reason();
}

std::string cpu_features() {
  return cpumoe_cpu_features();
}

// Tiers in rank order, worst first (the rows of cpumoe/tiers.h; ids need not follow it).
std::vector<std::string> built_isas() {
  std::vector<std::string> names;
#define CPUMOE_TIER_NAME(ENUM, ...) names.emplace_back(cpumoe_isa_name(CPUMOE_ISA_##ENUM));
  CPUMOE_FOR_EACH_TIER(CPUMOE_TIER_NAME)
#undef CPUMOE_TIER_NAME
  return names;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const std::string &name : built_isas())
    if (cpumoe_isa_native(cpumoe_isa_from_name(name.c_str()))) names.push_back(name);
  return names;
}

std::string numerics_class(const std::string &tier) {
  return cpumoe_isa_numerics(isa_named(tier, "cpumoe.numerics_class", ""));
}

void release_workspace() {
  cached_workspace = at::Tensor();
}

size_t workspace_bytes() {
  return cached_workspace.defined() ? cached_workspace.nbytes() : 0;
}

uintptr_t workspace_address() {
  return cached_workspace.defined() ? reinterpret_cast<uintptr_t>(cached_workspace.data_ptr()) : 0;
}

at::Tensor new_weight_buffer(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "new_weight_buffer: nbytes must be >= 0, got ", nbytes);
  return new_huge_page_tensor({nbytes}, at::TensorOptions().dtype(at::kByte));
}

double probe_read(const at::Tensor &buffer, int64_t passes) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(),
              "probe_read: contiguous CPU buffer");
  const cpumoe_runner runner = aten_runner();
  return cpumoe_probe_read(buffer.data_ptr(), buffer.nbytes(), passes, &runner);
}

// The active tier's activation kernel on fp32 gate/up values (cpumoe_activation_values):
// "silu", "gelu", "swiglu" (with alpha and limit) or "silu_clamp" (with limit).
at::Tensor activation_values(const std::string &name, const at::Tensor &gate, const at::Tensor &up,
                             double alpha, double limit) {
  const char *op = "activation_values";
  TORCH_CHECK(name == "silu" || name == "gelu" || name == "swiglu" || name == "silu_clamp", op,
              ": unknown activation '", name,
              "' (expected 'silu', 'gelu', 'swiglu' or 'silu_clamp')");
  TORCH_CHECK(gate.device().is_cpu() && gate.scalar_type() == at::kFloat && gate.dim() == 1 &&
                  gate.sizes() == up.sizes() && up.device().is_cpu() &&
                  up.scalar_type() == at::kFloat,
              op, ": gate and up must be 1-D float32 CPU tensors of one shape");
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor out = at::empty_like(g);
  const cpumoe_activation act = name == "silu"     ? CPUMOE_ACT_SILU_MUL
                                : name == "gelu"   ? CPUMOE_ACT_GELU_MUL
                                : name == "swiglu" ? CPUMOE_ACT_SWIGLU_CLAMP
                                                   : CPUMOE_ACT_SILU_CLAMP;
  check_status(cpumoe_activation_values(act, static_cast<float>(alpha), static_cast<float>(limit),
                                        static_cast<size_t>(g.numel()), g.data_ptr<float>(),
                                        u.data_ptr<float>(), out.data_ptr<float>()),
               op);
  return out;
}

double probe_int8(int64_t iterations) {
  const cpumoe_runner runner = aten_runner();
  return cpumoe_probe_int8(iterations, &runner);
}

double probe_int4(int64_t iterations) {
  const cpumoe_runner runner = aten_runner();
  return cpumoe_probe_int4(iterations, &runner);
}

double probe_bf16(int64_t iterations) {
  const cpumoe_runner runner = aten_runner();
  return cpumoe_probe_bf16(iterations, &runner);
}

double probe_fma(int64_t iterations) {
  const cpumoe_runner runner = aten_runner();
  return cpumoe_probe_fma(iterations, &runner);
}

// The number of distinct OS threads that torch's runner spreads `workers` workers over: a
// check that they really run in parallel (without OpenMP in this file's build it is 1).
int64_t runner_threads(int64_t workers) {
  TORCH_CHECK(workers >= 1, "runner_threads: at least one worker");
  std::vector<std::thread::id> ids(static_cast<size_t>(workers));
  run_on_aten_threads(
      nullptr, workers,
      [](void *arg, int64_t w) {
        (*static_cast<std::vector<std::thread::id> *>(arg))[static_cast<size_t>(w)] =
            std::this_thread::get_id();
      },
      &ids);
  std::sort(ids.begin(), ids.end());
  return std::unique(ids.begin(), ids.end()) - ids.begin();
}

}  // namespace cpumoe::bindings

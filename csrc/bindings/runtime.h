// What the ops borrow from torch to run the C core: threads (at::parallel_for, so torch's
// thread count governs the kernels), the per-thread workspace, the output allocation; and
// the Python-level helpers of cpumoe._C (ISA tier queries, workspace control, the probes the
// benchmarks use to measure this machine's limits).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpumoe/cpumoe.h"

namespace cpumoe::bindings {

// A runner that spreads the C core's workers over torch's intra-op threads.
cpumoe_runner aten_runner();

// A new contiguous CPU tensor of `like`'s shape and dtype: the op's output.
at::Tensor new_output_like(const at::Tensor &like);

// A new contiguous tensor on transparent huge pages where the OS gives them: for packed
// weights (streamed whole on every call) and the op workspace (its A panels and
// intermediate rows are written and read back on every call). Contents uninitialized.
at::Tensor new_huge_page_tensor(at::IntArrayRef sizes, const at::TensorOptions &options);

// Runs a checked fused-MoE problem on torch's threads with the calling thread's workspace.
void run_problem(const cpumoe_moe_problem &problem, const char *op);

// Runs a checked routing problem the same way.
void run_gating_problem(const cpumoe_gating_problem &problem, const char *op);

// Runs a checked dense linear problem the same way.
void run_linear_problem(const cpumoe_linear_problem &problem, const char *op);

// ---- cpumoe._C (bound in registration.cpp) ----
std::string active_isa();
std::string best_isa();
void set_isa(const std::string &name);
std::string isa_reason();
std::string cpu_features();
std::vector<std::string> built_isas();
std::vector<std::string> supported_isas();
std::string numerics_class(const std::string &tier);
void release_workspace();
size_t workspace_bytes();
uintptr_t workspace_address();
at::Tensor new_weight_buffer(int64_t nbytes);
double probe_read(const at::Tensor &buffer, int64_t passes);
double probe_int8(int64_t iterations);
double probe_int4(int64_t iterations);
double probe_fma(int64_t iterations);
double probe_bf16(int64_t iterations);
int64_t runner_threads(int64_t workers);
// Gives `ns`'s op overload `overload` ("name" or "name.overload", defined already) a CPU
// kernel that calls torch.ops.cpumoe's `target_overload` with the arguments as they are;
// both argument lists must have the same types, position by position (forwarding.cpp).
void forward_to_cpumoe(const std::string &ns, const std::string &overload,
                       const std::string &target_overload);
at::Tensor activation_values(const std::string &name, const at::Tensor &gate, const at::Tensor &up,
                             double alpha, double limit);

}  // namespace cpumoe::bindings

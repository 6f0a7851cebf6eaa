// CPU kernels for ops of another library's namespace (cpumoe.sglang, cpumoe.vllm) that pass
// their arguments, as the dispatcher boxed them, to the torch.ops.cpumoe overload with the
// same argument list. A Python kernel there would convert every argument to a Python object
// and back and enter the dispatcher a second time from Python: from cold caches, as a decode
// step calls it once per layer, that cost 15-30 us a call (docs/SGLANG.md, "Cost").
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime.h"

namespace cpumoe::bindings {
namespace {

// The boxed kernel: the stack holds the source op's arguments, which are the target's, and
// the target leaves its results there in their place.
class ForwardToCpumoe final : public c10::OperatorKernel {
 public:
  explicit ForwardToCpumoe(c10::OperatorHandle target) : target_(std::move(target)) {}
  void operator()(const c10::OperatorHandle &, c10::DispatchKeySet, torch::jit::Stack *stack) {
    target_.callBoxed(stack);
  }

 private:
  c10::OperatorHandle target_;
};

// "name.overload" -> {"namespace::name", "overload"}; "name" is the default overload ("")
std::pair<std::string, std::string> split_overload(const std::string &ns,
                                                   const std::string &overload) {
  const size_t dot = overload.find('.');
  if (dot == std::string::npos) return {ns + "::" + overload, ""};
  return {ns + "::" + overload.substr(0, dot), overload.substr(dot + 1)};
}

c10::OperatorHandle find_op(const std::string &ns, const std::string &overload) {
  const auto [name, overload_name] = split_overload(ns, overload);
  const auto op = c10::Dispatcher::singleton().findSchema({name, overload_name});
  TORCH_CHECK(op.has_value(), "forward_to_cpumoe: ", ns, "::", overload, " is not defined");
  return *op;
}

// Argument and result types position by position (names and defaults may differ: the
// source schema's defaults are filled in before the stack reaches the kernel).
void check_lines_up(const c10::FunctionSchema &source, const c10::FunctionSchema &target) {
  auto same = [](const std::vector<c10::Argument> &a, const std::vector<c10::Argument> &b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); i++)
      if (*a[i].type() != *b[i].type()) return false;
    return true;
  };
  TORCH_CHECK(
      same(source.arguments(), target.arguments()) && same(source.returns(), target.returns()),
      "forward_to_cpumoe: the arguments of ", source, " do not line up with ", target);
}

}  // namespace

void forward_to_cpumoe(const std::string &ns, const std::string &overload,
                       const std::string &target_overload) {
  // Registrations live as long as the process, as the Python fragments that defined the
  // schemas do: a torch::Library removes its kernels when it is destroyed, so these never
  // are, not even at exit, where the order of Python's and this library's teardown is not
  // ours to choose.
  static std::mutex mutex;
  static auto *libraries = new std::vector<std::unique_ptr<torch::Library>>();
  const c10::OperatorHandle source = find_op(ns, overload);
  const c10::OperatorHandle target = find_op("cpumoe", target_overload);
  check_lines_up(source.schema(), target.schema());
  std::lock_guard<std::mutex> lock(mutex);
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU,
                                                  __FILE__, __LINE__);
  library->impl(overload.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                      std::make_unique<ForwardToCpumoe>(target)));
  libraries->push_back(std::move(library));
}

}  // namespace cpumoe::bindings

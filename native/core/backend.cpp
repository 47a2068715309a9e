// Backend registry and the CPU fallback used by device plans.
#include "pyfast/backend.h"

#include <mutex>
#include <stdexcept>
#include <thread>

#include "pyfast/cpu.h"

namespace pyfast {

#ifdef PYFAST_HAVE_VULKAN
void register_vulkan_backend();  // vulkan/vk_backend.cpp
#endif
#ifdef PYFAST_HAVE_CUDA
void register_cuda_backend();  // cuda/cuda_backend.cpp
#endif

namespace {

std::vector<BackendFactory>& factories() {
  static std::vector<BackendFactory> f;
  return f;
}

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
#ifdef PYFAST_HAVE_VULKAN
    register_vulkan_backend();
#else
    register_backend({"vulkan", [] { return std::vector<DeviceInfo>{}; },
                      [](int) -> std::shared_ptr<Backend> {
                        throw std::runtime_error("this pyfast was built without the Vulkan backend");
                      },
                      "not compiled in (build with the Vulkan headers, loader and glslc present)"});
#endif
#ifdef PYFAST_HAVE_CUDA
    register_cuda_backend();
#else
    register_backend({"cuda", [] { return std::vector<DeviceInfo>{}; },
                      [](int) -> std::shared_ptr<Backend> {
                        throw std::runtime_error("this pyfast was built without the CUDA backend");
                      },
                      "not compiled in (build with nvcc present, PYFAST_CUDA=AUTO or ON)"});
#endif
  });
}

}  // namespace

void register_backend(BackendFactory f) { factories().push_back(std::move(f)); }

const std::vector<BackendFactory>& backend_factories() {
  ensure_registered();
  return factories();
}

std::vector<DeviceInfo> list_devices() {
  DeviceInfo cpu;
  cpu.name = "cpu";
  cpu.kind = "cpu";
  cpu.description = std::string("CPU (") + cpu_isa_name(cpu_best_isa()) + ", " +
                    std::to_string(std::thread::hardware_concurrency()) + " threads)";
  std::vector<DeviceInfo> out{cpu};
  for (const auto& f : backend_factories()) {
    std::vector<DeviceInfo> d;
    try {
      d = f.list();
    } catch (const std::exception&) {
      continue;  // a broken driver lists nothing; open_device says why
    }
    out.insert(out.end(), d.begin(), d.end());
  }
  return out;
}

std::shared_ptr<Backend> open_device(const std::string& name) {
  if (name.empty() || name == "cpu" || name == "cpu:0") return nullptr;
  const size_t colon = name.find(':');
  const std::string kind = name.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string num = name.substr(colon + 1);
    if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos || num.size() > 6)
      throw std::invalid_argument("device '" + name + "': expected KIND:INDEX, e.g. vulkan:0");
    index = std::stoi(num);
  }
  std::string kinds = "cpu";
  for (const auto& f : backend_factories()) {
    kinds += ", " + f.kind;
    if (f.kind != kind) continue;
    static std::mutex mu;
    static std::vector<std::pair<std::string, std::weak_ptr<Backend>>> opened;
    std::lock_guard<std::mutex> lk(mu);
    const std::string key = kind + ":" + std::to_string(index);
    for (auto& o : opened)
      if (o.first == key)
        if (auto b = o.second.lock()) return b;
    std::vector<DeviceInfo> devs;
    try {
      devs = f.list();
    } catch (const std::exception& e) {
      throw std::runtime_error("device '" + name + "': " + e.what());
    }
    if (index >= (int)devs.size()) {
      std::string why = devs.empty() ? (f.unavailable.empty() ? "no " + kind + " device was found" : f.unavailable)
                                     : std::to_string(devs.size()) + " " + kind + " device(s) found";
      throw std::invalid_argument("device '" + name + "' does not exist: " + why);
    }
    std::shared_ptr<Backend> b = f.open(index);
    opened.emplace_back(key, b);
    return b;
  }
  throw std::invalid_argument("unknown device kind '" + kind + "' in '" + name + "' (known: " + kinds + ")");
}

bool op_writes_src(Op op, int s) {
  switch (op) {
    case Op::set_rows: return s == 0;
    case Op::ssm_conv: return s == 2;
    case Op::gated_delta_net: return s == 5;
    default: return false;
  }
}

void cpu_run_node(ThreadPool* pool, Node& node, const Node* const* src, uint8_t* work, size_t work_size) {
  const int nth = pool ? pool->size() : 1;
  const CpuIsa isa = cpu_isa();
  auto body = [&](int ith) {
    ComputeParams p;
    p.ith = ith;
    p.nth = nth;
    p.pool = pool;
    p.isa = isa;
    p.wdata = work;
    p.wsize = work_size;
    switch (node.op) {
#define X(name, n_src, is_view) case Op::name: if (!is_view) cpu_##name(p, node, src); break;
#include "pyfast/ops.def"
#undef X
      default: break;
    }
  };
  if (pool && nth > 1) pool->run(body);
  else body(0);
}

}  // namespace pyfast

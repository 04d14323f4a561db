// Python module xlatrain.custom_calls._cuda: the NCCL handlers as capsules, plus what Python needs to
// set up communicators (a fresh NCCL unique id; registering one per mesh-axis group and device).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "xla/ffi/api/c_api.h"

namespace xlatrain {
extern "C" {
XLA_FFI_Error* kCudaAllReduce(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCudaReduceScatter(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCudaAllGather(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCudaAllToAll(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCudaPpermute(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCudaBroadcast(XLA_FFI_CallFrame*);
}
void RegisterCommunicator(int64_t key, int32_t device, const std::string& id, int rank, int size);
std::string NewUniqueId();
}  // namespace xlatrain

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.def("handlers", []() {
    nb::dict handlers;
    handlers["all_reduce"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCudaAllReduce));
    handlers["reduce_scatter"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCudaReduceScatter));
    handlers["all_gather"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCudaAllGather));
    handlers["all_to_all"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCudaAllToAll));
    handlers["ppermute"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCudaPpermute));
    handlers["broadcast"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCudaBroadcast));
    return handlers;
  });
  m.def("new_unique_id", []() {
    std::string id = xlatrain::NewUniqueId();
    return nb::bytes(id.data(), id.size());
  });
  m.def("register_communicator", [](int64_t key, int32_t device, nb::bytes id, int rank, int size) {
    xlatrain::RegisterCommunicator(key, device, std::string(id.c_str(), id.size()), rank, size);
  }, nb::arg("key"), nb::arg("device"), nb::arg("unique_id"), nb::arg("rank"), nb::arg("size"));
}

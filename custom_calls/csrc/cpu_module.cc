// Python module xlatrain.custom_calls._cpu: the CPU handlers as capsules for jax.ffi.register_ffi_target.

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include "cpu_mpi.h"
#include "xla/ffi/api/c_api.h"

namespace xlatrain {
int64_t LastLevelCacheBytes();
extern "C" {
XLA_FFI_Error* kCpuAllReduce(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuReduceScatter(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuAllGather(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuAllToAll(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuPpermute(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuBroadcast(XLA_FFI_CallFrame*);
}
}  // namespace xlatrain

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.def("handlers", []() {
    nb::dict handlers;
    handlers["all_reduce"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCpuAllReduce));
    handlers["reduce_scatter"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCpuReduceScatter));
    handlers["all_gather"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCpuAllGather));
    handlers["all_to_all"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCpuAllToAll));
    handlers["ppermute"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCpuPpermute));
    handlers["broadcast"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCpuBroadcast));
    return handlers;
  }, "FFI handlers of the CPU collectives, by op name.");
  m.def("last_level_cache_bytes", &xlatrain::LastLevelCacheBytes,
        "the largest cache of cpu0 as Linux describes it, 0 when unknown: reductions that read and write more than "
        "this write their outputs with non-temporal stores.");
  m.def("mpi_world", &xlatrain::MpiWorld,
        "(size, rank) in MPI_COMM_WORLD, initialising MPI on first use; (-1, -1) when built without MPI.");
  m.def("mpi_finalize", &xlatrain::MpiFinalize, nanobind::call_guard<nanobind::gil_scoped_release>(),
        "finalise MPI once the collectives in flight finished (a no-op when MPI was never initialised).");
}

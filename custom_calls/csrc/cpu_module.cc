// Python module xlatrain.custom_calls._cpu: the CPU handlers as capsules for jax.ffi.register_ffi_target.

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cpu_mpi.h"
#include "xla/ffi/api/c_api.h"

namespace xlatrain {
int64_t LastLevelCacheBytes();
std::string LoadBlas(int64_t index, const std::string& path, const std::string& prefix,
                     const std::string& set_threads);
extern "C" {
XLA_FFI_Error* kCpuAllReduce(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuReduceScatter(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuAllGather(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuAllToAll(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuPpermute(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuBroadcast(XLA_FFI_CallFrame*);
XLA_FFI_Error* kCpuGemm(XLA_FFI_CallFrame*);
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
    handlers["gemm"] = nb::capsule(reinterpret_cast<void*>(xlatrain::kCpuGemm));
    return handlers;
  }, "FFI handlers of the CPU collectives and the dense layers' BLAS matmul, by op name.");
  m.def("load_blas", &xlatrain::LoadBlas,
        "load_blas(index, path, prefix, set_threads): the BLAS the gemm handler's `library` attribute `index` calls, "
        "its cblas_sgemm named prefix + 'cblas_sgemm', set_threads(1) called once (when named); '' or why not.");
  m.def("last_level_cache_bytes", &xlatrain::LastLevelCacheBytes,
        "the largest cache of cpu0 as Linux describes it, 0 when unknown: reductions that read and write more than "
        "this write their outputs with non-temporal stores.");
  m.def("mpi_world", &xlatrain::MpiWorld,
        "(size, rank) in MPI_COMM_WORLD, initialising MPI on first use; (-1, -1) when built without MPI.");
  m.def("mpi_finalize", &xlatrain::MpiFinalize, nanobind::call_guard<nanobind::gil_scoped_release>(),
        "finalise MPI once the collectives in flight finished (a no-op when MPI was never initialised).");
}

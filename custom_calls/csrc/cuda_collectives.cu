// Collectives on GPU through NCCL, enqueued on XLA's own CUDA stream: no host synchronisation, so XLA's
// scheduler can overlap them with compute. One communicator per (mesh axis group, device), created on
// first use from a unique id that Python shared beforehand (custom_calls/nccl.py, through the
// jax.distributed key-value store) and cached for the life of the process. 16-bit floats are widened
// to float32 in scratch memory, reduced there, and narrowed back.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "collectives.h"

namespace xlatrain {
namespace {

struct Communicator {
  ncclUniqueId id;
  int rank = 0;
  int size = 0;
  ncclComm_t comm = nullptr;
};

std::mutex registry_mu;
std::map<std::pair<int64_t, int32_t>, Communicator>& Registry() {
  static auto* registry = new std::map<std::pair<int64_t, int32_t>, Communicator>();
  return *registry;
}

ffi::Error NcclError(const char* op, ncclResult_t result) {
  return ffi::Error::Internal(std::string("xlatrain ") + op + ": NCCL error: " + ncclGetErrorString(result));
}

ffi::Unexpected<ffi::Error> Fail(ffi::Error error) { return ffi::Unexpected<ffi::Error>(std::move(error)); }

ffi::Error CudaError(const char* op, cudaError_t result) {
  return ffi::Error::Internal(std::string("xlatrain ") + op + ": CUDA error: " + cudaGetErrorString(result));
}

ffi::ErrorOr<Communicator> Lookup(const char* op, int64_t key, int32_t device) {
  std::unique_lock<std::mutex> lock(registry_mu);
  auto found = Registry().find({key, device});
  if (found == Registry().end()) {
    return Fail(ffi::Error::InvalidArgument(std::string("xlatrain ") + op + ": no NCCL communicator registered for device " +
                                       std::to_string(device) +
                                       "; xlatrain.custom_calls.nccl.setup_communicators(mesh) must run first"));
  }
  if (found->second.comm == nullptr) {
    Communicator entry = found->second;
    lock.unlock();  // every rank of the group joins this call concurrently
    ncclComm_t comm;
    if (ncclResult_t r = ncclCommInitRank(&comm, entry.size, entry.id, entry.rank); r != ncclSuccess) {
      return Fail(NcclError(op, r));
    }
    lock.lock();
    Registry()[{key, device}].comm = comm;
    return Registry()[{key, device}];
  }
  return found->second;
}

ffi::ErrorOr<ncclDataType_t> NcclType(ffi::DataType t) {
  switch (t) {
    case ffi::F32: return ncclFloat32;
    case ffi::F64: return ncclFloat64;
    case ffi::S32: return ncclInt32;
    case ffi::F16: return ncclFloat16;
    case ffi::BF16: return ncclBfloat16;
    default: return Fail(ffi::Error::InvalidArgument("unsupported element type"));
  }
}

ncclRedOp_t NcclOp(Reduction r) {
  switch (r) {
    case Reduction::kMean: return ncclAvg;
    case Reduction::kMax: return ncclMax;
    case Reduction::kMin: return ncclMin;
    default: return ncclSum;
  }
}

template <typename Half>
__global__ void WidenKernel(const Half* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += int64_t(blockDim.x) * gridDim.x)
    out[i] = static_cast<float>(in[i]);
}

template <typename Half>
__global__ void NarrowKernel(const float* in, Half* out, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += int64_t(blockDim.x) * gridDim.x)
    out[i] = static_cast<Half>(in[i]);
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)); }

void Widen(ffi::DataType t, const void* in, float* out, int64_t n, cudaStream_t s) {
  if (t == ffi::F16) WidenKernel<<<Blocks(n), 256, 0, s>>>(static_cast<const __half*>(in), out, n);
  else WidenKernel<<<Blocks(n), 256, 0, s>>>(static_cast<const __nv_bfloat16*>(in), out, n);
}

void Narrow(ffi::DataType t, const float* in, void* out, int64_t n, cudaStream_t s) {
  if (t == ffi::F16) NarrowKernel<<<Blocks(n), 256, 0, s>>>(in, static_cast<__half*>(out), n);
  else NarrowKernel<<<Blocks(n), 256, 0, s>>>(in, static_cast<__nv_bfloat16*>(out), n);
}

bool IsHalf(ffi::DataType t) { return t == ffi::F16 || t == ffi::BF16; }

struct Context {
  const char* op;
  cudaStream_t stream;
  Communicator comm;
  ncclDataType_t type;
};

ffi::ErrorOr<Context> Prepare(const char* op, cudaStream_t stream, int32_t device, int64_t comm_key,
                              ffi::DataType element_type) {
  if (!IsSupportedType(element_type)) return Fail(UnsupportedType(op, element_type));
  auto comm = Lookup(op, comm_key, device);
  if (comm.has_error()) return Fail(comm.error());
  return Context{op, stream, comm.value(), NcclType(element_type).value()};
}

// A reduction over `in_count` elements per rank producing `out_count`, in float32 for 16-bit types.
template <typename Enqueue>
ffi::Error Reduce(const Context& c, ffi::ScratchAllocator& scratch, ffi::DataType type, const void* in, void* out,
                  int64_t in_count, int64_t out_count, Enqueue enqueue) {
  if (!IsHalf(type)) {
    if (ncclResult_t r = enqueue(in, out, c.type); r != ncclSuccess) return NcclError(c.op, r);
    return ffi::Error::Success();
  }
  auto wide_in = scratch.Allocate(sizeof(float) * in_count);
  auto wide_out = scratch.Allocate(sizeof(float) * out_count);
  if (!wide_in.has_value() || !wide_out.has_value()) {
    return ffi::Error::Internal(std::string("xlatrain ") + c.op + ": no scratch memory for float32 reduction");
  }
  float* a = static_cast<float*>(*wide_in);
  float* b = static_cast<float*>(*wide_out);
  Widen(type, in, a, in_count, c.stream);
  if (ncclResult_t r = enqueue(a, b, ncclFloat32); r != ncclSuccess) return NcclError(c.op, r);
  Narrow(type, b, out, out_count, c.stream);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return CudaError(c.op, e);
  return ffi::Error::Success();
}

ffi::Error AllReduce(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                     ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out, int32_t reduction, int64_t participants,
                     int64_t site, int64_t timeout_ms, int64_t comm_key) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  if (static_cast<Reduction>(reduction) == Reduction::kMean && x.element_type() == ffi::S32) {
    return ffi::Error::InvalidArgument("xlatrain all_reduce: mean of integers is not defined; use sum");
  }
  auto c = Prepare("all_reduce", stream, device, comm_key, x.element_type());
  if (c.has_error()) return c.error();
  const Context& ctx = c.value();
  return Reduce(ctx, scratch, x.element_type(), x.untyped_data(), out->untyped_data(), n, n,
                [&](const void* in, void* o, ncclDataType_t t) {
                  return ncclAllReduce(in, o, n, t, NcclOp(static_cast<Reduction>(reduction)), ctx.comm.comm, stream);
                });
}

ffi::Error ReduceScatter(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                         ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out, int32_t reduction, int64_t participants,
                         int64_t site, int64_t timeout_ms, int64_t comm_key) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  auto c = Prepare("reduce_scatter", stream, device, comm_key, x.element_type());
  if (c.has_error()) return c.error();
  const Context& ctx = c.value();
  const int64_t chunk = n / participants;
  return Reduce(ctx, scratch, x.element_type(), x.untyped_data(), out->untyped_data(), n, chunk,
                [&](const void* in, void* o, ncclDataType_t t) {
                  return ncclReduceScatter(in, o, chunk, t, NcclOp(static_cast<Reduction>(reduction)), ctx.comm.comm,
                                           stream);
                });
}

ffi::Error AllGather(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer,
                     ffi::Result<ffi::AnyBuffer> out, int64_t participants, int64_t site, int64_t timeout_ms,
                     int64_t comm_key) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  auto c = Prepare("all_gather", stream, device, comm_key, x.element_type());
  if (c.has_error()) return c.error();
  const Context& ctx = c.value();
  if (ncclResult_t r = ncclAllGather(x.untyped_data(), out->untyped_data(), n, ctx.type, ctx.comm.comm, stream);
      r != ncclSuccess) {
    return NcclError(ctx.op, r);
  }
  return ffi::Error::Success();
}

// Rank g's block j (of `participants` equal blocks) becomes rank j's block g: a send and a receive per peer in one
// NCCL group.
ffi::Error AllToAll(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer,
                    ffi::Result<ffi::AnyBuffer> out, int64_t participants, int64_t site, int64_t timeout_ms,
                    int64_t comm_key) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  if (n % participants != 0) {
    return ffi::Error::InvalidArgument("xlatrain all_to_all: " + std::to_string(n) + " elements do not split into " +
                                       std::to_string(participants) + " blocks");
  }
  auto c = Prepare("all_to_all", stream, device, comm_key, x.element_type());
  if (c.has_error()) return c.error();
  const Context& ctx = c.value();
  const int64_t count = n / participants, block = static_cast<int64_t>(x.size_bytes()) / participants;
  const char* in = static_cast<const char*>(x.untyped_data());
  char* o = static_cast<char*>(out->untyped_data());
  ncclGroupStart();
  for (int64_t peer = 0; peer < participants; ++peer) {
    ncclSend(in + peer * block, count, ctx.type, static_cast<int>(peer), ctx.comm.comm, stream);
    ncclRecv(o + peer * block, count, ctx.type, static_cast<int>(peer), ctx.comm.comm, stream);
  }
  if (ncclResult_t r = ncclGroupEnd(); r != ncclSuccess) return NcclError(ctx.op, r);
  return ffi::Error::Success();
}

ffi::Error Ppermute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> sources,
                    ffi::Span<const int64_t> targets, int64_t participants, int64_t site, int64_t timeout_ms,
                    int64_t comm_key) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  auto c = Prepare("ppermute", stream, device, comm_key, x.element_type());
  if (c.has_error()) return c.error();
  const Context& ctx = c.value();
  const int rank = ctx.comm.rank;
  if (std::find(targets.begin(), targets.end(), rank) == targets.end()) {
    if (cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0, x.size_bytes(), stream); e != cudaSuccess) {
      return CudaError(ctx.op, e);
    }
  }
  ncclGroupStart();
  for (size_t i = 0; i < sources.size(); ++i) {
    if (sources[i] == rank) ncclSend(x.untyped_data(), n, ctx.type, static_cast<int>(targets[i]), ctx.comm.comm, stream);
    if (targets[i] == rank) ncclRecv(out->untyped_data(), n, ctx.type, static_cast<int>(sources[i]), ctx.comm.comm, stream);
  }
  if (ncclResult_t r = ncclGroupEnd(); r != ncclSuccess) return NcclError(ctx.op, r);
  return ffi::Error::Success();
}

ffi::Error Broadcast(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer,
                     ffi::Result<ffi::AnyBuffer> out, int64_t root, int64_t participants, int64_t site,
                     int64_t timeout_ms, int64_t comm_key) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  auto c = Prepare("broadcast", stream, device, comm_key, x.element_type());
  if (c.has_error()) return c.error();
  const Context& ctx = c.value();
  if (ncclResult_t r = ncclBroadcast(x.untyped_data(), out->untyped_data(), n, ctx.type, static_cast<int>(root),
                                     ctx.comm.comm, stream);
      r != ncclSuccess) {
    return NcclError(ctx.op, r);
  }
  return ffi::Error::Success();
}

}  // namespace

void RegisterCommunicator(int64_t key, int32_t device, const std::string& id, int rank, int size) {
  Communicator entry;
  std::memcpy(&entry.id, id.data(), std::min(id.size(), sizeof(ncclUniqueId)));
  entry.rank = rank;
  entry.size = size;
  std::lock_guard<std::mutex> lock(registry_mu);
  Registry().emplace(std::make_pair(key, device), entry);  // an existing communicator is kept
}

std::string NewUniqueId() {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

// Every CUDA handler: (input, int32[rank, group] (unused: NCCL knows its rank)) -> output, with its
// own attributes, then these.
#define XLATRAIN_CUDA_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()
#define XLATRAIN_CUDA_BUFFERS Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
#define XLATRAIN_CUDA_ATTRS \
  Attr<int64_t>("participants").Attr<int64_t>("site").Attr<int64_t>("timeout_ms").Attr<int64_t>("comm")

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllReduce, AllReduce,
                              XLATRAIN_CUDA_BINDING.Ctx<ffi::ScratchAllocator>()
                                  .XLATRAIN_CUDA_BUFFERS.Attr<int32_t>("reduction")
                                  .XLATRAIN_CUDA_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaReduceScatter, ReduceScatter,
                              XLATRAIN_CUDA_BINDING.Ctx<ffi::ScratchAllocator>()
                                  .XLATRAIN_CUDA_BUFFERS.Attr<int32_t>("reduction")
                                  .XLATRAIN_CUDA_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllGather, AllGather,
                              XLATRAIN_CUDA_BINDING.XLATRAIN_CUDA_BUFFERS.XLATRAIN_CUDA_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllToAll, AllToAll,
                              XLATRAIN_CUDA_BINDING.XLATRAIN_CUDA_BUFFERS.XLATRAIN_CUDA_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaPpermute, Ppermute,
                              XLATRAIN_CUDA_BINDING.XLATRAIN_CUDA_BUFFERS
                                  .Attr<ffi::Span<const int64_t>>("sources")
                                  .Attr<ffi::Span<const int64_t>>("targets")
                                  .XLATRAIN_CUDA_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaBroadcast, Broadcast,
                              XLATRAIN_CUDA_BINDING.XLATRAIN_CUDA_BUFFERS.Attr<int64_t>("root")
                                  .XLATRAIN_CUDA_ATTRS);

}  // namespace xlatrain

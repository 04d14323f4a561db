// The dense layers' float32 matmul through a BLAS loaded at run time (OpenBLAS or MKL, from their wheels).
//
// The BLAS runs single-threaded and the product is split into blocks of output rows (or columns) run on XLA's own
// intra-op thread pool, so that the BLAS's threads and XLA's do not fight over the cores. The calling thread
// takes blocks too: it never waits on a block that no thread has begun.

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace xlatrain {
namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS's enums
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                       int);

struct Blas {
  Sgemm sgemm = nullptr;
};
Blas libraries[2];  // by the `library` attribute: 0 OpenBLAS, 1 MKL
std::mutex load_mutex;

// Below this many multiply-adds a product runs on the calling thread alone (splitting costs more than it saves).
constexpr int64_t kSplitAbove = int64_t{1} << 18;

struct Gemm {
  Sgemm sgemm;
  bool trans_a, trans_b;
  int64_t m, n, k;
  const float* a;
  const float* b;
  float* c;

  int64_t lda() const { return trans_a ? m : k; }
  int64_t ldb() const { return trans_b ? k : n; }

  // Output rows [r0, r1) x columns [c0, c1) of C = op(A) op(B), all row-major.
  void Run(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    if (r1 <= r0 || c1 <= c0) return;
    const float* a_block = a + (trans_a ? r0 : r0 * lda());
    const float* b_block = b + (trans_b ? c0 * ldb() : c0);
    sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(r1 - r0),
          static_cast<int>(c1 - c0), static_cast<int>(k), 1.0f, a_block, static_cast<int>(lda()), b_block,
          static_cast<int>(ldb()), 0.0f, c + r0 * n + c0, static_cast<int>(n));
  }
};

// Blocks of the longer side of C, taken in turn by the pool's threads and the caller.
struct Split {
  Gemm gemm;
  int64_t blocks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;

  void RunBlock(int64_t i) {
    bool by_rows = gemm.m >= gemm.n;
    int64_t extent = by_rows ? gemm.m : gemm.n;
    int64_t lo = extent * i / blocks, hi = extent * (i + 1) / blocks;
    if (by_rows) gemm.Run(lo, hi, 0, gemm.n);
    else gemm.Run(0, gemm.m, lo, hi);
  }

  void TakeBlocks() {
    for (int64_t i = next.fetch_add(1); i < blocks; i = next.fetch_add(1)) {
      RunBlock(i);
      if (done.fetch_add(1) + 1 == blocks) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                  ffi::ResultBuffer<ffi::F32> c, int64_t trans_a, int64_t trans_b, int64_t library) {
  if (library < 0 || library > 1 || libraries[library].sgemm == nullptr)
    return ffi::Error::InvalidArgument("xlatrain_cpu_gemm: the BLAS was not loaded (xlatrain.custom_calls.blas)");
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != 2 || db.size() != 2) return ffi::Error::InvalidArgument("xlatrain_cpu_gemm: 2-D operands only");
  Gemm gemm{libraries[library].sgemm, trans_a != 0, trans_b != 0, trans_a ? da[1] : da[0], trans_b ? db[0] : db[1],
            trans_a ? da[0] : da[1], a.typed_data(), b.typed_data(), c->typed_data()};
  if ((trans_b ? db[1] : db[0]) != gemm.k) return ffi::Error::InvalidArgument("xlatrain_cpu_gemm: shapes differ");
  if (gemm.m == 0 || gemm.n == 0) return ffi::Error::Success();
  if (gemm.k == 0) {
    std::fill(gemm.c, gemm.c + gemm.m * gemm.n, 0.0f);
    return ffi::Error::Success();
  }
  int64_t threads = pool.num_threads();
  int64_t blocks = std::min<int64_t>(threads, std::max(gemm.m, gemm.n));
  if (blocks <= 1 || gemm.m * gemm.n * gemm.k < kSplitAbove) {
    gemm.Run(0, gemm.m, 0, gemm.n);
    return ffi::Error::Success();
  }
  auto split = std::make_shared<Split>();
  split->gemm = gemm;
  split->blocks = blocks;
  for (int64_t i = 1; i < blocks; ++i) pool.Schedule([split] { split->TakeBlocks(); });
  split->TakeBlocks();
  std::unique_lock<std::mutex> lock(split->mutex);
  split->finished.wait(lock, [&] { return split->done.load() == split->blocks; });
  return ffi::Error::Success();
}

}  // namespace

// Loads `path` and its cblas_sgemm (`prefix` + "cblas_sgemm") as library `index`, single-threaded (the named
// function sets the BLAS's threads, called with 1). Returns "" or why it failed.
std::string LoadBlas(int64_t index, const std::string& path, const std::string& prefix,
                     const std::string& set_threads) {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (index < 0 || index > 1) return "no such BLAS slot";
  if (libraries[index].sgemm != nullptr) return "";
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return dlerror();
  auto sgemm = reinterpret_cast<Sgemm>(dlsym(handle, (prefix + "cblas_sgemm").c_str()));
  if (sgemm == nullptr) return "no " + prefix + "cblas_sgemm in it";
  if (!set_threads.empty()) {
    auto set = reinterpret_cast<void (*)(int)>(dlsym(handle, set_threads.c_str()));
    if (set == nullptr) return "no " + set_threads + " in it";
    set(1);
  }
  libraries[index].sgemm = sgemm;
  return "";
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuGemm, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("trans_a")
                                  .Attr<int64_t>("trans_b")
                                  .Attr<int64_t>("library"));

}  // namespace xlatrain

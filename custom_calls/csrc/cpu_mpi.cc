// The MPI thread of the CPU collectives (see cpu_mpi.h). MPI is initialised on this thread, which alone calls
// MPI (MPI_THREAD_FUNNELED). Built only when CMake finds MPI; otherwise every entry point says so.

#include "cpu_mpi.h"

#include <algorithm>
#include <deque>
#include <thread>

#ifdef XLATRAIN_MPI
#include <mpi.h>
#endif

namespace xlatrain {

#ifdef XLATRAIN_MPI
namespace {

class MpiThread {
 public:
  static MpiThread& Get() {
    static auto* instance = new MpiThread();  // never destroyed: finalised explicitly
    return *instance;
  }

  void Submit(std::shared_ptr<InterProcessJob> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

  int64_t size() const { return size_; }

  void Finalize() {
    std::unique_lock<std::mutex> lock(mu_);
    finalizing_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return finalized_; });
  }

 private:
  MpiThread() {
    std::mutex started_mu;
    std::condition_variable started;
    bool up = false;
    std::thread([&] {
      int provided = 0, size = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      MPI_Comm_size(MPI_COMM_WORLD, &size);
      size_ = size;
      {
        std::lock_guard<std::mutex> lock(started_mu);
        up = true;
      }
      started.notify_all();
      Loop();
    }).detach();
    std::unique_lock<std::mutex> lock(started_mu);
    started.wait(lock, [&] { return up; });
  }

  void Loop() {
    for (;;) {
      std::shared_ptr<InterProcessJob> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !jobs_.empty() || finalizing_; });
        if (jobs_.empty()) {
          MPI_Finalize();
          finalized_ = true;
          cv_.notify_all();
          return;
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job->WaitReady();
      job->finish(Reduce(*job));
    }
  }

  static std::string Reduce(InterProcessJob& job) {
    MPI_Datatype type = job.type == ffi::F64 ? MPI_DOUBLE : job.type == ffi::S32 ? MPI_INT : MPI_FLOAT;
    MPI_Op op = job.reduction == Reduction::kMax ? MPI_MAX : job.reduction == Reduction::kMin ? MPI_MIN : MPI_SUM;
    // MPI counts are int: reduce in pieces so any buffer size works.
    constexpr int64_t kPiece = int64_t{1} << 30;
    const int64_t width = job.type == ffi::F64 ? 8 : 4;
    for (int64_t start = 0; start < job.count; start += kPiece) {
      const int n = static_cast<int>(std::min(kPiece, job.count - start));
      int code = MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(job.data) + start * width, n, type, op, MPI_COMM_WORLD);
      if (code != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING];
        int length = 0;
        MPI_Error_string(code, text, &length);
        return std::string("MPI_Allreduce failed: ") + std::string(text, length);
      }
    }
    return "";
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<InterProcessJob>> jobs_;
  int64_t size_ = 0;
  bool finalizing_ = false, finalized_ = false;
};

bool initialised = false;

}  // namespace

void SubmitInterProcess(std::shared_ptr<InterProcessJob> job) { MpiThread::Get().Submit(std::move(job)); }

int64_t MpiWorldSize() {
  initialised = true;
  return MpiThread::Get().size();
}

void MpiFinalize() {
  if (initialised) MpiThread::Get().Finalize();
}

#else  // built without MPI

void SubmitInterProcess(std::shared_ptr<InterProcessJob> job) {
  job->finish("xlatrain was built without MPI, so its CPU collectives cannot reach other processes");
}
int64_t MpiWorldSize() { return -1; }
void MpiFinalize() {}

#endif

}  // namespace xlatrain

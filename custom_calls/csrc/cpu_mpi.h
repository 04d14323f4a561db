// The inter-process level of the CPU collectives: one MPI thread that runs all-reduces across processes in
// the order they are submitted. Every process submits the same collectives in the same order (each local
// meeting completes in program order), so no tags or communicator per call site are needed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "collectives.h"

namespace xlatrain {

// One all-reduce of `count` values of `type` (F32, F64 or S32) at `data`, in place across processes. The
// MPI thread waits until the local level marks it ready, reduces, then calls `finish` with "" or an error.
struct InterProcessJob {
  void* data = nullptr;
  int64_t count = 0;
  ffi::DataType type = ffi::F32;
  Reduction reduction = Reduction::kSum;
  std::function<void(const std::string& error)> finish;

  void MarkReady() {
    {
      std::lock_guard<std::mutex> lock(mu);
      ready = true;
    }
    cv.notify_all();
  }
  void WaitReady() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return ready; });
  }

 private:
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
};

// Queues `job` behind every job submitted before it.
void SubmitInterProcess(std::shared_ptr<InterProcessJob> job);

// MPI_COMM_WORLD's size (initialising MPI on first use), or -1 when built without MPI.
int64_t MpiWorldSize();

// Finalizes MPI once every queued job ran; a no-op when MPI was never initialised.
void MpiFinalize();

}  // namespace xlatrain

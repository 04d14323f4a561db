// The inter-process level of the CPU collectives: MPI point-to-point transfers on lanes. A lane is one group of
// devices along one mesh axis; its jobs run on its own thread in the order they are submitted, and its messages
// carry the lane as their tag. Every process submits a lane's jobs in the same order (each local meeting of a
// group completes in program order), so no order between lanes is needed, and one lane waiting for its peers
// never holds up another (MPI_THREAD_MULTIPLE).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace xlatrain {

// `bytes` bytes at `data`, to or from process `peer`.
struct Transfer {
  int64_t peer;
  void* data;
  int64_t bytes;
};

// What a job sees of MPI: its process, the process count, and transfers tagged with its lane.
class Peers {
 public:
  Peers(int64_t rank, int64_t size, int64_t lane) : rank_(rank), size_(size), lane_(lane) {}
  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  // Posts every receive and send at once and waits for all of them; "" or the MPI error. Transfers between the
  // same two processes match in the order they are listed, so both sides must list them in the same order.
  std::string Exchange(const std::vector<Transfer>& sends, const std::vector<Transfer>& receives) const;

 private:
  int64_t rank_, size_, lane_;
};

// One job on a lane: `run` once the local level marks it ready, then `finish` with its "" or error.
struct InterProcessJob {
  int64_t lane = 0;
  std::function<std::string(const Peers&)> run;
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

// Queues `job` on its lane behind every job submitted to that lane before it.
void SubmitInterProcess(std::shared_ptr<InterProcessJob> job);

// MPI_COMM_WORLD's size and this process's rank in it (initialising MPI on first use): (-1, -1) when built
// without MPI, (-2, -2) when the MPI library cannot serve several threads (no MPI_THREAD_MULTIPLE).
std::pair<int64_t, int64_t> MpiWorld();

// Finalizes MPI once every queued job ran; a no-op when MPI was never initialised.
void MpiFinalize();

}  // namespace xlatrain

// The MPI lanes of the CPU collectives (see cpu_mpi.h). MPI is initialised and finalised on a thread of its own;
// each lane's thread makes its own MPI calls (MPI_THREAD_MULTIPLE). Built only when CMake finds MPI; otherwise
// every entry point says so.

#include "cpu_mpi.h"

#include <algorithm>
#include <deque>
#include <map>
#include <thread>

#ifdef XLATRAIN_MPI
#include <mpi.h>
#endif

namespace xlatrain {

#ifdef XLATRAIN_MPI
namespace {

constexpr int64_t kPiece = int64_t{1} << 30;  // MPI counts are int: larger transfers go in pieces

std::string MpiError(const std::string& what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return what + " failed: " + std::string(text, length);
}

class Lane {
 public:
  Lane(int64_t id, int64_t rank, int64_t size) : peers_(rank, size, id), thread_([this] { Loop(); }) {}

  void Submit(std::shared_ptr<InterProcessJob> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

  // Returns once every job submitted before ran.
  void Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      finishing_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void Loop() {
    for (;;) {
      std::shared_ptr<InterProcessJob> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !jobs_.empty() || finishing_; });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job->WaitReady();
      job->finish(job->run(peers_));
    }
  }

  Peers peers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<InterProcessJob>> jobs_;
  bool finishing_ = false;
  std::thread thread_;  // last: starts once the members it uses exist
};

class Mpi {
 public:
  static Mpi& Get() {
    static auto* instance = new Mpi();  // never destroyed: finalised explicitly
    return *instance;
  }

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }

  void Submit(std::shared_ptr<InterProcessJob> job) {
    if (size_ < 0) {
      job->finish("the MPI library does not support MPI_THREAD_MULTIPLE, which xlatrain's CPU collectives need");
      return;
    }
    if (job->lane > tag_bound_) {
      job->finish("lane " + std::to_string(job->lane) + " is beyond this MPI's largest message tag (" +
                  std::to_string(tag_bound_) + ")");
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto& lane = lanes_[job->lane];
    if (!lane) lane = std::make_unique<Lane>(job->lane, rank_, size_);
    lane->Submit(std::move(job));
  }

  void Finalize() {
    std::unique_lock<std::mutex> lock(mu_);
    for (auto& [id, lane] : lanes_) lane->Finish();
    lanes_.clear();
    finalizing_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return finalized_; });
  }

 private:
  Mpi() {
    std::unique_lock<std::mutex> lock(mu_);
    std::thread([this] {
      int provided = 0, size = 0, rank = 0, found = 0;
      int* bound = nullptr;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);  // errors become messages, not aborts
      MPI_Comm_size(MPI_COMM_WORLD, &size);
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &bound, &found);
      std::unique_lock<std::mutex> lock(mu_);
      const bool threads = provided >= MPI_THREAD_MULTIPLE;
      size_ = threads ? size : -2;
      rank_ = threads ? rank : -2;
      tag_bound_ = found ? *bound : 32767;
      started_ = true;
      cv_.notify_all();
      cv_.wait(lock, [this] { return finalizing_; });
      MPI_Finalize();
      finalized_ = true;
      cv_.notify_all();
    }).detach();
    cv_.wait(lock, [this] { return started_; });
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, std::unique_ptr<Lane>> lanes_;
  int64_t size_ = 0, rank_ = 0, tag_bound_ = 0;
  bool started_ = false, finalizing_ = false, finalized_ = false;
};

bool initialised = false;

}  // namespace

std::string Peers::Exchange(const std::vector<Transfer>& sends, const std::vector<Transfer>& receives) const {
  std::vector<MPI_Request> requests;
  auto post = [&](const Transfer& t, bool send) {
    for (int64_t start = 0; start < t.bytes; start += kPiece) {
      const int n = static_cast<int>(std::min(kPiece, t.bytes - start));
      char* at = static_cast<char*>(t.data) + start;
      requests.emplace_back();
      const int peer = static_cast<int>(t.peer), tag = static_cast<int>(lane_);
      const int code = send ? MPI_Isend(at, n, MPI_BYTE, peer, tag, MPI_COMM_WORLD, &requests.back())
                            : MPI_Irecv(at, n, MPI_BYTE, peer, tag, MPI_COMM_WORLD, &requests.back());
      if (code != MPI_SUCCESS) return MpiError(send ? "MPI_Isend" : "MPI_Irecv", code);
    }
    return std::string();
  };
  for (const auto& t : receives) {
    if (std::string error = post(t, false); !error.empty()) return error;
  }
  for (const auto& t : sends) {
    if (std::string error = post(t, true); !error.empty()) return error;
  }
  const int code = MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
  return code == MPI_SUCCESS ? "" : MpiError("MPI_Waitall", code);
}

void SubmitInterProcess(std::shared_ptr<InterProcessJob> job) { Mpi::Get().Submit(std::move(job)); }

std::pair<int64_t, int64_t> MpiWorld() {
  initialised = true;
  return {Mpi::Get().size(), Mpi::Get().rank()};
}

void MpiFinalize() {
  if (initialised) Mpi::Get().Finalize();
}

#else  // built without MPI

std::string Peers::Exchange(const std::vector<Transfer>&, const std::vector<Transfer>&) const {
  return "xlatrain was built without MPI";
}
void SubmitInterProcess(std::shared_ptr<InterProcessJob> job) {
  job->finish("xlatrain was built without MPI, so its CPU collectives cannot reach other processes");
}
std::pair<int64_t, int64_t> MpiWorld() { return {-1, -1}; }
void MpiFinalize() {}

#endif

}  // namespace xlatrain

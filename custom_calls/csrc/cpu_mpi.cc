// The MPI thread of the CPU collectives (see cpu_mpi.h): a progress engine. It alone calls MPI
// (MPI_THREAD_FUNNELED); it posts each job's transfers without blocking, polls every job in flight, and runs a
// job's next round as soon as its current one completed, so a job waiting for a slow process never holds up
// another. Built only when CMake finds MPI; otherwise every entry point says so.

#include "cpu_mpi.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#ifdef XLATRAIN_MPI
#include <mpi.h>
#endif

namespace xlatrain {

#ifdef XLATRAIN_MPI
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kPiece = int64_t{1} << 30;  // MPI counts are int: larger transfers go in pieces
constexpr uint64_t kCallSlots = 8;            // calls of one (site, group) told apart before the tag repeats
constexpr uint64_t kGroupSlots = 1024;        // groups of one site told apart before the tag repeats

std::string MpiError(const std::string& what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return what + " failed: " + std::string(text, length);
}

// A job in flight: the requests of its current round, and from which process each receive comes.
struct Active {
  std::shared_ptr<InterProcessJob> job;
  int tag = 0;
  size_t round = 0;
  std::vector<MPI_Request> requests;
  std::vector<int64_t> senders;  // per request: the process a receive waits for, -1 for a send
  Clock::time_point deadline;
};

class Engine {
 public:
  static Engine& Get() {
    static auto* instance = new Engine();  // never destroyed: finalised explicitly
    return *instance;
  }

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }

  void Submit(std::shared_ptr<InterProcessJob> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      incoming_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

  void Finalize() {
    std::unique_lock<std::mutex> lock(mu_);
    finalizing_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return finalized_; });
  }

 private:
  Engine() {
    std::unique_lock<std::mutex> lock(mu_);
    std::thread([this] { Run(); }).detach();
    cv_.wait(lock, [this] { return started_; });
  }

  void Run() {
    int provided = 0, size = 0, rank = 0, found = 0;
    int* bound = nullptr;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);  // errors become messages, not aborts
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &bound, &found);
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_ = size;
      rank_ = rank;
      tag_bound_ = found ? *bound : 32767;
      started_ = true;
    }
    cv_.notify_all();
    Loop();
    MPI_Finalize();
    {
      std::lock_guard<std::mutex> lock(mu_);
      finalized_ = true;
    }
    cv_.notify_all();
  }

  // Polls while jobs are in flight, backing off from 10 us to 1 ms while none moves; sleeps while none is.
  void Loop() {
    auto pause = std::chrono::microseconds(10);
    for (;;) {
      std::deque<std::shared_ptr<InterProcessJob>> arrived;
      {
        std::unique_lock<std::mutex> lock(mu_);
        auto wake = [this] { return !incoming_.empty() || finalizing_; };
        if (active_.empty()) {
          cv_.wait(lock, wake);
        } else {
          cv_.wait_for(lock, pause, wake);
        }
        if (finalizing_ && incoming_.empty() && active_.empty()) return;
        arrived.swap(incoming_);
      }
      bool moved = !arrived.empty();
      for (auto& job : arrived) Start(std::move(job));
      for (auto it = active_.begin(); it != active_.end();) {
        const size_t round = it->round;
        if (Advance(*it)) {
          it = active_.erase(it);
          moved = true;
        } else {
          moved |= it->round != round;
          ++it;
        }
      }
      pause = moved ? std::chrono::microseconds(10) : std::min(2 * pause, std::chrono::microseconds(1000));
    }
  }

  int TagOf(const InterProcessJob& job) {
    const uint64_t calls = counts_[{job.site, job.group}]++;
    const uint64_t tag = (static_cast<uint64_t>(job.site) * kGroupSlots + static_cast<uint64_t>(job.group)) *
                             kCallSlots + calls % kCallSlots;
    return static_cast<int>(tag % (static_cast<uint64_t>(tag_bound_) + 1));
  }

  void Start(std::shared_ptr<InterProcessJob> job) {
    Active a;
    a.tag = TagOf(*job);
    a.job = std::move(job);
    if (!tags_in_flight_.insert(a.tag).second) {
      // Would mix this job's messages with another's: fail it rather than deliver wrong data.
      a.job->finish("its MPI tag " + std::to_string(a.tag) + " is already used by another collective in flight "
                    "(more call sites or groups than this MPI's tags can tell apart); use collectives.impl=xla");
      return;
    }
    if (Post(a) && !Advance(a)) active_.push_back(std::move(a));
  }

  // Posts the current round's transfers; false (and the job finished) on an MPI error.
  bool Post(Active& a) {
    const Round& round = a.job->rounds[a.round];
    a.requests.clear();
    a.senders.clear();
    a.deadline = Clock::now() + std::chrono::milliseconds(a.job->timeout_ms);
    auto post = [&](const Transfer& t, bool send) {
      for (int64_t start = 0; start < t.bytes; start += kPiece) {
        const int n = static_cast<int>(std::min(kPiece, t.bytes - start));
        char* at = static_cast<char*>(t.data) + start;
        MPI_Request request;
        const int peer = static_cast<int>(t.peer);
        const int code = send ? MPI_Isend(at, n, MPI_BYTE, peer, a.tag, MPI_COMM_WORLD, &request)
                              : MPI_Irecv(at, n, MPI_BYTE, peer, a.tag, MPI_COMM_WORLD, &request);
        if (code != MPI_SUCCESS) return MpiError(send ? "MPI_Isend" : "MPI_Irecv", code);
        a.requests.push_back(request);
        a.senders.push_back(send ? -1 : t.peer);
      }
      return std::string();
    };
    std::string error;
    for (const auto& t : round.receives) {
      if (error.empty()) error = post(t, false);
    }
    for (const auto& t : round.sends) {
      if (error.empty()) error = post(t, true);
    }
    if (error.empty()) return true;
    Abandon(a, error);
    return false;
  }

  // Moves `a` on as far as its transfers allow; true once it finished (done, failed or timed out).
  bool Advance(Active& a) {
    for (;;) {
      int done = 0;
      const int code = MPI_Testall(static_cast<int>(a.requests.size()), a.requests.data(), &done, MPI_STATUSES_IGNORE);
      if (code != MPI_SUCCESS) {
        Abandon(a, MpiError("MPI_Testall", code));
        return true;
      }
      if (!done) {
        if (Clock::now() < a.deadline) return false;
        Abandon(a, "no message from process(es) " + Pending(a) + " within " + std::to_string(a.job->timeout_ms) +
                       " ms: every process must run the same collectives (is one missing, or stuck?); raise "
                       "collectives.timeout_s for slow steps");
        return true;
      }
      const Round& round = a.job->rounds[a.round];
      if (round.then) round.then();
      if (++a.round == a.job->rounds.size()) {
        Finish(a, "");
        return true;
      }
      if (!Post(a)) return true;
    }
  }

  std::string Pending(Active& a) {
    std::set<int64_t> missing;
    for (size_t i = 0; i < a.requests.size(); ++i) {
      int done = 1;
      if (a.senders[i] >= 0 && a.requests[i] != MPI_REQUEST_NULL) {
        MPI_Request_get_status(a.requests[i], &done, MPI_STATUS_IGNORE);
      }
      if (!done) missing.insert(a.senders[i]);
    }
    std::ostringstream s;
    s << "[";
    for (auto it = missing.begin(); it != missing.end(); ++it) s << (it == missing.begin() ? "" : ", ") << *it;
    s << "]";
    return s.str();
  }

  // Fails the job; its receives are cancelled so no late message lands in buffers XLA may reuse, and the job
  // is kept so the buffers it owns outlive any send MPI still holds.
  void Abandon(Active& a, const std::string& error) {
    for (size_t i = 0; i < a.requests.size(); ++i) {
      if (a.requests[i] == MPI_REQUEST_NULL) continue;
      if (a.senders[i] >= 0) MPI_Cancel(&a.requests[i]);
      MPI_Request_free(&a.requests[i]);
    }
    abandoned_.push_back(a.job);
    Finish(a, error);
  }

  void Finish(Active& a, const std::string& error) {
    tags_in_flight_.erase(a.tag);
    a.job->finish(error);
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<InterProcessJob>> incoming_;
  bool started_ = false, finalizing_ = false, finalized_ = false;
  int64_t size_ = 0, rank_ = 0, tag_bound_ = 0;
  // Only the MPI thread touches these.
  std::deque<Active> active_;
  std::map<std::pair<int64_t, int64_t>, uint64_t> counts_;
  std::set<int> tags_in_flight_;
  std::vector<std::shared_ptr<InterProcessJob>> abandoned_;
};

bool initialised = false;

}  // namespace

void SubmitInterProcess(std::shared_ptr<InterProcessJob> job) { Engine::Get().Submit(std::move(job)); }

std::pair<int64_t, int64_t> MpiWorld() {
  initialised = true;
  return {Engine::Get().size(), Engine::Get().rank()};
}

void MpiFinalize() {
  if (initialised) Engine::Get().Finalize();
}

#else  // built without MPI

void SubmitInterProcess(std::shared_ptr<InterProcessJob> job) {
  job->finish("xlatrain was built without MPI, so its CPU collectives cannot reach other processes");
}
std::pair<int64_t, int64_t> MpiWorld() { return {-1, -1}; }
void MpiFinalize() {}

#endif

}  // namespace xlatrain

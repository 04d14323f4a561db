// Collectives across the devices of one process on XLA:CPU, as asynchronous FFI calls.
//
// XLA:CPU runs the devices of an execution side by side and gives them one RunId. Each participant of
// a collective arrives at a meeting keyed by (run, call site, group, how many times this site ran in
// this run), leaves its input and output pointers and a promise, and returns a pending future at
// once, so no XLA thread ever blocks (XLA's executor may run many devices on a few threads). The last
// to arrive hands every participant's share of the work to xlatrain's worker threads: for a reduction,
// participant r reduces slice r of the buffer over all inputs and writes it into every output
// (reduce-scatter then all-gather, in place), so no thread reduces everything; where the inputs and outputs do not
// fit the last-level cache together, the outputs are written with non-temporal stores. When all shares are
// written, every promise completes. A watchdog fails the promises of a meeting that is still missing
// participants after the timeout, with an error naming the op and who came: never a silent hang.
//
// A collective over devices of several processes (started by mpirun) is two-level, like NCCL's intra/inter-node
// split: the devices of each process meet as above, their shares combine or place their inputs in the meeting's
// scratch buffer, then the MPI thread (cpu_mpi.h) exchanges blocks of it with the other processes in rounds of
// point-to-point transfers and writes the local outputs. A reduction reduces in memory first, so only one buffer
// per process crosses.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "collectives.h"
#include "cpu_mpi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace xlatrain {

// The size of the largest cache of the CPU this runs on (as Linux describes cpu0's caches), 0 when unknown.
int64_t LastLevelCacheBytes() {
  int64_t largest = 0;
  for (int index = 0;; ++index) {
    std::ifstream size_file("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    int64_t size = 0;
    std::string unit;
    if (!(size_file >> size)) return largest;
    size_file >> unit;  // "K" or "M" (or nothing: bytes)
    size *= unit == "M" ? (1 << 20) : unit == "K" ? (1 << 10) : 1;
    largest = std::max(largest, size);
  }
}

namespace {

using Clock = std::chrono::steady_clock;

struct Participant {
  const void* in = nullptr;
  void* out = nullptr;
};

// One participant's part of the work, given everyone's buffers (and the meeting's scratch buffer, used by
// two-level collectives).
using Share = std::function<void(const std::vector<Participant>&, void* scratch)>;

// The inter-process level of a two-level collective: once every local share is done, the rounds `plan` gives
// (from everyone's buffers and the scratch buffer) run on the MPI thread; the last one writes the local outputs.
struct Across {
  size_t scratch_bytes;
  std::function<std::vector<Round>(const std::vector<Participant>&, char* scratch)> plan;
};

struct Call {
  const char* op;
  int64_t run, site, group, rank, participants, sequence, timeout_ms;
};

std::string Describe(const Call& c) {
  std::ostringstream s;
  s << "xlatrain " << c.op << " (call site " << c.site << ", group " << c.group << ", call " << c.sequence
    << " of run " << c.run << ", rank " << c.rank << " of " << c.participants << ")";
  return s.str();
}

std::string Ranks(const std::vector<bool>& arrived, bool which) {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (size_t i = 0; i < arrived.size(); ++i) {
    if (arrived[i] != which) continue;
    s << (first ? "" : ", ") << i;
    first = false;
  }
  s << "]";
  return s.str();
}

struct Meeting {
  explicit Meeting(const Call& first)
      : call(first), parts(first.participants), shares(first.participants), promises(first.participants),
        arrived(first.participants, false),
        deadline(Clock::now() + std::chrono::milliseconds(first.timeout_ms)) {}
  Call call;  // the first arrival's, for messages
  std::vector<Participant> parts;
  std::vector<Share> shares;
  std::vector<ffi::Promise> promises;
  std::vector<bool> arrived;
  int64_t arrived_count = 0;
  int64_t bytes = -1;  // every participant must bring the same size
  Clock::time_point deadline;
  std::optional<Across> across;
  std::vector<char> scratch;
};

std::shared_ptr<InterProcessJob> InterProcessJobFor(std::shared_ptr<Meeting> meeting);

// Runs the shares of complete meetings; shares never block, so a few threads serve any number of devices.
class Workers {
 public:
  static Workers& Get() {
    static auto* instance = new Workers();  // never destroyed: threads may outlive static teardown
    return *instance;
  }

  void Run(std::shared_ptr<Meeting> meeting) {
    auto remaining = std::make_shared<std::atomic<int64_t>>(meeting->call.participants);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& share : meeting->shares) {
      tasks_.push_back([meeting, remaining, share] {
        share(meeting->parts, meeting->scratch.data());
        if (remaining->fetch_sub(1) == 1) {
          if (meeting->across) {
            SubmitInterProcess(InterProcessJobFor(meeting));  // the MPI thread takes it from here
          } else {
            for (auto& promise : meeting->promises) promise.SetAvailable();
          }
        }
      });
    }
    cv_.notify_all();
  }

 private:
  Workers() {
    unsigned threads = std::max(2u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < threads; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
};

// (run, site, group, sequence)
using MeetingKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;
// (site, group, rank) -> how many times it has run, per run
using SequenceKey = std::tuple<int64_t, int64_t, int64_t>;

class Rendezvous {
 public:
  static Rendezvous& Get() {
    static auto* instance = new Rendezvous();
    return *instance;
  }

  // Registers one participant; returns its future, already complete if it was the last to arrive
  // and its share is done, or failed if the call does not fit the meeting.
  ffi::Future Arrive(Call call, const void* in, void* out, int64_t bytes, Share share, std::optional<Across> across) {
    ffi::Promise promise;
    ffi::Future future(promise);
    std::shared_ptr<Meeting> complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      call.sequence = SequencesOf(call.run)[{call.site, call.group, call.rank}]++;
      auto& meeting = meetings_[{call.run, call.site, call.group, call.sequence}];
      if (!meeting) {
        meeting = std::make_shared<Meeting>(call);
        meeting->across = std::move(across);
        watchdog_cv_.notify_all();
      }
      if (meeting->arrived[call.rank]) {
        promise.SetError(ffi::Error::Internal(Describe(call) + ": this rank arrived twice"));
        return future;
      }
      if (meeting->bytes >= 0 && meeting->bytes != bytes) {
        promise.SetError(ffi::Error::InvalidArgument(
            Describe(call) + ": participants disagree on the buffer size (" + std::to_string(meeting->bytes) +
            " vs " + std::to_string(bytes) + " bytes)"));
        return future;
      }
      meeting->bytes = bytes;
      meeting->parts[call.rank] = {in, out};
      meeting->shares[call.rank] = std::move(share);
      meeting->promises[call.rank] = promise;
      meeting->arrived[call.rank] = true;
      if (++meeting->arrived_count == call.participants) {
        complete = meeting;
        meetings_.erase({call.run, call.site, call.group, call.sequence});
        if (complete->across) complete->scratch.resize(complete->across->scratch_bytes);
      }
    }
    if (complete) Workers::Get().Run(std::move(complete));
    return future;
  }

 private:
  // Call counts are kept for the most recent runs only; a run this far behind has long finished.
  static constexpr size_t kRunsKept = 4096;

  Rendezvous() { std::thread([this] { Watch(); }).detach(); }

  std::map<SequenceKey, int64_t>& SequencesOf(int64_t run) {
    auto found = sequences_.find(run);
    if (found != sequences_.end()) return found->second;
    runs_.push_back(run);
    if (runs_.size() > kRunsKept) {
      sequences_.erase(runs_.front());
      runs_.pop_front();
    }
    return sequences_[run];
  }

  // Fails the meetings whose deadline passed with participants still missing.
  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      auto next = Clock::time_point::max();
      for (auto it = meetings_.begin(); it != meetings_.end();) {
        Meeting& m = *it->second;
        if (m.deadline > Clock::now()) {
          next = std::min(next, m.deadline);
          ++it;
          continue;
        }
        Call call = m.call;
        call.sequence = std::get<3>(it->first);
        std::string message = Describe(call) + " timed out after " + std::to_string(call.timeout_ms) +
                              " ms waiting for the other participants: arrived ranks " + Ranks(m.arrived, true) +
                              ", missing ranks " + Ranks(m.arrived, false) +
                              ". Every participant must run the same collectives in the same order (is one "
                              "inside a branch that some ranks skip?); raise collectives.timeout_s for slow steps";
        for (size_t r = 0; r < m.arrived.size(); ++r) {
          if (m.arrived[r]) m.promises[r].SetError(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message));
        }
        it = meetings_.erase(it);
      }
      if (next == Clock::time_point::max()) {
        watchdog_cv_.wait(lock);
      } else {
        watchdog_cv_.wait_until(lock, next);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable watchdog_cv_;
  std::map<MeetingKey, std::shared_ptr<Meeting>> meetings_;
  std::map<int64_t, std::map<SequenceKey, int64_t>> sequences_;
  std::deque<int64_t> runs_;
};

ffi::Future Ready() {
  ffi::Promise promise;
  promise.SetAvailable();
  return ffi::Future(promise);
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  promise.SetError(std::move(error));
  return ffi::Future(promise);
}

ffi::Future Meet(const Call& call, const void* in, void* out, int64_t bytes, Share share,
                 std::optional<Across> across = std::nullopt) {
  if (call.rank < 0 || call.rank >= call.participants) {
    return Failed(ffi::Error::InvalidArgument(Describe(call) + ": rank out of range"));
  }
  return Rendezvous::Get().Arrive(call, in, out, bytes, std::move(share), std::move(across));
}

// 16-bit floats are reduced in float32: widen, combine, round back to nearest even.
float Widen(uint16_t bits, ffi::DataType type) {
  if (type == ffi::F16) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
  }
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

uint16_t Narrow(float f, ffi::DataType type) {
  uint16_t bits;
  if (type == ffi::F16) {
    _Float16 h = static_cast<_Float16>(f);
    std::memcpy(&bits, &h, 2);
    return bits;
  }
  uint32_t wide;
  std::memcpy(&wide, &f, 4);
  if ((wide & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((wide >> 16) | 0x40u);  // quiet NaN
  wide += 0x7fffu + ((wide >> 16) & 1u);
  return static_cast<uint16_t>(wide >> 16);
}

// `in` as Acc values: itself when T is Acc, else widened into `scratch`.
template <typename T, typename Acc>
const Acc* AsAcc(const T* in, Acc* scratch, int64_t len, ffi::DataType type) {
  if constexpr (std::is_same_v<T, Acc>) {
    return in;
  } else {
    for (int64_t i = 0; i < len; ++i) scratch[i] = Widen(in[i], type);
    return scratch;
  }
}

template <typename Acc>
void Accumulate(Acc* acc, const Acc* values, int64_t len, Reduction r) {
  switch (r) {  // one loop per reduction, so each vectorises
    case Reduction::kMax:
      for (int64_t i = 0; i < len; ++i) acc[i] = std::max(acc[i], values[i]);
      break;
    case Reduction::kMin:
      for (int64_t i = 0; i < len; ++i) acc[i] = std::min(acc[i], values[i]);
      break;
    default:
      for (int64_t i = 0; i < len; ++i) acc[i] += values[i];
  }
}

// Calls f(T{}, Acc{}) with the element type of `type` and the type it is reduced in (float32 for 16-bit floats).
template <typename F>
void WithTypes(ffi::DataType type, F&& f) {
  switch (type) {
    case ffi::F32: return f(float{}, float{});
    case ffi::F64: return f(double{}, double{});
    case ffi::S32: return f(int32_t{}, int32_t{});
    default: return f(uint16_t{}, float{});  // F16, BF16
  }
}

constexpr int64_t kBlock = 4096;  // elements reduced at a time, so each participant's slice stays in cache

enum class Block { kAcc, kWidened, kNarrowed };

// One of this thread's blocks of kBlock values, kept across calls: allocating them for every share took the
// allocator's lock, which the single heap the `xlatrain` command keeps (host_memory.py) shares with XLA's threads.
template <typename V>
V* ThreadBlock(Block which) {
  thread_local std::vector<char> blocks[3];
  std::vector<char>& block = blocks[static_cast<int>(which)];
  block.resize(kBlock * sizeof(double));  // the widest value type; a no-op after the thread's first call
  return reinterpret_cast<V*>(block.data());
}

// out = ((a + b) + c) + d, elementwise: three additions per pass over memory, in the order adding one input at a
// time gives, so the result is bit for bit the same. Compiled also for AVX2 and AVX-512, picked at load time.
__attribute__((target_clones("avx512f", "avx2", "default")))
void SumFour(float* out, const float* a, const float* b, const float* c, const float* d, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] = ((a[i] + b[i]) + c[i]) + d[i];
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void SumTwo(float* out, const float* a, const float* b, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] = a[i] + b[i];
}

// acc[0, len) = elements [start, start + len) of every participant's input combined (summed for a mean), in Acc.
template <typename T, typename Acc>
void CombineBlock(const std::vector<Participant>& parts, int64_t start, int64_t len, Reduction r, Acc* acc,
                  Acc* widened, ffi::DataType type) {
  size_t p = 0;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Acc, float>) {
    if ((r == Reduction::kSum || r == Reduction::kMean) && parts.size() >= 4) {  // memory-bound: fewer passes
      auto in = [&](size_t q) { return static_cast<const float*>(parts[q].in) + start; };
      SumFour(acc, in(0), in(1), in(2), in(3), len);
      for (p = 4; p + 3 <= parts.size(); p += 3) SumFour(acc, acc, in(p), in(p + 1), in(p + 2), len);
      for (; p < parts.size(); ++p) SumTwo(acc, acc, in(p), len);
    }
  }
  for (; p < parts.size(); ++p) {
    const Acc* values = AsAcc<T, Acc>(static_cast<const T*>(parts[p].in) + start, widened, len, type);
    if (p == 0) {
      std::copy(values, values + len, acc);
    } else {
      Accumulate(acc, values, len, r);
    }
  }
}

// Whether a collective that reads and writes `bytes` in all (every local input and output) should write its outputs
// with non-temporal stores: only where they do not fit the last-level cache together. There, an ordinary store first
// reads each line it writes from memory, and the outputs would be evicted before anything reads them; below it, they
// are still cached when the program reads them next.
bool StreamsPastCache(int64_t bytes) {
  static const int64_t cache = LastLevelCacheBytes();
  return cache > 0 && bytes > cache;
}

// memcpy, with non-temporal stores where `stream` says (on x86-64; elsewhere always memcpy). A share that streamed
// ends with Fence() before its results count as written.
void CopyOut(void* to, const void* from, size_t bytes, bool stream) {
#if defined(__x86_64__)
  if (stream) {
    auto* out = static_cast<char*>(to);
    const auto* in = static_cast<const char*>(from);
    const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(out) % 16) % 16);
    std::memcpy(out, in, head);
    size_t i = head;
    for (; i + 16 <= bytes; i += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    }
    std::memcpy(out + i, in + i, bytes - i);
    return;
  }
#endif
  std::memcpy(to, from, bytes);
}

// Orders this thread's non-temporal stores before whatever it does next (such as completing a promise).
void Fence(bool streamed) {
#if defined(__x86_64__)
  if (streamed) _mm_sfence();
#endif
}

// acc[0, len), divided by `participants` for a mean and rounded back to T, into every one of `outs` at `at`.
template <typename T, typename Acc>
void WriteBlock(Acc* acc, int64_t len, Reduction r, int64_t participants, const std::vector<void*>& outs, int64_t at,
                T* narrowed, ffi::DataType type, bool stream) {
  if (r == Reduction::kMean) {
    for (int64_t i = 0; i < len; ++i) acc[i] /= static_cast<Acc>(participants);
  }
  const void* result = acc;
  if constexpr (!std::is_same_v<T, Acc>) {
    for (int64_t i = 0; i < len; ++i) narrowed[i] = Narrow(acc[i], type);
    result = narrowed;
  }
  for (void* out : outs) CopyOut(static_cast<T*>(out) + at, result, len * sizeof(T), stream);
}

// Reduces elements [begin, end) over every input, a block at a time; element i goes to each of `outs` at
// index i - shift, streamed past the cache where `stream` says.
void ReduceShare(ffi::DataType type, const std::vector<Participant>& parts, int64_t begin, int64_t end, Reduction r,
                 const std::vector<void*>& outs, int64_t shift, bool stream) {
  WithTypes(type, [&](auto t, auto a) {
    using T = decltype(t);
    using Acc = decltype(a);
    Acc *acc = ThreadBlock<Acc>(Block::kAcc), *widened = ThreadBlock<Acc>(Block::kWidened);
    T* narrowed = ThreadBlock<T>(Block::kNarrowed);
    for (int64_t start = begin; start < end; start += kBlock) {
      const int64_t len = std::min(kBlock, end - start);
      CombineBlock<T, Acc>(parts, start, len, r, acc, widened, type);
      WriteBlock<T, Acc>(acc, len, r, static_cast<int64_t>(parts.size()), outs, start - shift, narrowed, type,
                         stream);
    }
  });
  Fence(stream);
}

std::vector<void*> Outputs(const std::vector<Participant>& parts) {
  std::vector<void*> outs;
  for (const auto& p : parts) outs.push_back(p.out);
  return outs;
}

int64_t AccBytes(ffi::DataType type) { return type == ffi::F64 ? 8 : 4; }

// Two-level reductions, local level: elements [begin, end) of every local input combined (summed for a mean) into
// the meeting's scratch buffer, in Acc.
void AccumulateShare(ffi::DataType type, const std::vector<Participant>& parts, int64_t begin, int64_t end,
                     Reduction r, void* scratch) {
  WithTypes(type, [&](auto t, auto a) {
    using Acc = decltype(a);
    Acc* widened = ThreadBlock<Acc>(Block::kWidened);
    for (int64_t start = begin; start < end; start += kBlock) {
      CombineBlock<decltype(t), Acc>(parts, start, std::min(kBlock, end - start), r, static_cast<Acc*>(scratch) + start,
                                     widened, type);
    }
  });
}

// Two-level reductions, last step: elements [begin, end) of the scratch buffer (divided by `participants` for a
// mean, rounded back for 16-bit floats) into every one of `outs`, from its start, streamed past the cache where
// `stream` says.
void WriteFromScratch(ffi::DataType type, Reduction r, int64_t participants, void* scratch, int64_t begin,
                      int64_t end, const std::vector<void*>& outs, bool stream) {
  WithTypes(type, [&](auto t, auto a) {
    using T = decltype(t);
    using Acc = decltype(a);
    T* narrowed = ThreadBlock<T>(Block::kNarrowed);
    for (int64_t start = begin; start < end; start += kBlock) {
      WriteBlock<T, Acc>(static_cast<Acc*>(scratch) + start, std::min(kBlock, end - start), r, participants, outs,
                         start - begin, narrowed, type, stream);
    }
  });
  Fence(stream);
}

// Where a process sits among the processes a group spans (equal blocks of consecutive ranks, in process order,
// over every process: checked when lowering), so its position is also its MPI rank.
struct Processes {
  int64_t me, count;
};

// Block q of `units` units of `unit` bytes split over the processes: the part of a buffer process q owns.
Transfer BlockOf(char* buffer, int64_t units, int64_t unit, int64_t processes, int64_t q) {
  const int64_t begin = ShareBegin(units, processes, q);
  return {q, buffer + begin * unit, (ShareBegin(units, processes, q + 1) - begin) * unit};
}

// Inter-process reduce-scatter of the scratch buffer (`count` values of `type`'s reduction type): each other
// process's block goes to it, theirs of this process's block come here and are combined into it, in place.
Round ReduceBlocks(ffi::DataType type, Reduction r, char* scratch, int64_t count, Processes processes) {
  const int64_t width = AccBytes(type);
  const Transfer mine = BlockOf(scratch, count, width, processes.count, processes.me);
  auto received = std::make_shared<std::vector<char>>(mine.bytes * (processes.count - 1));
  Round round;
  for (int64_t q = 0; q < processes.count; ++q) {
    if (q == processes.me) continue;
    round.sends.push_back(BlockOf(scratch, count, width, processes.count, q));
    round.receives.push_back({q, received->data() + round.receives.size() * mine.bytes, mine.bytes});
  }
  round.then = [=] {
    WithTypes(type, [&](auto, auto a) {
      using Acc = decltype(a);
      const int64_t len = mine.bytes / width;
      for (int64_t i = 0; i + 1 < processes.count; ++i) {
        Accumulate(static_cast<Acc*>(mine.data), reinterpret_cast<const Acc*>(received->data()) + i * len, len, r);
      }
    });
  };
  return round;
}

// Inter-process all-gather: this process's block of `buffer` to every other process, theirs into place here.
Round ShareBlocks(char* buffer, int64_t units, int64_t unit, Processes processes) {
  Round round;
  for (int64_t q = 0; q < processes.count; ++q) {
    if (q == processes.me) continue;
    Transfer mine = BlockOf(buffer, units, unit, processes.count, processes.me);
    mine.peer = q;
    round.sends.push_back(mine);
    round.receives.push_back(BlockOf(buffer, units, unit, processes.count, q));
  }
  return round;
}

std::shared_ptr<InterProcessJob> InterProcessJobFor(std::shared_ptr<Meeting> meeting) {
  auto job = std::make_shared<InterProcessJob>();
  job->site = meeting->call.site;
  job->group = meeting->call.group;
  job->timeout_ms = meeting->call.timeout_ms;
  job->rounds = meeting->across->plan(meeting->parts, meeting->scratch.data());
  job->finish = [meeting](const std::string& error) {
    for (auto& promise : meeting->promises) {
      if (error.empty()) {
        promise.SetAvailable();
      } else {
        promise.SetError(ffi::Error::Internal(Describe(meeting->call) + " across processes: " + error));
      }
    }
  };
  return job;
}

// Where the calling device meets: `processes` > 1 means its axis spans that many processes, so it meets the
// devices of its own process, by its rank among them.
struct Where {
  Call call;            // the local meeting
  int64_t global;       // the rank along the whole axis
  Processes processes;  // its process among those of its group
};

Where Locate(const char* op, ffi::RunId run, ffi::Buffer<ffi::S32> where, int64_t participants, int64_t processes,
             int64_t site, int64_t timeout_ms) {
  const int32_t* rank_group = where.typed_data();
  const int64_t local = participants / processes;
  Call call{op, run.run_id, site, rank_group[1], rank_group[0] % local, local, -1, timeout_ms};
  return {call, rank_group[0], {rank_group[0] / local, processes}};
}

// The shares and the inter-process plans capture plain values: the FFI buffer views are only valid while the
// handler runs. A plan is taken from the first participant to arrive, so it captures only what every participant
// shares.

ffi::Future AllReduce(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where_, ffi::Result<ffi::AnyBuffer> out,
                      int32_t reduction, int64_t participants, int64_t processes, int64_t site, int64_t timeout_ms) {
  const ffi::DataType type = x.element_type();
  if (!IsSupportedType(type)) return Failed(UnsupportedType("all_reduce", type));
  const auto r = static_cast<Reduction>(reduction);
  if (r == Reduction::kMean && type == ffi::S32) {
    return Failed(ffi::Error::InvalidArgument("xlatrain all_reduce: mean of integers is not defined; use sum"));
  }
  const int64_t count = static_cast<int64_t>(x.element_count());
  if (count == 0) return Ready();
  const Where where = Locate("all_reduce", run, where_, participants, processes, site, timeout_ms);
  const int64_t local = where.call.participants;
  const int64_t begin = ShareBegin(count, local, where.call.rank), end = ShareBegin(count, local, where.call.rank + 1);
  const bool stream = StreamsPastCache(2 * local * static_cast<int64_t>(x.size_bytes()));  // inputs and outputs
  if (processes == 1) {
    return Meet(where.call, x.untyped_data(), out->untyped_data(), x.size_bytes(),
                [=](const std::vector<Participant>& parts, void*) {
                  ReduceShare(type, parts, begin, end, r, Outputs(parts), 0, stream);
                });
  }
  const Processes across = where.processes;
  return Meet(where.call, x.untyped_data(), out->untyped_data(), x.size_bytes(),
              [=](const std::vector<Participant>& parts, void* scratch) {
                AccumulateShare(type, parts, begin, end, r, scratch);
              },
              Across{static_cast<size_t>(count * AccBytes(type)),
                     [=](const std::vector<Participant>& parts, char* scratch) {
                       Round gather = ShareBlocks(scratch, count, AccBytes(type), across);
                       gather.then = [=] {
                         WriteFromScratch(type, r, participants, scratch, 0, count, Outputs(parts), stream);
                       };
                       return std::vector<Round>{ReduceBlocks(type, r, scratch, count, across), gather};
                     }});
}

ffi::Future ReduceScatter(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where_,
                          ffi::Result<ffi::AnyBuffer> out, int32_t reduction, int64_t participants, int64_t processes,
                          int64_t site, int64_t timeout_ms) {
  const ffi::DataType type = x.element_type();
  if (!IsSupportedType(type)) return Failed(UnsupportedType("reduce_scatter", type));
  const auto r = static_cast<Reduction>(reduction);
  const int64_t count = static_cast<int64_t>(x.element_count());
  if (count % participants != 0) {
    return Failed(ffi::Error::InvalidArgument("xlatrain reduce_scatter: " + std::to_string(count) +
                                              " elements do not split over " + std::to_string(participants) +
                                              " participants"));
  }
  if (count == 0) return Ready();
  const Where where = Locate("reduce_scatter", run, where_, participants, processes, site, timeout_ms);
  const int64_t chunk = count / participants, local = where.call.participants;
  void* mine = out->untyped_data();
  const int64_t in_bytes = local * static_cast<int64_t>(x.size_bytes());
  const bool stream = StreamsPastCache(in_bytes + in_bytes / participants);  // inputs and outputs
  if (processes == 1) {
    const int64_t begin = where.global * chunk;
    return Meet(where.call, x.untyped_data(), mine, x.size_bytes(), [=](const std::vector<Participant>& parts, void*) {
      ReduceShare(type, parts, begin, begin + chunk, r, {mine}, begin, stream);
    });
  }
  const int64_t begin = ShareBegin(count, local, where.call.rank), end = ShareBegin(count, local, where.call.rank + 1);
  const Processes across = where.processes;
  return Meet(where.call, x.untyped_data(), mine, x.size_bytes(),
              [=](const std::vector<Participant>& parts, void* scratch) {
                AccumulateShare(type, parts, begin, end, r, scratch);
              },
              Across{static_cast<size_t>(count * AccBytes(type)),
                     [=](const std::vector<Participant>& parts, char* scratch) {
                       Round round = ReduceBlocks(type, r, scratch, count, across);
                       round.then = [=, combine = round.then] {
                         combine();
                         for (int64_t j = 0; j < local; ++j) {  // this process's block holds its devices' chunks
                           const int64_t at = (across.me * local + j) * chunk;
                           WriteFromScratch(type, r, participants, scratch, at, at + chunk, {parts[j].out}, stream);
                         }
                       };
                       return std::vector<Round>{round};
                     }});
}

ffi::Future AllGather(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where_, ffi::Result<ffi::AnyBuffer> out,
                      int64_t participants, int64_t processes, int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return Failed(UnsupportedType("all_gather", x.element_type()));
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (bytes == 0) return Ready();
  const Where where = Locate("all_gather", run, where_, participants, processes, site, timeout_ms);
  const void* in = x.untyped_data();
  const int64_t at = where.global * bytes, total = participants * bytes, local = where.call.participants;
  const bool stream = StreamsPastCache(local * (bytes + total));  // inputs and outputs
  if (processes == 1) {
    return Meet(where.call, in, out->untyped_data(), bytes, [=](const std::vector<Participant>& parts, void*) {
      for (const auto& p : parts) CopyOut(static_cast<char*>(p.out) + at, in, bytes, stream);
      Fence(stream);
    });
  }
  const Processes across = where.processes;
  return Meet(where.call, in, out->untyped_data(), bytes,
              [=](const std::vector<Participant>&, void* scratch) {
                std::memcpy(static_cast<char*>(scratch) + at, in, bytes);
              },
              Across{static_cast<size_t>(total), [=](const std::vector<Participant>& parts, char* scratch) {
                       Round round = ShareBlocks(scratch, total, 1, across);
                       round.then = [=] {
                         for (const auto& p : parts) CopyOut(p.out, scratch, total, stream);
                         Fence(stream);
                       };
                       return std::vector<Round>{round};
                     }});
}

// Participant g's block j (of `participants` equal blocks of its buffer) becomes participant j's block g. Across
// processes each process sends every other one, in one message, the blocks its devices address to that one's
// devices, laid out [source device][target device][block] in a scratch buffer whose second half receives.
ffi::Future AllToAll(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where_, ffi::Result<ffi::AnyBuffer> out,
                     int64_t participants, int64_t processes, int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return Failed(UnsupportedType("all_to_all", x.element_type()));
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (bytes % participants != 0) {
    return Failed(ffi::Error::InvalidArgument("xlatrain all_to_all: " + std::to_string(bytes) +
                                              " bytes do not split into " + std::to_string(participants) +
                                              " blocks"));
  }
  if (bytes == 0) return Ready();
  const Where where = Locate("all_to_all", run, where_, participants, processes, site, timeout_ms);
  const int64_t block = bytes / participants, local = where.call.participants, rank = where.call.rank;
  const int64_t me = where.processes.me;
  const char* in = static_cast<const char*>(x.untyped_data());
  const bool stream = StreamsPastCache(2 * local * bytes);  // inputs and outputs
  Share share = [=](const std::vector<Participant>& parts, void* scratch) {
    for (int64_t j = 0; j < local; ++j) {  // this process's devices: straight into their outputs
      CopyOut(static_cast<char*>(parts[j].out) + where.global * block, in + (me * local + j) * block, block, stream);
    }
    Fence(stream);
    for (int64_t q = 0; q < processes && scratch != nullptr; ++q) {  // the others': into the message to their process
      if (q == me) continue;
      char* message = static_cast<char*>(scratch) + q * local * local * block;
      std::memcpy(message + rank * local * block, in + q * local * block, local * block);
    }
  };
  if (processes == 1) return Meet(where.call, in, out->untyped_data(), bytes, std::move(share));
  const int64_t message = local * local * block, half = processes * message;
  return Meet(where.call, in, out->untyped_data(), bytes, std::move(share),
              Across{static_cast<size_t>(2 * half), [=](const std::vector<Participant>& parts, char* scratch) {
                       Round round;
                       for (int64_t q = 0; q < processes; ++q) {
                         if (q == me) continue;
                         round.sends.push_back({q, scratch + q * message, message});
                         round.receives.push_back({q, scratch + half + q * message, message});
                       }
                       round.then = [=] {
                         for (int64_t q = 0; q < processes; ++q) {
                           if (q == me) continue;
                           const char* received = scratch + half + q * message;  // [its device r][my device t]
                           for (int64_t r = 0; r < local; ++r) {
                             for (int64_t t = 0; t < local; ++t) {
                               std::memcpy(static_cast<char*>(parts[t].out) + (q * local + r) * block,
                                           received + (r * local + t) * block, block);
                             }
                           }
                         }
                       };
                       return std::vector<Round>{round};
                     }});
}

ffi::Future Ppermute(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where_, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Span<const int64_t> sources_, ffi::Span<const int64_t> targets_, int64_t participants,
                     int64_t processes, int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return Failed(UnsupportedType("ppermute", x.element_type()));
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (bytes == 0) return Ready();
  const Where where = Locate("ppermute", run, where_, participants, processes, site, timeout_ms);
  const std::vector<int64_t> sources(sources_.begin(), sources_.end()), targets(targets_.begin(), targets_.end());
  const int64_t local = where.call.participants, rank = where.call.rank;
  auto process_of = [local](int64_t global) { return global / local; };
  const bool receives = std::find(targets.begin(), targets.end(), where.global) != targets.end();
  int64_t target = -1;  // the local rank it sends to, when that is in this process
  for (size_t i = 0; i < sources.size(); ++i) {
    if (sources[i] == where.global && process_of(targets[i]) == process_of(where.global)) target = targets[i] % local;
  }
  const void* in = x.untyped_data();
  Share share = [=](const std::vector<Participant>& parts, void*) {
    if (!receives) std::memset(parts[rank].out, 0, bytes);
    if (target >= 0) std::memcpy(parts[target].out, in, bytes);
  };
  if (processes == 1) return Meet(where.call, in, out->untyped_data(), bytes, std::move(share));
  const int64_t me = where.processes.me;
  return Meet(where.call, in, out->untyped_data(), bytes, std::move(share),
              Across{0, [=](const std::vector<Participant>& parts, char*) {
                       Round round;  // in pair order, the same on both sides
                       for (size_t i = 0; i < sources.size(); ++i) {
                         const int64_t from = process_of(sources[i]), to = process_of(targets[i]);
                         if (from == to) continue;
                         if (from == me) round.sends.push_back({to, const_cast<void*>(parts[sources[i] % local].in), bytes});
                         if (to == me) round.receives.push_back({from, parts[targets[i] % local].out, bytes});
                       }
                       return std::vector<Round>{round};
                     }});
}

ffi::Future Broadcast(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where_, ffi::Result<ffi::AnyBuffer> out,
                      int64_t root, int64_t participants, int64_t processes, int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return Failed(UnsupportedType("broadcast", x.element_type()));
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (bytes == 0) return Ready();
  const Where where = Locate("broadcast", run, where_, participants, processes, site, timeout_ms);
  void* mine = out->untyped_data();
  if (processes == 1) {
    return Meet(where.call, x.untyped_data(), mine, bytes,
                [=](const std::vector<Participant>& parts, void*) { std::memcpy(mine, parts[root].in, bytes); });
  }
  const int64_t local = where.call.participants, from = root / local;
  const Processes across = where.processes;
  return Meet(where.call, x.untyped_data(), mine, bytes, [](const std::vector<Participant>&, void*) {},
              Across{0, [=](const std::vector<Participant>& parts, char*) {
                       Round round;
                       const void* value = parts[0].out;
                       if (from == across.me) {
                         value = parts[root % local].in;
                         for (int64_t q = 0; q < across.count; ++q) {
                           if (q != from) round.sends.push_back({q, const_cast<void*>(value), bytes});
                         }
                       } else {
                         round.receives.push_back({from, parts[0].out, bytes});
                       }
                       round.then = [=] {
                         for (const auto& p : parts) {
                           if (p.out != value) std::memcpy(p.out, value, bytes);
                         }
                       };
                       return std::vector<Round>{round};
                     }});
}

}  // namespace

// Every CPU handler: (input, int32[rank, group]) -> output, with its own attributes, then these.
#define XLATRAIN_CPU_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::RunId>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>()
#define XLATRAIN_CPU_ATTRS \
  Attr<int64_t>("participants").Attr<int64_t>("processes").Attr<int64_t>("site").Attr<int64_t>("timeout_ms")

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduce, AllReduce, XLATRAIN_CPU_BINDING.Attr<int32_t>("reduction").XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuReduceScatter, ReduceScatter,
                              XLATRAIN_CPU_BINDING.Attr<int32_t>("reduction").XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllGather, AllGather, XLATRAIN_CPU_BINDING.XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllToAll, AllToAll, XLATRAIN_CPU_BINDING.XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuPpermute, Ppermute,
                              XLATRAIN_CPU_BINDING.Attr<ffi::Span<const int64_t>>("sources")
                                  .Attr<ffi::Span<const int64_t>>("targets")
                                  .XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuBroadcast, Broadcast, XLATRAIN_CPU_BINDING.Attr<int64_t>("root").XLATRAIN_CPU_ATTRS);

}  // namespace xlatrain

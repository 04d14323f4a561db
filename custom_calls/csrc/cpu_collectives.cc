// Collectives across the devices of one process on XLA:CPU.
//
// XLA:CPU runs every device of an execution on its own thread and gives them one RunId. Each
// participant of a collective arrives at a meeting keyed by (run, call site, group, how many times
// this site ran in this run), publishes its input and output pointers, and once everyone is there
// does an equal share of the work: for a reduction it reduces its own slice of the buffer over all
// inputs and writes that slice into every output (reduce-scatter then all-gather, in place), so no
// thread reduces everything. A second barrier keeps buffers alive until every share is written.
// A participant that waits longer than the timeout fails with an error naming the op and who came.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>
#include <vector>

#include "collectives.h"

namespace xlatrain {
namespace {

using Clock = std::chrono::steady_clock;

struct Participant {
  const void* in = nullptr;
  void* out = nullptr;
};

struct Meeting {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Participant> parts;
  std::vector<bool> arrived;
  int64_t arrived_count = 0;
  int64_t finished_count = 0;
  int64_t departed_count = 0;
  int64_t bytes = -1;  // every participant must bring the same size
  explicit Meeting(int64_t n) : parts(n), arrived(n, false) {}
};

// (run, site, group, sequence)
using MeetingKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;
// (site, group, rank) -> how many times it has run, per run
using SequenceKey = std::tuple<int64_t, int64_t, int64_t>;

class Rendezvous {
 public:
  static Rendezvous& Get() {
    static auto* instance = new Rendezvous();  // never destroyed: threads may outlive static teardown
    return *instance;
  }

  std::pair<std::shared_ptr<Meeting>, int64_t> Join(int64_t run, int64_t site, int64_t group, int64_t rank,
                                                    int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& sequences = SequencesOf(run);
    int64_t sequence = sequences[{site, group, rank}]++;
    auto& meeting = meetings_[{run, site, group, sequence}];
    if (!meeting) meeting = std::make_shared<Meeting>(n);
    return {meeting, sequence};
  }

  void Forget(int64_t run, int64_t site, int64_t group, int64_t sequence) {
    std::lock_guard<std::mutex> lock(mu_);
    meetings_.erase({run, site, group, sequence});
  }

 private:
  // Call counts are kept for the most recent runs only; a run this far behind has long finished.
  static constexpr size_t kRunsKept = 4096;

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

  std::mutex mu_;
  std::map<MeetingKey, std::shared_ptr<Meeting>> meetings_;
  std::map<int64_t, std::map<SequenceKey, int64_t>> sequences_;
  std::deque<int64_t> runs_;
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

// Meets the other participants, runs `share(parts)` once all have arrived, and returns once every
// participant's share is done. `share` must only write this participant's part of the work.
template <typename Share>
ffi::Error Meet(Call call, const void* in, void* out, int64_t bytes, Share share) {
  if (call.rank < 0 || call.rank >= call.participants) {
    return ffi::Error::InvalidArgument(Describe(call) + ": rank out of range");
  }
  auto [meeting, sequence] = Rendezvous::Get().Join(call.run, call.site, call.group, call.rank, call.participants);
  call.sequence = sequence;
  const auto deadline = Clock::now() + std::chrono::milliseconds(call.timeout_ms);
  std::unique_lock<std::mutex> lock(meeting->mu);
  auto leave = [&]() {
    if (++meeting->departed_count == call.participants) {
      Rendezvous::Get().Forget(call.run, call.site, call.group, sequence);
    }
  };
  if (meeting->arrived[call.rank]) {
    return ffi::Error::Internal(Describe(call) + ": this rank arrived twice");
  }
  if (meeting->bytes >= 0 && meeting->bytes != bytes) {
    return ffi::Error::InvalidArgument(Describe(call) + ": participants disagree on the buffer size (" +
                                       std::to_string(meeting->bytes) + " vs " + std::to_string(bytes) +
                                       " bytes)");
  }
  meeting->bytes = bytes;
  meeting->parts[call.rank] = {in, out};
  meeting->arrived[call.rank] = true;
  if (++meeting->arrived_count == call.participants) meeting->cv.notify_all();
  if (!meeting->cv.wait_until(lock, deadline, [&] { return meeting->arrived_count == call.participants; })) {
    std::string message = Describe(call) + " timed out after " + std::to_string(call.timeout_ms) +
                          " ms waiting for the other participants: arrived ranks " + Ranks(meeting->arrived, true) +
                          ", missing ranks " + Ranks(meeting->arrived, false) +
                          ". Every participant must run the same collectives in the same order (is one inside "
                          "a branch that some ranks skip?); raise collectives.timeout_s for slow steps";
    leave();
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message);
  }
  std::vector<Participant> parts = meeting->parts;
  lock.unlock();
  share(parts);
  lock.lock();
  if (++meeting->finished_count == call.participants) meeting->cv.notify_all();
  // Everyone has arrived, so everyone is running its share: no deadline for the finish.
  meeting->cv.wait(lock, [&] { return meeting->finished_count == call.participants; });
  leave();
  return ffi::Error::Success();
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

template <typename Acc>
Acc Combine(Acc a, Acc b, Reduction r) {
  switch (r) {
    case Reduction::kMax: return std::max(a, b);
    case Reduction::kMin: return std::min(a, b);
    default: return a + b;
  }
}

// Reduces elements [begin, end) over every participant's input; `write(i, value)` stores element i.
template <typename T, typename Acc, typename Load, typename Write>
void ReduceRange(const std::vector<Participant>& parts, int64_t begin, int64_t end, Reduction r, Load load,
                 Write write) {
  const auto n = static_cast<int64_t>(parts.size());
  for (int64_t i = begin; i < end; ++i) {
    Acc acc = load(static_cast<const T*>(parts[0].in)[i]);
    for (int64_t p = 1; p < n; ++p) acc = Combine<Acc>(acc, load(static_cast<const T*>(parts[p].in)[i]), r);
    if (r == Reduction::kMean) acc = acc / static_cast<Acc>(n);
    write(i, acc);
  }
}

// Reduces [begin, end) of every input and writes the result to out(i) for each target element.
template <typename Targets>
void ReduceShare(ffi::DataType type, const std::vector<Participant>& parts, int64_t begin, int64_t end, Reduction r,
                 Targets targets) {
  auto store = [&](auto value_type_tag, int64_t i, auto value) {
    using T = decltype(value_type_tag);
    for (void* out : targets(i)) static_cast<T*>(out)[0] = value;
  };
  switch (type) {
    case ffi::F32:
      ReduceRange<float, float>(parts, begin, end, r, [](float v) { return v; },
                                [&](int64_t i, float v) { store(float{}, i, v); });
      break;
    case ffi::F64:
      ReduceRange<double, double>(parts, begin, end, r, [](double v) { return v; },
                                  [&](int64_t i, double v) { store(double{}, i, v); });
      break;
    case ffi::S32:
      ReduceRange<int32_t, int32_t>(parts, begin, end, r, [](int32_t v) { return v; },
                                    [&](int64_t i, int32_t v) { store(int32_t{}, i, v); });
      break;
    default:  // F16, BF16
      ReduceRange<uint16_t, float>(parts, begin, end, r, [type](uint16_t v) { return Widen(v, type); },
                                   [&](int64_t i, float v) { store(uint16_t{}, i, Narrow(v, type)); });
  }
}

Call MakeCall(const char* op, ffi::RunId run, ffi::Buffer<ffi::S32> where, int64_t participants, int64_t site,
              int64_t timeout_ms) {
  const int32_t* rank_group = where.typed_data();
  return Call{op, run.run_id, site, rank_group[1], rank_group[0], participants, -1, timeout_ms};
}

ffi::Error AllReduce(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where, ffi::Result<ffi::AnyBuffer> out,
                     int32_t reduction, int64_t participants, int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return UnsupportedType("all_reduce", x.element_type());
  const auto r = static_cast<Reduction>(reduction);
  if (r == Reduction::kMean && x.element_type() == ffi::S32) {
    return ffi::Error::InvalidArgument("xlatrain all_reduce: mean of integers is not defined; use sum");
  }
  const int64_t count = static_cast<int64_t>(x.element_count());
  if (count == 0) return ffi::Error::Success();
  Call call = MakeCall("all_reduce", run, where, participants, site, timeout_ms);
  const size_t width = ffi::ByteWidth(x.element_type());
  return Meet(call, x.untyped_data(), out->untyped_data(), x.size_bytes(), [&](const std::vector<Participant>& parts) {
    std::vector<void*> outs(parts.size());
    ReduceShare(x.element_type(), parts, ShareBegin(count, participants, call.rank),
                ShareBegin(count, participants, call.rank + 1), r, [&](int64_t i) {
                  for (size_t p = 0; p < parts.size(); ++p) outs[p] = static_cast<char*>(parts[p].out) + i * width;
                  return outs;
                });
  });
}

ffi::Error ReduceScatter(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where,
                         ffi::Result<ffi::AnyBuffer> out, int32_t reduction, int64_t participants, int64_t site,
                         int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return UnsupportedType("reduce_scatter", x.element_type());
  const auto r = static_cast<Reduction>(reduction);
  const int64_t count = static_cast<int64_t>(x.element_count());
  if (count % participants != 0) {
    return ffi::Error::InvalidArgument("xlatrain reduce_scatter: " + std::to_string(count) +
                                       " elements do not split over " + std::to_string(participants) +
                                       " participants");
  }
  if (count == 0) return ffi::Error::Success();
  Call call = MakeCall("reduce_scatter", run, where, participants, site, timeout_ms);
  const int64_t chunk = count / participants;
  const size_t width = ffi::ByteWidth(x.element_type());
  char* mine = static_cast<char*>(out->untyped_data());
  return Meet(call, x.untyped_data(), out->untyped_data(), x.size_bytes(), [&](const std::vector<Participant>& parts) {
    std::vector<void*> target(1);
    ReduceShare(x.element_type(), parts, call.rank * chunk, (call.rank + 1) * chunk, r, [&](int64_t i) {
      target[0] = mine + (i - call.rank * chunk) * width;
      return target;
    });
  });
}

ffi::Error AllGather(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where, ffi::Result<ffi::AnyBuffer> out,
                     int64_t participants, int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return UnsupportedType("all_gather", x.element_type());
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return ffi::Error::Success();
  Call call = MakeCall("all_gather", run, where, participants, site, timeout_ms);
  return Meet(call, x.untyped_data(), out->untyped_data(), bytes, [&](const std::vector<Participant>& parts) {
    for (const auto& p : parts) std::memcpy(static_cast<char*>(p.out) + call.rank * bytes, x.untyped_data(), bytes);
  });
}

ffi::Error Ppermute(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Span<const int64_t> sources, ffi::Span<const int64_t> targets, int64_t participants,
                    int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return UnsupportedType("ppermute", x.element_type());
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return ffi::Error::Success();
  Call call = MakeCall("ppermute", run, where, participants, site, timeout_ms);
  const bool receives = std::find(targets.begin(), targets.end(), call.rank) != targets.end();
  return Meet(call, x.untyped_data(), out->untyped_data(), bytes, [&](const std::vector<Participant>& parts) {
    if (!receives) std::memset(parts[call.rank].out, 0, bytes);
    for (size_t i = 0; i < sources.size(); ++i) {
      if (sources[i] == call.rank) std::memcpy(parts[targets[i]].out, x.untyped_data(), bytes);
    }
  });
}

ffi::Error Broadcast(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where, ffi::Result<ffi::AnyBuffer> out,
                     int64_t root, int64_t participants, int64_t site, int64_t timeout_ms) {
  if (!IsSupportedType(x.element_type())) return UnsupportedType("broadcast", x.element_type());
  const size_t bytes = x.size_bytes();
  if (bytes == 0) return ffi::Error::Success();
  Call call = MakeCall("broadcast", run, where, participants, site, timeout_ms);
  return Meet(call, x.untyped_data(), out->untyped_data(), bytes, [&](const std::vector<Participant>& parts) {
    std::memcpy(out->untyped_data(), parts[root].in, bytes);
  });
}

}  // namespace

// Every CPU handler: (input, int32[rank, group]) -> output, with its own attributes, then these.
#define XLATRAIN_CPU_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::RunId>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>()
#define XLATRAIN_CPU_ATTRS Attr<int64_t>("participants").Attr<int64_t>("site").Attr<int64_t>("timeout_ms")

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduce, AllReduce,
                              XLATRAIN_CPU_BINDING.Attr<int32_t>("reduction").XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuReduceScatter, ReduceScatter,
                              XLATRAIN_CPU_BINDING.Attr<int32_t>("reduction").XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllGather, AllGather, XLATRAIN_CPU_BINDING.XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuPpermute, Ppermute,
                              XLATRAIN_CPU_BINDING.Attr<ffi::Span<const int64_t>>("sources")
                                  .Attr<ffi::Span<const int64_t>>("targets")
                                  .XLATRAIN_CPU_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuBroadcast, Broadcast,
                              XLATRAIN_CPU_BINDING.Attr<int64_t>("root").XLATRAIN_CPU_ATTRS);

}  // namespace xlatrain

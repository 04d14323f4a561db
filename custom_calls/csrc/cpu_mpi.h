// The inter-process level of the CPU collectives: one MPI thread that moves point-to-point messages for every
// collective in flight at once, without blocking on any of them.
//
// Local meetings complete in whatever order XLA happens to run independent calls, and that order differs
// between processes, so nothing here relies on an order across collectives. Each collective's messages carry a
// tag made of its call site, its group and how many times that (site, group) crossed processes before: the
// same on every process, because the calls of one site and group run one after the other (the next cannot
// start before this one's promise completes).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace xlatrain {

// `bytes` bytes at `data`, to or from process `peer` (its rank in MPI_COMM_WORLD, which is its jax process index).
struct Transfer {
  int64_t peer;
  void* data;
  int64_t bytes;
};

// One step of a job: every transfer posted at once, then `then` on the MPI thread once all of them completed.
// Transfers between the same two processes match in the order they are listed, so both sides list them alike.
struct Round {
  std::vector<Transfer> sends, receives;
  std::function<void()> then;
};

struct InterProcessJob {
  int64_t site = 0, group = 0;  // which collective: with the per-(site, group) count, the tag of its messages
  int64_t timeout_ms = 0;       // how long its transfers may wait for the other processes
  std::vector<Round> rounds;    // run in order
  std::function<void(const std::string& error)> finish;  // "" or what went wrong
};

// Starts `job` on the MPI thread; the local level submits it once its own part is done.
void SubmitInterProcess(std::shared_ptr<InterProcessJob> job);

// MPI_COMM_WORLD's size and this process's rank in it (initialising MPI on first use); (-1, -1) when built
// without MPI.
std::pair<int64_t, int64_t> MpiWorld();

// Finalizes MPI once every job in flight finished; a no-op when MPI was never initialised.
void MpiFinalize();

}  // namespace xlatrain

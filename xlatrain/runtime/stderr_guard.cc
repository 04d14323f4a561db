// Python module xlatrain.runtime._stderr_guard: turns the JAX runtime's fatal abort into xlatrain's one line.
//
// When process 0 of a multi-process run dies, jax's coordination-service client in every other process logs
// a fatal error and aborts within milliseconds, with a C++ stack dump and before any Python code can run.
// The guard routes native writes to file descriptor 2 through a pipe read by a plain C++ thread (no GIL, so
// it reacts at once): lines pass through to the real stderr, except that the runtime's fatal line makes the
// thread print xlatrain's line instead and end the process with the watchdog's exit code, while the aborting
// thread is still formatting its stack dump. Python's own sys.stderr writes to the real stderr directly.

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

namespace {

constexpr int kQuietMs = 100;  // a partial or held line is passed on after this long without more output

struct Guard {
  std::string fatal_marker, held_marker;
  int exit_code = 1;
  int real_stderr = -1, pipe_read = -1;
  std::mutex mu;
  std::string message;  // xlatrain's line for the fatal case, kept current by the watchdog
  std::atomic<bool> releasing{false};
  std::thread reader;
};

Guard* guard = nullptr;

void WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// Passes complete lines on, holding back a line that announces the fatal one (they come microseconds apart).
void Read(Guard* g) {
  std::string partial, held;
  char chunk[4096];
  for (;;) {
    pollfd waiting{g->pipe_read, POLLIN, 0};
    const int ready = poll(&waiting, 1, kQuietMs);
    if (ready < 0 && errno == EINTR) continue;
    const ssize_t n = ready > 0 ? read(g->pipe_read, chunk, sizeof chunk) : 0;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // quiet, so nothing fatal followed; or every writer is gone
      WriteAll(g->real_stderr, held + partial);
      held.clear();
      partial.clear();
      if (g->releasing || ready > 0) return;
      continue;
    }
    partial.append(chunk, static_cast<size_t>(n));
    for (size_t end; (end = partial.find('\n')) != std::string::npos;) {
      std::string line = partial.substr(0, end + 1);
      partial.erase(0, end + 1);
      if (line.find(g->fatal_marker) != std::string::npos) {
        std::string message;
        {
          std::lock_guard<std::mutex> lock(g->mu);
          message = g->message;
        }
        WriteAll(g->real_stderr, message);
        _exit(g->exit_code);
      }
      if (line.find(g->held_marker) != std::string::npos) {
        held += line;
      } else {
        WriteAll(g->real_stderr, held + line);
        held.clear();
      }
    }
  }
}

int Start(std::string fatal_marker, std::string held_marker, int exit_code, std::string message) {
  if (guard) throw std::runtime_error("the stderr guard is already started");
  int ends[2];
  if (pipe2(ends, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  auto* g = new Guard();
  g->fatal_marker = std::move(fatal_marker);
  g->held_marker = std::move(held_marker);
  g->exit_code = exit_code;
  g->message = std::move(message);
  g->real_stderr = fcntl(2, F_DUPFD_CLOEXEC, 3);
  g->pipe_read = ends[0];
  dup2(ends[1], 2);
  close(ends[1]);
  g->reader = std::thread(Read, g);
  guard = g;
  return dup(g->real_stderr);  // for Python's sys.stderr, which owns and closes its copy
}

void SetMessage(std::string message) {
  if (!guard) return;
  std::lock_guard<std::mutex> lock(guard->mu);
  guard->message = std::move(message);
}

// Points fd 2 back at the real stderr and waits until everything written before is passed on (forked children
// may still hold the pipe's write end, so the reader ends at the first quiet moment rather than at its end).
void Release() {
  if (!guard) return;
  dup2(guard->real_stderr, 2);
  guard->releasing = true;
  guard->reader.join();
  close(guard->pipe_read);
  close(guard->real_stderr);
  delete guard;
  guard = nullptr;
}

}  // namespace

namespace nb = nanobind;

NB_MODULE(_stderr_guard, m) {
  m.def("start", &Start, nb::arg("fatal_marker"), nb::arg("held_marker"), nb::arg("exit_code"), nb::arg("message"),
        "Route native writes to fd 2 through the guard; returns a new descriptor of the real stderr.");
  m.def("set_message", &SetMessage, nb::arg("message"), "The text written instead of the runtime's fatal line.");
  m.def("release", &Release, nb::call_guard<nb::gil_scoped_release>(),
        "Give fd 2 back to the real stderr after passing on what is still in the pipe.");
}

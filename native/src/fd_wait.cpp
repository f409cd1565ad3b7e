#include "tandem/fd_wait.hpp"

#include <poll.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace tandem {

namespace {

// poll(2) over `fds` once; the ready indexes, or throws on a real error. EINTR: nothing ready.
std::vector<int> poll_once(std::vector<pollfd>& fds, int timeout_ms) {
  const int rc = ::poll(fds.data(), static_cast<nfds_t>(fds.size()), timeout_ms);
  std::vector<int> ready;
  if (rc < 0) {
    if (errno == EINTR) return ready;
    throw std::runtime_error(std::string("poll failed: ") + std::strerror(errno));
  }
  for (size_t i = 0; rc > 0 && i < fds.size(); ++i) {
    if (fds[i].revents != 0) ready.push_back(static_cast<int>(i));
  }
  return ready;
}

}  // namespace

std::vector<int> wait_readable(const std::vector<int>& fds, std::chrono::microseconds spin, int timeout_ms) {
  std::vector<pollfd> polled(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) polled[i] = pollfd{fds[i], POLLIN, 0};
  if (spin.count() > 0) {
    const auto until = std::chrono::steady_clock::now() + spin;
    do {
      std::vector<int> ready = poll_once(polled, 0);
      if (!ready.empty()) return ready;
      // Yield between polls, as the pool's spin does: on oversubscribed cores
      // a spinning waiter must not keep a runnable thread off its core.
      std::this_thread::yield();
    } while (std::chrono::steady_clock::now() < until);
  }
  return poll_once(polled, timeout_ms);
}

}  // namespace tandem

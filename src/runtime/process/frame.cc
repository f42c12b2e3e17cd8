#include "runtime/process/frame.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>

namespace shoal::runtime_protocol {
namespace {

// Waits until `fd` is ready for `events`, the deadline passes, or (with
// `exit_fd` >= 0) the peer process has exited while `fd` is not ready.
Status WaitReady(int fd, short events, int64_t deadline_mono_us, int exit_fd) {
  while (true) {
    const int64_t left_us = deadline_mono_us - NowMonoUs();
    if (left_us <= 0) return DeadlineExceeded("runtime did not answer in time", "runtime_timeout");
    pollfd p[2] = {{fd, events, 0}, {exit_fd, POLLIN, 0}};
    const int n = ::poll(p, exit_fd >= 0 ? 2 : 1, static_cast<int>(std::min<int64_t>(left_us / 1000 + 1, 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Unavailable(std::string("poll: ") + std::strerror(errno), "runtime_io");
    if (n == 0) continue;
    if (p[0].revents & (events | POLLHUP | POLLERR)) return Status::Ok();
    if (exit_fd >= 0 && p[1].revents != 0) return Unavailable("the runtime process exited", "peer_closed");
  }
}

}  // namespace

int64_t NowMonoUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Status WriteFrame(int fd, std::string_view payload, int64_t deadline_mono_us, int exit_fd) {
  const uint32_t n = static_cast<uint32_t>(payload.size());
  const unsigned char head[4] = {static_cast<unsigned char>(n >> 24), static_cast<unsigned char>(n >> 16),
                                 static_cast<unsigned char>(n >> 8), static_cast<unsigned char>(n)};
  std::string_view parts[2] = {std::string_view(reinterpret_cast<const char*>(head), 4), payload};
  for (std::string_view part : parts) {
    size_t off = 0;
    while (off < part.size()) {
      RETURN_IF_ERROR(WaitReady(fd, POLLOUT, deadline_mono_us, exit_fd));
      const ssize_t w = ::send(fd, part.data() + off, part.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (w < 0) return Unavailable(std::string("runtime socket: ") + std::strerror(errno), "peer_closed");
      off += static_cast<size_t>(w);
    }
  }
  return Status::Ok();
}

Result<std::string> ReadFrame(int fd, int64_t max_bytes, int64_t deadline_mono_us, int exit_fd) {
  auto read_exact = [&](char* dst, size_t len) -> Status {
    size_t off = 0;
    while (off < len) {
      RETURN_IF_ERROR(WaitReady(fd, POLLIN, deadline_mono_us, exit_fd));
      const ssize_t r = ::recv(fd, dst + off, len - off, MSG_DONTWAIT);
      if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (r < 0) return Unavailable(std::string("runtime socket: ") + std::strerror(errno), "peer_closed");
      if (r == 0) return Unavailable("the runtime closed the connection", "peer_closed");
      off += static_cast<size_t>(r);
    }
    return Status::Ok();
  };
  unsigned char head[4];
  RETURN_IF_ERROR(read_exact(reinterpret_cast<char*>(head), 4));
  const uint64_t n = (uint64_t{head[0]} << 24) | (uint64_t{head[1]} << 16) | (uint64_t{head[2]} << 8) | head[3];
  if (static_cast<int64_t>(n) > max_bytes) {
    return Status(StatusCode::kBadGateway,
                  "runtime sent a frame of " + std::to_string(n) + " bytes; the limit is " + std::to_string(max_bytes),
                  "frame_too_large");
  }
  // Reserved (address space only) and written as bytes arrive, a MiB at a
  // time: a header that claims far more than follows costs no more memory
  // than what was sent, and a real frame is never copied.
  constexpr size_t kStep = size_t{1} << 20;
  std::string out;
  try {
    out.reserve(n);
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kResourceExhausted, "no memory for a runtime frame of " + std::to_string(n) + " bytes",
                  "frame_too_large");
  }
  while (out.size() < n) {
    const size_t at = out.size();
    const size_t take = std::min<size_t>(n - at, kStep);
    out.resize(at + take);
    RETURN_IF_ERROR(read_exact(out.data() + at, take));
  }
  return out;
}

}  // namespace shoal::runtime_protocol

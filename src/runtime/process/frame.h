// Frames of the out-of-process runtime protocol (docs/runtime-protocol.md):
// a 4-byte big-endian length, then that many bytes of MessagePack. Reads and
// writes on a blocking or non-blocking socket with an absolute deadline, so a
// silent or misbehaving peer can never hang the caller.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace shoal::runtime_protocol {

inline constexpr int kProtocolVersion = 1;
inline constexpr int64_t kDefaultMaxFrameBytes = int64_t{64} << 20;

// Writes one frame. DeadlineExceeded past `deadline_mono_us` (steady clock,
// microseconds), Unavailable when the peer has gone. `exit_fd` (>= 0): a
// descriptor that becomes readable when the peer process exits (a pidfd);
// the wait for the socket then ends with Unavailable "peer_closed" even if
// processes the peer started keep the socket open.
Status WriteFrame(int fd, std::string_view payload, int64_t deadline_mono_us, int exit_fd = -1);

// Reads one frame. Errors: DeadlineExceeded; Unavailable "peer_closed" on
// EOF or, with `exit_fd`, once the peer process has exited and the socket
// has nothing more to read; BadGateway "frame_too_large" when the announced
// length exceeds `max_bytes` (the stream cannot be trusted after that).
Result<std::string> ReadFrame(int fd, int64_t max_bytes, int64_t deadline_mono_us, int exit_fd = -1);

// Steady-clock microseconds, the time base of the deadlines above.
int64_t NowMonoUs();

}  // namespace shoal::runtime_protocol

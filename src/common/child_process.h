// What a child process does between fork and exec, shared by every place
// Shoal starts one. Only async-signal-safe calls.
#pragma once

#include <signal.h>

namespace shoal {

// The signals the parent's threads block (SIGINT, SIGTERM: one thread of
// the parent waits for them) would stay blocked across exec.
inline void UnblockAllSignalsInChild() {
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

}  // namespace shoal

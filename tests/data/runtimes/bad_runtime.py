#!/usr/bin/python3
"""Misbehaving runtimes for ProcessRuntime's tests (--mode picks how).

  wrong-version  answers hello with protocol 2
  refuse-device  refuses hello with error code device_fault
  exit           exits with code 3 before listening
  silent         never listens on the socket
  oversized      answers `run` with a frame header of 1 GiB
  garbage        answers `run` with bytes that are not MessagePack
  hang           never answers `run`
  error          answers `run` with ok:false (code device_fault), keeps
                 serving
  crash-once     like the real runtime, but dies (SIGKILL-like exit) on the
                 first `run` while $CRASH_MARKER does not exist; creates it
  slow-reload    the first `load` creates $SHOAL_TEST_MARK; a later one
                 (a restart's) finds it and sleeps
  leave-group    moves into its parent's process group, then serves, and
                 stays after `shutdown`
  fork-then-die  on `run`, forks a helper that sleeps holding the socket
                 (as forked multiprocessing workers do), writes its pid to
                 $HELPER_PID_FILE, then exits
  load-in-helper on `load`, forks a helper that writes 96 MiB of its own
                 and sleeps (as a runtime whose model lives in a forked
                 worker), waits until it has, then loads as usual
Everything else behaves as runtimes/python/shoal_runtime.py.
"""

import argparse
import os
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "runtimes", "python"))
import shoal_runtime  # noqa: E402


class BadServer(shoal_runtime.Server):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def hello(self, req):
        if self.mode == "refuse-device":
            return shoal_runtime.error("device_fault", "this runtime says its device broke")
        reply = super().hello(req)
        if self.mode == "wrong-version":
            reply["protocol"] = 2
        return reply

    def load(self, req):
        if self.mode == "load-in-helper":
            ready_r, ready_w = os.pipe()
            if os.fork() == 0:
                held = b"\x01" * (96 << 20)  # written, so resident  # noqa: F841
                os.write(ready_w, b"x")
                time.sleep(600)
                os._exit(0)
            os.read(ready_r, 1)
        if self.mode == "slow-reload":
            marker = os.environ["SHOAL_TEST_MARK"]
            if os.path.exists(marker):
                time.sleep(600)
            open(marker, "w").close()
        return super().load(req)

    def run(self, req):
        if self.mode == "crash-once":
            marker = os.environ["CRASH_MARKER"]
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(9)
        if self.mode == "fork-then-die":
            helper = os.fork()
            if helper == 0:
                time.sleep(600)
                os._exit(0)
            with open(os.environ["HELPER_PID_FILE"], "w") as f:
                f.write(str(helper))
            os._exit(7)
        if self.mode == "error":
            return shoal_runtime.error("device_fault", "this runtime refuses every batch")
        return super().run(req)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    mode = ap.parse_args().mode
    if mode == "exit":
        sys.exit(3)
    if mode == "silent":
        time.sleep(3600)
    if mode == "leave-group":
        os.setpgid(0, os.getpgid(os.getppid()))
    server = BadServer(mode)
    raw_write = shoal_runtime.write_frame

    def write_frame(conn, obj):
        if obj.get("rows") is not None:  # the reply to `run`
            if mode == "oversized":
                conn.sendall(struct.pack(">I", 1 << 30) + b"x" * 16)
                return
            if mode == "garbage":
                data = b"\xc1\xc1\xc1 not messagepack"
                conn.sendall(struct.pack(">I", len(data)) + data)
                return
            if mode == "hang":
                time.sleep(3600)
        raw_write(conn, obj)

    shoal_runtime.write_frame = write_frame
    shoal_runtime.serve(server, os.environ["SHOAL_RUNTIME_SOCKET"])
    if mode == "leave-group":
        time.sleep(3600)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Shoal's reference out-of-process runtime, in Python.

Speaks docs/runtime-protocol.md (version 1) on the Unix socket named by
$SHOAL_RUNTIME_SOCKET: 4-byte big-endian length, then a MessagePack map.
It serves eager-mode PyTorch models: `load` imports the model directory's
Python module (process.module in shoal.json, default model.py), whose
load(model_dir, config) returns an object with
    dim                      embedding width
    embed(ids, mask)         LongTensor[B,T] x2 -> FloatTensor[B,dim]
    memory_bytes()           optional: bytes the model holds

Dependencies are the runtime's own: Debian's python3-torch and
python3-msgpack. The worker starts one such process per model (command,
environment and working directory from shoal.json), restarts it when it dies
and redelivers a batch that was in flight.
"""

import importlib.util
import json
import os
import socket
import struct
import sys
import traceback

import msgpack
import torch

PROTOCOL = 1
MAX_FRAME = 64 << 20
TASKS = ["embed"]


class ProtocolError(Exception):
    pass


def read_frame(conn):
    head = recv_exact(conn, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = recv_exact(conn, n)
    if body is None:
        raise ProtocolError("connection closed inside a frame")
    return msgpack.unpackb(body, raw=False)


def recv_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None if not buf else bytes(buf)
        buf += chunk
    return bytes(buf)


def write_frame(conn, obj):
    data = msgpack.packb(obj, use_bin_type=True)
    conn.sendall(struct.pack(">I", len(data)) + data)


def error(code, message):
    return {"ok": False, "error": {"code": code, "message": message}}


class Server:
    """One model per process (Shoal starts one process per model), but the
    protocol names the model on load, so a runtime may hold several."""

    def __init__(self):
        self.model = None
        self.name = None

    def hello(self, req):
        if req.get("protocol") != PROTOCOL:
            return error("unsupported_protocol",
                         f"this runtime speaks protocol {PROTOCOL}, not {req.get('protocol')}")
        return {"ok": True, "protocol": PROTOCOL, "tasks": TASKS,
                "runtime": f"shoal-python/1 (python {sys.version.split()[0]}, torch {torch.__version__})"}

    def load(self, req):
        global MAX_FRAME
        m = req["model"]
        config = json.loads(m.get("config_json") or "{}")
        # The worker's limit on frames both ways (process.max_frame_bytes),
        # which it has checked a full batch against.
        MAX_FRAME = int(config.get("process", {}).get("max_frame_bytes", MAX_FRAME))
        threads = int(m.get("intra_op_threads") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        module_file = config.get("process", {}).get("module", "model.py")
        path = os.path.join(m["dir"], module_file)
        spec = importlib.util.spec_from_file_location("shoal_user_model", path)
        if spec is None or spec.loader is None:
            return error("model_load_failed", f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.load(m["dir"], dict(config, **{k: v for k, v in m.items() if k != "config_json"}))
        self.model, self.name = model, m["name"]
        memory = model.memory_bytes() if hasattr(model, "memory_bytes") else 0
        return {"ok": True, "dim": int(model.dim), "memory_bytes": int(memory)}

    def run(self, req):
        if self.model is None:
            return error("not_loaded", "no model is loaded")
        if req.get("task", "embed") not in TASKS:
            return error("unsupported_task", f"task {req.get('task')!r} is not served here")
        rows, seq_len = int(req["rows"]), int(req["seq_len"])
        ids = req["input_ids"]
        mask = req["attention_mask"]
        if len(ids) != rows * seq_len * 4 or len(mask) != rows * seq_len:
            return error("invalid_batch", "input_ids / attention_mask do not match rows x seq_len")
        ids_t = torch.frombuffer(bytearray(ids), dtype=torch.int32).view(rows, seq_len).long()
        mask_t = torch.frombuffer(bytearray(mask), dtype=torch.uint8).view(rows, seq_len).long()
        with torch.inference_mode():
            out = self.model.embed(ids_t, mask_t)
        if tuple(out.shape) != (rows, self.model.dim):
            return error("bad_output", f"embed returned shape {tuple(out.shape)}, expected ({rows}, {self.model.dim})")
        # A model on a GPU answers with a device tensor: copy it to the host.
        out = out.detach().to("cpu", torch.float32).contiguous()
        return {"ok": True, "rows": rows, "embeddings": out.numpy().tobytes()}

    def unload(self, req):
        self.model, self.name = None, None
        return {"ok": True}

    def ping(self, req):
        return {"ok": True}

    def handle(self, req):
        """The reply to one request (without its id)."""
        op = req.get("op")
        handler = {"hello": self.hello, "load": self.load, "run": self.run,
                   "unload": self.unload, "ping": self.ping}.get(op)
        if op == "shutdown":
            return {"ok": True}
        if handler is None:
            return error("unknown_op", f"unknown op {op!r}")
        try:
            return handler(req)
        except Exception as e:  # the runtime answers; it never dies of a bad request
            traceback.print_exc(file=sys.stderr)
            return error("runtime_error", f"{type(e).__name__}: {e}")


def serve(server, socket_path):
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(1)
    while True:
        conn, _ = listener.accept()
        with conn:
            while True:
                try:
                    req = read_frame(conn)
                except ProtocolError as e:
                    print(f"shoal_runtime: {e}; dropping the connection", file=sys.stderr)
                    break
                if req is None:
                    break  # the worker went away; wait for the next one
                if not isinstance(req, dict):
                    write_frame(conn, dict(error("malformed_frame", "a request must be a map"), id=0))
                    continue
                reply = server.handle(req)
                reply["id"] = req.get("id", 0)
                write_frame(conn, reply)
                if req.get("op") == "shutdown":
                    return


def main():
    socket_path = os.environ.get("SHOAL_RUNTIME_SOCKET")
    if not socket_path:
        sys.exit("shoal_runtime: $SHOAL_RUNTIME_SOCKET is not set (the worker sets it)")
    serve(Server(), socket_path)


if __name__ == "__main__":
    main()

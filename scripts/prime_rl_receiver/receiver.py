"""A TEST RECEIVER standing in for a prime-rl trainer + inference server. It is not prime-rl.

It exists so the prime_rl backend can be run end to end on a machine without GPUs or
prime-rl: a real process that

- reads TrainingBatches from the real transport, the way prime-rl's trainer does at the
  pinned commit (retrain/backends/prime_rl.py, PRIME_RL_COMMIT): the filesystem transport
  (`{output_dir}/rollouts/step_N/rollouts.bin`, step after step) or the ZMQ transport (a
  PULL socket bound on host:port, two-part messages `[sender_id, payload]`);
- decodes each batch with its own msgpack reader (written from the msgpack specification,
  no msgspec) and checks it against prime-rl's TrainingSample/TrainingBatch layout, then
  records it as one JSON line in `{output_dir}/receiver/batches.jsonl`;
- "trains" (does nothing) and publishes weights the way prime-rl's filesystem broadcaster
  does: `{output_dir}/broadcasts/step_{N+1}/` with a weights file, then the empty `STABLE`
  marker last;
- serves, on 127.0.0.1, `POST /v1/chat/completions/tokens` (deterministic completions: token
  ids and logprobs drawn from a seeded generator, vLLM's response shape) and
  `POST /update_weights` (`{"weight_dir": ...}`, recorded in `receiver/updates.jsonl`),
  plus `GET /health`.

Usage (the tests start it as a subprocess):

    python scripts/prime_rl_receiver/receiver.py --output-dir DIR --vocab-size 100 \
        --eos-id 2 --ready-file ready.json [--transport zmq --zmq-port 5555] [--no-http]

Only the Python standard library is needed, plus pyzmq for --transport zmq.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# prime-rl's src/prime_rl/transport/types.py, field by field in wire order, with the
# msgpack types each field may hold (array_like structs: a struct is an array of its
# fields; like msgspec's decoder, missing trailing optional fields read as None).
SAMPLE_LAYOUT = (
    ("prompt_ids", "ints", True),
    ("prompt_mask", "bools", True),
    ("completion_ids", "ints", True),
    ("completion_mask", "bools", True),
    ("completion_logprobs", "floats", True),
    ("completion_temperatures", "floats", True),
    ("teacher_logprobs", "floats?", False),
    ("advantage", "float?", False),
    ("reward", "float?", False),
    ("pixel_values", "bin?", False),
    ("pixel_values_shape", "ints?", False),
    ("image_grid_thw", "nested?", False),
    ("routed_experts", "nested?", False),
)
BATCH_LAYOUT = (("examples", "samples", True), ("step", "int", True), ("run_idx", "int?", False))


# ---------------------------------------------------------------- msgpack, from the spec


class MsgpackError(ValueError):
    pass


def unpack(data: bytes) -> Any:
    """Decode one msgpack object (the subset prime-rl's batches use: nil, bool, ints,
    float 32/64, str, bin, array, map). Raises MsgpackError on anything else or on
    trailing bytes."""
    value, end = _unpack(memoryview(data), 0)
    if end != len(data):
        raise MsgpackError(f"{len(data) - end} trailing bytes after the object")
    return value


def _take(buf: memoryview, pos: int, n: int) -> tuple[bytes, int]:
    if pos + n > len(buf):
        raise MsgpackError("truncated data")
    return bytes(buf[pos : pos + n]), pos + n


def _unpack(buf: memoryview, pos: int) -> tuple[Any, int]:
    if pos >= len(buf):
        raise MsgpackError("truncated data")
    b = buf[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if b >= 0xE0:
        return b - 0x100, pos
    if 0x90 <= b <= 0x9F:
        return _array(buf, pos, b & 0x0F)
    if 0x80 <= b <= 0x8F:
        return _map(buf, pos, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        raw, pos = _take(buf, pos, b & 0x1F)
        return raw.decode("utf-8"), pos
    if b == 0xC0:
        return None, pos
    if b == 0xC2:
        return False, pos
    if b == 0xC3:
        return True, pos
    fixed = {
        0xCC: ">B",
        0xCD: ">H",
        0xCE: ">I",
        0xCF: ">Q",
        0xD0: ">b",
        0xD1: ">h",
        0xD2: ">i",
        0xD3: ">q",
        0xCA: ">f",
        0xCB: ">d",
    }
    if b in fixed:
        fmt = fixed[b]
        raw, pos = _take(buf, pos, struct.calcsize(fmt))
        return struct.unpack(fmt, raw)[0], pos
    sized = {0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str")}
    sized |= {0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin")}
    sized |= {0xDC: (">H", "array"), 0xDD: (">I", "array"), 0xDE: (">H", "map")}
    sized |= {0xDF: (">I", "map")}
    if b in sized:
        fmt, kind = sized[b]
        raw, pos = _take(buf, pos, struct.calcsize(fmt))
        n = struct.unpack(fmt, raw)[0]
        if kind == "array":
            return _array(buf, pos, n)
        if kind == "map":
            return _map(buf, pos, n)
        raw, pos = _take(buf, pos, n)
        return (raw.decode("utf-8") if kind == "str" else raw), pos
    raise MsgpackError(f"unsupported msgpack type byte 0x{b:02x}")


def _array(buf: memoryview, pos: int, n: int) -> tuple[list, int]:
    out = []
    for _ in range(n):
        value, pos = _unpack(buf, pos)
        out.append(value)
    return out, pos


def _map(buf: memoryview, pos: int, n: int) -> tuple[dict, int]:
    out = {}
    for _ in range(n):
        key, pos = _unpack(buf, pos)
        out[key], pos = _unpack(buf, pos)
    return out, pos


# ---------------------------------------------------------------- prime-rl's schema


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(kind: str, value: Any, name: str) -> Any:
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if value is None and optional:
        return None
    ok = {
        "ints": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
        "bools": lambda v: isinstance(v, list) and all(isinstance(x, bool) for x in v),
        "floats": lambda v: isinstance(v, list) and all(isinstance(x, float) for x in v),
        "float": lambda v: isinstance(v, float),
        "int": _is_int,
        "samples": lambda v: isinstance(v, list),
        "bin": lambda v: isinstance(v, bytes),
        "nested": lambda v: isinstance(v, list),
    }[kind]
    if not ok(value):
        raise MsgpackError(f"field {name!r} should hold {kind}, got {value!r:.80}")
    return value


def _struct(values: Any, layout: tuple, what: str) -> dict[str, Any]:
    if not isinstance(values, list):
        raise MsgpackError(f"{what} must be a msgpack array (array_like), got {type(values)}")
    required = sum(1 for _, _, req in layout if req)
    if not required <= len(values) <= len(layout):
        raise MsgpackError(f"{what} has {len(values)} fields, expected {required}..{len(layout)}")
    out = {name: None for name, _, _ in layout}
    for (name, kind, _), value in zip(layout, values):
        out[name] = _check(kind, value, f"{what}.{name}")
    return out


def batch_from_wire(payload: bytes) -> dict[str, Any]:
    """A TrainingBatch's bytes as a dict of prime-rl's field names (examples as dicts),
    checked field by field; MsgpackError when the bytes do not follow the layout."""
    batch = _struct(unpack(payload), BATCH_LAYOUT, "TrainingBatch")
    batch["examples"] = [
        _struct(e, SAMPLE_LAYOUT, f"TrainingSample[{i}]") for i, e in enumerate(batch["examples"])
    ]
    for i, e in enumerate(batch["examples"]):
        n_p, n_c = len(e["prompt_ids"]), len(e["completion_ids"])
        for name, n in (("prompt_mask", n_p), ("completion_mask", n_c)):
            if len(e[name]) != n:
                raise MsgpackError(
                    f"TrainingSample[{i}].{name} has {len(e[name])} entries, not {n}"
                )
        for name in ("completion_logprobs", "completion_temperatures"):
            if len(e[name]) != n_c:
                raise MsgpackError(
                    f"TrainingSample[{i}].{name} has {len(e[name])} entries, not {n_c}"
                )
    return batch


# ---------------------------------------------------------------- the receiver


class Receiver:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.output_dir = Path(args.output_dir)
        self.record_dir = self.output_dir / "receiver"
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.step = args.start_step
        self.loaded_step = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def record(self, name: str, row: dict[str, Any]) -> None:
        with self.lock, open(self.record_dir / name, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def handle_batch(self, payload: bytes, sender_id: str | None) -> None:
        try:
            batch = batch_from_wire(payload)
        except MsgpackError as exc:
            self.record("errors.jsonl", {"expected_step": self.step, "error": str(exc)})
            return
        self.record(
            "batches.jsonl",
            {
                "expected_step": self.step,
                "sender_id": sender_id,
                "bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
                **batch,
            },
        )
        self.step = batch["step"] + 1
        time.sleep(self.args.train_s)  # the "training"
        if not self.args.no_broadcast:
            self.broadcast(self.step)

    def broadcast(self, step: int) -> None:
        """Weights first, the STABLE marker last (as prime-rl's filesystem broadcaster)."""
        where = self.output_dir / "broadcasts" / f"step_{step}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "weights.json").write_text(json.dumps({"step": step, "test_receiver": True}))
        (where / "STABLE").touch()

    def run_filesystem(self) -> None:
        while not self.stop.is_set():
            path = self.output_dir / "rollouts" / f"step_{self.step}" / "rollouts.bin"
            if path.exists():
                self.handle_batch(path.read_bytes(), None)
            else:
                time.sleep(0.05)

    def run_zmq(self) -> None:
        import zmq

        context = zmq.Context.instance()
        sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, self.args.zmq_hwm)
        sock.bind(f"tcp://{self.args.zmq_host}:{self.args.zmq_port}")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        self.zmq_ready.set()
        while not self.stop.is_set():
            if not dict(poller.poll(100)):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 2:
                self.record("errors.jsonl", {"error": f"{len(frames)} frames, expected 2"})
                continue
            self.handle_batch(frames[1], frames[0].decode("utf-8"))
        sock.close(linger=0)

    # ------------------------------------------------------------ inference

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        tokens = [int(t) for t in body["tokens"]]
        n, max_tokens = int(body.get("n", 1)), int(body.get("max_tokens", 16))
        seed = body.get("seed")
        key = json.dumps([tokens, seed, self.loaded_step]).encode()
        rng = random.Random(hashlib.sha256(key).hexdigest())
        choices = []
        for i in range(n):
            length = rng.randint(1, max_tokens)
            ids = [
                rng.randrange(self.args.first_token, self.args.vocab_size) for _ in range(length)
            ]
            ids = [t if t != self.args.eos_id else self.args.first_token for t in ids]
            finish = "length"
            if length < max_tokens:
                ids[-1] = self.args.eos_id
                finish = "stop"
            content = [
                {"token": f"token_id:{t}", "logprob": -rng.uniform(0.05, 4.0), "top_logprobs": []}
                for t in ids
            ]
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": ""},
                    "finish_reason": finish,
                    "token_ids": ids,
                    "logprobs": {"content": content},
                }
            )
        self.record(
            "requests.jsonl",
            {"n": n, "prompt_tokens": len(tokens), "seed": seed, "loaded_step": self.loaded_step},
        )
        return {
            "id": f"chatcmpl-test-{rng.randrange(1 << 30)}",
            "object": "chat.completion",
            "model": body.get("model", ""),
            "prompt_token_ids": tokens,
            "choices": choices,
            "usage": {"prompt_tokens": len(tokens)},
        }

    def update_weights(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        where = Path(str(body.get("weight_dir", "")))
        if not (where / "STABLE").exists():
            return 400, {"error": f"{where} holds no STABLE weights"}
        step = int(json.loads((where / "weights.json").read_text())["step"])
        self.loaded_step = step
        self.record("updates.jsonl", {"weight_dir": str(where), "step": step})
        return 200, {"status": "ok"}

    def http_handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _reply(self, status: int, data: dict[str, Any]) -> None:
                body = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._reply(200, {"status": "ok", "loaded_step": receiver.loaded_step})
                else:
                    self._reply(404, {"error": self.path})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    self._reply(400, {"error": "body is not JSON"})
                    return
                if self.path == "/v1/chat/completions/tokens":
                    self._reply(200, receiver.complete(body))
                elif self.path == "/update_weights":
                    self._reply(*receiver.update_weights(body))
                else:
                    self._reply(404, {"error": self.path})

        return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="A test receiver standing in for prime-rl (not prime-rl)"
    )
    p.add_argument("--output-dir", required=True)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--transport", choices=("filesystem", "zmq"), default="filesystem")
    p.add_argument("--zmq-host", default="127.0.0.1")
    p.add_argument("--zmq-port", type=int, default=5555)
    p.add_argument("--zmq-hwm", type=int, default=10)
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--no-http", action="store_true")
    p.add_argument("--no-broadcast", action="store_true")
    p.add_argument("--vocab-size", type=int, default=100)
    p.add_argument("--first-token", type=int, default=3, help="lowest token id to sample")
    p.add_argument("--eos-id", type=int, default=2)
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--train-s", type=float, default=0.05)
    args = p.parse_args(argv)

    receiver = Receiver(args)
    receiver.zmq_ready = threading.Event()
    ready: dict[str, Any] = {"transport": args.transport}
    if args.transport == "zmq":
        loop = threading.Thread(target=receiver.run_zmq, daemon=True)
        loop.start()
        if not receiver.zmq_ready.wait(10):
            print("the ZMQ socket did not bind", file=sys.stderr)
            return 1
        ready["zmq"] = f"tcp://{args.zmq_host}:{args.zmq_port}"
    else:
        loop = threading.Thread(target=receiver.run_filesystem, daemon=True)
        loop.start()
    server = None
    if not args.no_http:
        server = ThreadingHTTPServer(("127.0.0.1", args.http_port), receiver.http_handler())
        ready["url"] = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
    tmp = Path(args.ready_file + ".tmp")
    tmp.write_text(json.dumps(ready))
    tmp.replace(args.ready_file)
    try:
        while loop.is_alive():
            loop.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop.set()
        if server is not None:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

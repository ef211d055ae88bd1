"""A TEST RECEIVER standing in for a prime-rl trainer + inference server. It is not prime-rl.

It exists so the prime_rl backend can be run end to end on a machine without GPUs or
prime-rl: a real process that

- finds the run the way prime-rl's trainer does at the pinned commit
  (retrain/backends/prime_rl.py, PRIME_RL_COMMIT): only a `run_*` directory holding
  `control/orch.toml` (its `ckpt.resume_step`, when set, is the first batch step to read;
  a config it cannot read is refused in `control/config_validation_error.txt`), and it
  evicts the run (`control/evicted.txt`) for a sample longer than `--seq-len`;
- reads TrainingBatches from the real transport, as that trainer does: the filesystem transport
  (`{output_dir}/rollouts/step_N/rollouts.bin`, step after step) or the ZMQ transport (a
  PULL socket bound on host:port, two-part messages `[sender_id, payload]`);
- decodes each batch with its own msgpack reader (written from the msgpack specification,
  no msgspec) and checks it against prime-rl's TrainingSample/TrainingBatch layout, then
  records it as one JSON line in `{output_dir}/receiver/batches.jsonl`;
- "trains" (does nothing) and publishes weights the way prime-rl's filesystem broadcaster
  does: `{output_dir}/broadcasts/step_{N+1}/` with a weights file (and, with `--lora`, an
  `adapter_config.json`: a LoRA trainer's adapter), then the empty `STABLE` marker last;
- serves, on 127.0.0.1, `POST /v1/chat/completions/tokens` (deterministic completions: token
  ids and logprobs drawn from a seeded generator, vLLM's response shape),
  `POST /update_weights` (`{"weight_dir": ...}`) and `POST /load_lora_adapter`
  (`{"lora_name": ..., "lora_path": ...}`), both recorded in `receiver/updates.jsonl`,
  plus `GET /health`.

Usage (the tests start it as a subprocess):

    python scripts/prime_rl_receiver/receiver.py --output-dir DIR --vocab-size 100 \
        --eos-id 2 --ready-file ready.json [--transport zmq --zmq-port 5555] [--no-http] \
        [--lora] [--seq-len 4096]

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
import tomllib
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
        self.step = 0
        self.loaded_step = 0
        self.lora_name: str | None = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.control = self.output_dir / "control"
        self.evicted = False

    def discover(self) -> bool:
        """Whether the run is found, as prime-rl's trainer finds runs: a `run_*` directory
        with a readable control/orch.toml; its resume step is the first batch step to read."""
        config_path = self.control / "orch.toml"
        if not self.output_dir.name.startswith("run_") or not config_path.is_file():
            return False
        try:
            config = tomllib.loads(config_path.read_text())
            assert isinstance(config["model"]["name"], str), "model.name is not a string"
            assert config["output_dir"] == str(self.output_dir), "output_dir is another run's"
            resume = (config.get("ckpt") or {}).get("resume_step")
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            (self.control / "config_validation_error.txt").write_text(f"{exc!r}\n")
            return False
        self.step = int(resume or 0)
        self.record("discovered.jsonl", {"step": self.step, "config": config})
        return True

    def evict(self, batch: dict[str, Any]) -> bool:
        """Evict the run for a sample the trainer cannot pack (prime-rl's packer checks)."""
        for e in batch["examples"]:
            n = len(e["prompt_ids"]) + len(e["completion_ids"])
            if n > self.args.seq_len:
                (self.control / "evicted.txt").write_text(
                    f"Run wrote a sample with invalid data: Run wrote a sample with length {n} "
                    f"which exceeds max sequence length {self.args.seq_len}\n"
                )
                self.evicted = True
                return True
        return False

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
        if self.evict(batch):
            return
        self.step = batch["step"] + 1
        time.sleep(self.args.train_s)  # the "training"
        if not self.args.no_broadcast:
            self.broadcast(self.step)

    def broadcast(self, step: int) -> None:
        """Weights first, the STABLE marker last (as prime-rl's filesystem broadcaster)."""
        where = self.output_dir / "broadcasts" / f"step_{step}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "weights.json").write_text(json.dumps({"step": step, "test_receiver": True}))
        if self.args.lora:
            (where / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
        (where / "STABLE").touch()

    def wait_for_the_run(self) -> None:
        while not self.stop.is_set() and not self.discover():
            time.sleep(0.05)

    def run_filesystem(self) -> None:
        self.wait_for_the_run()
        while not self.stop.is_set() and not self.evicted:
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
        self.wait_for_the_run()  # meanwhile batches queue in the socket, as in prime-rl
        while not self.stop.is_set() and not self.evicted:
            if not dict(poller.poll(100)):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 2:
                self.record("errors.jsonl", {"error": f"{len(frames)} frames, expected 2"})
                continue
            if frames[0].decode("utf-8") != self.output_dir.name:  # another run's batches
                self.record("errors.jsonl", {"error": f"sender {frames[0]!r} is no known run"})
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
            {
                "n": n,
                "prompt_tokens": len(tokens),
                "seed": seed,
                "loaded_step": self.loaded_step,
                "model": body.get("model"),
            },
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
        if (where / "adapter_config.json").exists():  # vLLM cannot load an adapter as weights
            return 400, {"error": f"{where} holds a LoRA adapter: load it with /load_lora_adapter"}
        step = int(json.loads((where / "weights.json").read_text())["step"])
        self.loaded_step = step
        self.record("updates.jsonl", {"weight_dir": str(where), "step": step})
        return 200, {"status": "ok"}

    def load_lora_adapter(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        where = Path(str(body.get("lora_path", "")))
        if not (where / "adapter_config.json").exists():
            return 400, {"error": f"{where} holds no LoRA adapter"}
        step = int(json.loads((where / "weights.json").read_text())["step"])
        self.loaded_step, self.lora_name = step, str(body.get("lora_name"))
        self.record(
            "updates.jsonl", {"lora_path": str(where), "step": step, "lora_name": self.lora_name}
        )
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
                elif self.path == "/load_lora_adapter":
                    self._reply(*receiver.load_lora_adapter(body))
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
    p.add_argument("--lora", action="store_true", help="broadcast LoRA adapters")
    p.add_argument("--seq-len", type=int, default=4096, help="evict a run's longer samples")
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

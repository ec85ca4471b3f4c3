#!/usr/bin/env python3
"""Fault storm for `slowfast serve`: clients that misbehave, over loopback raw sockets, each
fault bounded in count and time; after each one /metrics must show no running or queued
sequence and the KV bytes in use back at their idle value, and a normal request must succeed.

Used by tests/serve/test_faults.py (CPU, its own servers) and standalone against any server:
  python3 tests/serve/fault_storm.py --url http://127.0.0.1:8080 [--token-ids VOCAB]
      [--header-read-timeout S] [--nvidia-smi] [--gpu-mem-tolerance-mib M]
(scripts/gpu_run.sh's `faults` phase runs it against `serve --device cuda` with --nvidia-smi:
GPU memory, measured idle after a warm-up, must come back to that value after the storm.)
"""
from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse


class Target:
    def __init__(self, url: str, model: str | None = None, token_ids: int = 0):
        u = urlparse(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.url = url.rstrip("/")
        self.token_ids = token_ids  # > 0: prompts are token ids below this vocab size
        self.model = model

    # -- raw HTTP -----------------------------------------------------------------------------
    def sock(self, timeout: float = 30) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout=timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def head(self, method: str, path: str, length: int | None, extra: str = "") -> bytes:
        h = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if length is not None:
            h += f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
        return (h + extra + "\r\n").encode()

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 120,
                extra: str = "") -> tuple[int, bytes]:
        """One request on a fresh connection (Connection: close); (status, body)."""
        s = self.sock(timeout)
        try:
            s.sendall(self.head(method, path, None if body is None else len(body),
                                extra + "Connection: close\r\n") + (body or b""))
            data = b""
            while True:
                c = s.recv(65536)
                if not c:
                    break
                data += c
        finally:
            s.close()
        return parse_response(data)

    def prompt(self, n: int, seed: int = 0):
        if self.token_ids:
            rng = random.Random(seed)
            return [rng.randrange(10, self.token_ids - 10) for _ in range(n)]
        words = ("the river ran past the mill and the miller counted his sacks of grain while "
                 "rain fell on the hills ").split()
        return " ".join(words[(i + seed) % len(words)] for i in range(n))

    def body(self, prompt_tokens: int, max_tokens: int, stream: bool, seed: int = 0) -> bytes:
        b = {"prompt": self.prompt(prompt_tokens, seed), "max_tokens": max_tokens,
             "temperature": 0, "stream": stream, "ignore_eos": True}
        if self.model:
            b["model"] = self.model
        return json.dumps(b).encode()

    def metrics(self) -> dict[str, float]:
        st, body = self.request("GET", "/metrics", timeout=30)
        assert st == 200, f"/metrics: HTTP {st}"
        out = {}
        for line in body.decode().splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line.strip())
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def wait_idle(self, kv_idle: float, timeout: float = 30) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m.get("slowfast_running_sequences") == 0 and m.get("slowfast_queued_sequences") == 0
                    and m.get("slowfast_kv_bytes_in_use") == kv_idle):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not idle {timeout}s after the fault: running={m.get('slowfast_running_sequences')} "
                    f"queued={m.get('slowfast_queued_sequences')} kv_bytes_in_use="
                    f"{m.get('slowfast_kv_bytes_in_use')} (idle {kv_idle})")
            time.sleep(0.1)

    def ok_request(self, stream: bool = False, timeout: float = 120):
        st, body = self.request("POST", "/v1/completions", self.body(8, 4, stream), timeout=timeout)
        assert st == 200, f"a normal request got HTTP {st}: {body[:300]!r}"
        if stream:
            assert b"data: [DONE]" in body, body[-300:]
        else:
            j = json.loads(body)
            assert j["choices"][0]["finish_reason"] in ("length", "stop"), j


def parse_response(data: bytes) -> tuple[int, bytes]:
    if not data:
        return 0, b""
    head, _, rest = data.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    status = int(m.group(1)) if m else 0
    if b"transfer-encoding: chunked" in head.lower():
        out, r = b"", rest
        while r:
            ln, _, r = r.partition(b"\r\n")
            try:
                n = int(ln.split(b";")[0], 16)
            except ValueError:
                break
            if n == 0:
                break
            out, r = out + r[:n], r[n + 2:]
        rest = out
    return status, rest


def read_until(s: socket.socket, marker: bytes, limit: float) -> bytes:
    """Reads until `marker` is seen (or the peer closes / `limit` s pass)."""
    s.settimeout(limit)
    data = b""
    deadline = time.monotonic() + limit
    while marker not in data and time.monotonic() < deadline:
        try:
            c = s.recv(65536)
        except socket.timeout:
            break
        if not c:
            break
        data += c
    return data


def hard_close(s: socket.socket):
    """Close with RST (SO_LINGER 0): the abrupt disconnect of a crashed client."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    s.close()


# -- the faults ----------------------------------------------------------------------------------
def disconnect_mid_prefill(t: Target, n: int = 4, prompt_tokens: int = 700):
    """Long prompts, the socket closed once the server has taken the request (before any token).

    The close waits for /metrics to count the prompt: a reset that arrives before the server
    has read the body drops the request unread (a connection error, not a cancelled request),
    and on a busy machine that race decided the outcome."""
    key = "slowfast_prompt_tokens_total"
    for i in range(n):
        s = t.sock()
        body = t.body(prompt_tokens, 16, stream=(i % 2 == 0), seed=i)
        seen = t.metrics().get(key, 0)
        s.sendall(t.head("POST", "/v1/completions", len(body)) + body)
        deadline = time.monotonic() + 30
        while t.metrics().get(key, 0) <= seen:
            assert time.monotonic() < deadline, "the server never took the request"
            time.sleep(0.005)
        time.sleep(0.05 * i)
        (hard_close if i % 2 else socket.socket.close)(s)


def disconnect_mid_stream(t: Target, n: int = 6):
    """Streams closed after their first chunk, at random points of the stream."""
    rng = random.Random(1)
    for i in range(n):
        s = t.sock()
        body = t.body(16, 64, stream=True, seed=i)
        s.sendall(t.head("POST", "/v1/completions", len(body)) + body)
        got = read_until(s, b"data: {", 60)
        assert b"200 OK" in got, got[:200]
        # between chunks: a random extra number of chunks read before closing
        for _ in range(rng.randrange(0, 4)):
            read_until(s, b"\n\n", 5)
        (hard_close if i % 2 else socket.socket.close)(s)


def abandon_nonstream(t: Target, n: int = 4):
    """Non-streaming requests whose client goes away while the answer is computed."""
    for i in range(n):
        s = t.sock()
        body = t.body(32, 96, stream=False, seed=i)
        s.sendall(t.head("POST", "/v1/completions", len(body)) + body)
        time.sleep(0.2)
        (hard_close if i % 2 else socket.socket.close)(s)


def concurrent_cancels(t: Target, n: int = 24):
    """n streams started together, every one dropped at the same moment."""
    socks, errs = [None] * n, []
    barrier = threading.Barrier(n)

    def one(i):
        try:
            s = t.sock()
            body = t.body(16, 128, stream=True, seed=100 + i)
            barrier.wait(30)
            s.sendall(t.head("POST", "/v1/completions", len(body)) + body)
            got = read_until(s, b"HTTP/1.1", 60)
            if b"HTTP/1.1" not in got:
                errs.append(f"stream {i}: no response head")
            socks[i] = s
        except Exception as e:  # noqa: BLE001
            errs.append(f"stream {i}: {e!r}")

    th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for x in th:
        x.start()
    for x in th:
        x.join(90)
    for s in socks:
        if s is not None:
            hard_close(s)
    assert not errs, errs[:5]


def bad_bodies(t: Target, max_body_bytes: int):
    """Past the size limit (413, by Content-Length and by chunked transfer), a truncated body
    (Content-Length larger than what is sent, then close), invalid UTF-8 (400, named)."""
    st, b = t.request("POST", "/v1/completions", b'{"prompt": "' + b"a" * (max_body_bytes + 10) + b'"}')
    assert st == 413, (st, b[:200])
    assert b"max-body-bytes" in b, b[:300]
    # chunked, no Content-Length: counted as it comes
    s = t.sock()
    s.sendall("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode())
    chunk = b"a" * 65536
    try:
        for _ in range(max_body_bytes // len(chunk) + 2):
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    except OSError:
        pass  # the server answered and closed
    got = read_until(s, b"max-body-bytes", 10)
    s.close()
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    # truncated: promise 4096 bytes, send 20, close the write side
    s = t.sock()
    s.sendall(t.head("POST", "/v1/completions", 4096) + b'{"prompt": "hello",')
    s.shutdown(socket.SHUT_WR)
    got = read_until(s, b"}}", 10)
    s.close()
    assert got == b"" or got.startswith(b"HTTP/1.1 400"), got[:300]
    # truncated with RST
    s = t.sock()
    s.sendall(t.head("POST", "/v1/completions", 4096) + b'{"prompt": "hello",')
    time.sleep(0.1)
    hard_close(s)
    # invalid UTF-8
    st, b = t.request("POST", "/v1/completions", b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}')
    assert st == 400, (st, b[:300])
    assert b"UTF-8" in b, b[:300]
    json.loads(b)


def slowloris(t: Target, header_timeout: float, body_timeout: float, n: int = 8):
    """Trickled headers and trickled bodies: each connection is closed (or, for a body, given a
    408) within a bounded time, while normal requests keep succeeding."""
    stop = threading.Event()
    results: dict[str, list] = {"head": [], "body": []}

    def trickle_head(i):
        s = t.sock()
        start = time.monotonic()
        msg = t.head("POST", "/v1/completions", 100)
        closed = False
        try:
            for k in range(len(msg) - 3):  # never completes the head
                s.sendall(msg[k:k + 1])
                s.settimeout(0.25)
                try:
                    if s.recv(4096) == b"":
                        closed = True
                        break
                except socket.timeout:
                    pass
                except OSError:
                    closed = True
                    break
                if stop.is_set() or time.monotonic() - start > header_timeout + 20:
                    break
        except OSError:
            closed = True
        results["head"].append((closed, time.monotonic() - start))
        s.close()

    def trickle_body(i):
        s = t.sock()
        start = time.monotonic()
        body = t.body(8, 2, False, seed=i)
        s.sendall(t.head("POST", "/v1/completions", len(body)))
        got = b""
        try:
            for k in range(len(body) - 1):  # never completes the body
                s.sendall(body[k:k + 1])
                s.settimeout(0.25)
                try:
                    c = s.recv(4096)
                    if c == b"":
                        break
                    got += c
                    if b"\r\n\r\n" in got:
                        break
                except socket.timeout:
                    pass
                if stop.is_set() or time.monotonic() - start > body_timeout + 20:
                    break
        except OSError:
            pass
        results["body"].append((got[:12], time.monotonic() - start))
        s.close()

    th = [threading.Thread(target=trickle_head if i % 2 == 0 else trickle_body, args=(i,))
          for i in range(n)]
    for x in th:
        x.start()
    # others are served meanwhile
    t0 = time.monotonic()
    served = 0
    while any(x.is_alive() for x in th) and time.monotonic() - t0 < max(header_timeout, body_timeout) + 25:
        t.ok_request(stream=served % 2 == 1, timeout=60)
        served += 1
    stop.set()
    for x in th:
        x.join(30)
    assert served >= 1, "no normal request finished while the slow clients were connected"
    for closed, dt in results["head"]:
        assert closed, f"a trickled-header connection was still open after {dt:.1f}s (--header-read-timeout {header_timeout})"
        assert dt < header_timeout + 5, f"a trickled-header connection lived {dt:.1f}s"
    for got, dt in results["body"]:
        assert got.startswith(b"HTTP/1.1 408"), f"a trickled body got {got!r} after {dt:.1f}s"
        assert dt < body_timeout + 5, f"a trickled body lived {dt:.1f}s"
    return served


def still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def idle_connections(t: Target, n: int = 1000, requests: int = 6) -> int:
    """n idle connections held open while normal requests still succeed; how many of them
    the server still holds open at the end (all, unless --header-read-timeout has passed)."""
    held = []
    try:
        for _ in range(n):
            held.append(t.sock(10))
        for i in range(requests):
            t.ok_request(stream=i % 2 == 1, timeout=60)
        # the server is still accepting: one more connection gets an answer
        st, _ = t.request("GET", "/health", timeout=20)
        assert st == 200, st
        return sum(still_open(s) for s in held)
    finally:
        for s in held:
            s.close()


def gpu_memory_mib() -> list[int]:
    p = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return [int(x) for x in p.stdout.split()]


STORM = ["disconnect_mid_prefill", "disconnect_mid_stream", "abandon_nonstream",
         "concurrent_cancels", "bad_bodies", "idle_connections", "slowloris"]


def run_storm(t: Target, faults: list[str], max_body_bytes: int, header_timeout: float,
              body_timeout: float, log=print) -> dict:
    # idle: what the server holds before the warm-up (a storm starts on an idle server; read
    # after a request, the metric may still count its KV, which the scheduler frees a step later)
    kv_idle0 = t.metrics().get("slowfast_kv_bytes_in_use", 0.0)
    t.ok_request()  # warm-up
    kv_idle = t.wait_idle(kv_idle0)["slowfast_kv_bytes_in_use"]
    report = {}
    for f in faults:
        t0 = time.monotonic()
        if f == "bad_bodies":
            bad_bodies(t, max_body_bytes)
        elif f == "slowloris":
            slowloris(t, header_timeout, body_timeout)
        elif f == "idle_connections":
            log(f"idle connections: {idle_connections(t)} of 1000 still open after the requests "
                f"(fewer once --header-read-timeout {header_timeout}s has passed)")
        else:
            globals()[f](t)
        t.wait_idle(kv_idle)
        t.ok_request()
        t.wait_idle(kv_idle)
        report[f] = round(time.monotonic() - t0, 2)
        log(f"fault {f}: ok in {report[f]}s (idle again, kv_bytes_in_use {kv_idle:.0f})")
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", help="the `model` field (default: left out)")
    ap.add_argument("--token-ids", type=int, default=0, metavar="VOCAB",
                    help="send prompts as token ids below VOCAB (models without a tokenizer)")
    ap.add_argument("--faults", default=",".join(STORM))
    ap.add_argument("--max-body-bytes", type=int, default=8 << 20, help="the server's --max-body-bytes")
    ap.add_argument("--header-read-timeout", type=float, default=10, help="the server's value")
    ap.add_argument("--body-read-timeout", type=float, default=30, help="the server's value")
    ap.add_argument("--nvidia-smi", action="store_true",
                    help="check GPU memory.used returns to its idle value after the storm")
    ap.add_argument("--gpu-mem-tolerance-mib", type=int, default=0)
    ap.add_argument("--settle", type=float, default=30, help="seconds to wait for GPU memory to settle")
    a = ap.parse_args()
    t = Target(a.url, a.model, a.token_ids)
    t.ok_request()
    t.ok_request(stream=True)
    idle_mem = None
    if a.nvidia_smi:
        time.sleep(2)
        idle_mem = gpu_memory_mib()
        print(f"GPU memory.used after warm-up (MiB): {idle_mem}")
    start = time.monotonic()
    rep = run_storm(t, [f for f in a.faults.split(",") if f], a.max_body_bytes,
                    a.header_read_timeout, a.body_read_timeout)
    print(json.dumps({"faults": rep, "wall_s": round(time.monotonic() - start, 1)}))
    if idle_mem is not None:
        deadline = time.monotonic() + a.settle
        while True:
            now = gpu_memory_mib()
            if all(n <= i + a.gpu_mem_tolerance_mib for n, i in zip(now, idle_mem)):
                print(f"GPU memory.used back to idle: {now} (idle {idle_mem})")
                break
            if time.monotonic() > deadline:
                print(f"FAIL: GPU memory.used {now} MiB, idle was {idle_mem} MiB", file=sys.stderr)
                sys.exit(1)
            time.sleep(1)


if __name__ == "__main__":
    main()

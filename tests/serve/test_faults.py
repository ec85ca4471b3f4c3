"""Fault tests for `slowfast serve` (issue 24): misbehaving clients over loopback, each bounded
in count and time (the faults themselves are in fault_storm.py, which also runs standalone
against a URL). Each ends with /metrics showing no running or queued sequence and the KV
bytes in use at their idle value, and a normal request served.

Run: python3 -m pytest -q tests/serve/test_faults.py
"""
from __future__ import annotations

import resource
import socket
import time

import pytest

import fault_storm as fs
from conftest import Server

HEADER_TIMEOUT = 1.5
BODY_TIMEOUT = 2.0
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def fault_server():
    s = Server("faults", ["--max-context", "1024", "--max-batch", "8", "--max-body-bytes", str(BODY_LIMIT),
                          "--header-read-timeout", str(HEADER_TIMEOUT),
                          "--body-read-timeout", str(BODY_TIMEOUT)]).start()
    t = fs.Target(s.url)
    # idle: what the fresh server holds before its first request
    kv_idle = t.metrics()["slowfast_kv_bytes_in_use"]
    t.ok_request()
    t.kv_idle = t.wait_idle(kv_idle)["slowfast_kv_bytes_in_use"]
    t.server = s
    try:
        yield t
    finally:
        s.stop()


def after(t: fs.Target):
    assert t.server.alive(), f"the server died:\n{t.server.log_tail()}"
    t.wait_idle(t.kv_idle)
    t.ok_request()
    t.ok_request(stream=True)
    m = t.wait_idle(t.kv_idle)
    assert m["slowfast_running_sequences"] == 0 and m["slowfast_queued_sequences"] == 0


CANCELLED = 'slowfast_requests_total{outcome="cancelled"}'


def cancelled(t) -> float:
    return t.metrics().get(CANCELLED, 0)


def test_disconnect_mid_prefill(fault_server):
    before = cancelled(fault_server)
    fs.disconnect_mid_prefill(fault_server, n=4)
    after(fault_server)
    assert cancelled(fault_server) >= before + 4, "the dropped prefills did not end as cancelled"


def test_disconnect_mid_stream_and_between_chunks(fault_server):
    before = cancelled(fault_server)
    fs.disconnect_mid_stream(fault_server, n=6)
    after(fault_server)
    assert cancelled(fault_server) >= before + 6


def test_abandoned_non_streaming(fault_server):
    before = cancelled(fault_server)
    fs.abandon_nonstream(fault_server, n=4)
    after(fault_server)
    assert cancelled(fault_server) >= before + 4, "abandoned non-streaming requests ran to their end"


def test_concurrent_cancels(fault_server):
    before = cancelled(fault_server)
    fs.concurrent_cancels(fault_server, n=24)
    after(fault_server)
    assert cancelled(fault_server) >= before + 24


def test_bad_bodies(fault_server):
    fs.bad_bodies(fault_server, BODY_LIMIT)
    after(fault_server)


def test_slowloris(fault_server):
    served = fs.slowloris(fault_server, HEADER_TIMEOUT, BODY_TIMEOUT, n=8)
    assert served >= 1
    after(fault_server)


def test_idle_connection_closed_by_header_timeout(fault_server):
    s = fault_server.sock()
    t0 = time.monotonic()
    s.settimeout(HEADER_TIMEOUT + 10)
    assert s.recv(100) == b"", "an idle connection got bytes"
    dt = time.monotonic() - t0
    s.close()
    assert dt < HEADER_TIMEOUT + 3, f"an idle connection was closed after {dt:.1f}s"


def test_thousand_idle_connections():
    want = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want + 100:
        pytest.skip(f"the hard open-file limit ({hard}) is below {want + 100}: cannot hold {want} connections")
    if soft != resource.RLIM_INFINITY and soft < 4 * want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4 * want, hard) if hard != resource.RLIM_INFINITY else 4 * want, hard))
    # the server inherits the raised soft limit
    s = Server("idle", ["--max-context", "256", "--header-read-timeout", "60"]).start()
    try:
        t = fs.Target(s.url)
        kv_idle = t.metrics()["slowfast_kv_bytes_in_use"]
        t.ok_request()
        kv = t.wait_idle(kv_idle)["slowfast_kv_bytes_in_use"]
        t0 = time.monotonic()
        n = fs.idle_connections(t, want, requests=6)
        assert n == want or time.monotonic() - t0 > 50, \
            f"only {n} of {want} idle connections were still open (--header-read-timeout 60)"
        assert s.alive()
        t.wait_idle(kv)
    finally:
        s.stop()


class PortServer(Server):
    """A server on a chosen port (conftest's servers take --port 0)."""

    def __init__(self, name, args, port):
        super().__init__(name, args)
        self.fixed_port = port

    @property
    def cmd(self):
        c = super().cmd
        c[c.index("--port") + 1] = str(self.fixed_port)
        return c


def free_port() -> int:
    x = socket.socket()
    x.bind(("127.0.0.1", 0))
    p = x.getsockname()[1]
    x.close()
    return p


def test_kill9_and_restart_on_same_port():
    port = free_port()
    args = ["--max-context", "256"]
    a = PortServer("kill9a", args, port).start()
    assert a.port == port, (a.port, port)
    t = fs.Target(a.url)
    # connections in flight when it dies: a stream and an idle socket (their ports go to
    # TIME_WAIT / the server's side is torn down)
    st = t.sock()
    body = t.body(16, 200, stream=True)
    st.sendall(t.head("POST", "/v1/completions", len(body)) + body)
    fs.read_until(st, b"data: {", 60)
    idle = t.sock()
    a.proc.kill()
    a.proc.wait(10)
    a.stop()
    st.close()
    idle.close()
    t0 = time.monotonic()
    b = PortServer("kill9b", args, port).start()
    try:
        assert b.port == port
        t = fs.Target(b.url)
        # idle is what the fresh server holds before any request (read after the requests, the
        # metric could still count the last one's KV: the scheduler frees it a step later)
        kv_idle = t.metrics()["slowfast_kv_bytes_in_use"]
        t.ok_request()
        t.ok_request(stream=True)
        t.wait_idle(kv_idle)
        assert time.monotonic() - t0 < 60
    finally:
        b.stop()

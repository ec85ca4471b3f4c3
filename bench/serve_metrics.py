"""What the serve benchmarks share: a free loopback port, and /metrics as a dict (unlabelled
samples only). Stdlib only."""
from __future__ import annotations

import http.client
import re
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(port: int) -> dict[str, float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(slowfast_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out

#!/usr/bin/env python3
"""Polls a slowfast server's /metrics until it is stopped (SIGTERM / Ctrl-C) and writes the
peaks of the gauges (running and queued sequences, KV bytes in use) and the last counters as
JSON: what a load test's own report leaves out. Stdlib only.

    python3 bench/metrics_peak.py --url http://127.0.0.1:8080 --json peak.json &
"""
from __future__ import annotations

import argparse
import http.client
import json
import re
import signal
import sys
import time
import urllib.parse

GAUGES = ("slowfast_running_sequences", "slowfast_queued_sequences", "slowfast_kv_bytes_in_use")


def scrape(host: str, port: int) -> dict[str, float]:
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        m = re.match(r"^(slowfast_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between scrapes")
    p.add_argument("--json", dest="json_out", required=True, help="where to write the peaks")
    a = p.parse_args()
    u = urllib.parse.urlparse(a.url)
    peak: dict[str, float] = {g: 0.0 for g in GAUGES}
    last: dict[str, float] = {}
    samples = 0
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop:
        try:
            m = scrape(u.hostname or "127.0.0.1", u.port or 80)
        except OSError:
            m = None
        if m:
            samples += 1
            last = m
            for g in GAUGES:
                peak[g] = max(peak[g], m.get(g, 0.0))
        time.sleep(a.interval)
    with open(a.json_out, "w") as f:
        json.dump({"samples": samples, "peak": peak, "last": last}, f, indent=1)
    print(f"metrics peaks ({samples} samples): " + ", ".join(f"{k} {v:.0f}" for k, v in peak.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

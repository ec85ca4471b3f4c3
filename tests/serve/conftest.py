"""Fixtures for the `slowfast serve` tests: servers on free loopback ports, references from
`slowfast generate`, and small HTTP / Prometheus helpers.

Environment:
  SLOWFAST_BIN          the slowfast binary (default: <repo>/target/release/slowfast)
  SLOWFAST_SERVE_MODEL  --model for serve and generate (default: gemma3-270m)
  SLOWFAST_DEVICE       --device for serve and generate (default: cpu)
  SLOWFAST_SERVE_ARGS   extra flags for every `slowfast serve` (shell words)
  SLOWFAST_SERVE_START_TIMEOUT  seconds to wait for a server to come up (default: 180)
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BIN = os.environ.get("SLOWFAST_BIN", str(REPO / "target" / "release" / "slowfast"))
MODEL = os.environ.get("SLOWFAST_SERVE_MODEL", "gemma3-270m")
DEVICE = os.environ.get("SLOWFAST_DEVICE", "cpu")
EXTRA_ARGS = shlex.split(os.environ.get("SLOWFAST_SERVE_ARGS", ""))
START_TIMEOUT = float(os.environ.get("SLOWFAST_SERVE_START_TIMEOUT", "180"))

# The main server's limits (tests below rely on them).
MAX_CONTEXT = 1024
MAX_BODY_BYTES = 256 * 1024
API_KEY = "sf-test-key-0123456789"
SERVED_ALIAS = "served-alias"
# Gemma 3 270M with f16 KV and no window ring (the context is below the window): 18 KB a token.
# Two sequences of 128 slots and 4 more (the preemption test's server): two ~50-token prompts
# are admitted, and the first to pass 128 tokens preempts the other.
PREEMPT_KV_MEMORY = (2 * 128 + 4) * 18 * 256 * 2 * 2

LISTEN_RE = re.compile(r"listening on http://([^\s/:]+|\[[^\]]+\]):(\d+)")

_live: list["Server"] = []


class Server:
    """One `slowfast serve` process on 127.0.0.1 with --port 0; stderr goes to a log file."""

    def __init__(self, name: str, args: list[str]):
        self.name = name
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.port = 0
        self.log_path = Path(tempfile.gettempdir()) / f"slowfast-serve-{name}-{os.getpid()}.log"
        self._log = None
        self._reader: threading.Thread | None = None
        self._found = threading.Event()

    @property
    def cmd(self) -> list[str]:
        return [
            BIN, "serve", "--model", MODEL, "--device", DEVICE,
            "--host", "127.0.0.1", "--port", "0", *EXTRA_ARGS, *self.args,
        ]

    def _read_stderr(self):
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace")
            self._log.write(line)
            self._log.flush()
            if not self._found.is_set():
                m = LISTEN_RE.search(line)
                if m:
                    self.port = int(m.group(2))
                    self.url = f"http://127.0.0.1:{self.port}"
                    self._found.set()

    def start(self) -> "Server":
        if not os.access(BIN, os.X_OK):
            pytest.fail(f"{BIN} is not an executable; build it (cargo build --release -p slowfast) or set SLOWFAST_BIN")
        self._log = open(self.log_path, "w", encoding="utf-8")
        self._log.write("$ " + shlex.join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.PIPE)
        _live.append(self)
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._found.wait(0.1):
            if self.proc.poll() is not None:
                self._reader.join(2)
                self.stop()
                pytest.fail(f"server {self.name} exited with {self.proc.returncode} before listening:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"server {self.name} printed no 'listening on http://HOST:PORT' in {START_TIMEOUT}s:\n{self.log_tail()}")
        while True:
            try:
                r = requests.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"server {self.name}: /health never answered 200:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def stop(self):
        p = self.proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self in _live:
            _live.remove(self)
        if self._log is not None and not self._log.closed:
            if self._reader is not None:
                self._reader.join(2)
            self._log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    # -- HTTP helpers ------------------------------------------------------------------------
    def post(self, path: str, body=None, *, data: bytes | str | None = None, headers=None,
             timeout: float = 300, stream: bool = False) -> requests.Response:
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        if data is None:
            data = json.dumps(body)
        return requests.post(self.url + path, data=data, headers=h, timeout=timeout, stream=stream)

    def get(self, path: str, headers=None, timeout: float = 30) -> requests.Response:
        return requests.get(self.url + path, headers=headers or {}, timeout=timeout)

    def metrics(self) -> "Metrics":
        r = self.get("/metrics")
        assert r.status_code == 200, f"/metrics: {r.status_code} {r.text[:300]}"
        return Metrics(r.text)

    def client(self, api_key: str = "unused", **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=kw.pop("timeout", 300), **kw)


def _kill_leftovers():
    for s in list(_live):
        try:
            s.stop()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


atexit.register(_kill_leftovers)


# -- server-sent events -------------------------------------------------------------------------
def sse_events(resp: requests.Response) -> list:
    """The `data:` payloads of an SSE response, parsed (the final "[DONE]" kept as a string).

    Lines are split on bytes and decoded as UTF-8 (SSE's encoding). requests' iter_lines with
    decode_unicode=True decodes a text/event-stream without a charset as ISO-8859-1 and splits
    with str.splitlines, which breaks at U+0085: the third byte of "者" (e8 80 85) then cut a
    JSON payload in two.
    """
    out = []
    for raw in resp.iter_lines():
        line = raw.decode("utf-8")
        if not line or line.startswith(":"):
            continue
        assert line.startswith("data:"), f"not an SSE data line: {line!r}"
        payload = line[5:].strip()
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# -- Prometheus text ---------------------------------------------------------------------------
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


class Metrics:
    def __init__(self, text: str):
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split()
                if len(parts) >= 4 and parts[1] == "TYPE":
                    self.types[parts[2]] = parts[3]
                continue
            m = _SAMPLE_RE.match(line)
            if not m:
                raise AssertionError(f"unparsable /metrics line: {line!r}")
            labels = frozenset(_LABEL_RE.findall(m.group(3) or ""))
            self.samples[(m.group(1), labels)] = float(m.group(4))

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}

    def get(self, name: str, default: float | None = 0.0, **labels) -> float | None:
        """The sample `name` whose labels include `labels` (summed if several match)."""
        want = set(labels.items())
        vals = [v for (n, ls), v in self.samples.items() if n == name and want <= set(ls)]
        if not vals:
            return default
        return sum(vals)


def wait_idle(server: Server, kv_baseline: float | None = None, timeout: float = 15) -> Metrics:
    """Poll /metrics until no sequence runs or waits (and the KV in use is back to the baseline)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        ok = (m.get("slowfast_running_sequences", None) == 0
              and m.get("slowfast_queued_sequences", None) == 0
              and (kv_baseline is None or m.get("slowfast_kv_bytes_in_use", None) == kv_baseline))
        if ok or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# -- error bodies ------------------------------------------------------------------------------
def names_field(err: dict, field: str) -> bool:
    """The error names `field`: as its param, or as a word in its message."""
    param = err.get("param")
    if isinstance(param, str) and (param == field or re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", param)):
        return True
    msg = str(err.get("message", ""))
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", msg) is not None


def assert_error(resp: requests.Response, status: int, *fields: str) -> dict:
    """`resp` is an OpenAI-style error with this status; its message or param names one of
    `fields` (when given)."""
    body = resp.text
    assert resp.status_code == status, f"expected HTTP {status}, got {resp.status_code}: {body[:500]}"
    try:
        j = resp.json()
    except ValueError:
        raise AssertionError(f"HTTP {status} body is not JSON: {body[:500]!r}") from None
    assert isinstance(j, dict) and isinstance(j.get("error"), dict), f"no error object: {j}"
    err = j["error"]
    assert isinstance(err.get("message"), str) and err["message"], f"error.message: {err}"
    assert isinstance(err.get("type"), str) and err["type"], f"error.type: {err}"
    for k in ("param", "code"):
        assert k in err, f"error object lacks `{k}` (the contract's shape is message/type/param/code): {err}"
    if fields:
        assert any(names_field(err, f) for f in fields), \
            f"the error does not name {' or '.join(repr(f) for f in fields)}: {err}"
    return err


# -- references from `slowfast generate` -------------------------------------------------------
_gen_cache: dict = {}
_gen_lock = threading.Lock()


def generate_ref(prompt: str, n: int, policy: tuple[str, ...] = (), chat: bool = False,
                 system: str | None = None) -> dict:
    """`slowfast generate --temperature 0 -n N --json` of `prompt` alone (cached)."""
    key = (prompt, n, tuple(policy), chat, system)
    with _gen_lock:
        if key in _gen_cache:
            return _gen_cache[key]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(prompt)
        path = f.name
    try:
        cmd = [BIN, "generate", "--model", MODEL, "--device", DEVICE, "-f", path,
               "--temperature", "0", "-n", str(n), "--json", *policy]
        if chat:
            cmd.append("--chat")
            if system is not None:
                cmd += ["--system", system]
        p = subprocess.run(cmd, capture_output=True, timeout=600)
    finally:
        os.unlink(path)
    if p.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed ({p.returncode}):\n{p.stderr.decode(errors='replace')[-2000:]}")
    out = json.loads(p.stdout)
    with _gen_lock:
        _gen_cache[key] = out
    return out


def prose_words() -> list[str]:
    return (HERE / "prose.txt").read_text(encoding="utf-8").split()


def prose(n_words: int, start: int = 0) -> str:
    w = prose_words()
    assert start + n_words <= len(w), (start, n_words, len(w))
    return " ".join(w[start:start + n_words])


# -- fixtures ----------------------------------------------------------------------------------
def _server(name: str, args: list[str]):
    s = Server(name, args).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def server():
    """The main server: default policy full, batch 8, --max-context 1024, 256 KiB bodies."""
    yield from _server("main", ["--max-context", str(MAX_CONTEXT), "--max-body-bytes", str(MAX_BODY_BYTES)])


@pytest.fixture(scope="session")
def auth_server():
    yield from _server("auth", ["--api-key", API_KEY, "--served-model-name", SERVED_ALIAS,
                                "--max-batch", "2", "--max-context", "512"])


@pytest.fixture(scope="session")
def tiny_queue_server():
    yield from _server("tinyqueue", ["--max-batch", "1", "--max-queue", "1", "--max-context", "512"])


@pytest.fixture(scope="session")
def sfi_default_server():
    """--policy sfi --kv-budget 300 as the server's default policy."""
    yield from _server("sfidefault", ["--policy", "sfi", "--kv-budget", "300", "--max-batch", "4",
                                      "--max-context", "1024"])


@pytest.fixture(scope="session")
def spec_server():
    """--speculate sfi --kv-budget 300: every request that says nothing speculates."""
    yield from _server("spec", ["--speculate", "sfi", "--spec-tokens", "4", "--kv-budget", "300",
                                "--max-batch", "4", "--max-context", "1024"])


@pytest.fixture(scope="session")
def prefix_server():
    """Prefill chunks of 64 tokens, so a few hundred shared tokens fill the prefix cache."""
    yield from _server("prefix", ["--chunk", "64", "--max-batch", "2", "--max-context", "1024"])


@pytest.fixture(scope="session")
def preempt_server():
    """KV memory for about two short sequences (1-token prefill chunks, so a recomputed KV is
    bit-equal to the decoded one): a third request waits, and growing sequences preempt."""
    yield from _server("preempt", ["--chunk", "1", "--max-batch", "4", "--max-context", "256",
                                   "--kv-memory", str(PREEMPT_KV_MEMORY), "--prefix-cache-memory", "0"])


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach the tail of every live server's log to the report."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed:
        for s in list(_live):
            rep.sections.append((f"slowfast serve [{s.name}] log tail ({s.log_path})", s.log_tail(30)))
            if not s.alive():
                rep.sections.append((f"server {s.name}", f"the process exited with {s.proc.returncode}"))


def pytest_report_header(config):
    return f"slowfast serve tests: bin={BIN} model={MODEL} device={DEVICE} extra={EXTRA_ARGS}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit("this is a pytest conftest")

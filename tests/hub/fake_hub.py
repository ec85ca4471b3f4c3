#!/usr/bin/env python3
"""A tiny fake Hugging Face hub on loopback, and the huggingface_hub side of slowfast's cache test.

  fake_hub.py serve FIXTURE_DIR REPO_ID      serve FIXTURE_DIR as REPO_ID (revision `main`);
                                             prints `PORT <n>` and serves until stdin closes
  fake_hub.py download ENDPOINT REPO CACHE   huggingface_hub.snapshot_download into CACHE
  fake_hub.py check REPO CACHE FILE...       find every FILE with try_to_load_from_cache and
                                             snapshot_download(local_files_only=True)

Run by crates/engine/tests/hf_cache.rs. Needs `huggingface_hub` (pip install huggingface_hub).
"""
import hashlib
import http.server
import json
import os
import sys
import threading
import urllib.parse

COMMIT = "5f3c1a0e9b7d2c4f6a8e0b1d3c5e7f9a1b2c3d4e"
SERVED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "model.safetensors", "model.safetensors.index.json")


def serve(fixture, repo):
    files = {f: os.path.join(fixture, f) for f in sorted(os.listdir(fixture))
             if f in SERVED or (f.startswith("model-") and f.endswith(".safetensors"))}
    meta = {}
    for f, p in files.items():
        data = open(p, "rb").read()
        meta[f] = (len(data), hashlib.sha256(data).hexdigest(), hashlib.sha1(data).hexdigest())

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _404(self):
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _route(self):
            path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
            api = f"/api/models/{repo}"
            if path in (api, f"{api}/revision/main", f"{api}/revision/{COMMIT}"):
                return self._json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": f} for f in files]})
            if path in (f"{api}/tree/main", f"{api}/tree/{COMMIT}"):
                return self._json([
                    {"type": "file", "path": f, "size": n, "oid": sha1,
                     **({"lfs": {"oid": sha256, "size": n, "pointerSize": 130}}
                        if f.endswith(".safetensors") else {})}
                    for f, (n, sha256, sha1) in meta.items()])
            for rev in ("main", COMMIT):
                pre = f"/{repo}/resolve/{rev}/"
                if path.startswith(pre) and path[len(pre):] in files:
                    f = path[len(pre):]
                    n, sha256, sha1 = meta[f]
                    etag = sha256 if f.endswith(".safetensors") else sha1
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("ETag", f'"{etag}"')
                    if f.endswith(".safetensors"):
                        self.send_header("X-Linked-Etag", f'"{etag}"')
                        self.send_header("X-Linked-Size", str(n))
                    self.send_header("Content-Length", str(n))
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(open(files[f], "rb").read())
                    return
            return self._404()

        do_GET = _route
        do_HEAD = _route

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(f"PORT {srv.server_address[1]}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    srv.shutdown()


def main():
    cmd = sys.argv[1]
    if cmd == "serve":
        return serve(sys.argv[2], sys.argv[3])
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if cmd == "download":
        endpoint, repo, cache = sys.argv[2:5]
        os.environ["HF_ENDPOINT"] = endpoint
        import huggingface_hub
        p = huggingface_hub.snapshot_download(repo, cache_dir=cache, endpoint=endpoint)
        print(p)
    elif cmd == "check":
        repo, cache, files = sys.argv[2], sys.argv[3], sys.argv[4:]
        os.environ["HF_HUB_OFFLINE"] = "1"
        import huggingface_hub
        for f in files:
            p = huggingface_hub.try_to_load_from_cache(repo, f, cache_dir=cache)
            if not isinstance(p, str) or not os.path.isfile(p):
                sys.exit(f"huggingface_hub does not find {f} in {cache}: {p!r}")
        p = huggingface_hub.snapshot_download(repo, cache_dir=cache, local_files_only=True)
        print(p)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()

"""`slowfast serve` against its own OpenAPI description (GET /openapi.json).

schemathesis (tests/serve/schemathesis.sh) fuzzes the request side and checks the JSON bodies. It
does not read server-sent events. So here the responses of hand-picked requests, streamed chunks
included, are validated against the schemas that the description gives them: the operation's
schema for each status and content type, and CompletionChunk / ChatCompletionChunk / Error for
each `data:` event of a stream. Needs the `jsonschema` package (installed with schemathesis, or
by scripts/test_serve.sh); skipped without it.
"""
from __future__ import annotations

import json

import pytest

from conftest import API_KEY, MODEL, sse_events

jsonschema = pytest.importorskip("jsonschema")


def to_json_schema(node):
    """OpenAPI 3.0 schema objects into JSON Schema 2020-12: `nullable`, boolean exclusive bounds."""
    if isinstance(node, list):
        return [to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (to_json_schema(v) if k != "enum" else v) for k, v in node.items()}
    for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if out.get(ex) is True:
            out[ex] = out.pop(bound)
        elif out.get(ex) is False:
            del out[ex]
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@pytest.fixture(scope="module")
def spec(server):
    r = server.get("/openapi.json")
    assert r.status_code == 200, r.text[:300]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    doc = r.json()
    assert doc["openapi"].startswith("3.0."), doc["openapi"]
    return doc


class Checker:
    def __init__(self, spec: dict):
        self.spec = spec
        self.components = to_json_schema(spec["components"])

    def validate(self, schema: dict, instance, what: str):
        root = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                "components": self.components, **to_json_schema(schema)}
        v = jsonschema.Draft202012Validator(root)
        errors = sorted(v.iter_errors(instance), key=lambda e: list(e.path))
        assert not errors, (f"{what}: {len(errors)} schema error(s), first: {errors[0].message} at "
                            f"{list(errors[0].absolute_path)}\n{json.dumps(instance)[:800]}")

    def named(self, name: str, instance, what: str):
        self.validate({"$ref": f"#/components/schemas/{name}"}, instance, what)

    def response(self, method: str, path: str, resp):
        """`resp` is a status and content type the operation lists; a JSON body matches its schema."""
        op = self.spec["paths"][path][method.lower()]
        code = str(resp.status_code)
        assert code in op["responses"], f"{method} {path}: HTTP {code} is not in the description"
        content = op["responses"][code].get("content", {})
        ctype = resp.headers.get("content-type", "").split(";")[0].strip()
        assert ctype in content, f"{method} {path} {code}: content type {ctype!r} not in {list(content)}"
        if ctype == "application/json":
            self.validate(content[ctype]["schema"], resp.json(), f"{method} {path} {code}")
        return ctype


@pytest.fixture(scope="module")
def check(spec):
    return Checker(spec)


def test_the_description_lists_every_path(spec):
    assert set(spec["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                  "/health", "/metrics", "/openapi.json", "/v1/inspect/{id}",
                                  "/", "/playground.js", "/playground.css"}


def test_get_endpoints_match(server, check):
    for path in ("/health", "/v1/models", "/openapi.json"):
        check.response("GET", path, server.get(path))
    assert check.response("GET", "/metrics", server.get("/metrics")) == "text/plain"
    for path, ctype in (("/", "text/html"), ("/playground.js", "text/javascript"),
                        ("/playground.css", "text/css")):
        assert check.response("GET", path, server.get(path)) == ctype


@pytest.mark.parametrize("policy", [{"name": "sfi", "kv_budget": 300}, {"name": "streaming", "kv_budget": 64},
                                    {"name": "h2o", "kv_budget": 64}, {"name": "snapkv", "kv_budget": 64},
                                    {"name": "full"}])
@pytest.mark.parametrize("stream", [False, True])
def test_inspections_match(server, check, policy, stream):
    from conftest import prose
    body = {"prompt": prose(400), "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "inspect": True, "kv_policy": policy, "stream": stream}
    r = server.post("/v1/completions", body, stream=stream)
    assert r.status_code == 200, r.text[:300]
    rid = sse_events(r)[0]["id"] if stream else r.json()["id"]
    ins = server.get(f"/v1/inspect/{rid}")
    check.response("GET", "/v1/inspect/{id}", ins)
    j = ins.json()
    assert j["id"] == rid and j["policy"] == policy["name"]
    assert j["positions"] == j["prompt_tokens"] + 24 - 1 == len(j["tokens"])
    assert (j["slow_steps"] is not None) == (policy["name"] == "sfi")
    global_layers = [l for l in j["layers"] if not l["sliding"]]
    assert global_layers
    for l in global_layers:
        for h in l["heads"]:
            held = sum(b - a for role in ("sinks", "selected", "recent", "kept") for a, b in h[role])
            if policy["name"] == "full":
                assert h["kept"] == [[0, j["positions"]]]
            else:
                assert held <= policy["kv_budget"] + 24 + 16, (policy, held)  # SFI: the window grows to the next refresh
    check.response("GET", "/v1/inspect/{id}", server.get("/v1/inspect/cmpl-none"))


COMPLETIONS = [
    {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 3, "logprobs": 3, "return_token_ids": True, "seed": 1},
    {"prompt": [2, 651, 6037], "max_tokens": 2, "logprobs": 0, "stop": ["\n"], "top_k": 5, "min_p": 0.1},
    {"prompt": ["Hello"], "max_tokens": 5, "ignore_eos": True, "kv_policy": {"name": "full"}},
]
CHATS = [
    {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
     "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "return_token_ids": True},
    {"messages": [{"role": "user", "content": "Count."}], "max_completion_tokens": 2, "logprobs": False},
]


@pytest.mark.parametrize("body", COMPLETIONS)
def test_completion_matches(server, check, body):
    r = server.post("/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text[:300]
    check.response("POST", "/v1/completions", r)


@pytest.mark.parametrize("body", CHATS)
def test_chat_matches(server, check, body):
    r = server.post("/v1/chat/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text[:300]
    check.response("POST", "/v1/chat/completions", r)


@pytest.mark.parametrize("path,chunk,body", [
    ("/v1/completions", "CompletionChunk", COMPLETIONS[1]),
    ("/v1/completions", "CompletionChunk", COMPLETIONS[0]),
    ("/v1/chat/completions", "ChatCompletionChunk", CHATS[1]),
    ("/v1/chat/completions", "ChatCompletionChunk", CHATS[0]),
])
@pytest.mark.parametrize("usage", [False, True])
def test_stream_chunks_match(server, check, path, chunk, body, usage):
    body = {"model": MODEL, **body, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    r = server.post(path, body, stream=True)
    assert check.response("POST", path, r) == "text/event-stream"
    evs = sse_events(r)
    assert evs and evs[-1] == "[DONE]", evs[-3:]
    chunks = evs[:-1]
    assert chunks, "no chunk before [DONE]"
    for i, ch in enumerate(chunks):
        check.named(chunk, ch, f"{path} chunk {i} of {len(chunks)}")
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and "slowfast" in finals[0], chunks[-2:]
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] and "slowfast" in chunks[-1], chunks[-1]
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "x", "kv_policy": {"bogus": 1}}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}, 404),
])
def test_errors_match(server, check, path, body, status):
    r = server.post(path, body)
    assert r.status_code == status, r.text[:300]
    check.response("POST", path, r)


def test_malformed_json_matches(server, check):
    r = server.post("/v1/completions", data=b'{"prompt": ')
    assert r.status_code == 400
    check.response("POST", "/v1/completions", r)


def test_unknown_path_is_the_error_object(server, check):
    r = server.get("/v2/nothing")
    assert r.status_code == 404
    check.named("Error", r.json(), "the fallback")
    assert "/openapi.json" in r.json()["error"]["message"]


def test_auth_errors_match(auth_server, check):
    for path in ("/v1/models",):
        check.response("GET", path, auth_server.get(path))
        check.response("GET", path, auth_server.get(path, headers={"Authorization": "Bearer nope"}))
        ok = auth_server.get(path, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
        check.response("GET", path, ok)
    r = auth_server.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401
    check.response("POST", "/v1/completions", r)

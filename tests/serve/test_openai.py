"""`slowfast serve` against its contract, through the `openai` client and raw HTTP.

Run: python3 -m pytest -q tests/serve     (see conftest.py for the environment variables)
"""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from conftest import (API_KEY, DEVICE, MAX_BODY_BYTES, MAX_CONTEXT, MODEL, SERVED_ALIAS, assert_error,
                      generate_ref, prose, prose_words, sse_events, wait_idle)

SHORT = "The capital of France is"
NUM = (int, float)


def d(obj) -> dict:
    """An openai response object (extension fields included) as a dict."""
    return obj.model_dump() if hasattr(obj, "model_dump") else obj


def check_usage(u: dict, completion_tokens: int | None = None):
    assert isinstance(u, dict), f"no usage: {u!r}"
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert isinstance(u.get(k), int), f"usage.{k}: {u}"
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    assert u["prompt_tokens"] > 0, u
    if completion_tokens is not None:
        assert u["completion_tokens"] == completion_tokens, u


def check_slowfast(sf, policy: str | None = None):
    assert isinstance(sf, dict), f"the final response lacks the `slowfast` object: {sf!r}"
    assert isinstance(sf.get("policy"), str), sf
    for k in ("slow_steps", "fast_steps"):
        assert isinstance(sf.get(k), int) and sf[k] >= 0, sf
    if policy is not None:
        assert sf["policy"] == policy or sf["policy"].startswith(policy), sf


def check_last_chunk_slowfast(chunks: list, policy: str | None = None):
    """The contract: the last stream chunk (the usage chunk when include_usage is set) carries
    the `slowfast` object."""
    where = [i for i, ch in enumerate(chunks) if isinstance(ch, dict) and ch.get("slowfast")]
    assert chunks[-1].get("slowfast"), (
        f"the last of {len(chunks)} chunks has no `slowfast` object "
        f"(found on chunk(s) {where}; last chunk: {json.dumps(chunks[-1])[:300]})")
    check_slowfast(chunks[-1]["slowfast"], policy)


def complete(server, **body) -> dict:
    body.setdefault("model", MODEL)
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, f"{body}: HTTP {r.status_code} {r.text[:500]}"
    return r.json()


# ============================================================================ basics
def test_health(server):
    r = server.get("/health")
    assert r.status_code == 200
    assert r.json().get("status") == "ok", r.text


def test_models(server, client):
    r = server.get("/v1/models")
    assert r.status_code == 200, r.text
    j = r.json()
    assert j.get("object") == "list", j
    ids = [m["id"] for m in j["data"]]
    assert MODEL in ids, ids
    assert all(m.get("object") == "model" for m in j["data"]), j
    assert MODEL in [m.id for m in client.models.list().data]


def test_completion_basic(client):
    r = d(client.completions.create(model=MODEL, prompt=SHORT, max_tokens=8, temperature=0))
    assert r["object"] == "text_completion", r
    assert r["model"] == MODEL, r
    assert isinstance(r["id"], str) and r["id"], r
    assert len(r["choices"]) == 1, r
    c = r["choices"][0]
    assert c["index"] == 0
    assert isinstance(c["text"], str) and c["text"], r
    assert c["finish_reason"] in ("length", "stop"), c
    check_usage(r["usage"])
    assert r["usage"]["completion_tokens"] <= 8
    check_slowfast(r.get("slowfast"), "full")


def test_completion_matches_generate(client):
    ref = generate_ref(SHORT, 16)
    r = d(client.completions.create(model=MODEL, prompt=SHORT, max_tokens=16, temperature=0,
                                    extra_body={"return_token_ids": True}))
    c = r["choices"][0]
    assert c.get("token_ids") == ref["tokens"], f"server {c.get('token_ids')} vs generate {ref['tokens']}"
    assert c["text"] == ref["text"]
    assert r["usage"]["prompt_tokens"] == ref["prompt_tokens"], (r["usage"], ref["prompt_tokens"])
    assert r["usage"]["completion_tokens"] == len(ref["tokens"])


@pytest.mark.parametrize("n", [1, 5, 12])
def test_max_tokens_and_usage(client, n):
    r = d(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}))
    c = r["choices"][0]
    check_usage(r["usage"], completion_tokens=n)
    assert isinstance(c.get("token_ids"), list) and len(c["token_ids"]) == n, c
    assert all(isinstance(t, int) and t >= 0 for t in c["token_ids"]), c
    assert c["finish_reason"] == "length", c


def test_token_id_prompt(client):
    ids = [2, 506, 5279, 529, 7001]  # <bos> " the capital of France" (Gemma 3)
    r = d(client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}))
    check_usage(r["usage"], completion_tokens=4)
    assert r["usage"]["prompt_tokens"] == len(ids), r["usage"]
    assert len(r["choices"][0]["token_ids"]) == 4


def test_sampling_parameters_accepted(client):
    r = d(client.completions.create(
        model=MODEL, prompt=SHORT, max_tokens=6, temperature=0.7, top_p=0.9, seed=7,
        presence_penalty=0.5, frequency_penalty=0.3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True}))
    check_usage(r["usage"], completion_tokens=6)


def test_n_1_accepted(client):
    r = d(client.completions.create(model=MODEL, prompt=SHORT, max_tokens=2, n=1, temperature=0))
    assert len(r["choices"]) == 1


# ============================================================================ streaming
def test_stream_completion(client):
    body = dict(model=MODEL, prompt=SHORT, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    full = d(client.completions.create(**body))
    chunks = [d(c) for c in client.completions.create(
        **body, stream=True, stream_options={"include_usage": True})]
    assert chunks, "no chunks"
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch.get("choices"))
    assert text == full["choices"][0]["text"]
    ids = [t for ch in chunks if ch.get("choices") for t in (ch["choices"][0].get("token_ids") or [])]
    assert ids == full["choices"][0]["token_ids"], "the stream's token_ids differ from the non-streamed ones"
    finishes = [ch["choices"][0]["finish_reason"] for ch in chunks
                if ch.get("choices") and ch["choices"][0].get("finish_reason")]
    assert finishes == ["length"], finishes
    usage = [ch["usage"] for ch in chunks if ch.get("usage")]
    assert usage, "include_usage set but no chunk carries usage"
    check_usage(usage[-1], completion_tokens=12)
    assert usage[-1] == full["usage"], (usage[-1], full["usage"])
    check_last_chunk_slowfast(chunks, "full")
    assert all(ch["object"] == "text_completion" for ch in chunks), chunks[0]


def test_stream_raw_sse(server):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 6, "temperature": 0,
                                        "stream": True, "ignore_eos": True}, stream=True)
    assert r.status_code == 200, r.text
    assert r.headers.get("content-type", "").startswith("text/event-stream"), r.headers
    ev = sse_events(r)
    assert ev and ev[-1] == "[DONE]", ev[-3:]
    assert ev.count("[DONE]") == 1
    objs = ev[:-1]
    assert objs and all(isinstance(o, dict) for o in objs)
    assert objs[-1]["choices"] and objs[-1]["choices"][0]["finish_reason"] == "length", objs[-1]
    assert all(o["choices"][0]["finish_reason"] is None for o in objs[:-1] if o.get("choices")), objs
    check_last_chunk_slowfast(objs, "full")


def test_stream_usage_only_when_asked(server):
    r = server.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 3, "temperature": 0,
                                        "stream": True, "ignore_eos": True}, stream=True)
    objs = [o for o in sse_events(r) if o != "[DONE]"]
    assert not [o for o in objs if o.get("usage")], "usage sent without stream_options.include_usage"


# ============================================================================ chat
def test_chat_basic(client):
    r = d(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert r["object"] == "chat.completion", r
    c = r["choices"][0]
    assert c["message"]["role"] == "assistant"
    assert isinstance(c["message"]["content"], str)
    assert c["finish_reason"] == "length"
    check_usage(r["usage"], completion_tokens=8)
    assert len(c.get("token_ids") or []) == 8, c
    check_slowfast(r.get("slowfast"), "full")


def test_chat_matches_generate_chat(client):
    system, user = "You are terse.", "What is the capital of France?"
    ref = generate_ref(user, 12, chat=True, system=system)
    r = d(client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, extra_body={"return_token_ids": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}]))
    c = r["choices"][0]
    assert c.get("token_ids") == ref["tokens"], f"server {c.get('token_ids')} vs generate --chat {ref['tokens']}"
    assert c["message"]["content"] == ref["text"]
    assert r["usage"]["prompt_tokens"] == ref["prompt_tokens"]


def test_chat_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=10,
              temperature=0, extra_body={"ignore_eos": True})
    full = d(client.chat.completions.create(**kw))
    chunks = [d(c) for c in client.chat.completions.create(**kw, stream=True,
                                                           stream_options={"include_usage": True})]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks), chunks[0]
    with_choices = [ch for ch in chunks if ch.get("choices")]
    assert with_choices[0]["choices"][0]["delta"].get("role") == "assistant", with_choices[0]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in with_choices)
    assert text == full["choices"][0]["message"]["content"]
    finishes = [ch["choices"][0]["finish_reason"] for ch in with_choices if ch["choices"][0].get("finish_reason")]
    assert finishes == ["length"], finishes
    usage = [ch["usage"] for ch in chunks if ch.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 10, usage
    check_last_chunk_slowfast(chunks, "full")


# ============================================================================ stop strings

def _stop_case(client):
    prompt = prose(40)
    base = d(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True}))
    text = base["choices"][0]["text"]
    words = text.split()
    assert len(words) >= 6, f"too little text to pick a stop string from: {text!r}"
    # a word from the second half, with its leading space (a token boundary in SentencePiece)
    for w in words[len(words) // 2:] + words[1:len(words) // 2]:
        stop = " " + w
        i = text.find(stop)
        if i > 0:
            return prompt, stop, text[:i]
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string(client):
    prompt, stop, want = _stop_case(client)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    for s in (stop, [stop], ["\u2603never-there\u2603", stop]):
        r = d(client.completions.create(**kw, stop=s))
        c = r["choices"][0]
        assert c["text"] == want, f"stop={s!r}: {c['text']!r}, wanted {want!r}"
        assert c["finish_reason"] == "stop", c
        assert r["usage"]["completion_tokens"] == len(c["token_ids"]) < 24, (r["usage"], c["token_ids"])
        check_slowfast(r.get("slowfast"))
    chunks = [d(ch) for ch in client.completions.create(**kw, stop=stop, stream=True)]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch.get("choices"))
    assert text == want, f"streamed with stop={stop!r}: {text!r}, wanted {want!r}"
    finishes = [ch["choices"][0]["finish_reason"] for ch in chunks
                if ch.get("choices") and ch["choices"][0].get("finish_reason")]
    assert finishes == ["stop"], finishes


def test_stop_string_chat(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about lighthouses."}],
              max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    text = d(client.chat.completions.create(**kw))["choices"][0]["message"]["content"]
    words = text.split()
    stop = next((" " + w for w in words[len(words) // 2:] if text.find(" " + w) > 0), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {text!r}")
    r = d(client.chat.completions.create(**kw, stop=[stop]))
    assert r["choices"][0]["message"]["content"] == text[:text.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


# ============================================================================ logprobs
def test_logprobs_completion(client):
    r = d(client.completions.create(model=MODEL, prompt=SHORT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}))
    c = r["choices"][0]
    lp = c["logprobs"]
    assert lp is not None, c
    assert len(lp["tokens"]) == 6 == r["usage"]["completion_tokens"], lp
    assert len(lp["token_logprobs"]) == 6 and len(lp["top_logprobs"]) == 6, lp
    assert "".join(lp["tokens"]) == c["text"], (lp["tokens"], c["text"])
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert isinstance(tlp, NUM) and tlp <= 1e-6, tlp
        assert isinstance(top, dict) and len(top) == 3, top
        assert all(isinstance(v, NUM) and v <= 1e-6 for v in top.values()), top
        # greedy: the chosen token is the most likely one
        assert tlp >= max(top.values()) - 1e-3, (tok, tlp, top)
    if lp.get("text_offset") is not None:
        assert len(lp["text_offset"]) == 6


def test_logprobs_chat(client):
    r = d(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}))
    c = r["choices"][0]
    content = (c.get("logprobs") or {}).get("content")
    assert isinstance(content, list) and len(content) == 5 == r["usage"]["completion_tokens"], c.get("logprobs")
    for e in content:
        assert isinstance(e["token"], str) and isinstance(e["logprob"], NUM) and e["logprob"] <= 1e-6, e
        top = e["top_logprobs"]
        assert len(top) == 2, e
        assert top[0]["logprob"] >= top[1]["logprob"], top
        assert e["logprob"] >= top[0]["logprob"] - 1e-3, e
    assert "".join(e["token"] for e in content) == c["message"]["content"]


def test_no_logprobs_by_default(client):
    r = d(client.completions.create(model=MODEL, prompt=SHORT, max_tokens=2, temperature=0))
    assert r["choices"][0].get("logprobs") is None


# ============================================================================ seeds
def _sampled(server, seed, prompt="Once upon a time, in a small village,"):
    return complete(server, prompt=prompt, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0,
                    seed=seed, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]


def test_seed_reproducible(server):
    a = _sampled(server, 1234)
    b = _sampled(server, 1234)
    assert a == b, "same seed, different samples"
    others = [_sampled(server, s) for s in (1, 2, 3)]
    assert any(o != a for o in others), "different seeds all gave the same sample"


def test_seed_reproducible_under_batching(server):
    alone = _sampled(server, 99)
    barrier = threading.Barrier(4)

    def job(i):
        barrier.wait()
        if i == 0:
            return _sampled(server, 99)
        return complete(server, prompt=prose(30 * i, start=i), max_tokens=16, temperature=0.9,
                        seed=i, ignore_eos=True)

    with ThreadPoolExecutor(4) as ex:
        res = list(ex.map(job, range(4)))
    assert res[0] == alone, "a seeded sample changed when other requests ran beside it"


# ============================================================================ bad input
def test_n_2_rejected(server):
    assert_error(server.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "n": 2}), 400, "n")
    assert_error(server.post("/v1/chat/completions", {"model": MODEL, "n": 3,
                                                      "messages": [{"role": "user", "content": "hi"}]}), 400, "n")


def test_n_2_through_openai_client(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=SHORT, n=2, max_tokens=2)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", ['{"model": "x", "prompt": ', "not json at all", '{"model": "m",}', "[1, 2"])
def test_malformed_json(server, path, raw):
    assert_error(server.post(path, data=raw), 400)


def test_not_an_object(server):
    assert_error(server.post("/v1/completions", data="[1, 2, 3]"), 400)


WRONG_TYPES = [
    ("max_tokens", "ten"), ("max_tokens", -3), ("max_tokens", 1.5), ("temperature", "hot"),
    ("top_p", [1]), ("top_k", "many"), ("seed", "abc"), ("stop", 5), ("stream", "yes"),
    ("logprobs", "three"), ("prompt", 5), ("prompt", {"text": "hi"}), ("ignore_eos", "yes"),
    ("return_token_ids", 3), ("kv_policy", "sfi"), ("presence_penalty", "high"), ("n", "one"),
    ("stream_options", 1),
]


@pytest.mark.parametrize("field,value", WRONG_TYPES, ids=[f"{f}={v!r}" for f, v in WRONG_TYPES])
def test_wrong_type_completions(server, field, value):
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 2, field: value}
    assert_error(server.post("/v1/completions", body), 400, field)


CHAT_WRONG = [
    ("messages", "hello"), ("messages", [{"role": "user"}]), ("messages", [{"role": "user", "content": 5}]),
    ("max_tokens", "ten"), ("temperature", "hot"), ("logprobs", "yes"), ("top_logprobs", "two"),
    ("stop", {"a": 1}),
]


@pytest.mark.parametrize("field,value", CHAT_WRONG, ids=[f"{f}={v!r}" for f, v in CHAT_WRONG])
def test_wrong_type_chat(server, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    fields = (field, "content") if field == "messages" else (field,)
    assert_error(server.post("/v1/chat/completions", body), 400, *fields)


def test_missing_prompt(server):
    assert_error(server.post("/v1/completions", {"model": MODEL, "max_tokens": 2}), 400, "prompt")


def test_missing_messages(server):
    assert_error(server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}), 400, "messages")


def test_kv_policy_unknown_name(server):
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 2, "kv_policy": {"name": "no-such-policy"}}
    assert_error(server.post("/v1/completions", body), 400, "kv_policy", "name", "no-such-policy")


def test_kv_policy_budget_too_small(server):
    """SFI's budget must exceed sinks + sfi_recent (4 + 256), as `generate` checks."""
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 2, "kv_policy": {"name": "sfi", "kv_budget": 200}}
    assert_error(server.post("/v1/completions", body), 400, "kv_budget", "kv_policy")


def test_kv_policy_sfi_needs_budget(server):
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 2, "kv_policy": {"name": "sfi"}}
    assert_error(server.post("/v1/completions", body), 400, "kv_budget", "kv_policy")


def test_kv_policy_wrong_field_type(server):
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 2, "kv_policy": {"name": "sfi", "kv_budget": "big"}}
    assert_error(server.post("/v1/completions", body), 400, "kv_budget", "kv_policy")


@pytest.mark.parametrize("drafter", ["ngram", "streaming"])
def test_speculate_gives_full_kv_tokens(server, drafter):
    """Lossless speculative decoding: the greedy tokens of a speculative request are full
    KV's (`generate`'s), and /metrics counts its drafts and verifications."""
    ref = generate_ref(SHORT, 24)
    before = server.metrics()
    spec = {"drafter": drafter, "spec_tokens": 4}
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 24, "temperature": 0,
            "return_token_ids": True, "speculate": spec}
    if drafter == "streaming":
        body["kv_policy"] = {"kv_budget": 8}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text[:500]
    c = r.json()["choices"][0]
    assert c["token_ids"] == ref["tokens"], f"speculative {c['token_ids']} vs generate {ref['tokens']}"
    after = server.metrics()
    for name in ("slowfast_spec_verifications_total", "slowfast_spec_drafted_tokens_total"):
        assert after.get(name) > before.get(name), name
    assert after.get("slowfast_spec_accepted_tokens_total") <= after.get("slowfast_spec_drafted_tokens_total")


def test_server_speculation_sizes_the_drafter_with_its_flags(spec_server):
    """`serve --speculate sfi --kv-budget 300`: requests that say nothing speculate with the
    server's drafter, sized by its --kv-budget, and give full KV's tokens, batched."""
    ref = [generate_ref(p, 16) for p in (SHORT, SHORT + " And then")]
    before = spec_server.metrics()
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0,
               "return_token_ids": True} for p in (SHORT, SHORT + " And then")]
    with ThreadPoolExecutor(2) as ex:
        rs = list(ex.map(lambda b: spec_server.post("/v1/completions", b), bodies))
    for r, want in zip(rs, ref):
        assert r.status_code == 200, r.text[:500]
        assert r.json()["choices"][0]["token_ids"] == want["tokens"]
    after = spec_server.metrics()
    assert after.get("slowfast_spec_verifications_total") > before.get("slowfast_spec_verifications_total")


def test_speculate_refusals_name_the_field(server):
    base = {"model": MODEL, "prompt": SHORT, "max_tokens": 2}
    for extra, param in [
        ({"speculate": {"drafter": "eagle"}}, "speculate.drafter"),
        ({"speculate": {"drafter": "ngram", "spec_tokens": 99}}, "speculate.spec_tokens"),
        ({"speculate": {"drafter": "ngram"}, "logprobs": 1}, "speculate"),
        ({"speculate": {"drafter": "ngram"}, "kv_policy": {"name": "sfi"}}, "kv_policy.name"),
    ]:
        assert_error(server.post("/v1/completions", {**base, **extra}), 400, param)


def _long_text(min_tokens: int) -> str:
    # prose.txt is ~790 tokens; repeat it (with paragraph breaks) past min_tokens
    w = " ".join(prose_words())
    reps = min_tokens // 700 + 1
    return "\n\n".join([w] * reps)


def test_prompt_too_long_text(server):
    body = {"model": MODEL, "prompt": _long_text(MAX_CONTEXT + 100), "max_tokens": 4}
    assert_error(server.post("/v1/completions", body), 400)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": _long_text(MAX_CONTEXT + 100)}], "max_tokens": 4}
    assert_error(server.post("/v1/chat/completions", chat), 400)


def test_prompt_too_long_token_ids(server):
    body = {"model": MODEL, "prompt": [2] + [506] * (MAX_CONTEXT + 50), "max_tokens": 4}
    assert_error(server.post("/v1/completions", body), 400)


def test_prompt_plus_max_tokens_over_context(server):
    """--max-context is prompt + max_tokens: either refused (400) or cut at the context."""
    n_prompt = MAX_CONTEXT - 10
    body = {"model": MODEL, "prompt": [2] + [506] * (n_prompt - 1), "max_tokens": 50, "ignore_eos": True}
    r = server.post("/v1/completions", body)
    if r.status_code == 200:
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] <= MAX_CONTEXT, u
        assert r.json()["choices"][0]["finish_reason"] == "length"
    else:
        assert_error(r, 400)


def test_prompt_at_the_limit_accepted(server):
    body = {"model": MODEL, "prompt": [2] + [506] * (MAX_CONTEXT - 9), "max_tokens": 2, "ignore_eos": True}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text[:300]


def test_unknown_model(server, client):
    assert_error(server.post("/v1/completions", {"model": "no-such-model", "prompt": SHORT, "max_tokens": 2}), 404)
    assert_error(server.post("/v1/chat/completions", {"model": "no-such-model", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]}), 404)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=SHORT, max_tokens=2)


def _raw_post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    """POST with a raw socket, reading the reply even when the server stops reading the body."""
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    try:
        h = {"Host": f"{host}:{port}", "Content-Type": "application/json",
             "Content-Length": str(len(body)), "Connection": "close"}
        h.update(headers or {})
        head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        try:
            s.sendall(head.encode() + body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if b"\r\n\r\n" in data:
                    hdr, rest = data.split(b"\r\n\r\n", 1)
                    cl = [ln for ln in hdr.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                    if cl and len(rest) >= int(cl[0].split(b":")[1]):
                        break
        except (ConnectionResetError, socket.timeout):
            pass
    finally:
        s.close()
    assert data.startswith(b"HTTP/1."), f"no HTTP reply: {data[:200]!r}"
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""


def test_oversize_body(server):
    body = json.dumps({"model": MODEL, "prompt": "a " * (MAX_BODY_BYTES // 2 + 20000), "max_tokens": 1}).encode()
    assert len(body) > MAX_BODY_BYTES
    status, payload = _raw_post(server.url, "/v1/completions", body)
    assert status == 413, (status, payload[:300])
    # the server still works afterwards
    assert server.get("/health").status_code == 200


def test_oversize_body_requests(server):
    """The same through `requests`, when the server reads (or drains) the body."""
    body = json.dumps({"model": MODEL, "prompt": "a " * (MAX_BODY_BYTES // 2 + 20000), "max_tokens": 1})
    try:
        r = server.post("/v1/completions", data=body)
    except requests.ConnectionError:
        pytest.skip("the server closed the connection before reading the whole body (the raw-socket test covers 413)")
    assert_error(r, 413)


# ============================================================================ api key
def test_api_key_required(auth_server):
    body = {"model": SERVED_ALIAS, "prompt": SHORT, "max_tokens": 2}
    assert_error(auth_server.post("/v1/completions", body), 401)
    assert_error(auth_server.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(auth_server.post("/v1/completions", body, headers={"Authorization": API_KEY}), 401)
    assert_error(auth_server.post("/v1/chat/completions", {"model": SERVED_ALIAS, "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]}), 401)
    with pytest.raises(openai.AuthenticationError):
        auth_server.client(api_key="wrong").completions.create(model=SERVED_ALIAS, prompt=SHORT, max_tokens=2)


def test_api_key_accepted(auth_server):
    r = auth_server.post("/v1/completions", {"model": SERVED_ALIAS, "prompt": SHORT, "max_tokens": 2},
                         headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    c = auth_server.client(api_key=API_KEY)
    out = d(c.completions.create(model=SERVED_ALIAS, prompt=SHORT, max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True}))
    assert out["model"] == SERVED_ALIAS
    check_usage(out["usage"], completion_tokens=3)
    chat = d(c.chat.completions.create(model=SERVED_ALIAS, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0))
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert SERVED_ALIAS in [m.id for m in c.models.list().data]


def test_served_model_name(auth_server):
    c = auth_server.client(api_key=API_KEY)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt=SHORT, max_tokens=2)


# ============================================================================ queue limit
def test_queue_full_429(tiny_queue_server):
    s = tiny_queue_server
    before = s.metrics()
    n = 6
    barrier = threading.Barrier(n)

    def job(i):
        barrier.wait()
        return s.post("/v1/completions", {"model": MODEL, "prompt": f"Request number {i} says", "max_tokens": 48,
                                          "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(job, range(n)))
    codes = [r.status_code for r in res]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1, f"max-batch 1 + max-queue 1 but {n} concurrent requests all accepted: {codes}"
    assert codes.count(200) >= 1, codes
    for r in res:
        if r.status_code == 429:
            assert_error(r, 429)
        else:
            assert r.json()["usage"]["completion_tokens"] == 48
    after = wait_idle(s)
    assert after.get("slowfast_running_sequences", None) == 0
    assert after.get("slowfast_queued_sequences", None) == 0
    rej = after.get("slowfast_requests_total", outcome="rejected") - before.get("slowfast_requests_total", outcome="rejected")
    assert rej == codes.count(429), (rej, codes)


# ============================================================================ metrics
METRIC_NAMES = [
    "slowfast_requests_total", "slowfast_prompt_tokens_total", "slowfast_generation_tokens_total",
    "slowfast_running_sequences", "slowfast_queued_sequences", "slowfast_kv_bytes_in_use",
    "slowfast_kv_bytes_free", "slowfast_sfi_steps_total", "slowfast_prefix_cache_hit_tokens_total",
    "slowfast_prefix_cache_bytes", "slowfast_preemptions_total",
]
HISTOGRAMS = ["slowfast_time_to_first_token_seconds", "slowfast_inter_token_latency_seconds"]


def test_metrics_names(server, client):
    client.completions.create(model=MODEL, prompt=SHORT, max_tokens=3, temperature=0)
    r = server.get("/metrics")
    assert r.status_code == 200
    assert r.headers.get("content-type", "").startswith("text/plain"), r.headers
    m = server.metrics()
    names = m.names()
    for n in METRIC_NAMES:
        assert n in names, f"/metrics lacks {n}"
    for h in HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            assert h + suffix in names, f"/metrics lacks {h}{suffix}"
        assert m.types.get(h) == "histogram", (h, m.types.get(h))
        assert m.get(h + "_bucket", None, le="+Inf") == m.get(h + "_count", None), h
    assert m.types.get("slowfast_requests_total") == "counter"
    assert m.get("slowfast_requests_total", None, outcome="ok") >= 1
    labels = {dict(ls).get("kind") for (n, ls) in m.samples if n == "slowfast_sfi_steps_total"}
    assert {"slow", "fast"} <= labels, labels
    assert m.get("slowfast_kv_bytes_free", None) > 0


def test_metrics_count_requests(server, client):
    before = wait_idle(server)
    kv0 = before.get("slowfast_kv_bytes_in_use", None)
    assert kv0 is not None
    r1 = d(client.completions.create(model=MODEL, prompt=SHORT, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True}))
    long_prompt = prose(300)
    r2 = d(client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "kv_policy": {"name": "sfi", "kv_budget": 300}}))
    assert r2["usage"]["prompt_tokens"] > 300
    check_slowfast(r2.get("slowfast"), "sfi")
    after = wait_idle(server, kv0)

    def delta(name, **labels):
        return after.get(name, **labels) - before.get(name, **labels)

    assert delta("slowfast_requests_total", outcome="ok") == 2
    assert delta("slowfast_prompt_tokens_total") == r1["usage"]["prompt_tokens"] + r2["usage"]["prompt_tokens"]
    assert delta("slowfast_generation_tokens_total") == 5 + 8
    assert delta("slowfast_time_to_first_token_seconds_count") == 2
    assert delta("slowfast_inter_token_latency_seconds_count") >= 1
    assert delta("slowfast_time_to_first_token_seconds_sum") > 0
    fast = r1["slowfast"]["fast_steps"] + r2["slowfast"]["fast_steps"]
    assert delta("slowfast_sfi_steps_total", kind="fast") == fast
    assert delta("slowfast_sfi_steps_total", kind="slow") in (
        r2["slowfast"]["slow_steps"], r2["slowfast"]["slow_steps"] + r1["slowfast"]["slow_steps"])
    assert after.get("slowfast_running_sequences", None) == 0
    assert after.get("slowfast_queued_sequences", None) == 0
    assert after.get("slowfast_kv_bytes_in_use", None) == kv0, "KV bytes in use did not return to the idle value"


def test_cancelled_stream(server):
    before = wait_idle(server)
    kv0 = before.get("slowfast_kv_bytes_in_use", None)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 400, "temperature": 0,
                                        "stream": True, "ignore_eos": True}, stream=True)
    assert r.status_code == 200
    n = 0
    for line in r.iter_lines():
        if line.startswith(b"data:"):
            n += 1
            if n == 3:
                break
    r.close()
    deadline = time.monotonic() + 15
    while True:
        m = server.metrics()
        cancelled = m.get("slowfast_requests_total", outcome="cancelled") - before.get("slowfast_requests_total", outcome="cancelled")
        if (cancelled >= 1 and m.get("slowfast_running_sequences", None) == 0
                and m.get("slowfast_kv_bytes_in_use", None) == kv0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cancelled == 1, f"requests_total{{outcome=cancelled}} rose by {cancelled}"
    assert m.get("slowfast_running_sequences", None) == 0
    assert m.get("slowfast_kv_bytes_in_use", None) == kv0
    gen = m.get("slowfast_generation_tokens_total") - before.get("slowfast_generation_tokens_total")
    assert gen < 400, f"the disconnected request was generated to the end ({gen} tokens)"


# ============================================================================ batch invariance
FULL_WORDS = [3, 15, 45, 90, 180, 290, 430, 620]          # ~4 .. ~700 tokens
SFI_WORDS = [285, 310, 340, 380, 420, 470, 530, 610]      # all > 300 tokens
GEN_TOKENS = 20


def _batch(server, word_counts, kv_policy, gen_policy):
    prompts = [prose(n, start=min(7 * i, len(prose_words()) - n)) for i, n in enumerate(word_counts)]
    refs = [generate_ref(p, GEN_TOKENS, gen_policy) for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def job(p):
        body = {"model": MODEL, "prompt": p, "max_tokens": GEN_TOKENS, "temperature": 0, "return_token_ids": True}
        if kv_policy:
            body["kv_policy"] = kv_policy
        barrier.wait()
        t0 = time.monotonic()
        out = complete(server, **body)
        return out, (t0, time.monotonic())

    with ThreadPoolExecutor(len(prompts)) as ex:
        res = list(ex.map(job, prompts))
    outs = [o for o, _ in res]
    spans = [t for _, t in res]
    # the point of the test: all of them were in flight together (the server batches up to 8)
    assert max(a for a, _ in spans) < min(b for _, b in spans), f"the requests did not overlap: {spans}"
    return prompts, refs, outs


@pytest.fixture(scope="module")
def batch_full(server):
    return _batch(server, FULL_WORDS, None, ())


@pytest.fixture(scope="module")
def batch_sfi(server):
    return _batch(server, SFI_WORDS, {"name": "sfi", "kv_budget": 300}, ("--policy", "sfi", "--kv-budget", "300"))


def _check_tokens(case):
    prompts, refs, outs = case
    bad = []
    for p, ref, out in zip(prompts, refs, outs):
        got = out["choices"][0].get("token_ids")
        if got != ref["tokens"]:
            first = next((i for i, (a, b) in enumerate(zip(got or [], ref["tokens"])) if a != b),
                         min(len(got or []), len(ref["tokens"])))
            bad.append(f"prompt of {ref['prompt_tokens']} tokens: first difference at generated token {first}: "
                       f"server {got} vs generate {ref['tokens']}")
    assert not bad, "batched greedy output differs from `slowfast generate` alone:\n" + "\n".join(bad)


def _check_usage(case):
    prompts, refs, outs = case
    for ref, out in zip(refs, outs):
        assert out["usage"]["prompt_tokens"] == ref["prompt_tokens"], (out["usage"], ref["prompt_tokens"])
        assert out["usage"]["completion_tokens"] == len(out["choices"][0]["token_ids"]), out["usage"]
        assert out["choices"][0]["text"] == ref["text"]


def test_batch_invariance_full(batch_full):
    _, refs, _ = batch_full
    assert min(r["prompt_tokens"] for r in refs) < 10 and max(r["prompt_tokens"] for r in refs) > 600
    _check_tokens(batch_full)


def test_batch_invariance_full_usage(batch_full):
    _check_usage(batch_full)
    for out in batch_full[2]:
        check_slowfast(out.get("slowfast"), "full")


def test_batch_invariance_sfi(batch_sfi):
    _, refs, _ = batch_sfi
    assert min(r["prompt_tokens"] for r in refs) > 300, [r["prompt_tokens"] for r in refs]
    assert all(r["policy"].startswith("sfi") for r in refs), refs[0]["policy"]
    assert sum(r["fast_steps"] for r in refs) > 0, "generate ran no fast step: SFI is not sparse here"
    _check_tokens(batch_sfi)


def test_batch_invariance_sfi_usage_and_steps(batch_sfi):
    _check_usage(batch_sfi)
    _, refs, outs = batch_sfi
    for ref, out in zip(refs, outs):
        sf = out.get("slowfast")
        check_slowfast(sf, "sfi")
        assert (sf["slow_steps"], sf["fast_steps"]) == (ref["slow_steps"], ref["fast_steps"]), \
            f"prompt of {ref['prompt_tokens']} tokens: server steps {sf} vs generate slow {ref['slow_steps']} fast {ref['fast_steps']}"


def test_idle_after_everything(server):
    m = wait_idle(server)
    assert m.get("slowfast_running_sequences", None) == 0
    assert m.get("slowfast_queued_sequences", None) == 0
    assert server.alive()


# ============================================================================ the server's default policy
def test_server_default_policy_sfi(sfi_default_server):
    """`serve --policy sfi --kv-budget 300`: requests without kv_policy decode with SFI, exactly as
    `generate --policy sfi --kv-budget 300`; kv_policy full overrides it per request."""
    s = sfi_default_server
    prompt = prose(340, start=20)
    ref_sfi = generate_ref(prompt, GEN_TOKENS, ("--policy", "sfi", "--kv-budget", "300"))
    ref_full = generate_ref(prompt, GEN_TOKENS)
    assert ref_sfi["prompt_tokens"] > 300
    r = complete(s, prompt=prompt, max_tokens=GEN_TOKENS, temperature=0, return_token_ids=True)
    check_slowfast(r.get("slowfast"), "sfi")
    assert r["choices"][0]["token_ids"] == ref_sfi["tokens"], (r["choices"][0]["token_ids"], ref_sfi["tokens"])
    # the same knobs spelled out in the request: the same output
    r2 = complete(s, prompt=prompt, max_tokens=GEN_TOKENS, temperature=0, return_token_ids=True,
                  kv_policy={"name": "sfi", "kv_budget": 300, "sinks": 4, "sfi_recent": 256})
    assert r2["choices"][0]["token_ids"] == ref_sfi["tokens"]
    r3 = complete(s, prompt=prompt, max_tokens=GEN_TOKENS, temperature=0, return_token_ids=True,
                  kv_policy={"name": "full"})
    check_slowfast(r3.get("slowfast"), "full")
    assert r3["choices"][0]["token_ids"] == ref_full["tokens"], (r3["choices"][0]["token_ids"], ref_full["tokens"])


def test_prefix_cache_restores_shared_chunks_and_changes_no_token(prefix_server):
    """Two prompts that share a long prefix: the second restores its whole 64-token chunks from
    the prefix cache, and both give what `generate` gives alone with the same chunks."""
    client = prefix_server.client()
    shared = prose(300)
    before = wait_idle(prefix_server)
    for i, ending in enumerate([" What happened next?", " Who spoke first, and why?"]):
        prompt = shared + ending
        ref = generate_ref(prompt, 12, ("--chunk", "64"))
        r = d(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True}))
        assert r["choices"][0].get("token_ids") == ref["tokens"], f"request {i}"
    after = wait_idle(prefix_server)
    hit = after.get("slowfast_prefix_cache_hit_tokens_total") - before.get("slowfast_prefix_cache_hit_tokens_total")
    # The shared ~400 tokens hold at least 5 whole chunks of 64 (the last part always runs).
    assert hit >= 5 * 64 and hit % 64 == 0, hit
    assert after.get("slowfast_prefix_cache_bytes", None) > 0


def test_preempted_requests_finish_with_the_tokens_of_generate(preempt_server):
    """Three requests in the KV memory of about two: the running sequences outgrow it, the newest
    is preempted and recomputed later, and every request still gets exactly what `generate`
    gives alone (1-token prefill chunks recompute the decoded KV bit for bit)."""
    if MODEL != "gemma3-270m" or DEVICE != "cpu":
        pytest.skip("the KV memory is sized for the default model on the CPU")
    client = preempt_server.client()
    prompts = [prose(40, start=300 + 60 * i) for i in range(3)]
    refs = [generate_ref(p, 100, ("--chunk", "1")) for p in prompts]
    before = wait_idle(preempt_server)
    out: list = [None] * 3

    def one(i):
        out[i] = d(client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=100, temperature=0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True}))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    for i in range(3):
        assert out[i] is not None, f"request {i} got no answer"
        assert out[i]["choices"][0].get("token_ids") == refs[i]["tokens"], f"request {i}"
        assert out[i]["usage"]["completion_tokens"] == 100
    after = wait_idle(preempt_server, kv_baseline=0)
    got = lambda k: after.get(k) - before.get(k)
    assert got("slowfast_preemptions_total") >= 1
    # Prefilled again: more than the three prompts.
    assert got("slowfast_prefill_tokens_total") > sum(r["prompt_tokens"] for r in refs)
    assert after.get("slowfast_kv_bytes_in_use") == 0

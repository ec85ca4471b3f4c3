// slowfast playground: sends completions or chat requests to this server (streamed), with the
// KV policy and speculation picked here, shows live speed and counts, then fetches the
// request's inspection (GET /v1/inspect/{id}) and colours the prompt by what the policy's
// memory held at the end, and marks the slow steps on a timeline of the generated tokens.
// Plain DOM code, no framework, no network besides this server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { chat: [], abort: null, inspection: null };

// ---------- the API key (asked for only when the server answers 401) ----------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value || localStorage.getItem("slowfast-key") || "";
  if (key) h.Authorization = "Bearer " + key;
  return h;
}
$("api-key").addEventListener("change", () => {
  localStorage.setItem("slowfast-key", $("api-key").value);
  loadModel();
});

async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) {
    $("key-box").hidden = false;
    $("model").textContent = "model: (API key needed)";
    return;
  }
  const j = await r.json();
  $("key-box").hidden = !$("api-key").value;
  const m = j.data[0];
  $("model").textContent = `model: ${m.id} · context ${m.max_model_len} tokens`;
}

// ---------- the request ----------
function mode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function num(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

/** The request body from the form (exported for tests through window.slowfastBody). */
function buildBody() {
  const body = {
    max_tokens: num("max-tokens"),
    temperature: num("temperature"),
    stream: true,
    stream_options: { include_usage: true },
    return_token_ids: true,
    inspect: true,
  };
  const stop = $("stop").value;
  if (stop) body.stop = stop.replace(/\\n/g, "\n");
  const kv = {};
  const policy = $("policy").value;
  if (policy) kv.name = policy;
  for (const [id, key] of [["budget", "kv_budget"], ["sinks", "sinks"],
                           ["sfi-recent", "sfi_recent"], ["sfi-interval", "sfi_refresh_interval"]]) {
    const v = num(id);
    if (v !== undefined) kv[key] = v;
  }
  const drafter = $("drafter").value;
  if (drafter) {
    body.speculate = { drafter };
    const t = $("spec-tokens").value.trim();
    if (t && drafter !== "off") body.speculate.spec_tokens = /^\d+$/.test(t) ? Number(t) : t;
    // Lossless speculation runs the drafter's own policy (sfi, streaming) or full KV.
    if (drafter === "sfi" || drafter === "streaming") kv.name = drafter;
    if (drafter === "ngram" || drafter === "model") delete kv.name;
  }
  if (Object.keys(kv).length) body.kv_policy = kv;
  if (mode() === "chat") {
    body.messages = state.chat.concat([{ role: "user", content: $("prompt").value }]);
  } else {
    body.prompt = $("prompt").value;
  }
  return body;
}
window.slowfastBody = buildBody;

function setStat(id, v) {
  $(id).textContent = v;
}

function resetStats() {
  for (const id of ["s-policy", "s-ttft", "s-tps", "s-prompt", "s-gen", "s-slow", "s-fast"]) setStat(id, "–");
}

async function send() {
  const body = buildBody();
  const chat = mode() === "chat";
  const url = chat ? "/v1/chat/completions" : "/v1/completions";
  const out = $("output");
  out.textContent = "";
  out.dataset.chunks = "0";
  out.classList.remove("error");
  $("memory").hidden = true;
  resetStats();
  $("status").textContent = "prefilling…";
  $("send").disabled = true;
  $("stop-btn").disabled = false;
  document.body.dataset.state = "running";
  const ctrl = new AbortController();
  state.abort = ctrl;
  const t0 = performance.now();
  let tFirst = null;
  let tokens = 0;
  let id = null;
  let answer = "";
  try {
    const r = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body), signal: ctrl.signal });
    if (!r.ok) {
      if (r.status === 401) $("key-box").hidden = false;
      const j = await r.json().catch(() => ({}));
      throw new Error(`${r.status}: ${(j.error && j.error.message) || r.statusText}`);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const j = JSON.parse(data);
          if (j.error) throw new Error(j.error.message);
          id = j.id;
          const c = j.choices && j.choices[0];
          if (c) {
            const text = chat ? (c.delta && c.delta.content) || "" : c.text || "";
            const n = (c.token_ids || []).length;
            if (n > 0 && tFirst === null) {
              tFirst = performance.now();
              setStat("s-ttft", `${((tFirst - t0) / 1000).toFixed(2)} s`);
              $("status").textContent = "decoding…";
            }
            tokens += n;
            answer += text;
            out.textContent = answer;
            out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
            setStat("s-gen", String(tokens));
            if (tFirst !== null && tokens > 1) {
              const s = (performance.now() - tFirst) / 1000;
              setStat("s-tps", ((tokens - 1) / s).toFixed(1));
            }
          }
          if (j.usage) {
            setStat("s-prompt", String(j.usage.prompt_tokens));
            setStat("s-gen", String(j.usage.completion_tokens));
          }
          if (j.slowfast) {
            setStat("s-policy", j.slowfast.policy);
            setStat("s-slow", String(j.slowfast.slow_steps));
            setStat("s-fast", String(j.slowfast.fast_steps));
          }
        }
      }
    }
    $("status").textContent = `done in ${((performance.now() - t0) / 1000).toFixed(2)} s`;
    if (chat) {
      state.chat.push({ role: "user", content: body.messages[body.messages.length - 1].content });
      state.chat.push({ role: "assistant", content: answer });
      renderChat();
      $("prompt").value = "";
    }
    if (id) await showInspection(id);
  } catch (e) {
    if (e.name === "AbortError") {
      $("status").textContent = "stopped";
    } else {
      out.classList.add("error");
      out.textContent = (answer ? answer + "\n\n" : "") + "error " + e.message;
      $("status").textContent = "failed";
    }
  } finally {
    state.abort = null;
    $("send").disabled = false;
    $("stop-btn").disabled = true;
    document.body.dataset.state = "idle";
  }
}

function renderChat() {
  const log = $("chat-log");
  log.replaceChildren();
  for (const m of state.chat) {
    const d = document.createElement("div");
    d.className = "msg " + m.role;
    d.textContent = m.content;
    log.append(d);
  }
}

// ---------- the inspection ----------
const ROLES = ["sinks", "selected", "recent", "kept"];
const ROLE_CLASS = { sinks: "sink", selected: "selected", recent: "recent", kept: "kept" };

async function showInspection(id) {
  const r = await fetch(`/v1/inspect/${encodeURIComponent(id)}`, { headers: headers() });
  if (!r.ok) return;
  const ins = await r.json();
  state.inspection = ins;
  const lp = $("layer-pick");
  lp.replaceChildren();
  const globals = ins.layers.filter((l) => !l.sliding);
  lp.append(new Option(`all ${globals.length} global layers (summed)`, "global"));
  lp.append(new Option(`all ${ins.layers.length} layers (summed)`, "all"));
  for (const l of ins.layers) {
    lp.append(new Option(`layer ${l.layer}${l.sliding ? " (sliding window)" : ""}`, String(l.layer)));
  }
  const hp = $("head-pick");
  hp.replaceChildren();
  const nh = ins.layers.length ? ins.layers[0].heads.length : 0;
  hp.append(new Option(`all ${nh} (summed)`, "all"));
  for (let h = 0; h < nh; h++) hp.append(new Option(`head ${h}`, String(h)));
  $("memory").hidden = false;
  renderMemory();
  renderTimeline();
}

/** Per position: how many (layer, head) pairs of the view hold it, per role. */
function counts(ins, layerSel, headSel) {
  const n = ins.positions;
  const diff = {};
  for (const role of ROLES) diff[role] = new Int32Array(n + 1);
  let pairs = 0;
  for (const l of ins.layers) {
    if (layerSel === "global" && l.sliding) continue;
    if (layerSel !== "global" && layerSel !== "all" && String(l.layer) !== layerSel) continue;
    l.heads.forEach((h, i) => {
      if (headSel !== "all" && String(i) !== headSel) return;
      pairs++;
      for (const role of ROLES) {
        for (const [a, b] of h[role]) {
          diff[role][Math.min(a, n)]++;
          diff[role][Math.min(b, n)]--;
        }
      }
    });
  }
  const c = {};
  for (const role of ROLES) {
    c[role] = new Int32Array(n);
    let run = 0;
    for (let p = 0; p < n; p++) {
      run += diff[role][p];
      c[role][p] = run;
    }
  }
  return { c, pairs };
}

function renderMemory() {
  const ins = state.inspection;
  if (!ins) return;
  const { c, pairs } = counts(ins, $("layer-pick").value, $("head-pick").value);
  const box = $("tokens");
  box.replaceChildren();
  const frag = document.createDocumentFragment();
  const held = { sinks: 0, selected: 0, recent: 0, kept: 0 };
  for (let p = 0; p < ins.positions; p++) {
    if (p === ins.prompt_tokens) {
      const hr = document.createElement("span");
      hr.className = "gen-start";
      hr.title = "generated tokens from here";
      frag.append(hr);
    }
    const s = document.createElement("span");
    s.textContent = ins.tokens[p];
    s.dataset.pos = String(p);
    let best = null;
    let total = 0;
    for (const role of ROLES) {
      const k = c[role][p];
      total += k;
      if (k > 0) held[role]++;
      if (k > 0 && (best === null || k > c[best][p])) best = role;
    }
    s.dataset.held = String(total);
    if (best) {
      s.className = "t " + ROLE_CLASS[best];
      s.dataset.role = best;
      s.style.setProperty("--a", String(0.25 + 0.75 * (total / Math.max(1, pairs))));
      s.title = `position ${p}: held by ${total} of ${pairs} (layer, head) pairs — ` +
        ROLES.filter((r) => c[r][p] > 0).map((r) => `${r} ${c[r][p]}`).join(", ");
    } else {
      s.className = "t none";
      s.title = `position ${p}: not held`;
    }
    frag.append(s);
  }
  box.append(frag);
  $("mem-summary").textContent =
    `${ins.policy}: ${ins.positions} positions in the KV (${ins.prompt_tokens} prompt), ` +
    `${pairs} (layer, kv head) pairs in view; positions held by any: ` +
    ROLES.map((r) => `${r} ${held[r]}`).join(", ") + (ins.truncated ? " (record truncated)" : "");
}

function renderTimeline() {
  const ins = state.inspection;
  const tl = $("timeline");
  tl.replaceChildren();
  const slow = new Map();
  for (const s of ins.slow_steps || []) slow.set(s.position, s.reason);
  // Generated token i was fed at position prompt_tokens + i (the last one is never fed).
  const fed = ins.positions - ins.prompt_tokens;
  const frag = document.createDocumentFragment();
  for (let i = 0; i < fed; i++) {
    const p = ins.prompt_tokens + i;
    const d = document.createElement("span");
    const reason = slow.get(p);
    d.className = "step " + (reason ? "slow r-" + (reason === "random" ? "periodic" : reason) : "fast");
    d.dataset.pos = String(p);
    if (reason) d.dataset.reason = reason;
    d.title = `step ${i + 1} (position ${p}, fed ${JSON.stringify(ins.tokens[p])}): ` +
      (reason ? `slow — ${reason}` : "fast");
    frag.append(d);
  }
  tl.append(frag);
  const by = {};
  for (const s of ins.slow_steps || []) by[s.reason] = (by[s.reason] || 0) + 1;
  $("tl-summary").textContent = ins.slow_steps
    ? `${fed} decode steps: ${ins.steps.slow} slow, ${ins.steps.fast} fast` +
      (Object.keys(by).length ? " — " + Object.entries(by).map(([k, v]) => `${k} ${v}`).join(", ") : "")
    : `${fed} decode steps; ${ins.policy} has no slow/fast schedule (${ins.steps.slow} dense, ${ins.steps.fast} sparse)`;
}

// ---------- a pass key example ----------
function passkeyExample() {
  const key = String(10000 + Math.floor(Math.random() * 90000));
  const filler = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
  const before = filler.repeat(45);
  const after = filler.repeat(45);
  $("prompt").value = before + ` The pass key is ${key}. Remember it. ${key} is the pass key.` + after +
    "\n\nWhat is the pass key? The pass key is";
  $("max-tokens").value = "8";
  $("temperature").value = "0";
  $("budget").value = "400";
  document.querySelector('input[name="mode"][value="complete"]').checked = true;
  onMode();
}

function onMode() {
  const chat = mode() === "chat";
  $("chat-log").hidden = !chat;
  $("clear").hidden = !chat;
}

$("send").addEventListener("click", send);
$("stop-btn").addEventListener("click", () => state.abort && state.abort.abort());
$("clear").addEventListener("click", () => { state.chat = []; renderChat(); });
$("example").addEventListener("click", passkeyExample);
$("layer-pick").addEventListener("change", renderMemory);
$("head-pick").addEventListener("change", renderMemory);
for (const r of document.querySelectorAll('input[name="mode"]')) r.addEventListener("change", onMode);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send();
});
onMode();
loadModel();

//! The router against its OpenAPI description (openapi.json): the same routes both ways, each
//! answered by its handler (not the fallback, not a 405), and `/openapi.json` serving the file.
//! The router runs over the tiny Qwen3 fixture.
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use serde_json::Value;
use slowfast_engine::scheduler::{self, SchedulerConfig};
use slowfast_engine::{Device, KvDtype, PolicySpec};
use tower::ServiceExt;

use super::*;

fn spec() -> Value {
    serde_json::from_str(OPENAPI_JSON).expect("openapi.json is valid JSON")
}

/// (METHOD, path) of every operation in openapi.json.
fn spec_routes() -> BTreeSet<(String, String)> {
    let s = spec();
    let paths = s["paths"].as_object().expect("openapi.json has `paths`");
    let mut out = BTreeSet::new();
    for (path, item) in paths {
        let ops = item.as_object().expect("a path item is an object");
        for method in ops.keys() {
            if [
                "get", "put", "post", "delete", "options", "head", "patch", "trace",
            ]
            .contains(&method.as_str())
            {
                out.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    out
}

fn router_routes() -> BTreeSet<(String, String)> {
    routes()
        .into_iter()
        .map(|(m, p, _)| (m.to_string(), p.to_owned()))
        .collect()
}

fn app() -> Router {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen3");
    let loaded = Arc::new(slowfast_engine::load(dir.to_str().unwrap(), &mut |_| {}).unwrap());
    let sched_cfg = SchedulerConfig {
        device: Device::Cpu,
        max_batch: 2,
        max_queue: 4,
        prefill_tokens_per_step: 16,
        chunk: 16,
        kv_dtype: KvDtype::F32,
        kv_memory: usize::MAX,
        kv_reserve: false,
        gpu_memory_utilization: 0.9,
        max_context: 64,
        default_policy: PolicySpec::Full,
        draft: None,
        prefix_cache_bytes: 0,
        prefix_block: 16,
    };
    let (handle, _thread) = scheduler::spawn(loaded.clone(), sched_cfg).unwrap();
    let cfg = ServerConfig {
        host: "127.0.0.1".into(),
        port: 0,
        served_model_name: "tiny".into(),
        api_key: None,
        max_body_bytes: 1 << 16,
        max_context: 64,
        device: "cpu".into(),
        max_batch: 2,
        header_read_timeout: std::time::Duration::from_secs(10),
        body_read_timeout: std::time::Duration::from_secs(30),
        speculate: None,
        draft_model: false,
    };
    let resolve: Arc<PolicyResolver> =
        Arc::new(|_: Option<&KvPolicyRequest>, _: usize| Ok::<_, String>(PolicySpec::Full));
    router(cfg, loaded, handle, resolve)
}

async fn call(app: &Router, method: &str, path: &str, body: &str) -> (StatusCode, String, Vec<u8>) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let ctype = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
        .await
        .unwrap();
    (status, ctype, bytes.to_vec())
}

#[test]
fn openapi_json_describes_exactly_the_routes() {
    let s = spec();
    assert!(
        s["openapi"].as_str().is_some_and(|v| v.starts_with("3.0.")),
        "OpenAPI 3.0.x: {}",
        s["openapi"]
    );
    let (spec, router) = (spec_routes(), router_routes());
    let missing: Vec<_> = router.difference(&spec).collect();
    let extra: Vec<_> = spec.difference(&router).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "routes not in openapi.json: {missing:?}; paths in openapi.json the router lacks: {extra:?}"
    );
    // Every $ref points at a schema that exists.
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    out.push(r.clone());
                }
                m.values().for_each(|x| refs(x, out));
            }
            Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&s, &mut all);
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("unexpected $ref {r}"));
        assert!(
            s["components"]["schemas"].get(name).is_some(),
            "$ref {r} has no schema"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_is_served_by_its_handler() {
    let app = app();
    for (method, path) in router_routes() {
        let body = if method == "POST" { "{}" } else { "" };
        let (status, _, bytes) = call(&app, &method, &path, body).await;
        let text = String::from_utf8_lossy(&bytes);
        assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert!(
            !text.contains("no such endpoint"),
            "{method} {path} reached the fallback: {text}"
        );
        // Every documented status of the operation covers what it answered.
        let op = &spec()["paths"][&path][method.to_lowercase()];
        assert!(
            op["responses"].get(status.as_str()).is_some(),
            "{method} {path} answered {status}, which openapi.json does not list"
        );
    }
    // /openapi.json serves the file, as JSON.
    let (status, ctype, bytes) = call(&app, "GET", "/openapi.json", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ctype, "application/json");
    assert_eq!(bytes, OPENAPI_JSON.as_bytes());
    // The fallback lists it.
    let (status, _, bytes) = call(&app, "GET", "/nope", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(String::from_utf8_lossy(&bytes).contains("/openapi.json"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inspected_request_can_be_fetched_by_its_id() {
    let app = app();
    let body = r#"{"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 4, "temperature": 0, "ignore_eos": true, "inspect": true}"#;
    let (status, _, bytes) = call(&app, "POST", "/v1/completions", body).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    let resp: Value = serde_json::from_slice(&bytes).unwrap();
    let id = resp["id"].as_str().unwrap();
    let (status, ctype, bytes) = call(&app, "GET", &format!("/v1/inspect/{id}"), "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ctype, "application/json");
    let ins: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(ins["id"], id);
    assert_eq!(ins["object"], "slowfast.inspection");
    assert_eq!(ins["policy"], "full");
    // 6 prompt tokens and 3 of the 4 generated ones were fed.
    assert_eq!(ins["positions"], 9);
    assert_eq!(ins["tokens"].as_array().unwrap().len(), 9);
    let layers = ins["layers"].as_array().unwrap();
    assert!(!layers.is_empty());
    for l in layers {
        for h in l["heads"].as_array().unwrap() {
            assert_eq!(h["kept"], serde_json::json!([[0, 9]]));
            assert_eq!(h["sinks"], serde_json::json!([]));
        }
    }
    assert!(ins["slow_steps"].is_null());
    assert_eq!(ins["truncated"], false);
    // A request that did not ask has no record; nor has an unknown id.
    let plain = r#"{"prompt": [5, 6, 7], "max_tokens": 2}"#;
    let (_, _, bytes) = call(&app, "POST", "/v1/completions", plain).await;
    let id2 = serde_json::from_slice::<Value>(&bytes).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    for path in [format!("/v1/inspect/{id2}"), "/v1/inspect/nope".into()] {
        let (status, _, bytes) = call(&app, "GET", &path, "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert!(String::from_utf8_lossy(&bytes).contains("\\\"inspect\\\": true"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_playground_and_its_assets_are_served() {
    let app = app();
    for (path, ctype, needle) in [
        ("/", "text/html; charset=utf-8", "/playground.js"),
        (
            "/playground.js",
            "text/javascript; charset=utf-8",
            "/v1/inspect/",
        ),
        ("/playground.css", "text/css; charset=utf-8", ".t.selected"),
    ] {
        let (status, got, bytes) = call(&app, "GET", path, "").await;
        assert_eq!((status, got.as_str()), (StatusCode::OK, ctype), "{path}");
        assert!(String::from_utf8_lossy(&bytes).contains(needle), "{path}");
    }
    // Nothing the page loads comes from another origin.
    let html = String::from_utf8(call(&app, "GET", "/", "").await.2).unwrap();
    assert!(!html.contains("http://") && !html.contains("https://"));
}

#[test]
fn an_inspection_record_is_bounded() {
    use slowfast_engine::scheduler::{Finish, FinishReason, Inspection, LayerHeld};
    use slowfast_kv::Held;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/qwen3");
    let loaded = slowfast_engine::load(dir.to_str().unwrap(), &mut |_| {}).unwrap();
    // 4 layers x 8 heads, each with 5,000 one-position selected runs: 160,000 runs.
    let sel: Vec<u32> = (0..5000).map(|i| 10 + 2 * i).collect();
    let held = Held::with_roles(0..4, &sel, 10_100..10_200);
    let ins = Inspection {
        positions: 10_200,
        layers: (0..4)
            .map(|l| LayerHeld {
                layer: l,
                sliding: false,
                heads: vec![held.clone(); 8],
            })
            .collect(),
        slow_steps: None,
        slow_steps_total: 0,
    };
    let f = Finish {
        reason: FinishReason::Length,
        text: String::new(),
        prompt_tokens: 10_000,
        completion_tokens: 201,
        policy: "sfi".into(),
        stats: Default::default(),
        inspection: None,
    };
    let prompt = vec![5u32; 10_000];
    let r = inspect::record(
        "cmpl-1",
        "m",
        &loaded.tokenizer,
        &prompt,
        &[6; 201],
        &f,
        &ins,
    );
    assert_eq!(r["truncated"], true);
    let mut runs = 0;
    for l in r["layers"].as_array().unwrap() {
        for h in l["heads"].as_array().unwrap() {
            // Sinks and the window survive the cut.
            assert_eq!(h["sinks"], serde_json::json!([[0, 4]]));
            assert_eq!(h["recent"], serde_json::json!([[10_100, 10_200]]));
            for role in ["sinks", "selected", "recent", "kept"] {
                runs += h[role].as_array().unwrap().len();
            }
        }
    }
    assert!(runs <= inspect::MAX_RUNS, "{runs}");
    assert_eq!(r["tokens"].as_array().unwrap().len(), 10_200);
}

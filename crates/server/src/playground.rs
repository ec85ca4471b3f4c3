//! The playground: a page at `/` that chats with the model, picks the KV policy per request
//! and shows what the policy's memory held (crates/server/static; compiled into the binary,
//! no network at run time). Public, like `/health`: the page asks for the API key when the
//! server has one and sends it on its `/v1` calls.
use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../static/index.html");
const SCRIPT: &str = include_str!("../static/playground.js");
const STYLE: &str = include_str!("../static/playground.css");

fn asset(ctype: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, ctype),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

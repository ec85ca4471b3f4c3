//! slowfast-server: the OpenAI-compatible HTTP front of the scheduler (`slowfast serve`).
//! It parses and checks requests, hands them to the scheduler thread and turns the
//! scheduler's events into JSON responses or server-sent events; no model code lives here.
pub mod api;
pub mod error;
mod handlers;
pub mod inspect;
pub mod metrics;
mod playground;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::http::Method;
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use slowfast_engine::scheduler::SchedulerHandle;
use slowfast_engine::Loaded;

pub use api::{KvPolicyRequest, PolicyResolver};

/// The OpenAPI 3.0 description of every route (crates/server/openapi.json), served at
/// `GET /openapi.json`.
pub const OPENAPI_JSON: &str = include_str!("../openapi.json");

/// What the server needs besides the scheduler.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0: any free port (the one bound is printed).
    pub port: u16,
    /// The name `/v1/models` lists and requests must use (or leave out).
    pub served_model_name: String,
    /// Bearer token the /v1 endpoints require, when set.
    pub api_key: Option<String>,
    /// Request bodies larger than this get a 413.
    pub max_body_bytes: usize,
    /// Longest sequence (prompt + generated) a request may have.
    pub max_context: usize,
    /// Printed at start ("cpu", "cuda").
    pub device: String,
    pub max_batch: usize,
    /// A connection that has not sent a whole request head this long after it opened (or
    /// after its last response) is closed: slow or idle clients cannot hold sockets forever.
    pub header_read_timeout: std::time::Duration,
    /// A request body not received whole this long after its head gets a 408.
    pub body_read_timeout: std::time::Duration,
    /// Speculative decoding of requests that do not say (`serve --speculate`).
    pub speculate: Option<slowfast_engine::spec::SpecOptions>,
    /// A draft model was loaded (`serve --draft-model`): requests may use the `model` drafter.
    pub draft_model: bool,
}

pub(crate) struct AppState {
    pub cfg: ServerConfig,
    pub loaded: Arc<Loaded>,
    pub sched: SchedulerHandle,
    pub resolve: Arc<PolicyResolver>,
    pub metrics: metrics::Metrics,
    /// Unix time the server started (the models' `created`).
    pub created: u64,
    pub next_id: std::sync::atomic::AtomicU64,
    pub end_of_turn: Vec<u32>,
    /// The inspections of the last requests that asked for one.
    pub inspections: inspect::Inspections,
}

/// The routes over a running scheduler.
pub fn router(
    cfg: ServerConfig,
    loaded: Arc<Loaded>,
    sched: SchedulerHandle,
    resolve: Arc<PolicyResolver>,
) -> Router {
    let limit = cfg.max_body_bytes;
    let state = Arc::new(AppState {
        cfg,
        sched,
        resolve,
        metrics: metrics::Metrics::default(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        next_id: std::sync::atomic::AtomicU64::new(1),
        end_of_turn: api::end_of_turn_ids(&loaded.tokenizer),
        inspections: inspect::Inspections::default(),
        loaded,
    });
    routes()
        .into_iter()
        .fold(Router::new(), |r, (_, path, handler)| {
            r.route(path, handler)
        })
        .fallback(handlers::not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Every route the router serves, with its method: openapi.json describes exactly these (a
/// test checks it, and that each method here is the one its handler answers).
fn routes() -> Vec<(Method, &'static str, MethodRouter<Arc<AppState>>)> {
    vec![
        (Method::GET, "/health", get(handlers::health)),
        (Method::GET, "/metrics", get(handlers::metrics)),
        (Method::GET, "/openapi.json", get(handlers::openapi)),
        (Method::GET, "/v1/models", get(handlers::models)),
        (Method::POST, "/v1/completions", post(handlers::completions)),
        (Method::POST, "/v1/chat/completions", post(handlers::chat)),
        (Method::GET, "/v1/inspect/{id}", get(inspect::get)),
        (Method::GET, "/", get(playground::index)),
        (Method::GET, "/playground.js", get(playground::script)),
        (Method::GET, "/playground.css", get(playground::style)),
    ]
}

/// Binds, prints the address and serves until Ctrl-C / SIGTERM (a tokio runtime of its own,
/// two worker threads: the model's work runs on the scheduler thread and its pool).
pub fn run(
    cfg: ServerConfig,
    loaded: Arc<Loaded>,
    sched: SchedulerHandle,
    resolve: Arc<PolicyResolver>,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))
        })?;
        let bound: SocketAddr = listener.local_addr()?;
        eprintln!(
            "slowfast serve: `{}` on {}, up to {} sequences of {} tokens; listening on http://{bound} (playground: http://{bound}/)",
            cfg.served_model_name, cfg.device, cfg.max_batch, cfg.max_context
        );
        let header_timeout = cfg.header_read_timeout;
        let app = router(cfg, loaded, sched, resolve);
        serve_loop(listener, app, header_timeout).await
    })
}

/// The accept loop (axum::serve without its fixed timeouts): one hyper HTTP/1 connection a
/// socket, with a header read timeout; on Ctrl-C / SIGTERM it stops accepting, asks every
/// connection to finish its current request, and returns when all are closed.
async fn serve_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: std::time::Duration,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    let stop = shutdown();
    tokio::pin!(stop);
    loop {
        let (stream, _peer) = tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: wait a little, keep serving.
                    eprintln!("slowfast serve: accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let mut stop_rx = stop_rx.clone();
        conns.spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = b.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stop_rx.changed() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
        // Reap the connections that ended.
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("slowfast serve: shutting down");
}

#[cfg(test)]
mod tests;

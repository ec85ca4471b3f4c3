//! An [`EventSink`] over a channel: many requests' events into one receiver, each tagged with
//! its request's number, and [`collect`] to gather them into one [`Outcome`] per request. What
//! an embedder that drives the scheduler from one thread needs, and what the scheduler's own
//! tests (CPU and GPU) use.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Event, EventSink, Finish};

/// Forwards events as `(id, event)` until its flag is set (then the request is cancelled).
pub struct ChannelSink {
    id: usize,
    tx: Sender<(usize, Event)>,
    closed: Arc<AtomicBool>,
}

impl ChannelSink {
    /// A sink for request `id`, and the flag that cancels it when set.
    pub fn new(id: usize, tx: &Sender<(usize, Event)>) -> (Box<Self>, Arc<AtomicBool>) {
        let closed = Arc::new(AtomicBool::new(false));
        let sink = ChannelSink {
            id,
            tx: tx.clone(),
            closed: closed.clone(),
        };
        (Box::new(sink), closed)
    }
}

impl EventSink for ChannelSink {
    fn send(&self, ev: Event) -> bool {
        !self.is_closed() && self.tx.send((self.id, ev)).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

/// What became of one request: its tokens, how it finished, or why it failed.
pub type Outcome = (Vec<u32>, Option<Finish>, Option<String>);

/// Gathers events until requests `0..n` have each finished or failed, or panics after
/// `timeout` (a scheduler that stops answering is a bug to the caller).
pub fn collect(rx: &Receiver<(usize, Event)>, n: usize, timeout: Duration) -> Vec<Outcome> {
    let mut out: Vec<Outcome> = vec![(Vec::new(), None, None); n];
    let mut left = n;
    let deadline = Instant::now() + timeout;
    while left > 0 {
        let (id, ev) = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the scheduler answers in time");
        match ev {
            Event::Token(t) => out[id].0.push(t.id),
            Event::Done(f) => {
                out[id].1 = Some(f);
                left -= 1;
            }
            Event::Error(e) => {
                out[id].2 = Some(e);
                left -= 1;
            }
        }
    }
    out
}

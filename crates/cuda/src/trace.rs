//! Step tracing: where a graph-replayed decode step spends its time, with every overlap of
//! programmatic dependent launch (PDL) in place. ncu serializes kernels and nsys is not on the
//! GPU machine, so the kernels time themselves.
//!
//! `SLOWFAST_TRACE=<folder>` compiles the kernels with `-DSLOWFAST_TRACE` (a separate cached
//! image). Then thread 0 of block 0 of every PDL kernel writes one record at its `pdl_wait()`
//! (kernels/common.cuh): the grid's launch number (`%gridid`), the global timer before and after
//! the wait, the wait's call site and the grid size, into slot (launch number % [`CAPACITY`]).
//! A kernel node of a CUDA graph keeps its launch number over replays, so the buffer holds the
//! last replay of each. `slowfast bench --device cuda` runs a step, empties the buffer, runs one
//! more and writes its records to `<folder>/trace-<policy>-b<batch>-<context>.csv`, and prints
//! [`format_summary`]'s table. Kernels that are not PDL launches (cuBLAS, plain launches) leave
//! no record; their time falls to the record before them. The records cost each traced kernel
//! two timer reads and four stores after its wait.
//!
//! A kernel's wait returns once the kernel before it in the stream has finished and its writes
//! are visible, so the time from one record's wait return to the next one's is what the earlier
//! kernel costs the step: its own work after its wait, plus whatever of its start it could not
//! hide behind the kernel before.

use std::collections::BTreeMap;

/// The environment variable that turns tracing on and names the folder for its files.
pub const ENV_TRACE: &str = "SLOWFAST_TRACE";

/// u64 words of one record, and the record slots (`SF_TRACE_CAP` in kernels/common.cuh).
pub const RECORD_WORDS: usize = 4;
pub const CAPACITY: usize = 16384;

/// The folder `SLOWFAST_TRACE` names, if tracing is on (unset, empty or `0`: off).
pub fn trace_dir() -> Option<std::path::PathBuf> {
    match std::env::var(ENV_TRACE) {
        Ok(v) if !v.is_empty() && v != "0" => Some(v.into()),
        _ => None,
    }
}

/// One traced `pdl_wait()`.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// The grid's launch number in the context (`%gridid`): launch order.
    pub grid: u64,
    /// Global timer (ns) when block 0 reached its wait, and when the wait returned.
    pub before_ns: u64,
    pub after_ns: u64,
    /// The call site: kernel file (kernels/*.cu) and line.
    pub file: &'static str,
    pub line: u32,
    /// Blocks in the grid.
    pub blocks: u32,
}

impl TraceRecord {
    /// `file:line` of the wait.
    pub fn site(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

/// Decodes a trace buffer as the kernels left it: the filled slots, in wait-return order.
pub fn parse_records(raw: &[u64]) -> Vec<TraceRecord> {
    let mut out: Vec<TraceRecord> = raw
        .chunks_exact(RECORD_WORDS)
        .filter(|r| r[2] != 0)
        .map(|r| {
            let file_idx = ((r[3] >> 16) & 0xffff) as usize;
            TraceRecord {
                grid: r[0],
                before_ns: r[1],
                after_ns: r[2],
                file: crate::kernels::SOURCES
                    .get(file_idx)
                    .map_or("?", |(name, _)| *name),
                line: (r[3] & 0xffff) as u32,
                blocks: (r[3] >> 32) as u32,
            }
        })
        .collect();
    out.sort_by_key(|r| r.after_ns);
    out
}

/// The records as CSV (a header line, then one line a record in the order given).
pub fn to_csv(records: &[TraceRecord]) -> String {
    let mut s = String::from("grid,before_ns,after_ns,site,blocks\n");
    for r in records {
        s.push_str(&format!(
            "{},{},{},{},{}\n",
            r.grid,
            r.before_ns,
            r.after_ns,
            r.site(),
            r.blocks
        ));
    }
    s
}

/// What the kernels of one (site, grid size) cost over the traced steps.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteCost {
    pub site: String,
    pub blocks: u32,
    /// The site of the record before (empty for the first).
    pub after: String,
    /// Launches seen (the last record of the trace has no successor and is not counted).
    pub count: usize,
    /// Mean time (us) from this kernel's wait return to the next record's.
    pub path_us: f64,
    /// Mean time (us) block 0 spent in the wait: how early the kernel started.
    pub wait_us: f64,
}

/// Orders the records by their wait returns and charges each the time to the next one's (see
/// the module text). Sorted by total cost, largest first. Also returns the traced span (us,
/// first wait return to last).
pub fn summarize(records: &[TraceRecord]) -> (Vec<SiteCost>, f64) {
    let mut rs: Vec<&TraceRecord> = records.iter().collect();
    rs.sort_by_key(|r| r.after_ns);
    // Keyed by the site, the grid size and the site before (o and down share a GEMV, grid and
    // site, but not the kernel before them).
    let mut acc: BTreeMap<(String, u32, String), (usize, f64, f64)> = BTreeMap::new();
    for (i, w) in rs.windows(2).enumerate() {
        let (r, next) = (w[0], w[1]);
        let before = i.checked_sub(1).map_or(String::new(), |j| rs[j].site());
        let e = acc.entry((r.site(), r.blocks, before)).or_default();
        e.0 += 1;
        e.1 += next.after_ns.saturating_sub(r.after_ns) as f64 * 1e-3;
        e.2 += r.after_ns.saturating_sub(r.before_ns) as f64 * 1e-3;
    }
    let span = match (rs.first(), rs.last()) {
        (Some(a), Some(b)) => b.after_ns.saturating_sub(a.after_ns) as f64 * 1e-3,
        _ => 0.0,
    };
    let mut out: Vec<SiteCost> = acc
        .into_iter()
        .map(|((site, blocks, after), (count, path, wait))| SiteCost {
            site,
            blocks,
            after,
            count,
            path_us: path / count as f64,
            wait_us: wait / count as f64,
        })
        .collect();
    out.sort_by(|a, b| (b.path_us * b.count as f64).total_cmp(&(a.path_us * a.count as f64)));
    (out, span)
}

/// [`summarize`]'s table as text, per step (`steps` traced steps).
pub fn format_summary(records: &[TraceRecord], steps: usize) -> String {
    let (costs, span) = summarize(records);
    let steps = steps.max(1) as f64;
    let mut s = format!(
        "{:<22} {:>7} {:<22} {:>7} {:>10} {:>11} {:>9}\n",
        "wait site", "blocks", "after", "a step", "us each", "us a step", "waited us"
    );
    for c in &costs {
        s.push_str(&format!(
            "{:<22} {:>7} {:<22} {:>7.1} {:>10.2} {:>11.1} {:>9.2}\n",
            c.site,
            c.blocks,
            c.after,
            c.count as f64 / steps,
            c.path_us,
            c.path_us * c.count as f64 / steps,
            c.wait_us
        ));
    }
    s.push_str(&format!(
        "traced span {:.1} us a step over {} records\n",
        span / steps,
        records.len()
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer with records (grid, before, after, file, line, blocks) in their slots.
    fn raw(recs: &[(u64, u64, u64, u64, u64, u64)]) -> Vec<u64> {
        let mut v = vec![0u64; CAPACITY * RECORD_WORDS];
        for &(g, b, a, file, line, blocks) in recs {
            let at = (g as usize % CAPACITY) * RECORD_WORDS;
            v[at..at + 4].copy_from_slice(&[g, b, a, (blocks << 32) | (file << 16) | line]);
        }
        v
    }

    #[test]
    fn records_decode_with_their_file_line_and_grid_in_wait_order() {
        let v = raw(&[(9, 90, 400, 5, 194, 64), (7, 100, 250, 7, 179, 1536)]);
        let r = parse_records(&v);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].grid, 7);
        assert_eq!(r[0].file, crate::kernels::SOURCES[7].0);
        assert_eq!(r[0].line, 179);
        assert_eq!(r[0].blocks, 1536);
        assert_eq!(r[1].site(), format!("{}:194", crate::kernels::SOURCES[5].0));
        assert!(to_csv(&r).lines().nth(2).unwrap().starts_with("9,90,400,"));
        assert!(parse_records(&[3, 3]).is_empty());
        assert!(parse_records(&raw(&[])).is_empty());
    }

    #[test]
    fn each_kernel_is_charged_up_to_the_next_wait_return() {
        // Two steps of a: 10 us, b: 3 us, c: 5 us (then the next step's a); launch numbers
        // out of order with the times, as a graph's are: the summary orders by wait return.
        let mut recs = Vec::new();
        let mut t = 10_000u64;
        let mut g = 500;
        for _ in 0..2 {
            for (line, us, blocks) in [(10u64, 10u64, 100u64), (20, 3, 64), (30, 5, 640)] {
                recs.push((g, t - 2_000, t, 0, line, blocks));
                t += us * 1000;
                g -= 1;
            }
        }
        recs.push((g, t - 500, t, 0, 10, 100));
        let r = parse_records(&raw(&recs));
        let (costs, span) = summarize(&r);
        assert!((span - 36.0).abs() < 1e-9, "{span}");
        let get = |blocks| costs.iter().find(|c| c.blocks == blocks).unwrap();
        // a: once first, once after c
        assert_eq!(costs.iter().filter(|c| c.blocks == 100).count(), 2);
        let a_after_c = costs
            .iter()
            .find(|c| c.blocks == 100 && c.after == "elementwise.cu:30")
            .unwrap();
        assert_eq!(a_after_c.count, 1);
        assert!((a_after_c.path_us - 10.0).abs() < 1e-9);
        assert_eq!(get(64).count, 2);
        assert!((get(100).path_us - 10.0).abs() < 1e-9);
        assert!((get(64).path_us - 3.0).abs() < 1e-9);
        assert!((get(640).path_us - 5.0).abs() < 1e-9);
        assert!((get(640).wait_us - 2.0).abs() < 1e-9);
        // largest total first
        assert_eq!(costs[0].blocks, 100);
        assert_eq!(costs[0].count, 1);
        let text = format_summary(&r, 2);
        assert!(text.contains("traced span 18.0 us a step"), "{text}");
    }
}

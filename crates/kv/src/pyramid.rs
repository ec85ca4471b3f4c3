//! PyramidKV's layer budgets: SnapKV scoring (see `snapkv.rs`, `SnapKvConfig::pyramidkv`) with
//! per-layer capacities decreasing linearly with depth, summing to the same total as SnapKV.

/// Capacities (window included) of `layers` scored layers, lowest first, for a mean capacity
/// `capacity`, window `window`, `n` prompt tokens and steepness `beta`: `min = (C - w) / beta`,
/// `max = 2 (C - w) - min` (capped at `n - w`, then `min` recomputed), linear in between,
/// rounded so the total is exactly `layers * capacity` (when the cap allows it).
pub fn pyramid_budgets(
    capacity: usize,
    window: usize,
    layers: usize,
    n: usize,
    beta: f64,
) -> Vec<usize> {
    if layers <= 1 {
        return vec![capacity; layers];
    }
    let c = capacity.saturating_sub(window) as f64;
    let mut min = c / beta;
    let mut max = 2.0 * c - min;
    let room = n.saturating_sub(window) as f64;
    if max >= room {
        max = room;
        min = (2.0 * c - max).max(0.0);
    }
    let step = (max - min) / (layers - 1) as f64;
    let mut out: Vec<usize> = (0..layers)
        .map(|l| (max - l as f64 * step).floor() as usize)
        .collect();
    // Hand out the rounding remainder from the lowest layer up (keeps the pyramid shape).
    let want = capacity.saturating_sub(window) * layers;
    let mut have: usize = out.iter().sum();
    let mut i = 0;
    while have < want && i < layers {
        out[i] += 1;
        have += 1;
        i += 1;
    }
    out.iter().map(|b| b + window).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pyramid_is_decreasing_with_the_same_total() {
        for (cap, layers) in [(320, 32), (1638, 3), (100, 7), (64, 2)] {
            let b = pyramid_budgets(cap, 32, layers, 100_000, 20.0);
            assert_eq!(b.len(), layers);
            assert_eq!(b.iter().sum::<usize>(), cap * layers, "{b:?}");
            assert!(b.windows(2).all(|w| w[0] >= w[1]), "{b:?}");
            assert!(b[0] > cap && b[layers - 1] < cap, "{b:?}");
        }
        // methods.md: min = (C - w) / 20, max = 2 (C - w) - min
        let b = pyramid_budgets(320, 64, 2, 100_000, 20.0);
        assert_eq!(b, vec![64 + 500, 64 + 12]);
        // Capped by the prompt: the bottom layer keeps at most n tokens.
        let b = pyramid_budgets(600, 32, 3, 800, 20.0);
        assert_eq!(b[0], 800);
        assert_eq!(b.iter().sum::<usize>(), 1800);
        assert_eq!(pyramid_budgets(50, 8, 1, 100, 20.0), vec![50]);
    }
}

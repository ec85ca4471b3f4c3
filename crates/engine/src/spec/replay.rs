//! Replayed acceptance for timing speculative decoding on models whose drafts mean nothing
//! (random weights): each verification accepts a length drawn from a distribution measured on
//! real text (`generate --speculate ... --json` writes `accept_hist`), or from a per-token
//! acceptance probability. Whatever a bench times this way is labelled as replayed.
use std::collections::BTreeMap;

/// Where accepted lengths come from.
#[derive(Debug, Clone, PartialEq)]
pub enum AcceptModel {
    /// Each drafted token is accepted with probability `alpha`, independently, until the first
    /// rejection (the standard model of speculative decoding's analysis).
    Alpha(f64),
    /// Per drafter and γ, counts of verifications that accepted 0, 1, ..., γ drafts.
    Hist(BTreeMap<String, BTreeMap<usize, Vec<f64>>>),
}

impl AcceptModel {
    /// `alpha:A` (0 <= A <= 1) or the path of a JSON file
    /// `{"sfi": {"4": [c0, c1, c2, c3, c4], ...}, ...}`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if let Some(a) = s.strip_prefix("alpha:") {
            let a: f64 = a
                .parse()
                .map_err(|_| format!("--spec-accept: `{a}` is not a number"))?;
            if !(0.0..=1.0).contains(&a) {
                return Err(format!("--spec-accept: alpha {a} is not in [0, 1]"));
            }
            return Ok(AcceptModel::Alpha(a));
        }
        let text = std::fs::read_to_string(s).map_err(|e| {
            format!("--spec-accept: cannot read {s} ({e}); give alpha:A or a histogram file")
        })?;
        let raw: BTreeMap<String, BTreeMap<String, Vec<f64>>> = serde_json::from_str(&text)
            .map_err(|e| {
                format!("--spec-accept: {s} is not {{drafter: {{gamma: [counts]}}}}: {e}")
            })?;
        let mut out = BTreeMap::new();
        for (d, per) in raw {
            let mut m = BTreeMap::new();
            for (g, counts) in per {
                let gamma: usize = g
                    .parse()
                    .map_err(|_| format!("--spec-accept: {s}: `{g}` ({d}) is not a γ"))?;
                if counts.len() != gamma + 1
                    || counts.iter().any(|c| !c.is_finite() || *c < 0.0)
                    || counts.iter().sum::<f64>() <= 0.0
                {
                    return Err(format!(
                        "--spec-accept: {s}: {d} at γ {gamma} needs {} non-negative counts, not all 0",
                        gamma + 1
                    ));
                }
                m.insert(gamma, counts);
            }
            out.insert(d, m);
        }
        Ok(AcceptModel::Hist(out))
    }

    /// Checks that `drafter` at every γ of `gammas` has a distribution.
    pub fn check(&self, drafter: &str, gammas: &[usize]) -> Result<(), String> {
        if let AcceptModel::Hist(h) = self {
            let per = h
                .get(drafter)
                .ok_or_else(|| format!("--spec-accept: no histograms for drafter {drafter}"))?;
            if let Some(g) = gammas.iter().find(|g| !per.contains_key(g)) {
                return Err(format!(
                    "--spec-accept: no histogram for {drafter} at γ {g} (has {:?})",
                    per.keys().collect::<Vec<_>>()
                ));
            }
        }
        Ok(())
    }

    /// Accepted drafts of one verification of `gamma` drafts; `u` uniform in [0, 1).
    pub fn draw(&self, drafter: &str, gamma: usize, u: f64) -> usize {
        match self {
            AcceptModel::Alpha(a) => {
                // P(accept >= k) = a^k
                let mut k = 0;
                let mut p = 1.0;
                while k < gamma {
                    p *= a;
                    if u >= p {
                        break;
                    }
                    k += 1;
                }
                k
            }
            AcceptModel::Hist(h) => {
                let counts = &h[drafter][&gamma];
                let total: f64 = counts.iter().sum();
                let mut acc = 0.0;
                for (k, c) in counts.iter().enumerate() {
                    acc += c / total;
                    if u < acc {
                        return k;
                    }
                }
                gamma
            }
        }
    }

    /// Mean accepted drafts of a verification of `gamma` drafts.
    pub fn mean(&self, drafter: &str, gamma: usize) -> f64 {
        match self {
            AcceptModel::Alpha(a) => (1..=gamma).map(|k| a.powi(k as i32)).sum(),
            AcceptModel::Hist(h) => {
                let c = &h[drafter][&gamma];
                let t: f64 = c.iter().sum();
                c.iter().enumerate().map(|(k, x)| k as f64 * x).sum::<f64>() / t
            }
        }
    }

    pub fn label(&self) -> String {
        match self {
            AcceptModel::Alpha(a) => format!("replayed: alpha {a}"),
            AcceptModel::Hist(_) => "replayed: measured histograms".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh xorshift stream of uniforms.
    fn uniforms(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64
            })
            .collect()
    }

    #[test]
    fn draws_follow_the_model_they_replay() {
        let n = 200_000;
        let a = AcceptModel::Alpha(0.8);
        let mean: f64 = uniforms(7, n)
            .iter()
            .map(|&u| a.draw("sfi", 6, u) as f64)
            .sum::<f64>()
            / n as f64;
        assert!(
            (mean - a.mean("sfi", 6)).abs() < 0.02,
            "{mean} vs {}",
            a.mean("sfi", 6)
        );
        let mut h = BTreeMap::new();
        h.insert(4usize, vec![1.0, 0.0, 3.0, 0.0, 6.0]);
        let mut m = BTreeMap::new();
        m.insert("sfi".to_string(), h);
        let hm = AcceptModel::Hist(m);
        let mut seen = [0usize; 5];
        for u in uniforms(9, n) {
            seen[hm.draw("sfi", 4, u)] += 1;
        }
        assert_eq!(
            (seen[1], seen[3]),
            (0, 0),
            "a zero count was drawn: {seen:?}"
        );
        for (k, want) in [(0, 0.1), (2, 0.3), (4, 0.6)] {
            let got = seen[k] as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "P({k}) = {got}, want {want}");
        }
        assert!((hm.mean("sfi", 4) - 3.0).abs() < 1e-12);
    }

    #[test]
    fn bad_specs_are_refused_by_name() {
        assert!(AcceptModel::parse("alpha:1.5").unwrap_err().contains("1.5"));
        assert!(AcceptModel::parse("alpha:x").is_err());
        let dir = std::env::temp_dir().join(format!("replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("h.json");
        std::fs::write(&f, r#"{"sfi": {"2": [1, 2]}}"#).unwrap();
        let e = AcceptModel::parse(f.to_str().unwrap()).unwrap_err();
        assert!(e.contains("γ 2") && e.contains("3 non-negative"), "{e}");
        std::fs::write(&f, r#"{"sfi": {"2": [1, 2, 3]}}"#).unwrap();
        let m = AcceptModel::parse(f.to_str().unwrap()).unwrap();
        assert!(m.check("sfi", &[2]).is_ok());
        assert!(m.check("sfi", &[4]).unwrap_err().contains("γ 4"));
        assert!(m.check("ngram", &[2]).unwrap_err().contains("ngram"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

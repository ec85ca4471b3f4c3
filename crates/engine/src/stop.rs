//! Stop strings over the decoded text stream: says when one appears and holds back text that
//! could still be the start of one, so a partial stop string is never printed.

/// Result of feeding text to a `StopMatcher`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text that is safe to print now (never contains a stop string or its start).
    pub emit: String,
    /// Index (into the matcher's list) of the stop string that was found, if any; generation
    /// should end and the stop string itself is not emitted.
    pub stopped: Option<usize>,
}

/// Watches streamed text for any of a set of stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String, // text not yet emitted: a suffix that may begin a stop string
    done: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Self {
        StopMatcher {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .collect(),
            held: String::new(),
            done: false,
        }
    }

    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// Whether a stop string has been seen.
    pub fn is_stopped(&self) -> bool {
        self.done
    }

    /// Feed newly decoded text. After a stop, further text is ignored.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.done {
            return StopStep::default();
        }
        self.held.push_str(text);
        // Earliest occurrence of any stop string (the longest one on a tie of positions).
        let mut found: Option<(usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(pos) = self.held.find(s.as_str()) {
                let better = match found {
                    None => true,
                    Some((p, j)) => pos < p || (pos == p && s.len() > self.stops[j].len()),
                };
                if better {
                    found = Some((pos, i));
                }
            }
        }
        if let Some((pos, i)) = found {
            self.done = true;
            let emit = self.held[..pos].to_owned();
            self.held.clear();
            return StopStep {
                emit,
                stopped: Some(i),
            };
        }
        let keep = self.partial_suffix_len();
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_owned();
        self.held.drain(..cut);
        StopStep {
            emit,
            stopped: None,
        }
    }

    /// End of generation without a stop: the held-back text is printed after all.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string
    /// (always on a char boundary).
    fn partial_suffix_len(&self) -> usize {
        let h = self.held.as_str();
        let mut best = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(h.len());
            for len in (best + 1..=max).rev() {
                let start = h.len() - len;
                if h.is_char_boundary(start) && s.starts_with(&h[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed pieces, collect output; returns (printed text, stop index).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = StopMatcher::new(stops.iter().copied());
        let mut out = String::new();
        for p in pieces {
            let step = m.push(p);
            out.push_str(&step.emit);
            if step.stopped.is_some() {
                return (out, step.stopped);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn stop_split_across_tokens() {
        let (out, stop) = run(&["</end>"], &["Hello <", "/e", "nd> more"]);
        assert_eq!(out, "Hello ");
        assert_eq!(stop, Some(0));
        // A near miss is printed in full once it cannot be a stop any more.
        let (out, stop) = run(&["</end>"], &["a </e", "x> b"]);
        assert_eq!(out, "a </ex> b");
        assert_eq!(stop, None);
    }

    #[test]
    fn partial_stop_is_never_printed() {
        let stop = "\n\nUser:";
        let text = "Answer: 42.\n\nUser: next";
        // Every split of the text into two pieces prints exactly the text before the stop.
        for cut in 0..=text.len() {
            let (a, b) = text.split_at(cut);
            let mut m = StopMatcher::new([stop]);
            let s1 = m.push(a);
            assert!("Answer: 42.".starts_with(&s1.emit), "{s1:?}");
            let s2 = m.push(b);
            assert_eq!(format!("{}{}", s1.emit, s2.emit), "Answer: 42.");
            assert!(s1.stopped.or(s2.stopped).is_some());
            assert!(m.is_stopped());
            assert_eq!(m.push("more").emit, "");
        }
    }

    #[test]
    fn earliest_of_several_and_unicode() {
        let (out, stop) = run(&["STOP", "é!", "x"], &["abc é", "! STOP x"]);
        assert_eq!(out, "abc ");
        assert_eq!(stop, Some(1));
        // Held text stays on char boundaries.
        let mut m = StopMatcher::new(["éa"]);
        assert_eq!(m.push("bé").emit, "b");
        assert_eq!(m.push("b").emit, "éb");
        let (out, stop) = run(&[""], &["no stops"]);
        assert_eq!((out.as_str(), stop), ("no stops", None));
    }
}

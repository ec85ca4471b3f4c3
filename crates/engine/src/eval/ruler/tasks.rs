//! RULER's task list (arXiv 2404.06654): names, generation budgets, and the parameters of
//! each needle-in-a-haystack variant.
use crate::EngineError;

/// One of RULER's synthetic tasks (the QA tasks need SQuAD / HotpotQA and are left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RulerTask {
    NiahSingle1,
    NiahSingle2,
    NiahSingle3,
    NiahMultikey1,
    NiahMultikey2,
    NiahMultikey3,
    NiahMultivalue,
    NiahMultiquery,
    /// Variable tracking.
    Vt,
    /// Common-words extraction.
    Cwe,
    /// Frequent-words extraction.
    Fwe,
}

/// What a NIAH haystack is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Haystack {
    /// "The grass is green. ..." repeated.
    Repeat,
    /// Long prose (`--input`).
    Essay,
    /// Distractor needles with random keys and values.
    Needle,
}

/// Keys and values of NIAH needles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// "adjective-noun".
    Word,
    /// 7-digit numbers.
    Number,
    Uuid,
}

/// The parameters of a NIAH task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Niah {
    pub haystack: Haystack,
    pub key: Kind,
    pub value: Kind,
    /// Keys hidden, values per key, keys asked.
    pub num_k: usize,
    pub num_v: usize,
    pub num_q: usize,
}

impl RulerTask {
    pub const ALL: [RulerTask; 11] = [
        RulerTask::NiahSingle1,
        RulerTask::NiahSingle2,
        RulerTask::NiahSingle3,
        RulerTask::NiahMultikey1,
        RulerTask::NiahMultikey2,
        RulerTask::NiahMultikey3,
        RulerTask::NiahMultivalue,
        RulerTask::NiahMultiquery,
        RulerTask::Vt,
        RulerTask::Cwe,
        RulerTask::Fwe,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RulerTask::NiahSingle1 => "niah_single_1",
            RulerTask::NiahSingle2 => "niah_single_2",
            RulerTask::NiahSingle3 => "niah_single_3",
            RulerTask::NiahMultikey1 => "niah_multikey_1",
            RulerTask::NiahMultikey2 => "niah_multikey_2",
            RulerTask::NiahMultikey3 => "niah_multikey_3",
            RulerTask::NiahMultivalue => "niah_multivalue",
            RulerTask::NiahMultiquery => "niah_multiquery",
            RulerTask::Vt => "vt",
            RulerTask::Cwe => "cwe",
            RulerTask::Fwe => "fwe",
        }
    }

    /// Tokens generated for the answer (RULER's budgets).
    pub fn budget(self) -> usize {
        match self {
            RulerTask::Vt => 30,
            RulerTask::Cwe => 120,
            RulerTask::Fwe => 50,
            _ => 128,
        }
    }

    /// The NIAH parameters (None for vt, cwe, fwe).
    pub fn niah(self) -> Option<Niah> {
        use Haystack::*;
        use Kind::*;
        let n = |haystack, key, value, num_k, num_v, num_q| {
            Some(Niah {
                haystack,
                key,
                value,
                num_k,
                num_v,
                num_q,
            })
        };
        match self {
            RulerTask::NiahSingle1 => n(Repeat, Word, Number, 1, 1, 1),
            RulerTask::NiahSingle2 => n(Essay, Word, Number, 1, 1, 1),
            RulerTask::NiahSingle3 => n(Essay, Word, Uuid, 1, 1, 1),
            RulerTask::NiahMultikey1 => n(Essay, Word, Number, 4, 1, 1),
            RulerTask::NiahMultikey2 => n(Needle, Word, Number, 1, 1, 1),
            RulerTask::NiahMultikey3 => n(Needle, Uuid, Uuid, 1, 1, 1),
            RulerTask::NiahMultivalue => n(Essay, Word, Number, 1, 4, 1),
            RulerTask::NiahMultiquery => n(Essay, Word, Number, 4, 1, 4),
            _ => None,
        }
    }

    /// Whether the task's haystack is the essay text (`--input`).
    pub fn needs_essay(self) -> bool {
        self.niah().is_some_and(|n| n.haystack == Haystack::Essay)
    }

    /// Parse a comma-separated list of task names (`all` for every task), in the order given,
    /// without repeats; a bad name gets an error naming it and the valid ones.
    pub fn parse_list(s: &str) -> Result<Vec<RulerTask>, EngineError> {
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let tasks: Vec<RulerTask> = if name == "all" {
                RulerTask::ALL.to_vec()
            } else {
                let t = RulerTask::ALL
                    .iter()
                    .copied()
                    .find(|t| t.name() == name)
                    .ok_or_else(|| {
                        EngineError::BadInput(format!(
                            "--ruler-tasks: unknown task `{name}` (expected all or some of {})",
                            RulerTask::ALL.map(|t| t.name()).join(", ")
                        ))
                    })?;
                vec![t]
            };
            for t in tasks {
                if !out.contains(&t) {
                    out.push(t);
                }
            }
        }
        if out.is_empty() {
            return Err(EngineError::BadInput(
                "--ruler-tasks needs at least one task".into(),
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_lists_parse_and_bad_names_are_named() {
        assert_eq!(RulerTask::parse_list("all").unwrap(), RulerTask::ALL);
        assert_eq!(
            RulerTask::parse_list("vt, cwe,vt").unwrap(),
            [RulerTask::Vt, RulerTask::Cwe]
        );
        let e = RulerTask::parse_list("vt,niah_single_9")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`niah_single_9`") && e.contains("niah_multikey_3"),
            "{e}"
        );
        assert!(RulerTask::parse_list(" , ").is_err());
        let budgets: Vec<usize> = RulerTask::ALL.iter().map(|t| t.budget()).collect();
        assert_eq!(
            budgets,
            [128, 128, 128, 128, 128, 128, 128, 128, 30, 120, 50]
        );
        let essay: Vec<&str> = RulerTask::ALL
            .iter()
            .filter(|t| t.needs_essay())
            .map(|t| t.name())
            .collect();
        assert_eq!(
            essay,
            [
                "niah_single_2",
                "niah_single_3",
                "niah_multikey_1",
                "niah_multivalue",
                "niah_multiquery"
            ]
        );
    }
}

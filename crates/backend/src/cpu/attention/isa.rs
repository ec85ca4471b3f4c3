//! Runtime choice of the instruction set the attention kernels run with.

use std::sync::OnceLock;

/// Instruction set chosen at runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// Best ISA of this CPU whose vector width divides `head_dim`, capped by the env var
    /// `SLOWFAST_ATTN_ISA` (`scalar`, `avx2`, `avx512`; read once) for benchmarks and checks.
    pub(crate) fn best(head_dim: usize) -> Isa {
        static CAP: OnceLock<usize> = OnceLock::new();
        let cap = *CAP.get_or_init(|| match std::env::var("SLOWFAST_ATTN_ISA").as_deref() {
            Ok("scalar") => 1,
            Ok("avx2") => 8,
            _ => usize::MAX,
        });
        Self::available()
            .iter()
            .filter(|i| i.lanes() <= cap)
            .rev()
            .copied()
            .find(|i| head_dim.is_multiple_of(i.lanes()))
            .unwrap_or(Isa::Scalar)
    }

    /// Every ISA this CPU can run, narrowest first (detected once).
    pub(crate) fn available() -> &'static [Isa] {
        static AVAILABLE: OnceLock<Vec<Isa>> = OnceLock::new();
        AVAILABLE.get_or_init(|| {
            #[allow(unused_mut)]
            let mut v = vec![Isa::Scalar];
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
                {
                    v.push(Isa::Avx2);
                }
                if is_x86_feature_detected!("avx512f") {
                    v.push(Isa::Avx512);
                }
            }
            v
        })
    }

    pub(crate) fn lanes(self) -> usize {
        match self {
            Isa::Scalar => 1,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => 8,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 16,
        }
    }
}

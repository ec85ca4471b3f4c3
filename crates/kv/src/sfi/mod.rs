//! SFI (Slow-Fast Inference) KV policy parts: the training-free Selector that refreshes the
//! sparse memory at slow steps, and the slow-step trigger.
/// Defines `pub(crate) fn $name` that runs `$body` compiled for AVX-512 or AVX2+FMA when the CPU
/// has them (runtime detection), and the portable build otherwise.
/// Tests cap the SIMD level to exercise every build: 0 = best detected, 1 = at most AVX2+FMA,
/// 2 = portable only.
#[cfg(test)]
pub(crate) static SIMD_CAP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

macro_rules! dispatch {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[cfg(test)]
                let cap = crate::sfi::SIMD_CAP.load(std::sync::atomic::Ordering::Relaxed);
                #[cfg(not(test))]
                let cap = 0u8;
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                if cap == 0
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
                {
                    // SAFETY: the required CPU features were detected at runtime.
                    return unsafe { avx512($($arg),*) };
                }
                if cap <= 1 && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the required CPU features were detected at runtime.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

pub mod candidates;
pub mod memory;
pub mod selector;
#[cfg(test)]
mod selector_cases;
mod selector_math;
pub mod selector_ref;
mod selector_score;
#[cfg(test)]
mod selector_tests;
pub mod trigger;

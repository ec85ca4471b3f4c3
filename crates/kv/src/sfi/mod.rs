//! SFI (Slow-Fast Inference) KV policy parts: the training-free Selector that refreshes the
//! sparse memory at slow steps, and the slow-step trigger.
/// Defines `pub(crate) fn $name` that runs `$body` compiled for AVX-512 or AVX2+FMA when the CPU
/// has them (runtime detection), and the portable build otherwise.
macro_rules! dispatch {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        pub(crate) fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
                {
                    // SAFETY: the required CPU features were detected at runtime.
                    return unsafe { avx512($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the required CPU features were detected at runtime.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

pub mod selector;
#[cfg(test)]
mod selector_cases;
mod selector_math;
pub mod selector_ref;
mod selector_score;
#[cfg(test)]
mod selector_tests;
pub mod trigger;

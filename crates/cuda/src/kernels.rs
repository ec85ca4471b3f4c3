//! The CUDA C++ kernel sources (kernels/*.cu, embedded at build time) and the names of
//! every `extern "C"` entry point they define.

/// Shared header prepended to every source file.
const COMMON: &str = include_str!("../kernels/common.cuh");

/// (file name, source) of each kernel file, in the order they are concatenated.
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise.cu", include_str!("../kernels/elementwise.cu")),
    ("norm.cu", include_str!("../kernels/norm.cu")),
    ("sampling.cu", include_str!("../kernels/sampling.cu")),
    (
        "attn_prefill.cu",
        include_str!("../kernels/attn_prefill.cu"),
    ),
    (
        "attn_prefill_wg.cu",
        include_str!("../kernels/attn_prefill_wg.cu"),
    ),
    ("attn_decode.cu", include_str!("../kernels/attn_decode.cu")),
    ("sfi.cu", include_str!("../kernels/sfi.cu")),
    ("snapkv.cu", include_str!("../kernels/snapkv.cu")),
    ("quest.cu", include_str!("../kernels/quest.cu")),
    ("sfi_cand.cu", include_str!("../kernels/sfi_cand.cu")),
    ("h2o.cu", include_str!("../kernels/h2o.cu")),
    ("gemv.cu", include_str!("../kernels/gemv.cu")),
    (
        "decode_fused.cu",
        include_str!("../kernels/decode_fused.cu"),
    ),
];

/// Every kernel entry point; the context loads each of these at start.
pub const KERNEL_NAMES: &[&str] = &[
    "embed_gather",
    "add_bf16",
    "add_bias_bf16",
    "glu_bf16",
    "kv_append",
    "advance_positions",
    "rmsnorm_bf16",
    "head_rmsnorm_bf16",
    "rope_neox_bf16",
    "argmax_f32",
    "sample_top_p_f32",
    "attn_prefill_d64",
    "attn_prefill_d128",
    "attn_prefill_d256",
    "attn_prefill_d64_m2",
    "attn_prefill_d128_m2",
    "attn_prefill_d128_wg",
    "attn_prefill_d128_wg3",
    "attn_decode_d64",
    "attn_decode_d128",
    "attn_decode_d128_s4",
    "attn_decode_d256",
    "attn_decode_post_d64",
    "attn_decode_post_d128",
    "attn_decode_post_d128_s4",
    "attn_decode_post_d256",
    "attn_decode_reduce",
    "attn_verify_d64",
    "attn_verify_d64_g2",
    "attn_verify_d64_g4",
    "attn_verify_d128",
    "attn_verify_d128_g2",
    "attn_verify_d128_g3",
    "attn_verify_d256",
    "attn_verify_d256_g2",
    "attn_sparse_decode_d64",
    "attn_sparse_decode_d128",
    "attn_sparse_decode_d256",
    "attn_sparse_decode_post_d64",
    "attn_sparse_decode_post_d128",
    "attn_sparse_decode_post_d256",
    "sfi_key_norms",
    "sfi_rowstats",
    "sfi_evidence",
    "sfi_score",
    "sfi_cross_head",
    "sfi_topk",
    "snap_rowstats",
    "snap_colsum",
    "snap_pool",
    "snap_head_sum",
    "quest_bounds",
    "quest_score",
    "quest_topk",
    "sfi_cand_ub",
    "sfi_cand_score",
    "sfi_view_norms",
    "sfi_pos_prior_view",
    "sfi_view_unmap",
    "h2o_colsum",
    "h2o_prep",
    "h2o_mark",
    "h2o_logits",
    "h2o_evict",
    "sfi_pos_prior",
    "sfi_score_part",
    "sfi_score_lambda",
    "sfi_score_fin",
    "sfi_topk_hist",
    "sfi_topk_cand",
    "sfi_topk_rank",
    "sfi_topk_write",
    "sfi_gather",
    "sfi_publish",
    "gemv_bf16_n3",
    "gemv_bf16_n4",
    "gemv_bf16_n5",
    "gemv_bf16_n6",
    "gemv_bf16_n7",
    "gemv_bf16_n8",
    "gemv_mma_fused_m0",
    "gemv_mma_fused_m1",
    "gemv_fused_n1_m0",
    "gemv_fused_n1_m1",
    "gemv_fused_n2_m0",
    "gemv_fused_n2_m1",
    "qkv_post_bf16",
    "qkv_post_f8",
    "scale_block_bf16",
    "stream_read_bench",
    // the same attention over e4m3 (fp8) caches: `kv_kernel(name, true)`
    "attn_prefill_d64_f8",
    "attn_prefill_d128_f8",
    "attn_prefill_d256_f8",
    "attn_prefill_d64_m2_f8",
    "attn_prefill_d128_m2_f8",
    "attn_decode_d64_f8",
    "attn_decode_d128_f8",
    "attn_decode_d128_s4_f8",
    "attn_decode_d256_f8",
    "attn_decode_post_d64_f8",
    "attn_decode_post_d128_f8",
    "attn_decode_post_d128_s4_f8",
    "attn_decode_post_d256_f8",
    "attn_verify_d64_f8",
    "attn_verify_d64_g2_f8",
    "attn_verify_d64_g4_f8",
    "attn_verify_d128_f8",
    "attn_verify_d128_g2_f8",
    "attn_verify_d128_g3_f8",
    "attn_verify_d256_f8",
    "attn_verify_d256_g2_f8",
    "attn_sparse_decode_d64_f8",
    "attn_sparse_decode_d128_f8",
    "attn_sparse_decode_d256_f8",
    "attn_sparse_decode_post_d64_f8",
    "attn_sparse_decode_post_d128_f8",
    "attn_sparse_decode_post_d256_f8",
    "sfi_key_norms_f8",
    "quest_bounds_f8",
    "quest_score_f8",
    "sfi_cand_ub_f8",
    "h2o_logits_f8",
];

/// The entry point reading the KV caches as `name` does, over e4m3 caches when `fp8` (the
/// kernels that touch the caches are compiled twice, the second time named `{name}_f8`).
/// Panics on a name without an fp8 twin: a caller's bug, caught by the fp8 tests.
pub fn kv_kernel(name: &'static str, fp8: bool) -> &'static str {
    if !fp8 {
        return name;
    }
    if name == "qkv_post_bf16" {
        return "qkv_post_f8";
    }
    KERNEL_NAMES
        .iter()
        .find(|n| n.len() == name.len() + 3 && n.starts_with(name) && n.ends_with("_f8"))
        .copied()
        .unwrap_or_else(|| panic!("kernel {name} has no fp8 twin"))
}

/// Whether kernel `name` calls `pdl_wait()` before touching anything an earlier kernel wrote
/// (see common.cuh): the only kernels a decode step launches with programmatic dependent launch.
pub fn is_pdl_kernel(name: &str) -> bool {
    name.starts_with("gemv_")
        || name.starts_with("attn_decode_")
        || name.starts_with("attn_sparse_decode_")
        || matches!(
            name,
            "embed_gather"
                | "advance_positions"
                | "rmsnorm_bf16"
                | "argmax_f32"
                | "qkv_post_bf16"
                | "qkv_post_f8"
        )
}

/// The attention kernels of a decode step (q/k post-processing, flash-decoding and its reduce,
/// dense or sparse): the kernels `SLOWFAST_PDL_WIDE=1` launches with PDL at 3+ rows.
pub fn is_attn_pdl_kernel(name: &str) -> bool {
    name.starts_with("attn_decode_")
        || name.starts_with("attn_sparse_decode_")
        || name == "qkv_post_bf16"
        || name == "qkv_post_f8"
}

/// The single translation unit handed to NVRTC: the common header followed by every file.
pub fn kernel_source() -> String {
    let mut src = String::with_capacity(64 * 1024);
    src.push_str(COMMON);
    for (i, (name, body)) in SOURCES.iter().enumerate() {
        // SF_FILE and the file's own line numbers name a traced pdl_wait() (src/trace.rs); the
        // #line also makes NVRTC's messages point into the file itself.
        src.push_str(&format!(
            "\n// ---- {name} ----\n#undef SF_FILE\n#define SF_FILE {i}\n#line 1 \"{name}\"\n"
        ));
        src.push_str(body);
    }
    src
}

/// Threads of `sfi_cand_ub` a page (kernels/sfi_cand.cu's `SFI_CAND_TPP`, passed to NVRTC as
/// a define by `nvrtc::compile_options`). Run 137 had one a page (39 us a layer at 32K, 64
/// blocks); 8 a page (512 blocks) with the prompt's bounds computed at prefill took the cheap
/// slow step from 6.31 to 4.54 ms at 32K in run 138.
pub const CAND_THREADS_A_PAGE: u32 = 8;

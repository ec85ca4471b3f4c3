//! The decode hot path (`matvec_into` / `matvec_rows` with a warmed-up scratch) allocates
//! nothing, on the sequential and the rayon-parallel paths.

mod common;

use common::{random_matrix, Rng};
use slowfast_quant::{matvec_into, matvec_rows, GgmlType, MatvecScratch, QMatrix};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn warmed_up_matvec_does_not_allocate() {
    let mut rng = Rng::fresh("warmed_up_matvec_does_not_allocate");
    // The counter is global: start rayon's pool and wait until every worker has run, so the
    // workers' own start-up allocations can't land inside a measured window (this raced in CI).
    rayon::broadcast(|_| ());
    // 37 rows: sequential; 1024 x 640 Q8_0 (~700 KB): the parallel path.
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 37, 640),
        (GgmlType::Q8_0, 1024, 640),
        (GgmlType::Q4_K, 1024, 1024),
        (GgmlType::F16, 999, 640),
    ] {
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).unwrap();
        let x = rng.vec(cols);
        let mut y = vec![0.0f32; rows];
        let mut scratch = MatvecScratch::new();
        let start = ALLOCS.load(Ordering::SeqCst);
        matvec_into(&w, &x, &mut y, &mut scratch).unwrap(); // warm-up: sizes the scratch
        let before = ALLOCS.load(Ordering::SeqCst);
        if ty != GgmlType::F16 {
            // The counter works: sizing the quantized-activation scratch allocated.
            assert!(before > start, "{ty}: warm-up should allocate the scratch");
        }
        for _ in 0..5 {
            matvec_into(&w, &x, &mut y, &mut scratch).unwrap();
            matvec_rows(&w, &x, 3..rows, &mut y[3..], &mut scratch).unwrap();
        }
        let n = ALLOCS.load(Ordering::SeqCst) - before;
        assert_eq!(
            n, 0,
            "{ty} {rows}x{cols}: {n} allocations in the warmed-up decode path"
        );
    }
}

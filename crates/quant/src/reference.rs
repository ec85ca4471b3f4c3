//! Plain references for the kernels: dequantize each row to f32, then an f64 dot product.

use crate::matvec::QMatrix;
use crate::QuantError;

/// `y = W x` computed by dequantizing every row and summing in f64 (slow; for tests).
pub fn matvec_reference(w: &QMatrix, x: &[f32], y: &mut [f32]) -> Result<(), QuantError> {
    w.validate()?;
    QuantError::check_len("matvec_reference x", "values", w.cols, x.len())?;
    QuantError::check_len("matvec_reference y", "values", w.rows, y.len())?;
    if w.cols == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let mut row = vec![0.0f32; w.cols]; // [cols]
    for (r, out) in y.iter_mut().enumerate() {
        w.dequantize_row(r, &mut row)?;
        *out = row
            .iter()
            .zip(x)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum::<f64>() as f32;
    }
    Ok(())
}

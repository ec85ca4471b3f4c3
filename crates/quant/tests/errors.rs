//! Bad input gives an error naming the problem, never a panic; type table sanity.

use slowfast_quant::{
    dequantize_row, matmul, matvec, matvec_rows, quantize_row, GgmlType, MatvecScratch, QMatrix,
    QuantError,
};

#[test]
fn type_ids_and_sizes() {
    for &ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
    }
    assert_eq!(GgmlType::from_id(4), None);
    assert_eq!(GgmlType::from_id(1000), None);
    let sizes = [
        (GgmlType::F32, 1, 4),
        (GgmlType::F16, 1, 2),
        (GgmlType::BF16, 1, 2),
        (GgmlType::Q4_0, 32, 18),
        (GgmlType::Q5_0, 32, 22),
        (GgmlType::Q8_0, 32, 34),
        (GgmlType::Q4_K, 256, 144),
        (GgmlType::Q5_K, 256, 176),
        (GgmlType::Q6_K, 256, 210),
        (GgmlType::Q8_K, 256, 292),
        (GgmlType::Q2_K, 256, 84),
        (GgmlType::Q3_K, 256, 110),
    ];
    for (ty, bs, ts) in sizes {
        assert_eq!((ty.block_size(), ty.type_size()), (bs, ts), "{ty}");
    }
    assert_eq!(GgmlType::Q4_K.row_bytes(1024), Ok(576));
    assert!(matches!(
        GgmlType::Q4_K.row_bytes(640),
        Err(QuantError::BadColumns {
            ncols: 640,
            block_size: 256,
            ..
        })
    ));
}

#[test]
fn bad_sizes_are_errors() {
    let mut y = vec![0.0f32; 32];
    // src one byte short
    let err = dequantize_row(GgmlType::Q8_0, &[0u8; 33], &mut y).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::BadLength {
                expected: 34,
                got: 33,
                ..
            }
        ),
        "{err}"
    );
    // dst not a whole block
    let err = dequantize_row(GgmlType::Q8_0, &[0u8; 34], &mut y[..31]).unwrap_err();
    assert!(matches!(err, QuantError::BadColumns { .. }), "{err}");
    let err = quantize_row(GgmlType::Q6_K, &[0.0; 256], &mut [0u8; 209]).unwrap_err();
    assert!(err.to_string().contains("expected 210"), "{err}");

    let data = vec![0u8; 3 * 34];
    assert!(QMatrix::new(GgmlType::Q8_0, 4, 32, &data).is_err());
    let w = QMatrix::new(GgmlType::Q8_0, 3, 32, &data).unwrap();
    let mut y3 = vec![0.0f32; 3];
    assert!(matvec(&w, &[0.0; 31], &mut y3).is_err());
    assert!(matvec(&w, &[0.0; 32], &mut y3[..2]).is_err());
    let mut s = MatvecScratch::new();
    let err = matvec_rows(&w, &[0.0; 32], 2..4, &mut y3[..2], &mut s).unwrap_err();
    assert!(
        matches!(err, QuantError::BadRowRange { rows: 3, .. }),
        "{err}"
    );
    assert!(matmul(&w, &[0.0; 64], 2, &mut y3).is_err());
    // A QMatrix built by hand with inconsistent fields is still caught.
    let bad = QMatrix {
        ty: GgmlType::Q8_0,
        rows: 5,
        cols: 32,
        data: &data,
    };
    assert!(matvec(&bad, &[0.0; 32], &mut [0.0; 5]).is_err());
    assert!(matvec(&w, &[0.0; 32], &mut y3).is_ok());
}

#[test]
fn empty_shapes_are_fine() {
    let w = QMatrix::new(GgmlType::Q8_0, 3, 0, &[]).unwrap();
    let mut y = vec![f32::NAN; 3];
    matvec(&w, &[], &mut y).unwrap();
    assert_eq!(y, [0.0; 3]);
    let mut y2 = vec![f32::NAN; 6];
    matmul(&w, &[], 2, &mut y2).unwrap();
    assert_eq!(y2, [0.0; 6]);
    let w = QMatrix::new(GgmlType::Q4_K, 0, 256, &[]).unwrap();
    matvec(&w, &[0.0; 256], &mut []).unwrap();
}

#[test]
fn unsupported_types_are_errors() {
    let mut y = vec![0.0f32; 256];
    let err = dequantize_row(GgmlType::IQ3_XXS, &[0u8; 98], &mut y).unwrap_err();
    assert!(
        matches!(err, QuantError::Unsupported { ty: "IQ3_XXS", .. }),
        "{err}"
    );
    let err = quantize_row(GgmlType::IQ2_XXS, &[0.0; 256], &mut [0u8; 66]).unwrap_err();
    assert!(err.to_string().contains("IQ2_XXS"), "{err}");
    let data = vec![0u8; 54];
    let w = QMatrix::new(GgmlType::TQ1_0, 1, 256, &data).unwrap();
    assert!(matvec(&w, &[0.0; 256], &mut [0.0; 1]).is_err());
}

#[test]
fn the_supported_list_is_what_dequantize_and_matvec_take() {
    // Every type in GgmlType::SUPPORTED dequantizes and multiplies a zero row of 256 columns;
    // every other type is refused by both, so the list (and the messages built from it) is exact.
    for &ty in GgmlType::ALL {
        let data = vec![0u8; ty.row_bytes(256).unwrap()];
        let mut y = vec![0.0f32; 256];
        let dq = dequantize_row(ty, &data, &mut y);
        let w = QMatrix::new(ty, 1, 256, &data).unwrap();
        let mv = matvec(&w, &[0.0; 256], &mut [0.0; 1]);
        assert_eq!(ty.is_supported(), GgmlType::SUPPORTED.contains(&ty));
        assert_eq!(dq.is_ok(), ty.is_supported(), "{ty} dequantize_row: {dq:?}");
        assert_eq!(mv.is_ok(), ty.is_supported(), "{ty} matvec: {mv:?}");
    }
    let names = GgmlType::supported_names();
    assert!(names.starts_with("F32, F16, BF16, Q8_0"), "{names}");
    assert!(
        names.contains("Q4_1") && names.ends_with("IQ4_XS"),
        "{names}"
    );
    assert_eq!(names.split(", ").count(), GgmlType::SUPPORTED.len());
}

#[test]
fn the_quantizable_list_is_what_quantize_row_takes() {
    // Every type in GgmlType::QUANTIZABLE quantizes a row of 256 values, and only those; each
    // is also SUPPORTED (what can be written can be read).
    let x: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin()).collect();
    for &ty in GgmlType::ALL {
        let mut dst = vec![0u8; ty.row_bytes(256).unwrap()];
        let q = quantize_row(ty, &x, &mut dst);
        assert_eq!(q.is_ok(), ty.is_quantizable(), "{ty} quantize_row: {q:?}");
        assert!(!ty.is_quantizable() || ty.is_supported(), "{ty}");
    }
    let names = GgmlType::quantizable_names();
    assert_eq!(names.split(", ").count(), GgmlType::QUANTIZABLE.len());
    assert!(!names.contains("Q3_K"), "{names}");
}

//! The LLM's features on the wire: the final hidden state (after the last norm, the LM head's
//! input) of tokens the verifier has run, which a feature-conditioned drafter on the edge drafts
//! from. Sent as 8-bit rows with one scale each: a row of SmolLM2 (576 wide) is 580 bytes
//! instead of 2,304 in f32, and the drafter does not notice (`specinfer-train feature-eval`
//! measures it against f16 and f32).

use serde::{Deserialize, Serialize};

use crate::InvalidMessage;

/// The widest feature a frame may carry (the LLMs served are far narrower).
pub const MAX_FEATURE_DIM: u32 = 16_384;

/// How many of the prompt's last positions a verifier sends features of with a session's first
/// verdict: a drafter attends over at most this much of the prompt (then over everything after).
pub const PROMPT_FEATURE_ROWS: usize = 256;

/// Features of consecutive positions of a session's committed tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FeatureRows {
    /// Position (index into the session's committed tokens) of the first row.
    pub first_position: u32,
    /// Floats per row.
    pub dim: u32,
    /// One per row: a row's value `j` is `values[row * dim + j] as f32 * scales[row]`.
    pub scales: Vec<f32>,
    pub values: Vec<i8>,
}

impl FeatureRows {
    /// Quantizes `rows` (`[n, dim]`, row after row) to 8 bits per value, `scale = max|x| / 127`.
    pub fn quantize(first_position: u32, dim: usize, rows: &[f32]) -> Self {
        let mut scales = Vec::with_capacity(rows.len() / dim.max(1));
        let mut values = Vec::with_capacity(rows.len());
        for row in rows.chunks(dim.max(1)) {
            let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = if max > 0.0 && max.is_finite() {
                max / 127.0
            } else {
                1.0
            };
            scales.push(scale);
            values.extend(
                row.iter()
                    .map(|x| (x / scale).round().clamp(-127.0, 127.0) as i8),
            );
        }
        FeatureRows {
            first_position,
            dim: dim as u32,
            scales,
            values,
        }
    }

    pub fn rows(&self) -> usize {
        self.scales.len()
    }

    /// Every row back in f32, `[rows, dim]`.
    pub fn dequantize(&self) -> Vec<f32> {
        self.values
            .chunks(self.dim.max(1) as usize)
            .zip(&self.scales)
            .flat_map(|(row, &s)| row.iter().map(move |&v| f32::from(v) * s))
            .collect()
    }

    /// Sizes agree and scales are usable; at most `max_rows` rows.
    pub fn validate(&self, max_rows: usize) -> Result<(), InvalidMessage> {
        let bad = |s: String| Err(InvalidMessage::BadParam(s));
        if self.dim == 0 || self.dim > MAX_FEATURE_DIM {
            return bad(format!(
                "feature width {} must be in 1..={MAX_FEATURE_DIM}",
                self.dim
            ));
        }
        if self.rows() > max_rows {
            return Err(InvalidMessage::TooLong {
                what: "feature rows",
                got: self.rows(),
                limit: max_rows,
            });
        }
        if self.values.len() != self.rows() * self.dim as usize {
            return bad(format!(
                "{} feature values for {} rows of {}",
                self.values.len(),
                self.rows(),
                self.dim
            ));
        }
        if let Some(s) = self.scales.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return bad(format!("feature scale {s} must be finite and positive"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_within_half_a_step_of_their_scale() {
        let rows: Vec<f32> = (0..3 * 7)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
            .collect();
        let q = FeatureRows::quantize(5, 7, &rows);
        assert_eq!((q.rows(), q.first_position), (3, 5));
        q.validate(3).unwrap();
        for (r, (a, b)) in rows.chunks(7).zip(q.dequantize().chunks(7)).enumerate() {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= q.scales[r] / 2.0 + 1e-6, "{x} vs {y}");
            }
        }
        assert!(q.validate(2).is_err(), "more rows than allowed");
        let mut short = q.clone();
        short.values.pop();
        assert!(short.validate(3).is_err(), "values do not fill the rows");
        let mut nan = q;
        nan.scales[1] = f32::NAN;
        assert!(nan.validate(3).is_err(), "a NaN scale");
    }

    #[test]
    fn a_verdict_with_features_crosses_the_wire_and_an_oversized_one_is_refused() {
        use crate::{decode_frame, encode_frame, Limits, Message, RoundStats, Verified};
        let limits = Limits::default();
        let verdict = |rows: usize| {
            Message::Verified(Verified {
                session: 1,
                round: 0,
                accepted_nodes: vec![1],
                tokens: vec![5, 6],
                finish: None,
                stats: RoundStats::default(),
                features: Some(FeatureRows::quantize(9, 4, &vec![0.5; rows * 4])),
            })
        };
        let ok = verdict(2);
        let frame = encode_frame(&ok);
        // Two rows of four 8-bit values and a scale each, plus the rest of the verdict.
        assert!(frame.len() < 80, "{} bytes", frame.len());
        assert_eq!(
            decode_frame(&frame[crate::FRAME_HEADER_BYTES..], &limits).unwrap(),
            ok
        );
        let too_many = limits.max_tree_nodes as usize + PROMPT_FEATURE_ROWS + 1;
        let frame = encode_frame(&verdict(too_many));
        assert!(decode_frame(&frame[crate::FRAME_HEADER_BYTES..], &limits).is_err());
    }
}

//! Quantized matmul throughput for SmolLM2-sized matrices: `cargo bench -p specinfer-kernels`.
//! Reports ms per call and the weight bytes read per second, for N activation rows.

use std::time::Instant;

use specinfer_kernels::{QuantFormat, QuantMatrix};

fn main() {
    let shapes = [
        ("ffn up 1536x576 Q4_1", QuantFormat::Q4_1, 1536, 576),
        ("ffn down 576x1536 Q4_1", QuantFormat::Q4_1, 576, 1536),
        ("lm head 49152x576 Q8_0", QuantFormat::Q8_0, 49152, 576),
    ];
    println!("| matrix | N | ms | weight GB/s | cost(N)/cost(1) |");
    println!("|---|---:|---:|---:|---:|");
    for (name, format, rows, cols) in shapes {
        let bytes = rows * cols / 32 * format.ggml_block_bytes();
        let data: Vec<u8> = (0..bytes)
            .map(|i| {
                if i % format.ggml_block_bytes() < 2 {
                    0x20
                } else {
                    (i * 2654435761usize >> 7) as u8
                }
            })
            .collect();
        let m = QuantMatrix::from_ggml(format, rows, cols, &data).unwrap();
        let mut base = 0.0;
        for n in [1usize, 2, 4, 8, 16, 64] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            let reps = 20;
            m.matmul(&x, n, &mut out);
            let t = Instant::now();
            for _ in 0..reps {
                m.matmul(&x, n, &mut out);
            }
            let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            if n == 1 {
                base = ms;
            }
            println!(
                "| {name} | {n} | {ms:.3} | {:.1} | {:.2} |",
                bytes as f64 / ms / 1e6,
                ms / base
            );
        }
    }
}

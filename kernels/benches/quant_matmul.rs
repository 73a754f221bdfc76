//! Quantized matmul throughput for SmolLM2- and Qwen2.5-1.5B-sized matrices:
//! `cargo bench -p specinfer-kernels`. Reports ms per call and the weight bytes read per second
//! for N activation rows, twice: with the matrix hot in cache (the kernel's arithmetic), and with
//! enough copies cycled that every call streams its weights from memory (as in a real forward,
//! where a model's weights are far larger than the caches).

use std::time::Instant;

use specinfer_kernels::{QuantFormat, QuantMatrix};

fn main() {
    let shapes = [
        ("ffn up 1536x576 Q4_1", QuantFormat::Q4_1, 1536, 576),
        ("ffn down 576x1536 Q4_1", QuantFormat::Q4_1, 576, 1536),
        ("lm head 49152x576 Q8_0", QuantFormat::Q8_0, 49152, 576),
        ("ffn up 8960x1536 Q4_K", QuantFormat::Q4_K, 8960, 1536),
        ("ffn down 1536x8960 Q6_K", QuantFormat::Q6_K, 1536, 8960),
    ];
    println!("| matrix | weights | N | ms | weight GB/s | cost(N)/cost(1) |");
    println!("|---|---|---:|---:|---:|---:|");
    for (name, format, rows, cols) in shapes {
        let bytes = rows * cols / format.ggml_block_elems() * format.ggml_block_bytes();
        // Deterministic bytes; f16 scales kept small and finite.
        let data: Vec<u8> = (0..bytes)
            .map(|i| {
                let v = ((i * 2654435761usize) >> 7) as u8;
                if i % format.ggml_block_bytes() < 4 {
                    v & 0x1F
                } else {
                    v
                }
            })
            .collect();
        // Enough copies that cycling through them overflows the last-level cache.
        let copies = (256 << 20) / bytes + 1;
        let mats: Vec<QuantMatrix> = (0..copies)
            .map(|_| QuantMatrix::from_ggml(format, rows, cols, &data).unwrap())
            .collect();
        for (label, set) in [("cached", &mats[..1]), ("streamed", &mats[..])] {
            let mut base = 0.0;
            for n in [1usize, 2, 4, 8, 16, 64] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut out = vec![0f32; n * rows];
                let reps = (50 / set.len()).max(2) * set.len();
                // Called from this thread, as the model's forward is: it leads the compute team.
                set[0].matmul(&x, n, &mut out);
                let t = Instant::now();
                for r in 0..reps {
                    set[r % set.len()].matmul(&x, n, &mut out);
                }
                let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
                if n == 1 {
                    base = ms;
                }
                println!(
                    "| {name} | {label} | {n} | {ms:.3} | {:.1} | {:.2} |",
                    bytes as f64 / ms / 1e6,
                    ms / base
                );
            }
        }
    }
}

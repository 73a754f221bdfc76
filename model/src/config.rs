/// Which family the weights come from; decides q/k/v biases and the RoPE pairing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
}

/// How RoPE pairs the dimensions of a head. GGUF llama weights have q/k permuted by the converter
/// so that adjacent pairs rotate together; qwen2 GGUF and every Hugging Face checkpoint rotate
/// dimension `i` with `i + head_dim / 2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Interleaved,
    Neox,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub max_positions: usize,
}

impl ModelConfig {
    /// A tiny shape for tests with [`crate::Llama::random`] weights: two layers, GQA (4 heads over
    /// 2 KV heads), an odd vocabulary, and the RoPE pairing GGUF files of `arch` use.
    pub fn tiny(arch: Arch) -> Self {
        ModelConfig {
            arch,
            vocab_size: 101,
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 96,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_style: match arch {
                Arch::Llama => RopeStyle::Interleaved,
                Arch::Qwen2 => RopeStyle::Neox,
            },
            max_positions: 512,
        }
    }

    /// Floats of K (or of V) stored per position in one layer.
    pub fn kv_row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

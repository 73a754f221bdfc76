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
    /// Floats of K (or of V) stored per position in one layer.
    pub fn kv_row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

//! Loading checkpoints, and the errors a user sees for broken ones.

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use specinfer_model::{Arch, KvCache, Llama, ModelConfig, ModelError, SeqTree};
use specinfer_wire::TokenTree;

fn cfg() -> ModelConfig {
    ModelConfig::tiny(Arch::Qwen2)
}

/// A private folder, removed when dropped.
fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn logits(m: &Llama) -> Vec<f32> {
    let mut kv = KvCache::new(m.config());
    let tree = TokenTree::new(vec![3, 5, 7, 9], vec![0, 0, 1]).unwrap();
    let out = m
        .forward(&mut [SeqTree::new(&mut kv, &tree)])
        .unwrap()
        .remove(0);
    (0..4).flat_map(|i| out.node(i).to_vec()).collect()
}

#[test]
fn safetensors_bf16_checkpoint_loads_and_matches() {
    let dir = tmp();
    let dir = dir.path();
    let weights = Llama::random_weights(&cfg(), 7);
    // Store in bf16, as Hugging Face checkpoints usually are; the reference gets the same rounding.
    let bf16: std::collections::HashMap<String, Tensor> = weights
        .iter()
        .map(|(k, v)| (k.clone(), v.to_dtype(DType::BF16).unwrap()))
        .collect();
    candle_core::safetensors::save(&bf16, dir.join("model.safetensors")).unwrap();
    write_config(dir);
    let loaded = Llama::from_safetensors(dir).unwrap();
    assert_eq!(loaded.config(), &cfg());
    let d = max_diff_to_f32_weights(&loaded);
    // bf16 keeps 8 bits of mantissa: logits move, but only by rounding.
    assert!(
        d > 0.0 && d < 0.5,
        "bf16 checkpoint vs f32 weights: max diff {d}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// The tiny model's config.json (what [`cfg`] describes).
fn write_config(dir: &std::path::Path) {
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "qwen2", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
            "tie_word_embeddings": false}"#,
    )
    .unwrap();
}

/// Largest logit difference between `m` and the f32 random model it was saved from.
fn max_diff_to_f32_weights(m: &Llama) -> f32 {
    let f32_again = Llama::random(cfg(), 7, None).unwrap();
    let (a, b) = (logits(m), logits(&f32_again));
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn u8_embedding_rows_round_within_half_a_step_and_load() {
    let dir = tmp();
    let dir = dir.path();
    let mut weights = Llama::random_weights(&cfg(), 7);
    let name = "model.embed_tokens.weight";
    let embed = weights.remove(name).unwrap();
    let (q, scale) = specinfer_model::quantize_rows_u8(&embed).unwrap();
    assert_eq!(q.dtype(), DType::U8);
    let (x, q, s) = (
        embed.to_vec2::<f32>().unwrap(),
        q.to_vec2::<u8>().unwrap(),
        scale.to_vec1::<f32>().unwrap(),
    );
    for r in 0..x.len() {
        let max = x[r].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!((s[r] - max / 127.0).abs() <= 1e-6 * max, "row {r} scale");
        for c in 0..x[r].len() {
            let back = (f32::from(q[r][c]) - 128.0) * s[r];
            assert!(
                (back - x[r][c]).abs() <= s[r] * 0.5 + 1e-6,
                "row {r} col {c}"
            );
        }
    }
    // A u8 tensor without its scale is refused by name.
    let path = dir.join("model.safetensors");
    let mut without_scale = weights.clone();
    without_scale.insert(
        name.into(),
        Tensor::new(q.clone(), &candle_core::Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&without_scale, &path).unwrap();
    write_config(dir);
    let Err(err) = Llama::from_safetensors(dir) else {
        panic!("a u8 tensor without its scale loaded")
    };
    let err = err.to_string();
    assert!(err.contains("model.embed_tokens.weight_scale"), "{err}");
    // With it, the model loads and its logits move only by the rounding.
    let (q, scale) = specinfer_model::quantize_rows_u8(&embed).unwrap();
    weights.insert(name.into(), q);
    weights.insert(format!("{name}_scale"), scale);
    candle_core::safetensors::save(&weights, &path).unwrap();
    let d = max_diff_to_f32_weights(&Llama::from_safetensors(dir).unwrap());
    assert!(d > 0.0 && d < 0.1, "u8 embedding vs f32: max diff {d}");
    std::fs::remove_dir_all(dir).unwrap();
}

fn write_gguf(path: &std::path::Path, arch: &str) {
    let t = QTensor::quantize(
        &Tensor::ones((8, 32), DType::F32, &candle_core::Device::Cpu).unwrap(),
        GgmlDType::Q8_0,
    )
    .unwrap();
    let meta = [(
        "general.architecture",
        gguf_file::Value::String(arch.into()),
    )];
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(
        &mut f,
        &meta.iter().map(|(k, v)| (*k, v)).collect::<Vec<_>>(),
        &[("token_embd.weight", &t)],
    )
    .unwrap();
}

#[test]
fn unsupported_architecture_and_truncation_are_clear_errors() {
    let dir = tmp();
    let dir = dir.path();
    let path = dir.join("m.gguf");
    write_gguf(&path, "gpt2");
    match Llama::from_gguf(&path) {
        Err(ModelError::UnsupportedArch { arch, .. }) => assert_eq!(arch, "gpt2"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a gpt2 GGUF must be refused"),
    }
    write_gguf(&path, "llama");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 100).unwrap();
    let err = Llama::from_gguf(&path)
        .err()
        .expect("a truncated file must be refused");
    assert!(
        matches!(err, ModelError::Truncated { .. }),
        "wrong error: {err}"
    );
    assert!(err.to_string().contains("truncated"));
    std::fs::remove_dir_all(dir).unwrap();
}

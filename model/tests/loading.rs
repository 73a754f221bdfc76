//! Loading checkpoints, and the errors a user sees for broken ones.

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use specinfer_model::{Arch, KvCache, Llama, ModelConfig, ModelError, SeqTree};
use specinfer_wire::TokenTree;

fn cfg() -> ModelConfig {
    ModelConfig::tiny(Arch::Qwen2)
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("specinfer-load-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
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
    let dir = tmp("st");
    let weights = Llama::random_weights(&cfg(), 7);
    // Store in bf16, as Hugging Face checkpoints usually are; the reference gets the same rounding.
    let bf16: std::collections::HashMap<String, Tensor> = weights
        .iter()
        .map(|(k, v)| (k.clone(), v.to_dtype(DType::BF16).unwrap()))
        .collect();
    candle_core::safetensors::save(&bf16, dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "qwen2", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
            "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let loaded = Llama::from_safetensors(&dir).unwrap();
    assert_eq!(loaded.config(), &cfg());
    let f32_again = Llama::random(cfg(), 7, None).unwrap();
    let (a, b) = (logits(&loaded), logits(&f32_again));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    // bf16 keeps 8 bits of mantissa: logits move, but only by rounding.
    assert!(
        d > 0.0 && d < 0.5,
        "bf16 checkpoint vs f32 weights: max diff {d}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
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
    let dir = tmp("gguf");
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
    std::fs::remove_dir_all(&dir).unwrap();
}

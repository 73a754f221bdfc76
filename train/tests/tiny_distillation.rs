//! A tiny distillation run on a tiny random teacher: the loss falls, and the exported model
//! (loaded by the inference engine) computes the same logits as the training graph.

use candle_core::{Device, Tensor};
use specinfer_kernels::sampling::argmax;
use specinfer_model::{Arch, KvCache, Llama, ModelConfig, SeqTree};
use specinfer_train::ssm::{Ssm, SsmConfig};
use specinfer_train::teacher::{top_probabilities, Example, TOP_KEPT};
use specinfer_train::train::{head_tokens, train, TrainConfig};
use specinfer_wire::TokenTree;

/// Greedy continuations of random prompts by the teacher; every other one keeps the teacher's
/// top-k probabilities (soft targets), as teacher data made before and after they were kept.
fn teacher_examples(teacher: &Llama, n: usize) -> Vec<Example> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    (0..n)
        .map(|i| {
            let prompt: Vec<u32> = (0..rng.random_range(3..10))
                .map(|_| rng.random_range(0..101))
                .collect();
            let mut kv = KvCache::new(teacher.config());
            let mut last = teacher.prefill(&mut kv, &prompt).unwrap();
            let (mut answer, mut top) = (Vec::new(), Vec::new());
            for _ in 0..12 {
                let t = argmax(&last) as u32;
                answer.push(t);
                if i % 2 == 0 {
                    let kept = top_probabilities(&last, TOP_KEPT);
                    assert_eq!(kept[0].0, t, "the most likely token comes first");
                    assert!(kept.windows(2).all(|w| w[0].1 >= w[1].1));
                    top.push(kept);
                }
                let tree = TokenTree::root(t);
                last = teacher
                    .forward(&mut [SeqTree::new(&mut kv, &tree)])
                    .unwrap()
                    .remove(0)
                    .node(0)
                    .to_vec();
                kv.compact(&[0]);
            }
            // The example's prompt ends where the answer starts.
            Example {
                prompt,
                answer,
                top,
            }
        })
        .collect()
}

#[test]
fn tiny_distillation_reduces_the_loss_and_exports_faithfully() {
    let teacher = Llama::random(ModelConfig::tiny(Arch::Llama), 9, None).unwrap();
    let examples = teacher_examples(&teacher, 48);
    let head = head_tokens(&examples, 40, &[]);
    let cfg = SsmConfig {
        vocab_size: 101,
        d_model: 32,
        n_layers: 2,
        n_heads: 2,
        ffn_dim: 64,
        rope_theta: 10_000.0,
        rms_eps: 1e-5,
        max_positions: 256,
    };
    let mut ssm = Ssm::init(cfg, head, teacher.token_embeddings(), 64, 3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let tc = TrainConfig {
        steps: 150,
        batch: 8,
        seq_len: 32,
        lr: 1e-2,
        warmup: 10,
        seed: 1,
        checkpoint_every: 1000,
    };
    let checkpoint = dir.join("ckpt.safetensors");
    let curve = train(&mut ssm, &examples, &tc, &checkpoint, 0).unwrap();
    println!("loss curve: {curve:?}");
    assert!(
        curve.last().unwrap() < &(curve[0] * 0.7),
        "loss did not fall: {curve:?}"
    );

    // A resumed run keeps the checkpoint's head, whatever head its own data would choose.
    let mut other_head = ssm.head_ids.clone();
    other_head.reverse();
    let mut resumed = Ssm::init(
        ssm.cfg.clone(),
        other_head.clone(),
        teacher.token_embeddings(),
        64,
        4,
    )
    .unwrap();
    resumed.load_checkpoint(&checkpoint).unwrap();
    assert_eq!(resumed.head_ids, ssm.head_ids);

    let seq: Vec<u32> = vec![4, 8, 15, 16, 23, 42];
    let ids = Tensor::new(seq.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits_of = |m: &Ssm| {
        m.forward(&ids)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    };
    let train_logits = logits_of(&ssm);

    // A run with a larger head grows the checkpoint's: its rows keep their tokens and logits,
    // and each new token's logit starts at the mean of the trained ones.
    let n = ssm.head_ids.len();
    let extra: Vec<u32> = (0..101u32)
        .filter(|t| !ssm.head_ids.contains(t))
        .take(10)
        .collect();
    let mut bigger = extra.clone();
    bigger.extend(&other_head);
    let mut grown = Ssm::init(ssm.cfg.clone(), bigger, teacher.token_embeddings(), 64, 5).unwrap();
    grown.load_checkpoint(&checkpoint).unwrap();
    assert_eq!(grown.head_ids[..n], ssm.head_ids[..]);
    assert_eq!(grown.head_ids[n..], extra[..]);
    for (g, t) in logits_of(&grown).iter().zip(&train_logits) {
        let mean = t.iter().sum::<f32>() / n as f32;
        for (h, &x) in g.iter().enumerate() {
            let want = t.get(h).copied().unwrap_or(mean);
            assert!((x - want).abs() < 1e-4, "grown head row {h}: {x} vs {want}");
        }
    }

    // A run with more layers grows the checkpoint's: the new layers start as identities (the
    // logits are the trained model's), and training moves them.
    let mut deeper = Ssm::init(
        SsmConfig {
            n_layers: ssm.cfg.n_layers + 2,
            ..ssm.cfg.clone()
        },
        ssm.head_ids.clone(),
        teacher.token_embeddings(),
        64,
        6,
    )
    .unwrap();
    let before_load = logits_of(&deeper);
    deeper.load_checkpoint(&checkpoint).unwrap();
    let deeper_logits = logits_of(&deeper);
    let largest_difference = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert!(largest_difference(&deeper_logits, &train_logits) < 1e-4);
    assert!(largest_difference(&before_load, &train_logits) > 1e-2);
    let more = TrainConfig {
        steps: 160,
        ..tc.clone()
    };
    let deeper_checkpoint = dir.join("deeper.safetensors");
    train(&mut deeper, &examples, &more, &deeper_checkpoint, 150).unwrap();
    deeper.export(&dir.join("deeper"), &[0; 32]).unwrap();
    let weights =
        candle_core::safetensors::load(dir.join("deeper/model.safetensors"), &Device::Cpu).unwrap();
    for w in ["layers.2.self_attn.o_proj", "layers.3.mlp.down_proj"] {
        let largest = weights[&format!("model.{w}.weight")]
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_dtype(candle_core::DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(largest > 1e-4, "{w} did not learn: {largest}");
    }
    // ... and a checkpoint never shrinks.
    let mut shallower = Ssm::init(
        SsmConfig {
            n_layers: 1,
            ..ssm.cfg.clone()
        },
        ssm.head_ids.clone(),
        teacher.token_embeddings(),
        64,
        6,
    )
    .unwrap();
    let err = shallower.load_checkpoint(&deeper_checkpoint).unwrap_err();
    assert!(err.to_string().contains("4 layers"), "{err}");

    ssm.export(&dir.join("ssm"), &[0; 32]).unwrap();
    let exported = Llama::from_safetensors(&dir.join("ssm")).unwrap();
    let mut kv = KvCache::new(exported.config());
    let out = exported
        .forward(&mut [SeqTree::new(&mut kv, &TokenTree::chain(&seq))])
        .unwrap()
        .remove(0);
    let mut worst = 0f32;
    for (p, row) in train_logits.iter().enumerate() {
        for (h, &t) in ssm.head_ids.iter().enumerate() {
            worst = worst.max((out.node(p)[t as usize] - row[h]).abs());
        }
        // Tokens outside the head have probability exactly 0.
        let outside = (0..101u32).find(|t| !ssm.head_ids.contains(t)).unwrap();
        assert_eq!(out.node(p)[outside as usize], f32::NEG_INFINITY);
    }
    println!("export vs training graph: max abs logit diff {worst}");
    // The export stores f16 weights (the embedding 8-bit rows): differences of a few 1e-3 are rounding, not a wrong graph.
    assert!(
        worst < 0.05,
        "exported model disagrees with the training graph: {worst}"
    );
}

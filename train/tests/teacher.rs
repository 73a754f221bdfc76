//! Teacher answers on SmolLM2: sampled answers are not the greedy ones, and a resumed run
//! continues exactly the answers an uninterrupted run writes.

use specinfer_integration::smollm2;
use specinfer_train::teacher::{generate, read_examples, Decoding};

#[test]
fn sampled_teacher_answers_differ_from_greedy_and_resume_identically() {
    let (llm, tok) = smollm2();
    let prompts: Vec<String> = [
        "Name a colour.",
        "Write a short poem about rain.",
        "What is a hash map?",
        "Give me three ideas for a party.",
    ]
    .map(String::from)
    .to_vec();
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let file = |name: &str| {
        let f = dir.join(name);
        let _ = std::fs::remove_file(&f);
        f
    };
    let sampled = Decoding::Sampled { seed: 7 };
    let (greedy, whole, resumed) = (file("greedy"), file("whole"), file("resumed"));
    generate(llm, tok, &prompts, 24, 4, Decoding::Greedy, &greedy).unwrap();
    generate(llm, tok, &prompts, 24, 4, sampled, &whole).unwrap();
    // Interrupted after the first two prompts (another batch size, too), then resumed.
    generate(llm, tok, &prompts[..2], 24, 1, sampled, &resumed).unwrap();
    generate(llm, tok, &prompts, 24, 3, sampled, &resumed).unwrap();

    let (greedy, whole, resumed) = (
        read_examples(&greedy).unwrap(),
        read_examples(&whole).unwrap(),
        read_examples(&resumed).unwrap(),
    );
    assert_eq!(whole.len(), 4);
    for (a, b) in whole.iter().zip(&resumed) {
        assert_eq!(a.answer, b.answer, "a resumed run changed a sampled answer");
    }
    let differ = greedy
        .iter()
        .zip(&whole)
        .filter(|(g, s)| g.answer != s.answer)
        .count();
    assert!(
        differ >= 2,
        "only {differ} of 4 sampled answers differ from greedy"
    );
    for s in &whole {
        assert_eq!(
            s.top.len(),
            s.answer.len(),
            "soft targets for every sampled token"
        );
    }
}

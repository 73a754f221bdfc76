//! Table 3: multi-step speculative sampling, recursive rejection sampling and naive sampling.
//! The verifier's and the draft's random streams are independent (see `common::driver`).

use anyhow::Result;
use serde_json::json;
use specinfer_speculator::TreeShape;
use specinfer_wire::{DrawMode, VerifyMode};

use crate::common::{run_local, Ctx, Section};

pub fn run(ctx: &Ctx) -> Result<Section> {
    let shape = TreeShape::Expansion(vec![1, 1, 3, 1]);
    let sampled = |mode, draw| run_local(ctx, Some(shape.clone()), mode, draw);
    let mss = sampled(VerifyMode::Stochastic, DrawMode::Iid)?;
    let rrs = sampled(VerifyMode::Stochastic, DrawMode::WithoutReplacement)?;
    let naive = sampled(VerifyMode::Naive, DrawMode::Iid)?;
    let md = format!(
        "## 3. Stochastic verification (T = 0.8, tree <1,1,3,1>)\n\n| verifier | tokens per round |\n|---|---|\n| multi-step speculative sampling (children drawn i.i.d.) | {:.2} |\n| recursive rejection sampling (children drawn without replacement) | {:.2} |\n| naive sampling | {:.2} |\n\n",
        mss.tau(),
        rrs.tau(),
        naive.tau()
    );
    Ok(Section {
        key: "sampling",
        json: json!({"mss": mss.to_json(), "rrs": rrs.to_json(), "naive": naive.to_json()}),
        markdown: md,
    })
}

//! What trees a speculator grows, and how it picks their tokens.

use specinfer_wire::DrawMode;

/// How children are chosen at each expanded node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DraftMode {
    /// The `k` most likely tokens (greedy verification needs nothing else).
    Greedy,
    /// `k` children drawn from the draft's distribution (after temperature / top-p) truncated to
    /// its `top_k` tokens; the proposal travels with the tree for lossless verification.
    Sample {
        temperature: f32,
        top_p: f32,
        top_k: usize,
        draw: DrawMode,
    },
}

impl DraftMode {
    /// The draft's proposal is truncated to its this many likeliest tokens when sampling: the
    /// proposals travel on the wire, and past 16 tokens a small draft's tail holds little mass.
    pub const SAMPLED_TOP_K: usize = 16;

    /// Children drawn without replacement from the draft's distribution at the request's
    /// temperature and top-p, truncated to [`DraftMode::SAMPLED_TOP_K`] tokens (the clients'
    /// sampling drafts; verified by recursive rejection sampling, which never spends two nodes
    /// on one token: held-out tau 1.96 against 1.80 drawing i.i.d., dynamic tree of 32 nodes, 12
    /// prompts x 48 tokens).
    pub fn sampled(temperature: f32, top_p: f32) -> DraftMode {
        DraftMode::Sample {
            temperature,
            top_p,
            top_k: Self::SAMPLED_TOP_K,
            draw: DrawMode::WithoutReplacement,
        }
    }
}

/// The shape of the trees a speculator grows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TreeShape {
    /// SpecInfer's expansion trees: level `d` gives every node of level `d - 1` `k_d` children.
    /// `<1,1,3,1,1,1,1,1>` is the paper's default.
    Expansion(Vec<usize>),
    /// Beyond the paper: grow, wave by wave, the candidates with the highest path probability
    /// under the draft model until `budget` nodes (root excluded) are placed. When sampling,
    /// each child is a draw from the draft's distribution, declared with its proposal.
    Dynamic { budget: usize },
    /// An expansion tree cut to the depth that maximises measured tokens per second: deeper trees
    /// pay off only while the draft keeps being accepted there and verifying stays cheap next to
    /// the round trip. See [`DepthController`].
    Adaptive(Vec<usize>),
    /// A dynamic tree that stops growing, short of `budget`, at the first node whose expected
    /// acceptance (the draft's path probability, scaled by how well those predicted past rounds)
    /// does not pay for its verification (and, for a wave's first node, the draft forward that
    /// scored its parent) at the rate the tree reached so far. Whether to draft at all is learned
    /// from the rounds that tried, with drafting tried again now and then, as for
    /// [`TreeShape::Adaptive`].
    AdaptiveDynamic { budget: usize },
}

impl TreeShape {
    /// The clients' tree: best-first growth by the draft's path probabilities puts the nodes
    /// where they are likelier accepted than the paper's fixed expansion, and the adaptive cut
    /// spends nodes only where the measured costs pay for them. Held-out tau at the whole budget
    /// (60 prompts x 64 tokens, `models/ssm/EVAL.md`): greedy 2.24 against the paper's tree's
    /// 1.62; sampling at T = 0.8, its children drawn without replacement, 1.81 against 1.45.
    pub fn clients_default() -> TreeShape {
        TreeShape::AdaptiveDynamic { budget: 32 }
    }

    /// The tree without its adaptive cut: what it grows to while every node pays.
    pub fn uncut(&self) -> TreeShape {
        match self {
            TreeShape::Adaptive(e) => TreeShape::Expansion(e.clone()),
            TreeShape::AdaptiveDynamic { budget } => TreeShape::Dynamic { budget: *budget },
            other => other.clone(),
        }
    }
}

/// The form [`TreeShape`]'s `FromStr` reads.
impl std::fmt::Display for TreeShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let expansion = |e: &[usize]| {
            e.iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            TreeShape::Expansion(e) => write!(f, "{}", expansion(e)),
            TreeShape::Dynamic { budget } => write!(f, "dynamic:{budget}"),
            TreeShape::Adaptive(e) => write!(f, "adaptive:{}", expansion(e)),
            TreeShape::AdaptiveDynamic { budget } => write!(f, "adaptive:dynamic:{budget}"),
        }
    }
}

impl std::str::FromStr for TreeShape {
    type Err = String;

    /// `1,1,3,1`, `dynamic:N`, `adaptive:1,1,3,1` (the expansion cut to a measured depth) or
    /// `adaptive:dynamic:N` (the dynamic tree grown while it pays).
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("adaptive:") {
            return match rest.parse::<TreeShape>()? {
                TreeShape::Expansion(e) => Ok(TreeShape::Adaptive(e)),
                TreeShape::Dynamic { budget } => Ok(TreeShape::AdaptiveDynamic { budget }),
                _ => Err(format!(
                    "{s:?}: adaptive: takes an expansion (adaptive:1,1,3) or a dynamic tree (adaptive:dynamic:32)"
                )),
            };
        }
        if let Some(n) = s.strip_prefix("dynamic:") {
            let budget = n
                .parse()
                .map_err(|_| format!("{s:?}: dynamic:N needs a node count"))?;
            return Ok(TreeShape::Dynamic { budget });
        }
        s.split(',')
            .map(|k| {
                k.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{s:?}: expected numbers like 1,1,3,1 or dynamic:N"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(TreeShape::Expansion)
    }
}

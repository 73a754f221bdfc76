// specinfer's CUDA kernels, compiled at run time by NVRTC (no nvcc at build time).
//
// Activations are row-major [rows, dim], as on the CPU engine. K/V live in one pool per layer
// shared by all sequences, [slot, kv_heads * head_dim] (pages of one position): a sequence's slot
// table (device int array) gives the slot of each of its positions, its committed positions
// first, then the current tree's nodes in tree order (the scratch region), so that keeping a
// round's accepted path is a table update, no row moves. Everything runs in these kernels, the
// projections included: no cuBLAS, whose choice of algorithm by problem size (split-K, tiles)
// would make a row's result depend on the rows batched with it.

typedef unsigned long long u64;

// The launch's dynamic shared memory as an array `name` of `type` (the emulated device,
// `emulation.h`, gives it as a pointer).
#ifndef SPECINFER_DYNAMIC_SHARED
#define SPECINFER_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// NVRTC has no <math.h> macros.
#define NEG_INF __int_as_float(0xff800000)

// bf16 (as its bits) to f32, exactly; f32 to bf16 rounded to nearest, ties to even (the host's
// `half::bf16::from_f32`), NaN kept a NaN. Weights and K/V may be kept in either.
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(unsigned short v) { return __uint_as_float((unsigned)v << 16); }
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(unsigned short* p, float v) {
    const unsigned bits = __float_as_uint(v);
    *p = (v != v) ? (unsigned short)0x7fc0
                  : (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. One block per row; blockDim.x is a
// power of two and the dynamic shared memory holds blockDim.x floats.
extern "C" __global__ void rms_norm(float* out, const float* x, const float* w, int d, float eps) {
    SPECINFER_DYNAMIC_SHARED(float, part);
    const int r = blockIdx.x;
    const float* xr = x + (size_t)r * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
        __syncthreads();
    }
    const float scale = rsqrtf(part[0] / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[(size_t)r * d + i] = xr[i] * scale * w[i];
}

// Projections: y[r, c] = sum_k x[r, k] * w[c, k] (+ b[c]) for rows x [rows, in], weights
// row-major [out, in] as f32 or bf16 (converted exactly to f32 on load), accumulated in f32.
// Batch invariant: each output is summed in one fixed order whatever the number of rows or a
// row's place among them (lane l of a warp adds k = l, l + 32, ... with fused multiply-adds, then
// a fixed xor butterfly), so greedy speculation stays token-identical to incremental decoding
// and a session's output does not depend on what it was batched with. One warp per (column,
// tile of LINEAR_ROWS rows): each weight row is read once per tile. Block: 128 threads.
// `specinfer_kernels::projection::warp_linear` is this loop on the CPU, bit for bit.
#define LINEAR_ROWS 8


template <typename W>
__device__ void linear_rows(float* y, const float* x, const W* w, const float* b, int rows,
                            int out, int in) {
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int tiles = (rows + LINEAR_ROWS - 1) / LINEAR_ROWS;
    if (warp >= (long long)out * tiles) return;
    const int c = (int)(warp % out), r0 = (int)(warp / out) * LINEAR_ROWS;
    const int n = min(LINEAR_ROWS, rows - r0);
    const W* wc = w + (size_t)c * in;
    const float* xr = x + (size_t)r0 * in;
    float acc[LINEAR_ROWS];
    for (int j = 0; j < LINEAR_ROWS; j++) acc[j] = 0.0f;
    for (int k = lane; k < in; k += 32) {
        const float wv = to_f32(wc[k]);
        for (int j = 0; j < LINEAR_ROWS; j++)
            if (j < n) acc[j] = fmaf(xr[(size_t)j * in + k], wv, acc[j]);
    }
    for (int j = 0; j < LINEAR_ROWS; j++) {
        float s = acc[j];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0 && j < n) y[(size_t)(r0 + j) * out + c] = b ? s + b[c] : s;
    }
}

extern "C" __global__ void linear_f32(float* y, const float* x, const float* w, const float* b,
                                      int rows, int out, int in) {
    linear_rows(y, x, w, b, rows, out, in);
}

extern "C" __global__ void linear_bf16(float* y, const float* x, const unsigned short* w,
                                       const float* b, int rows, int out, int in) {
    linear_rows(y, x, w, b, rows, out, in);
}

// Rotary position embedding in place; each of the rows, `row_stride` floats apart (q or k inside
// rows of q | k | v), starts with `heads` heads of head_dim. Pairs are (2i, 2i+1) when
// `interleaved` (GGUF llama), else (i, i + head_dim/2). Angles in double, as on the CPU.
extern "C" __global__ void rope(float* x, int row_stride, const int* positions, int heads,
                                int head_dim, float theta, int interleaved) {
    const int r = blockIdx.x;
    const int half = head_dim / 2;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        const int h = t / half, i = t % half;
        const double angle = (double)positions[r] * pow((double)theta, -2.0 * i / head_dim);
        const float c = (float)cos(angle), s = (float)sin(angle);
        float* head = x + (size_t)r * row_stride + (size_t)h * head_dim;
        const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        const float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

// SwiGLU of the stacked gate | up rows: out[r, i] = silu(gu[r, i]) * gu[r, ffn + i], elementwise
// over n = rows * ffn.
extern "C" __global__ void swiglu(float* out, const float* gu, int ffn, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const u64 r = i / ffn, c = i % ffn;
        const float g = gu[r * 2 * ffn + c], u = gu[r * 2 * ffn + ffn + c];
        out[i] = g / (1.0f + expf(-g)) * u;
    }
}

// x += y (residual), elementwise.
extern "C" __global__ void add_into(float* x, const float* y, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// dst[i, :] = src[idx[i], :], one block per row: the tokens' embeddings, and the rows that want
// the LM head.
extern "C" __global__ void gather_rows(float* dst, const float* src, const int* idx, int row) {
    const int i = blockIdx.x;
    for (int c = threadIdx.x; c < row; c += blockDim.x)
        dst[(size_t)i * row + c] = src[(size_t)idx[i] * row + c];
}

// The new nodes' K/V rows into the layer's pools (k_pool, v_pool: [slot, row] elements of KV, as
// u16 units): node n's row goes to the slot its sequence's table (at device address tables[n])
// gives position committed[n] + node_in_tree[n] (the scratch region, behind the committed
// positions), as f32 or rounded to bf16. One block per node; node n's k and v are `row` floats at
// k + n * stride and v + n * stride (inside rows of q | k | v).
template <typename KV>
__device__ void store_rows(unsigned short* k_pool, unsigned short* v_pool, const u64* tables,
                           const int* committed, const int* node_in_tree, const float* k,
                           const float* v, int stride, int row) {
    const int n = blockIdx.x;
    const int* table = (const int*)tables[n];
    const size_t at = (size_t)table[committed[n] + node_in_tree[n]] * row;
    KV* K = (KV*)k_pool + at;
    KV* V = (KV*)v_pool + at;
    for (int c = threadIdx.x; c < row; c += blockDim.x) {
        store_as(K + c, k[(size_t)n * stride + c]);
        store_as(V + c, v[(size_t)n * stride + c]);
    }
}

extern "C" __global__ void store_kv_f32(unsigned short* k_pool, unsigned short* v_pool,
                                        const u64* tables, const int* committed,
                                        const int* node_in_tree, const float* k, const float* v,
                                        int stride, int row) {
    store_rows<float>(k_pool, v_pool, tables, committed, node_in_tree, k, v, stride, row);
}

extern "C" __global__ void store_kv_bf16(unsigned short* k_pool, unsigned short* v_pool,
                                         const u64* tables, const int* committed,
                                         const int* node_in_tree, const float* k, const float* v,
                                         int stride, int row) {
    store_rows<unsigned short>(k_pool, v_pool, tables, committed, node_in_tree, k, v, stride,
                               row);
}

// Fused tree attention for every node of every sequence in a batch, online softmax, no mask
// materialised, split over blocks of positions so that long contexts use many warps: one warp
// per (node, head, split) writes the split's partial softmax (its max m, its sum l and its
// weighted values), then attention_combine merges a (node, head)'s splits in order. Split s
// covers the absolute positions [s * split_len, (s + 1) * split_len) of the keys a node sees,
// so the grouping of a node's sums is the same whether its ancestors are committed or still in
// the tree, and whatever it is batched with: greedy speculation stays token-identical to
// incremental decoding. With one split, the result is the unsplit pass's bit for bit.
//
// Node n of the packed batch belongs to a sequence whose slot table is at device address
// tables[n] (position p's K/V row is row table[p] of the layer's k_pool / v_pool) and has
// committed[n] committed positions; it is node node_in_tree[n] of its tree, whose nodes sit at
// slots committed + j. It sees every committed position and the tree nodes set in its ancestor
// bitset (itself included): anc[n * words + j / 64] bit j % 64; the k-th of those is at absolute
// position committed + k. GQA: head h reads KV head h / (heads / kv_heads). Node n's query
// heads start at q + n * q_stride (inside rows of q | k | v). head_dim <= 256. K/V as f32 or
// bf16 (tree_attention_f32 / _bf16), computed with in f32. Partials: ml[(pair * splits + s) * 2
// + {0, 1}] and acc[(pair * splits + s) * head_dim + d], pair = n * heads + h.
template <typename KV>
__device__ void attend_split(float* ml, float* part_acc, const float* q, int q_stride,
                             const unsigned short* k_pool, const unsigned short* v_pool,
                             const u64* tables, const int* committed, const int* node_in_tree,
                             const u64* anc, int words, int nodes, int heads, int kv_heads,
                             int head_dim, float scale, int splits, int split_len) {
    const int warps_per_block = blockDim.x / 32;
    const long long warp = (long long)blockIdx.x * warps_per_block + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= (long long)nodes * heads * splits) return;
    const int pair = (int)(warp / splits), split = (int)(warp % splits);
    const int n = pair / heads, h = pair % heads;
    const int c = committed[n], self = node_in_tree[n];
    const u64* bits = anc + (size_t)n * words;
    const int lo = split * split_len, hi = lo + split_len;
    if (lo > c + self) return;  // past every key this node could see: no partial
    const int kvh = h / (heads / kv_heads);
    const int row = kv_heads * head_dim;
    const KV* K = (const KV*)k_pool;
    const KV* V = (const KV*)v_pool;
    const int* table = (const int*)tables[n];
    const float* qh = q + (size_t)n * q_stride + (size_t)h * head_dim;
    const int per_lane = (head_dim + 31) / 32;
    float qv[8], acc[8];
    for (int j = 0; j < per_lane; j++) {
        const int d = lane + 32 * j;
        qv[j] = d < head_dim ? qh[d] * scale : 0.0f;
        acc[j] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    // Committed keys in the split, then the tree's visible ones whose absolute position is.
    int seen = 0;  // visible tree keys so far: the next one is at absolute position c + seen
    for (int p = lo < c ? lo : c; p <= c + self; p++) {
        if (p < c) {
            if (p >= hi) {
                p = c - 1;  // the rest of the committed keys lie past this split
                continue;
            }
        } else {
            const int j = p - c;
            if (!((bits[j / 64] >> (j % 64)) & 1ull)) continue;
            const int at = c + seen++;
            if (at < lo) continue;
            if (at >= hi) break;
        }
        const size_t at = (size_t)table[p] * row + kvh * head_dim;
        const KV* kp = K + at;
        float s = 0.0f;
        for (int j = 0; j < per_lane; j++) {
            const int d = lane + 32 * j;
            if (d < head_dim) s += qv[j] * to_f32(kp[d]);
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float m2 = fmaxf(m, s);
        const float corr = expf(m - m2), w = expf(s - m2);
        l = l * corr + w;
        const KV* vp = V + at;
        for (int j = 0; j < per_lane; j++) {
            const int d = lane + 32 * j;
            acc[j] = acc[j] * corr + (d < head_dim ? w * to_f32(vp[d]) : 0.0f);
        }
        m = m2;
    }
    const size_t slot = (size_t)pair * splits + split;
    if (lane == 0) {
        ml[slot * 2] = m;
        ml[slot * 2 + 1] = l;
    }
    for (int j = 0; j < per_lane; j++) {
        const int d = lane + 32 * j;
        if (d < head_dim) part_acc[slot * head_dim + d] = acc[j];
    }
}

extern "C" __global__ void tree_attention_f32(float* ml, float* part_acc, const float* q,
                                              int q_stride, const unsigned short* k_pool,
                                              const unsigned short* v_pool, const u64* tables,
                                              const int* committed, const int* node_in_tree,
                                              const u64* anc, int words, int nodes, int heads,
                                              int kv_heads, int head_dim, float scale, int splits,
                                              int split_len) {
    attend_split<float>(ml, part_acc, q, q_stride, k_pool, v_pool, tables, committed,
                        node_in_tree, anc, words, nodes, heads, kv_heads, head_dim, scale, splits,
                        split_len);
}

extern "C" __global__ void tree_attention_bf16(float* ml, float* part_acc, const float* q,
                                               int q_stride, const unsigned short* k_pool,
                                               const unsigned short* v_pool, const u64* tables,
                                               const int* committed, const int* node_in_tree,
                                               const u64* anc, int words, int nodes, int heads,
                                               int kv_heads, int head_dim, float scale,
                                               int splits, int split_len) {
    attend_split<unsigned short>(ml, part_acc, q, q_stride, k_pool, v_pool, tables, committed,
                                 node_in_tree, anc, words, nodes, heads, kv_heads, head_dim,
                                 scale, splits, split_len);
}

// out[n, h, :] from the partials of (node n, head h)'s splits 0 .. S - 1, S the splits its keys
// reach (committed + the popcount of its ancestor bits keys in all), merged in split order:
// M = max m_s, L = sum l_s e^(m_s - M), out = sum acc_s e^(m_s - M) / L. One warp per (node,
// head).
extern "C" __global__ void attention_combine(float* out, const float* ml, const float* part_acc,
                                             const int* committed, const u64* anc, int words,
                                             int nodes, int heads, int head_dim, int splits,
                                             int split_len) {
    const int warps_per_block = blockDim.x / 32;
    const int pair = blockIdx.x * warps_per_block + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (pair >= nodes * heads) return;
    const int n = pair / heads;
    int keys = committed[n];
    for (int w = 0; w < words; w++) keys += __popcll(anc[(size_t)n * words + w]);
    const int used = (keys - 1) / split_len + 1;
    const size_t first = (size_t)pair * splits;
    float mx = NEG_INF;
    for (int s = 0; s < used; s++) mx = fmaxf(mx, ml[(first + s) * 2]);
    float l = 0.0f;
    for (int s = 0; s < used; s++) l += ml[(first + s) * 2 + 1] * expf(ml[(first + s) * 2] - mx);
    float* o = out + (size_t)pair * head_dim;
    for (int d = lane; d < head_dim; d += 32) {
        float a = 0.0f;
        for (int s = 0; s < used; s++)
            a += part_acc[(first + s) * head_dim + d] * expf(ml[(first + s) * 2] - mx);
        o[d] = a / l;
    }
}

// Each row's most likely token, so that greedy verification copies one id per node instead of a
// row of the vocabulary: ids[r] = the token of row r's largest logit, the smallest token id among
// equal maxima, as the host's argmax over the whole vocabulary (where tokens outside a restricted
// head are -inf). Row r holds `cols` logits; column c is token head[c], or c when head is null.
// A NaN never wins. One block per row; blockDim.x a power of two; dynamic shared memory of
// blockDim.x floats then blockDim.x ints.
__device__ __forceinline__ bool beats(float v, int t, float best, int best_t) {
    return v > best || (v == best && t < best_t);
}

extern "C" __global__ void argmax_rows(int* ids, const float* logits, int cols,
                                       const unsigned* head) {
    SPECINFER_DYNAMIC_SHARED(float, part);
    int* part_t = (int*)(part + blockDim.x);
    const float* x = logits + (size_t)blockIdx.x * cols;
    float best = NEG_INF;
    int best_t = 0x7fffffff;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const int t = head ? (int)head[c] : c;
        if (beats(x[c], t, best, best_t)) {
            best = x[c];
            best_t = t;
        }
    }
    part[threadIdx.x] = best;
    part_t[threadIdx.x] = best_t;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k && beats(part[threadIdx.x + k], part_t[threadIdx.x + k],
                                     part[threadIdx.x], part_t[threadIdx.x])) {
            part[threadIdx.x] = part[threadIdx.x + k];
            part_t[threadIdx.x] = part_t[threadIdx.x + k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = part_t[0];
}

// Block-wide reductions over blockDim.x (a power of two) floats of shared memory.
__device__ float block_max(float* part, float v) {
    part[threadIdx.x] = v;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + k]);
        __syncthreads();
    }
    const float r = part[0];
    __syncthreads();
    return r;
}

// An exact block-wide sum of integers (blockDim.x a power of two, at most WALK_THREADS).
#define WALK_THREADS 256
__device__ u64 block_sum_u64(u64 v) {
    __shared__ u64 part64[WALK_THREADS];
    part64[threadIdx.x] = v;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part64[threadIdx.x] += part64[threadIdx.x + k];
        __syncthreads();
    }
    const u64 r = part64[0];
    __syncthreads();
    return r;
}

// The defined arithmetic of `specinfer_kernels::sampling`, op for op, so that the device's
// sampled verification decides exactly as the host's: `exp_defined` (IEEE operations that the
// compiler may not fuse), and `FixedMass` (probabilities as whole units of 2^-40 times the
// largest one's power of two, summed as integers: exact in any order).
__device__ float exp_defined(float x) {
    if (!(x >= -87.0f)) return 0.0f;
    // Round to nearest even by adding and subtracting 1.5 * 2^23, as the host does.
    const float k = __fsub_rn(__fadd_rn(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)), 12582912.0f),
                              12582912.0f);
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(k, __uint_as_float(0x3f317200u))),
                              __fmul_rn(k, __uint_as_float(0x35bfbe8eu)));
    float p = __uint_as_float(0x39500d01u);
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3ab60b61u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c088889u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d2aaaabu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e2aaaabu));
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __uint_as_float((unsigned)((int)k + 127) << 23));
}

// Units per 1.0 for values whose largest (positive, finite) is `max`; 0 when there is none.
__device__ double mass_scale(float max) {
    if (!(max > 0.0f) || max == __int_as_float(0x7f800000)) return 0.0;
    const int e = (int)((__float_as_uint(max) >> 23) & 0xff) - 127;
    return ldexp(1.0, 40 - e);
}

__device__ bool finite_positive(float x) { return x > 0.0f && x != __int_as_float(0x7f800000); }

__device__ u64 mass_units(float x, double scale) {
    return finite_positive(x) ? (u64)(long long)((double)x * scale) : 0ull;
}

// The rank key of token i with probability v: larger probability first, then smaller index.
__device__ u64 rank_key(float v, int i) {
    return ((u64)__float_as_uint(v) << 32) | (u64)(0xffffffffu - (unsigned)i);
}

// `normalise`: p /= its FixedMass total, block-wide; false (p unchanged) without mass.
__device__ bool normalise_row(float* p, int vocab, float* part) {
    float mx = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (finite_positive(p[i])) mx = fmaxf(mx, p[i]);
    mx = block_max(part, mx);
    const double scale = mass_scale(mx);
    if (scale == 0.0) return false;
    u64 units = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) units += mass_units(p[i], scale);
    const double inv = 1.0 / ((double)block_sum_u64(units) / scale);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) p[i] = (float)((double)p[i] * inv);
    __syncthreads();
    return true;
}

// A verification distribution, block-wide, as the host's `distribution` (without top-k):
// p = exp_defined((x - max) / temperature), then, when top_p < 1, the shortest prefix of the
// ranking (probability descending, then token id) whose units reach ceil(top_p * total), found
// by bisection on the rank key (the largest key whose tokens at or above it hold that much),
// the rest 0; then normalised. `part` is blockDim.x floats of shared memory.
__device__ void distribution_row(float* p, const float* x, int vocab, float temperature,
                                 float top_p, float* part) {
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, x[i]);
    mx = block_max(part, mx);
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        p[i] = exp_defined(__fdiv_rn(__fsub_rn(x[i], mx), temperature));
    __syncthreads();
    if (top_p < 1.0f) {
        float pm = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (finite_positive(p[i])) pm = fmaxf(pm, p[i]);
        pm = block_max(part, pm);
        const double scale = mass_scale(pm);
        if (scale > 0.0) {
            u64 units = 0;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) units += mass_units(p[i], scale);
            const u64 total = block_sum_u64(units);
            const u64 target = (u64)ceil((double)top_p * (double)total);
            u64 key = 0;
            for (int bit = 63; bit >= 0; bit--) {
                const u64 cand = key | (1ull << bit);
                u64 held = 0;
                for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                    if (rank_key(p[i], i) >= cand) held += mass_units(p[i], scale);
                if (block_sum_u64(held) >= target) key = cand;
            }
            for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                if (rank_key(p[i], i) < key) p[i] = 0.0f;
            __syncthreads();
        }
    }
    normalise_row(p, vocab, part);
}

// Verification distributions of whole rows: probs[r, :] from logits[r, :] (distribution_row).
// One block per row, at most WALK_THREADS threads; dynamic shared memory of blockDim.x floats.
extern "C" __global__ void softmax_top_p(float* probs, const float* logits, int vocab,
                                         float temperature, float top_p) {
    SPECINFER_DYNAMIC_SHARED(float, part);
    distribution_row(probs + (size_t)blockIdx.x * vocab, logits + (size_t)blockIdx.x * vocab,
                     vocab, temperature, top_p, part);
}

// Sampled verification of one sequence's tree on the device: multi-step speculative sampling
// (children drawn i.i.d.) or recursive rejection sampling (drawn without replacement), the host's
// verify_stochastic step for step and bit for bit (the defined arithmetic above), with the
// uniforms the host drew from the session's RNG in the order the host would use them (one per
// child tried, then one for the emitted token), so only the logits rows' distributions are
// computed here and nothing but the verdict crosses to the host.
// logits: the tree's rows [n, vocab] (a full vocabulary head). The tree: node i's children, in draw
// order, are kids[kid_start[i] .. kid_start[i + 1]); token[i]; node i >= 1 was drawn from proposal
// drawn_from[i], whose support is q_ids / q_probs[q_start[d] .. q_start[d + 1]); n nodes. p: 2 *
// vocab floats of scratch (the distribution, then the values a residual update overwrote). out
// (2 + 2n + 1 ints): the number A of accepted nodes, the emitted token, n slots of which the first
// A are the accepted nodes, then the children rejected at each depth 1 ..= A + 1. One block of
// WALK_THREADS threads; dynamic shared memory of WALK_THREADS floats.

// Whether token t was drawn from proposal d by one of node's children before its k-th (a draw
// without replacement removes it from what the later ones were drawn from).
__device__ bool drawn_before(const int* kid_start, const int* kids, const int* token,
                             const int* drawn_from, int node, int k, int d, int t) {
    for (int e = kid_start[node]; e < k; e++)
        if (drawn_from[kids[e]] == d && token[kids[e]] == t) return true;
    return false;
}

extern "C" __global__ void sample_walk(int* out, const float* logits, int vocab,
                                       const int* kid_start, const int* kids, const int* token,
                                       const int* drawn_from, const int* q_start, const int* q_ids,
                                       const float* q_probs, int without_replacement, int n,
                                       const double* u, float temperature, float top_p,
                                       float* p) {
    SPECINFER_DYNAMIC_SHARED(float, part);
    __shared__ u64 chunk[WALK_THREADS];
    __shared__ int s_accept, s_drew;
    float* saved = p + vocab;
    int node = 0, ui = 0, accepted = 0, depth = 0;
    for (;;) {
        distribution_row(p, logits + (size_t)node * vocab, vocab, temperature, top_p, part);
        depth++;
        int rejected = 0, next = -1;
        for (int k = kid_start[node]; k < kid_start[node + 1]; k++) {
            const int c = kids[k], d = drawn_from[c], x = token[c];
            const int q0 = q_start[d], q1 = q_start[d + 1];
            if (threadIdx.x == 0) {
                // q' = proposal d without the tokens its earlier draws at this node took,
                // renormalised by the mass actually left (summed in f32, in order, as the host
                // does); i.i.d. draws use q as sent.
                float total = 0.0f;
                for (int j = q0; j < q1; j++) {
                    const bool taken = without_replacement &&
                        drawn_before(kid_start, kids, token, drawn_from, node, k, d, q_ids[j]);
                    if (!taken) total = __fadd_rn(total, q_probs[j]);
                }
                float qx = 0.0f;
                bool found = false;
                for (int j = q0; j < q1; j++) {
                    const bool taken = without_replacement &&
                        drawn_before(kid_start, kids, token, drawn_from, node, k, d, q_ids[j]);
                    if (!taken && !found && q_ids[j] == x) {
                        qx = without_replacement ? __fdiv_rn(q_probs[j], total) : q_probs[j];
                        found = true;
                    }
                }
                // Accept with min(1, p(x) / q'(x)); q'(x) > 0 since x was drawn from q' (where
                // rounding made it 0, no uniform is used, as on the host).
                s_drew = qx > 0.0f;
                s_accept = s_drew && u[ui] * (double)qx < (double)p[x];
                if (!s_accept) {
                    // Residual p <- max(0, p - q') on q's support; old values saved.
                    for (int j = q0; j < q1; j++) {
                        const bool taken = without_replacement &&
                            drawn_before(kid_start, kids, token, drawn_from, node, k, d, q_ids[j]);
                        saved[j - q0] = p[q_ids[j]];
                        if (!taken) {
                            const float w =
                                without_replacement ? __fdiv_rn(q_probs[j], total) : q_probs[j];
                            p[q_ids[j]] = fmaxf(__fsub_rn(p[q_ids[j]], w), 0.0f);
                        }
                    }
                }
            }
            __syncthreads();
            ui += s_drew;
            if (s_accept) {
                next = c;
                break;
            }
            rejected++;
            // Normalised; where nothing is left (only through rounding when p == q'), p as it
            // was.
            if (!normalise_row(p, vocab, part) && threadIdx.x == 0)
                for (int j = q0; j < q1; j++) p[q_ids[j]] = saved[j - q0];
            __syncthreads();
        }
        if (threadIdx.x == 0) out[2 + n + depth - 1] = rejected;
        if (next < 0) break;
        if (threadIdx.x == 0) out[2 + accepted] = next;
        accepted++;
        node = next;
    }
    // The emitted token: the host's `sample`, an inverse-CDF draw over FixedMass units (never a
    // token of probability 0; the last positive one when the target is past the total).
    float mx = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (finite_positive(p[i])) mx = fmaxf(mx, p[i]);
    mx = block_max(part, mx);
    const double scale = mass_scale(mx);
    const int per = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = min(vocab, lo + per);
    u64 mass = 0;
    for (int i = lo; i < hi; i++) mass += mass_units(p[i], scale);
    chunk[threadIdx.x] = mass;
    __syncthreads();
    if (threadIdx.x == 0) {
        int pick = 0;
        if (scale > 0.0) {
            u64 total = 0;
            for (int t = 0; t < (int)blockDim.x; t++) total += chunk[t];
            const u64 target = (u64)(u[ui] * (double)total);
            u64 acc = 0;
            pick = -1;
            for (int t = 0; t < (int)blockDim.x && pick < 0; t++) {
                if (target >= acc + chunk[t]) {
                    acc += chunk[t];
                    continue;
                }
                const int c0 = t * per, c1 = min(vocab, c0 + per);
                for (int i = c0; i < c1; i++) {
                    if (p[i] > 0.0f) {
                        acc += mass_units(p[i], scale);
                        if (target < acc) {
                            pick = i;
                            break;
                        }
                    }
                }
            }
            if (pick < 0) {
                for (int i = vocab - 1; i >= 0; i--)
                    if (p[i] > 0.0f) {
                        pick = i;
                        break;
                    }
            }
        }
        out[0] = accepted;
        out[1] = pick;
    }
}

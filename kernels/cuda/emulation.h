// What `specinfer.cu` needs from CUDA, for a C++ host compiler: the emulated device
// (`emulated_device.cpp`, feature `cuda`) compiles the very file NVRTC compiles with this header
// in front of it. Each CUDA thread of a block runs as a fiber on one host thread; `__syncthreads`
// and the warp shuffles are points where a fiber waits until every thread of its block (or lane of
// its warp) has come, and a point some of them never reach is an error of the launch, not a hang.
#pragma once

#include <math.h>
#include <stddef.h>
#include <string.h>

#include <algorithm>

struct dim3 {
    unsigned x, y, z;
};

namespace emu {
// The running fiber's thread and block (set by the scheduler before it resumes a fiber).
extern thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
// Waits until every thread of the block has called it.
void syncthreads();
// A warp shuffle of 8 raw bytes: the value lane (lane ^ lane_mask) gave, once all 32 gave one.
unsigned long long shuffle_xor(unsigned mask, unsigned long long bits, int lane_mask);
// The launch's dynamic shared memory (per block; filled with 0xff bytes when a block starts, so
// that a read before the write that a missing barrier lets through shows as NaN or -1).
void* dynamic_shared();
}  // namespace emu

#define __global__
#define __device__
#define __forceinline__ inline
// Static shared memory: one object per host thread, and a block's fibers share a host thread.
#define __shared__ static thread_local
#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define SPECINFER_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(emu::dynamic_shared())

inline void __syncthreads() { emu::syncthreads(); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    bits = emu::shuffle_xor(mask, bits, lane_mask);
    T r;
    memcpy(&r, &bits, sizeof(T));
    return r;
}

inline float __int_as_float(int v) {
    float f;
    memcpy(&f, &v, 4);
    return f;
}
inline float __uint_as_float(unsigned v) {
    float f;
    memcpy(&f, &v, 4);
    return f;
}
inline unsigned __float_as_uint(float v) {
    unsigned u;
    memcpy(&u, &v, 4);
    return u;
}
// Single-precision operations rounded to nearest, never fused (the build turns contraction off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
// CUDA's rsqrtf is within 2 ulp; the host's is the correctly rounded 1 / sqrt.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
using std::max;
using std::min;

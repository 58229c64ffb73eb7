// tandem's CUDA kernels, compiled once at start-up by NVRTC (see ptx.rs).
//
// Conventions:
// - Activations are f32 row-major `[tokens, width]`; weights and the KV pool
//   are f32 or bf16 (`bf16_t`, the raw 16 bits: NVRTC needs no CUDA headers).
// - Every per-step quantity (token ids, positions, KV slots, query tiles,
//   block tables) is read from device memory, never from kernel arguments, so
//   a captured CUDA graph replays correctly after the host rewrites those
//   buffers. Padding rows have position -1 and are skipped everywhere.
// - Each kernel exists once per storage type behind an `extern "C"` name with
//   a `_f32` / `_bf16` suffix.

typedef unsigned short bf16_t;

#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, as torch does.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float load_f32(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load_f32(const bf16_t* p, long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store_f32(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(bf16_t* p, long i, float v) { p[i] = f32_to_bf16(v); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of at most 1024 threads; every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int nw = (blockDim.x + 31) >> 5;
        float s = lane < nw ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// ---------------------------------------------------------------- embedding

// out[r, :] = table[tokens[r], :]. One block per row.
template <typename T>
__device__ void embed(const int* tokens, const T* table, float* out, int hidden) {
    int r = blockIdx.x;
    long tok = tokens[r];
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[(long)r * hidden + i] = load_f32(table, tok * hidden + i);
    }
}
extern "C" __global__ void embed_f32(const int* t, const float* w, float* o, int h) { embed(t, w, o, h); }
extern "C" __global__ void embed_bf16(const int* t, const bf16_t* w, float* o, int h) { embed(t, w, o, h); }

// ---------------------------------------------------------------- RMSNorm

// out[r] = w * (x[src] / sqrt(mean(x[src]^2) + eps)), src = gather ? gather[r] : r.
// One block per output row. The output is the next GEMM's input type.
template <typename O>
__device__ void rms_norm(const float* x, const float* w, O* out, const int* gather, int hidden, float eps) {
    int r = blockIdx.x;
    long src = gather ? gather[r] : r;
    const float* xr = x + src * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        store_f32(out, (long)r * hidden + i, w[i] * (xr[i] * inv));
    }
}
extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* o, const int* g, int h, float eps) { rms_norm(x, w, o, g, h, eps); }
extern "C" __global__ void rms_norm_bf16(const float* x, const float* w, bf16_t* o, const int* g, int h, float eps) { rms_norm(x, w, o, g, h, eps); }

// ---------------------------------------------------------------- element-wise

// y[r, c] += b[c] over `rows` rows of `n` columns with row stride `stride`.
extern "C" __global__ void bias_add(float* y, const float* b, int rows, int n, int stride) {
    long total = (long)rows * n;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        long r = i / n, c = i % n;
        y[r * stride + c] += b[c];
    }
}

// out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: the fused gate|up output.
template <typename O>
__device__ void silu_mul(const float* gu, O* out, int rows, int inter) {
    long total = (long)rows * inter;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        long r = i / inter, c = i % inter;
        float g = gu[r * 2 * inter + c];
        float u = gu[r * 2 * inter + inter + c];
        float s = g / (1.0f + expf(-g));
        store_f32(out, i, s * u);
    }
}
extern "C" __global__ void silu_mul_f32(const float* gu, float* o, int rows, int inter) { silu_mul(gu, o, rows, inter); }
extern "C" __global__ void silu_mul_bf16(const float* gu, bf16_t* o, int rows, int inter) { silu_mul(gu, o, rows, inter); }

// ---------------------------------------------------------------- RoPE + KV write

// For each row of the fused qkv buffer: rotates the q heads in place
// (rotate-half pairing, as transformers' Llama; the angle is the f32 product
// position * inv_freq, its cosine taken in double as the CPU engine does) and
// writes the rotated k and the v of the row into the paged pool at
// slots[r] = block * block_size + slot. Pool layout per layer:
// [block][kv_head][slot][head_dim], K and V apart. Padding rows (position -1)
// are skipped.
template <typename T>
__device__ void rope_kv_write(float* qkv, const float* inv_freq, const int* positions, const int* slots,
                              T* kpool, T* vpool, int stride, int num_heads, int kv_heads, int head_dim,
                              int block_size) {
    int r = blockIdx.x;
    int pos = positions[r];
    if (pos < 0) return;
    int half = head_dim / 2;
    float* row = qkv + (long)r * stride;
    int slot = slots[r];
    long block = slot / block_size, s = slot % block_size;
    for (int i = threadIdx.x; i < (num_heads + kv_heads) * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        float a = (float)pos * inv_freq[j];
        float c = (float)cos((double)a), sn = (float)sin((double)a);
        float* hp = row + h * head_dim;
        float x1 = hp[j], x2 = hp[j + half];
        float y1 = x1 * c - x2 * sn, y2 = x2 * c + x1 * sn;
        if (h < num_heads) {
            hp[j] = y1;
            hp[j + half] = y2;
        } else {
            long dst = ((block * kv_heads + (h - num_heads)) * block_size + s) * head_dim;
            store_f32(kpool, dst + j, y1);
            store_f32(kpool, dst + j + half, y2);
        }
    }
    const float* v = row + (num_heads + kv_heads) * head_dim;
    for (int i = threadIdx.x; i < kv_heads * head_dim; i += blockDim.x) {
        int h = i / head_dim, d = i % head_dim;
        store_f32(vpool, ((block * kv_heads + h) * block_size + s) * head_dim + d, v[i]);
    }
}
// Per-head q/k RMSNorm (Qwen3, Gemma 3) on the fused qkv buffer, before
// RoPE: each of the row's q heads is normalised over its head_dim and scaled
// by qw, each k head by kw. One block per row, one warp per head; padding
// rows (position -1) are skipped.
extern "C" __global__ void qk_head_norm(float* qkv, const float* qw, const float* kw, const int* positions,
                                        int stride, int num_heads, int kv_heads, int head_dim, float eps) {
    int r = blockIdx.x;
    if (positions[r] < 0) return;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    float* row = qkv + (long)r * stride;
    for (int h = warp; h < num_heads + kv_heads; h += warps) {
        float* hp = row + h * head_dim;
        const float* w = h < num_heads ? qw : kw;
        float ss = 0.0f;
        for (int i = lane; i < head_dim; i += 32) ss += hp[i] * hp[i];
        ss = warp_sum(ss);
        float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
        for (int i = lane; i < head_dim; i += 32) hp[i] = w[i] * (hp[i] * inv);
    }
}

#define ROPE_ARGS(T) float *qkv, const float *f, const int *p, const int *sl, T *k, T *v, int st, int nh, int kh, int d, int bs
extern "C" __global__ void rope_kv_write_f32(ROPE_ARGS(float)) { rope_kv_write(qkv, f, p, sl, k, v, st, nh, kh, d, bs); }
extern "C" __global__ void rope_kv_write_bf16(ROPE_ARGS(bf16_t)) { rope_kv_write(qkv, f, p, sl, k, v, st, nh, kh, d, bs); }

// ---------------------------------------------------------------- GEMV

// y[r, c] = x[r, :] · w[c, :] + beta * y[r, c] for the few rows of a decode
// step (rows <= 8), bf16 x and w, f32 accumulation. Decode is bound by
// reading w once: one warp per output column streams its weight row in
// 16-byte loads, four in flight per lane, and reuses each for every row.
// Needs k % 8 == 0 (16-byte aligned rows).
#define GEMV_MAX_ROWS 8
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}
// Weights are read once per step: stream them past L1 (keeping L1 for x).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
extern "C" __global__ void __launch_bounds__(256) gemv_bf16(const bf16_t* x, const bf16_t* w, float* y, int rows,
                                                             int n, int k, float beta) {
    int col = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (col >= n) return;
    const uint4* wr = (const uint4*)(w + (long)col * k);
    int kv = k >> 3;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.0f;
    const int U = 4;
    for (int base = 0; base < kv; base += 32 * U) {
        uint4 wv[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + u * 32 + lane;
            wv[u] = i < kv ? ld_stream(wr + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + u * 32 + lane;
            if (i >= kv) break;
            float wf[8];
            unpack8(wv[u], wf);
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++) {
                if (r >= rows) break;
                uint4 xv = __ldg((const uint4*)(x + (long)r * k) + i);
                float xf[8];
                unpack8(xv, xf);
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) s += wf[e] * xf[e];
                acc[r] += s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r >= rows) break;
        float s = warp_sum(acc[r]);
        if (lane == 0) {
            long o = (long)r * n + col;
            y[o] = beta != 0.0f ? s + beta * y[o] : s;
        }
    }
}

// ---------------------------------------------------------------- attention

#define ATTN_WARPS 8

// DPL consecutive values from p (16-, 8- or 4-byte loads where they fit).
template <typename T, int DPL> struct VecLoad {
    static __device__ __forceinline__ void load(const T* p, float* out) {
#pragma unroll
        for (int i = 0; i < DPL; i++) out[i] = load_f32(p, i);
    }
};
template <> struct VecLoad<bf16_t, 8> {
    static __device__ __forceinline__ void load(const bf16_t* p, float* o) {
        uint4 v = *(const uint4*)p;
        o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
        o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
        o[4] = __uint_as_float(v.z << 16); o[5] = __uint_as_float(v.z & 0xffff0000u);
        o[6] = __uint_as_float(v.w << 16); o[7] = __uint_as_float(v.w & 0xffff0000u);
    }
};
template <> struct VecLoad<bf16_t, 4> {
    static __device__ __forceinline__ void load(const bf16_t* p, float* o) {
        uint2 v = *(const uint2*)p;
        o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
        o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
    }
};
template <> struct VecLoad<float, 4> {
    static __device__ __forceinline__ void load(const float* p, float* o) {
        float4 v = *(const float4*)p;
        o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
    }
};

// Paged causal attention, one warp per (query row, query head).
//
// Grid: (tiles, head chunks, splits). A tile is up to `tile_tokens`
// consecutive query rows of one sequence (tiles[4*i] = seq, first row, rows);
// a head chunk is `heads_per_cta` query heads sharing one KV head, so the
// warps of a CTA read the same K/V rows (the second and later reads hit L1).
// Lane l owns dims [l*DPL, (l+1)*DPL) of the head: a key's score is DPL
// products and a warp sum, and lane j keeps key j's score of the current
// block, so the softmax recurrence runs block by block exactly as the CPU
// engine's (block max, then exp, then the weighted V sum in key order).
// Split z of `splits` takes a contiguous share of the tile's KV blocks
// (flash-decoding); with several splits each writes its unnormalised
// partial (m, l, acc) and `attn_reduce` combines them. Block size <= 32.
template <typename T, int HD, int UK>
__device__ void attention(const float* qkv, const T* kpool, const T* vpool, const int* tiles,
                          const int* positions, const int* block_tables, float* out, bf16_t* out_bf16,
                          float* part_o, float* part_ml, int stride, int num_heads, int kv_heads,
                          int block_size, int max_blocks, int heads_per_cta, int window, int splits,
                          float scale) {
    constexpr int DPL = HD >= 32 ? HD / 32 : 1;
    int tile = blockIdx.x, chunk = blockIdx.y, split = blockIdx.z;
    int seq = tiles[4 * tile], row0 = tiles[4 * tile + 1], nrows = tiles[4 * tile + 2];
    if (nrows <= 0) return;
    int group = num_heads / kv_heads;
    int head0 = chunk * heads_per_cta;
    int kvh = head0 / group;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int my_tok = warp / heads_per_cta, my_head = head0 + warp % heads_per_cta;
    if (my_tok >= nrows) return;
    int row = row0 + my_tok;
    int pos = positions[row];
    if (pos < 0) return;
    int lo = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;

    // This split's share of the tile's key blocks (the same for every warp
    // of the CTA, so partials line up).
    int first_pos = positions[row0];
    int last_pos = positions[row0 + nrows - 1];
    int tile_lo = (window > 0 && first_pos + 1 > window) ? first_pos + 1 - window : 0;
    int b_begin = tile_lo / block_size, b_end = last_pos / block_size + 1;
    int per = (b_end - b_begin + splits - 1) / splits;
    int sb = max(b_begin + split * per, lo / block_size);
    int se = min(min(b_end, b_begin + (split + 1) * per), pos / block_size + 1);

    bool has_dims = lane * DPL < HD;
    float q[DPL];
    const float* qp = qkv + (long)row * stride + my_head * HD + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; i++) q[i] = has_dims ? qp[i] : 0.0f;
    float m = -INFINITY, l = 0.0f;
    float acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[i] = 0.0f;
    const int* table = block_tables + (long)seq * max_blocks;

    for (int b = sb; b < se; b++) {
        long base = ((long)table[b] * kv_heads + kvh) * block_size * HD;
        int kpos0 = b * block_size;
        int j_lo = max(lo - kpos0, 0), j_hi = min(pos - kpos0 + 1, block_size);
        float my_score = -INFINITY;
        // Keys in groups of UK: the group's loads are all in flight before
        // the first product needs one, and its warp sums interleave.
        for (int j0 = j_lo; j0 < j_hi; j0 += UK) {
            float k[UK][DPL];
#pragma unroll
            for (int u = 0; u < UK; u++) {
                if (j0 + u < j_hi && has_dims) {
                    VecLoad<T, DPL>::load(kpool + base + (long)(j0 + u) * HD + lane * DPL, k[u]);
                } else {
#pragma unroll
                    for (int i = 0; i < DPL; i++) k[u][i] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < UK; u++) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < DPL; i++) dot += q[i] * k[u][i];
                dot = warp_sum(dot) * scale;
                if (lane == j0 + u && j0 + u < j_hi) my_score = dot;
            }
        }
        float bmax = warp_max(my_score);
        if (bmax == -INFINITY) continue;
        float m_new = fmaxf(m, bmax);
        float alpha = (m == -INFINITY) ? 0.0f : expf(m - m_new);
        float p = my_score == -INFINITY ? 0.0f : expf(my_score - m_new);
        l = l * alpha + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] *= alpha;
        for (int j0 = j_lo; j0 < j_hi; j0 += UK) {
            float v[UK][DPL];
#pragma unroll
            for (int u = 0; u < UK; u++) {
                if (j0 + u < j_hi && has_dims) {
                    VecLoad<T, DPL>::load(vpool + base + (long)(j0 + u) * HD + lane * DPL, v[u]);
                } else {
#pragma unroll
                    for (int i = 0; i < DPL; i++) v[u][i] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < UK; u++) {
                // Keys past j_hi have p == 0 (lanes >= block_size too).
                float pj = __shfl_sync(0xffffffffu, p, (j0 + u) & 31);
                if (j0 + u >= j_hi) pj = 0.0f;
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[i] += pj * v[u][i];
            }
        }
        m = m_new;
    }
    if (!has_dims) return;
    long oh = ((long)row * num_heads + my_head) * HD + lane * DPL;
    if (splits == 1) {
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            if (out_bf16) out_bf16[oh + i] = f32_to_bf16(acc[i] * inv);
            else out[oh + i] = acc[i] * inv;
        }
    } else {
        long ps = (long)row * num_heads + my_head;
        long po = (ps * splits + split) * HD + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; i++) part_o[po + i] = acc[i];
        if (lane == 0) {
            part_ml[2 * (ps * splits + split)] = m;
            part_ml[2 * (ps * splits + split) + 1] = l;
        }
    }
}

#define ATTN_ARGS(T)                                                                                    \
    const float *qkv, const T *k, const T *v, const int *tiles, const int *pos, const int *bt, float *out, bf16_t *ob, \
        float *po, float *pml, int stride, int nh, int kh, int bs, int mb, int hpc, int win, int splits, float scale
#define ATTN_CALL qkv, k, v, tiles, pos, bt, out, ob, po, pml, stride, nh, kh, bs, mb, hpc, win, splits, scale
// Two key-group sizes: 16 keys in flight for decode (one query row per
// warp, latency-bound), 8 for prefill tiles (more warps per SM instead).
#define ATTN_KERNEL(NAME, T, HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) NAME(ATTN_ARGS(T)) {                   \
        attention<T, HD, (HD >= 256 ? 4 : 8)>(ATTN_CALL);                                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) NAME##_decode(ATTN_ARGS(T)) {          \
        attention<T, HD, (HD >= 256 ? 8 : 16)>(ATTN_CALL);                                                \
    }
ATTN_KERNEL(attention_f32_16, float, 16)
ATTN_KERNEL(attention_f32_32, float, 32)
ATTN_KERNEL(attention_f32_64, float, 64)
ATTN_KERNEL(attention_f32_128, float, 128)
ATTN_KERNEL(attention_f32_256, float, 256)
ATTN_KERNEL(attention_bf16_16, bf16_t, 16)
ATTN_KERNEL(attention_bf16_32, bf16_t, 32)
ATTN_KERNEL(attention_bf16_64, bf16_t, 64)
ATTN_KERNEL(attention_bf16_128, bf16_t, 128)
ATTN_KERNEL(attention_bf16_256, bf16_t, 256)

// Combines the splits of each (row, head): grid (rows, heads), head_dim threads.
extern "C" __global__ void attn_reduce(const float* part_o, const float* part_ml, const int* positions,
                                       float* out, bf16_t* out_bf16, int num_heads, int head_dim, int splits) {
    int r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (positions[r] < 0 || d >= head_dim) return;
    long base = ((long)r * num_heads + h) * splits;
    float mx = -INFINITY;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, part_ml[2 * (base + s)]);
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < splits; s++) {
        float ms = part_ml[2 * (base + s)];
        if (ms == -INFINITY) continue;
        float w = expf(ms - mx);
        den += part_ml[2 * (base + s) + 1] * w;
        num += part_o[(base + s) * head_dim + d] * w;
    }
    long o = ((long)r * num_heads + h) * head_dim + d;
    float v = den > 0.0f ? num / den : 0.0f;
    if (out_bf16) out_bf16[o] = f32_to_bf16(v);
    else out[o] = v;
}

// ---------------------------------------------------------------- sampling

// out[r] = argmax(logits[r]), the first index on ties (as the CPU sampler).
extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    int r = blockIdx.x;
    const float* z = logits + (long)r * vocab;
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = z[i];
        if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        int nw = (blockDim.x + 31) >> 5;
        for (int w = 1; w < nw; w++) {
            if (sv[w] > best || (sv[w] == best && si[w] < idx)) { best = sv[w]; idx = si[w]; }
        }
        out[r] = idx == 0x7fffffff ? 0 : idx;
    }
}

// ---------------------------------------------------------------- benchmarks

// Uniform values in [-scale, scale) from a counter hash (random weights for
// shape benchmarks without a checkpoint).
extern "C" __global__ void fill_uniform_bf16(bf16_t* out, long n, unsigned long long seed, float scale) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        unsigned long long x = seed ^ ((unsigned long long)i * 0x9E3779B97F4A7C15ull);
        x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 27; x *= 0x94D049BB133111EBull;
        x ^= x >> 31;
        float f = (float)(x >> 40) * (1.0f / 16777216.0f);
        out[i] = f32_to_bf16((2.0f * f - 1.0f) * scale);
    }
}

extern "C" __global__ void fill_f32(float* out, long n, float v) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) out[i] = v;
}

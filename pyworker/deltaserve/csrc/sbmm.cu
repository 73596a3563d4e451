// SBMM on tensor cores: every token's compressed-delta product of one linear, one launch per step.
//
// The op, its format and its semantics are kernels/sbmm.py's (module docstring); the packed format
// is compress/pack.py's. This file is a faster implementation of the same op for work tiles of at
// most 16 tokens (decode, short prefill runs), used on CUDA where it builds (kernels/cuda_ext.py)
// and the call fits it (``sbmm.cuda_supports``); ``sbmm_ref`` is the reference it is tested against.
//
// Work split: block (row block, work tile, K split) computes ROWS = 128 output rows of one tile's
// tokens (8 * NT, NT = 1 or 2 fragments of 8) over its share of K, in stages of KS = 256 columns:
//
//     stage s (cp.async, STAGES in flight; consecutive threads copy consecutive 16 bytes of a row):
//       raw words   [ROWS][qvalues bytes + 16]   (4-bit 2:4: 64 + 16 bytes per row; +16: no bank conflicts)
//                   [ROWS][qindices bytes + 16]  (2:4 only: 32 + 16)
//       scales      [ROWS][16 bytes], zeros [ROWS][16 bytes]   (KS / G per row: G = 32, 64 or 128)
//       x           [8 * NT tokens][KS + 8]      (the tile's rows through ``order``; past its end zeros)
//     per 64-column sub-step, lane = one row of its warp's 32:
//       expand: (code - zero) * scale in fp32, rounded to the activation dtype; 2:4 groups placed by a
//               byte permute whose selector the position nibble picks from a 16-entry table
//               -> w_s[warp][32 rows][64 + 8]
//       wmma m32n8k16: A = w_s (row major), B = x stage (col major), NT fp32 accumulators
//     end: accumulators -> shared memory -> lane = row:
//          one split:  out[order[p], row] = dtype(out + acc)              (the op's one rounding)
//          K split:    ws[split, p, row] = acc;  sbmm_splitk_reduce adds the splits in a fixed order
//
// Nothing is read for padding tiles (slot -1): their blocks return at once. The grid and the
// arguments depend on the step's metadata tensors only, so the launch can be captured in a graph.
//
// A second entry, ``deltaserve_dequant``, writes one slot's delta as a dense [N, K] tensor of the
// activation dtype (kernels/sbmm.py ``dequantize_slot``: long prefill segments multiply it with one
// cuBLAS matmul). One thread per qvalues word: its 8 / 16 codes, their 2:4 positions, fp32
// (code - zero) * scale rounded once (pack.dequantize's arithmetic, bit for bit), 16-byte stores;
// consecutive threads write consecutive pieces of a row.
//
// Requirements (checked by the caller, kernels/sbmm.py ``cuda_supports``): float16 or bfloat16
// activations, K % 256 == 0, G in {32, 64, 128}, x rows 16-byte aligned, slot offsets of qvalues /
// qindices multiples of 4 words and of scales / zeros multiples of 2.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

namespace {

using namespace nvcuda;

constexpr int WARPS = 4;
constexpr int ROWS = 32 * WARPS;  // output rows per block
constexpr int KS = 256;           // input columns per stage (one pipelined copy)
constexpr int SUB = 64;           // input columns per expand + MMA sub-step
constexpr int LDW = SUB + 8;      // w_s row stride in elements (16 bytes of padding: no bank conflicts)
constexpr int LDX = KS + 8;       // x_s row stride in elements
#ifndef SBMM_STAGES
#define SBMM_STAGES 2
#endif
constexpr int STAGES = SBMM_STAGES;  // stages in flight (cp.async)

__device__ __forceinline__ float to_float(__half h) { return __half2float(h); }
__device__ __forceinline__ float to_float(__nv_bfloat16 h) { return __bfloat162float(h); }
template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ __half from_float<__half>(float f) { return __float2half_rn(f); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float f) {
  return __float2bfloat16_rn(f);
}
// (a, b) rounded to T, a in the low 16 bits.
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// An unsigned code (< 2^23) as float: its bits under the exponent of 2^23, minus 2^23. Exact.
__device__ __forceinline__ float code_to_float(uint32_t c) { return __uint_as_float(0x4B000000u | c) - 8388608.0f; }

// Asynchronous global -> shared copy of 16 or 4 bytes; ``fill`` false zero-fills (nothing is read).
template <int BYTES> __device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = fill ? BYTES : 0;
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Shared-memory layout of one block (bytes), per stage: the packed words of ROWS rows x KS columns
// (rows padded by 16 bytes against bank conflicts), their scales / zeros, the tile's x columns.
template <int BITS, bool SPARSE, int NT> struct Layout {
  static constexpr int TM = 8 * NT;                                 // tokens the block holds
  static constexpr int QB = (SPARSE ? KS / 2 : KS) * BITS / 8;      // qvalues bytes per row and stage
  static constexpr int IB = SPARSE ? KS / 2 * 2 / 8 : 0;            // qindices bytes per row and stage
  static constexpr int QS = QB + 16, IS = SPARSE ? IB + 16 : 0, GS = 16;  // row strides
  static constexpr int Q_OFF = 0, I_OFF = ROWS * QS, S_OFF = I_OFF + ROWS * IS, Z_OFF = S_OFF + ROWS * GS;
  static constexpr int X_OFF = Z_OFF + ROWS * GS;
  static constexpr int STAGE = X_OFF + TM * LDX * 2;
  static constexpr int W_OFF = STAGES * STAGE;                      // [warp][32 rows][LDW] dense slice
  static constexpr int P_OFF = W_OFF + WARPS * 32 * LDW * 2;        // 2:4 placement selectors
  static constexpr int BYTES = P_OFF + 16 * 4;
  static constexpr int SUB_QW = SUB * BITS / 32 / (SPARSE ? 2 : 1);  // qvalues words per sub-step
};

// 2:4 placement: byte-permute selectors putting a group's two values (v = v0 | v1 << 16) at its
// positions p0, p1 of 4 columns (lo word: columns 0-1, hi word: 2-3), indexed by the position
// nibble p0 | p1 << 2 of qindices. Entry: lo selector | hi selector << 16.
__device__ __forceinline__ uint32_t placement(int nib) {
  const int p0 = nib & 3, p1 = nib >> 2;
  uint32_t sel = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t src = q == p0 ? 0x10u : q == p1 ? 0x32u : 0x44u;  // half 0 of v, half 1, zero bytes
    sel |= src << (8 * q);
  }
  return sel;
}

// One sub-step: the dense, dequantised SUB columns of one row (dtype T) from its packed words in
// shared memory (q: qvalues words, idx: qindices words, sc / zr: the row's scales / zeros of the stage).
template <typename T, int BITS, bool SPARSE>
__device__ __forceinline__ void expand(const uint32_t* q, const uint32_t* idx, float s0, float z0, float s1, float z1,
                                       const uint32_t* place, T* dst) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  constexpr int QW = SUB * BITS / 32 / (SPARSE ? 2 : 1);
  uint32_t words[QW], iw[2];
#pragma unroll
  for (int i = 0; i < QW; i += (QW >= 4 ? 4 : 2)) {
    if constexpr (QW >= 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(q + i);
      words[i] = v.x; words[i + 1] = v.y; words[i + 2] = v.z; words[i + 3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(q + i);
      words[i] = v.x; words[i + 1] = v.y;
    }
  }
  if constexpr (SPARSE) {
    const uint2 v = *reinterpret_cast<const uint2*>(idx);
    iw[0] = v.x; iw[1] = v.y;
  }
#pragma unroll
  for (int c = 0; c < SUB; c += 8) {  // 8 columns = one 16-byte store
    const float s = c < 32 ? s0 : s1, z = c < 32 ? z0 : z1;
    uint32_t o[4];
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // 4 columns each
      if constexpr (SPARSE) {
        const int j = c / 4 + k, i0 = 2 * j, i1 = 2 * j + 1;
        const uint32_t c0 = (words[i0 / PER] >> ((i0 % PER) * BITS)) & MASK;
        const uint32_t c1 = (words[i1 / PER] >> ((i1 % PER) * BITS)) & MASK;
        const uint32_t v = pack2<T>((code_to_float(c0) - z) * s, (code_to_float(c1) - z) * s);
        const uint32_t sel = place[(iw[j / 8] >> (4 * (j % 8))) & 0xF];
        o[2 * k] = __byte_perm(v, 0, sel & 0xFFFF);
        o[2 * k + 1] = __byte_perm(v, 0, sel >> 16);
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = c + 4 * k + 2 * e;
          const uint32_t c0 = (words[i / PER] >> ((i % PER) * BITS)) & MASK;
          const uint32_t c1 = (words[(i + 1) / PER] >> (((i + 1) % PER) * BITS)) & MASK;
          o[2 * k + e] = pack2<T>((code_to_float(c0) - z) * s, (code_to_float(c1) - z) * s);
        }
      }
    }
    *reinterpret_cast<uint4*>(dst + c) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

template <typename T, int BITS, bool SPARSE, int NT>
#ifndef SBMM_MIN_BLOCKS
#define SBMM_MIN_BLOCKS 3
#endif
__global__ void __launch_bounds__(ROWS, SBMM_MIN_BLOCKS) sbmm_kernel(
    const T* __restrict__ x, T* __restrict__ out, float* __restrict__ ws, const int32_t* __restrict__ order,
    const int32_t* __restrict__ tiles, const uint32_t* __restrict__ qvalues, const uint32_t* __restrict__ qindices,
    const __half* __restrict__ scales, const __half* __restrict__ zeros, const int64_t* __restrict__ qv_offsets,
    const int64_t* __restrict__ qi_offsets, const int64_t* __restrict__ group_offsets, int N, int K, int G,
    int64_t x_stride, int64_t out_stride, int stages_per_split, int ws_rows) {
  using L = Layout<BITS, SPARSE, NT>;
  constexpr int TM = L::TM;

  const int tile = blockIdx.y;
  const int slot = tiles[tile * 3 + 2];
  if (slot < 0) return;  // a padding row of the tile table
  const int first = tiles[tile * 3], end = tiles[tile * 3 + 1];

  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * ROWS;
  const int stages = K / KS;
  const int s_lo = blockIdx.z * stages_per_split;
  const int s_hi = min(stages, s_lo + stages_per_split);
  uint32_t* place = reinterpret_cast<uint32_t*>(smem + L::P_OFF);
  if (SPARSE && threadIdx.x < 16) place[threadIdx.x] = placement(threadIdx.x);

  // The slot's blocks; row strides in elements.
  const int64_t qv_row = K / (SPARSE ? 2 : 1) * BITS / 32, qi_row = SPARSE ? K / 32 : 0, g_row = K / G;
  const uint32_t* qv = qvalues + qv_offsets[slot];
  const uint32_t* qi = SPARSE ? qindices + qi_offsets[slot] : qvalues;
  const __half* sc = scales + group_offsets[slot];
  const __half* zr = zeros + group_offsets[slot];
  const int gb = KS / G * 2;  // scale bytes per row and stage (16, 8 or 4: G = 32, 64, 128)

  // Stage s's packed words, scales and x columns -> buffer s % STAGES (one commit group per call,
  // empty past the split). Consecutive threads copy consecutive 16 bytes of a row: coalesced.
  auto issue = [&](int s) {
    if (s < s_hi) {
      unsigned char* buf = smem + (s % STAGES) * L::STAGE;
      constexpr int QP = L::QB / 16;  // 16-byte pieces per row
      for (int p = threadIdx.x; p < ROWS * QP; p += ROWS) {
        const int r = p / QP, c = p % QP;
        const bool ok = row0 + r < N;
        cp_async<16>(buf + L::Q_OFF + r * L::QS + c * 16, ok ? qv + (row0 + r) * qv_row + s * (L::QB / 4) + c * 4 : qv, ok);
      }
      if constexpr (SPARSE) {
        constexpr int IP = L::IB / 16;
        for (int p = threadIdx.x; p < ROWS * IP; p += ROWS) {
          const int r = p / IP, c = p % IP;
          const bool ok = row0 + r < N;
          cp_async<16>(buf + L::I_OFF + r * L::IS + c * 16, ok ? qi + (row0 + r) * qi_row + s * (L::IB / 4) + c * 4 : qi, ok);
        }
      }
      const int gp = gb / 4;  // 4-byte pieces of scales (and of zeros) per row
      for (int p = threadIdx.x; p < ROWS * gp; p += ROWS) {
        const int r = p / gp, c = p % gp;
        const bool ok = row0 + r < N;
        const int64_t at = (row0 + r) * g_row + s * (KS / G) + c * 2;
        cp_async<4>(buf + L::S_OFF + r * L::GS + c * 4, ok ? sc + at : sc, ok);
        cp_async<4>(buf + L::Z_OFF + r * L::GS + c * 4, ok ? zr + at : zr, ok);
      }
      constexpr int XP = KS / 8;  // 16-byte pieces per token
      for (int p = threadIdx.x; p < TM * XP; p += ROWS) {
        const int m = p / XP, c = p % XP;
        const bool ok = first + m < end;
        const T* src = ok ? x + static_cast<int64_t>(order[first + m]) * x_stride + s * KS + c * 8 : x;
        cp_async<16>(buf + L::X_OFF + (m * LDX + c * 8) * 2, src, ok);
      }
    }
    cp_async_commit();
  };

  wmma::fragment<wmma::accumulator, 32, 8, 16, float> acc[NT];
#pragma unroll
  for (int f = 0; f < NT; ++f) wmma::fill_fragment(acc[f], 0.f);

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(s_lo + i);

  T* w_mine = reinterpret_cast<T*>(smem + L::W_OFF) + warp * 32 * LDW;
  const int r = warp * 32 + lane;  // this lane's row in the block
  for (int s = s_lo; s < s_hi; ++s) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of stage s have landed
    __syncthreads();              // everyone's have; everyone is done with stage s - 1's buffer
    issue(s + STAGES - 1);
    const unsigned char* buf = smem + (s % STAGES) * L::STAGE;
    const uint32_t* q_row = reinterpret_cast<const uint32_t*>(buf + L::Q_OFF + r * L::QS);
    const uint32_t* i_row = reinterpret_cast<const uint32_t*>(buf + L::I_OFF + r * L::IS);
    const __half* s_row = reinterpret_cast<const __half*>(buf + L::S_OFF + r * L::GS);
    const __half* z_row = reinterpret_cast<const __half*>(buf + L::Z_OFF + r * L::GS);
    const T* x_s = reinterpret_cast<const T*>(buf + L::X_OFF);
#pragma unroll
    for (int sub = 0; sub < KS / SUB; ++sub) {
      const int g0 = (sub * SUB) / G, g1 = (sub * SUB + 32) / G;
      expand<T, BITS, SPARSE>(q_row + sub * L::SUB_QW, i_row + sub * 2, __half2float(s_row[g0]),
                              __half2float(z_row[g0]), __half2float(s_row[g1]), __half2float(z_row[g1]), place,
                              w_mine + lane * LDW);
      __syncwarp();
#pragma unroll
      for (int kk = 0; kk < SUB; kk += 16) {
        wmma::fragment<wmma::matrix_a, 32, 8, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, w_mine + kk, LDW);
#pragma unroll
        for (int f = 0; f < NT; ++f) {
          wmma::fragment<wmma::matrix_b, 32, 8, 16, T, wmma::col_major> b;
          wmma::load_matrix_sync(b, x_s + f * 8 * LDX + sub * SUB + kk, LDX);
          wmma::mma_sync(acc[f], a, b, acc[f]);
        }
      }
      __syncwarp();  // the next sub-step's expand overwrites w_mine
    }
  }
  cp_async_wait<0>();

  // Accumulators -> this warp's weight buffer as [32 rows][8 tokens] floats -> lane = row.
  const int row = row0 + r;
  float* acc_s = reinterpret_cast<float*>(w_mine);
#pragma unroll
  for (int f = 0; f < NT; ++f) {
    wmma::store_matrix_sync(acc_s, acc[f], 8, wmma::mem_row_major);
    __syncwarp();
    if (row < N) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int p = first + f * 8 + n;
        if (p < end) {
          const float v = acc_s[lane * 8 + n];
          if (ws == nullptr) {
            T* o = out + static_cast<int64_t>(order[p]) * out_stride + row;
            *o = from_float<T>(to_float(*o) + v);
          } else {
            ws[(static_cast<int64_t>(blockIdx.z) * ws_rows + p) * N + row] = v;
          }
        }
      }
    }
    __syncwarp();
  }
}

// For every token of every real tile: out[order[p], n] = dtype(out + sum over splits of ws[split, p, n]),
// the splits summed in order. Walks the tile table, so the grid depends on its rows only.
template <typename T>
__global__ void sbmm_splitk_reduce(T* __restrict__ out, const float* __restrict__ ws, const int32_t* __restrict__ order,
                                   const int32_t* __restrict__ tiles, int N, int ws_rows, int splits,
                                   int64_t out_stride) {
  const int tile = blockIdx.x, n = blockIdx.y * blockDim.x + threadIdx.x;
  if (tiles[tile * 3 + 2] < 0 || n >= N) return;
  for (int p = tiles[tile * 3]; p < tiles[tile * 3 + 1]; ++p) {
    float total = 0.f;
    for (int s = 0; s < splits; ++s) total += ws[(static_cast<int64_t>(s) * ws_rows + p) * N + n];
    T* o = out + static_cast<int64_t>(order[p]) * out_stride + n;
    *o = from_float<T>(to_float(*o) + total);
  }
}

template <typename T, int BITS, bool SPARSE, int NT>
cudaError_t launch(const void* x, void* out, float* ws, const int32_t* order, const int32_t* tiles, const void* qv,
                   const void* qi, const void* sc, const void* zr, const int64_t* qv_off, const int64_t* qi_off,
                   const int64_t* g_off, int N, int K, int G, int64_t x_stride, int64_t out_stride, int grid_tiles,
                   int splits, int ws_rows, cudaStream_t stream) {
  constexpr int bytes = Layout<BITS, SPARSE, NT>::BYTES;
  static bool configured = false;  // once per instantiation: shared memory above the 48 KB default
  if (!configured) {
    const cudaError_t e =
        cudaFuncSetAttribute(sbmm_kernel<T, BITS, SPARSE, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  const int stages = K / KS, per = (stages + splits - 1) / splits;
  const dim3 grid((N + ROWS - 1) / ROWS, grid_tiles, splits);
  sbmm_kernel<T, BITS, SPARSE, NT><<<grid, ROWS, bytes, stream>>>(
      static_cast<const T*>(x), static_cast<T*>(out), splits > 1 ? ws : nullptr, order, tiles,
      static_cast<const uint32_t*>(qv), static_cast<const uint32_t*>(qi), static_cast<const __half*>(sc),
      static_cast<const __half*>(zr), qv_off, qi_off, g_off, N, K, G, x_stride, out_stride, per, ws_rows);
  if (splits > 1) {
    const dim3 rgrid(grid_tiles, (N + 255) / 256);
    sbmm_splitk_reduce<T><<<rgrid, 256, 0, stream>>>(static_cast<T*>(out), ws, order, tiles, N, ws_rows, splits,
                                                     out_stride);
  }
  return cudaGetLastError();
}

template <typename T, int BITS, bool SPARSE>
cudaError_t by_tile(int nt, const void* x, void* out, float* ws, const int32_t* order, const int32_t* tiles,
                    const void* qv, const void* qi, const void* sc, const void* zr, const int64_t* qv_off,
                    const int64_t* qi_off, const int64_t* g_off, int N, int K, int G, int64_t xs, int64_t os,
                    int grid_tiles, int splits, int ws_rows, cudaStream_t st) {
#define DS_SBMM_NT(V)                                                                                              \
  if (nt == V)                                                                                                     \
    return launch<T, BITS, SPARSE, V>(x, out, ws, order, tiles, qv, qi, sc, zr, qv_off, qi_off, g_off, N, K, G, xs, \
                                      os, grid_tiles, splits, ws_rows, st);
  DS_SBMM_NT(1) DS_SBMM_NT(2)
#undef DS_SBMM_NT
  return cudaErrorInvalidValue;
}

// dst[n, k] = delta[n, k] of one slot, dense (module header). Thread = one qvalues word of one row.
template <typename T, int BITS, bool SPARSE>
__global__ void dequant_kernel(T* __restrict__ dst, const uint32_t* __restrict__ qvalues,
                               const uint32_t* __restrict__ qindices, const __half* __restrict__ scales,
                               const __half* __restrict__ zeros, const int64_t* __restrict__ qv_offsets,
                               const int64_t* __restrict__ qi_offsets, const int64_t* __restrict__ group_offsets,
                               int slot, int N, int K, int G) {
  constexpr int PER = 32 / BITS;                 // codes per word
  constexpr int SPAN = SPARSE ? 2 * PER : PER;   // dense columns per word
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int words_per_row = K / SPAN;
  const int64_t total = static_cast<int64_t>(N) * words_per_row;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int n = static_cast<int>(i / words_per_row), w = static_cast<int>(i % words_per_row);
  const uint32_t word = qvalues[qv_offsets[slot] + i];
  uint32_t pos = 0;  // 2 bits per kept value, first value lowest
  if constexpr (SPARSE) {
    // Kept value w * PER of the row starts at bit (w * PER % 16) * 2 of qindices word w * PER / 16.
    const uint32_t iw = qindices[qi_offsets[slot] + static_cast<int64_t>(n) * (K / 32) + (w * PER) / 16];
    pos = iw >> (((w * PER) % 16) * 2);
  }
  const __half* sc = scales + group_offsets[slot] + static_cast<int64_t>(n) * (K / G);
  const __half* zr = zeros + group_offsets[slot] + static_cast<int64_t>(n) * (K / G);
  const int col0 = w * SPAN;
  uint32_t packed[SPAN / 2];
#pragma unroll
  for (int j = 0; j < SPAN / 4; ++j) {  // 4 dense columns each
    const int g = (col0 + 4 * j) / G;   // G % 4 == 0: one group for the 4 columns
    const float s = __half2float(sc[g]), z = __half2float(zr[g]);
    float v[4];
    if constexpr (SPARSE) {
      const float v0 = (static_cast<float>((word >> (2 * j * BITS)) & MASK) - z) * s;
      const float v1 = (static_cast<float>((word >> ((2 * j + 1) * BITS)) & MASK) - z) * s;
      const uint32_t p0 = (pos >> (4 * j)) & 3, p1 = (pos >> (4 * j + 2)) & 3;
#pragma unroll
      for (int q = 0; q < 4; ++q) v[q] = q == p0 ? v0 : q == p1 ? v1 : 0.f;
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) v[q] = (static_cast<float>((word >> ((4 * j + q) * BITS)) & MASK) - z) * s;
    }
    packed[2 * j] = pack2<T>(v[0], v[1]);
    packed[2 * j + 1] = pack2<T>(v[2], v[3]);
  }
  uint4* out = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(n) * K + col0);
#pragma unroll
  for (int c = 0; c < SPAN / 8; ++c) out[c] = make_uint4(packed[4 * c], packed[4 * c + 1], packed[4 * c + 2], packed[4 * c + 3]);
}

template <typename T, int BITS, bool SPARSE>
cudaError_t launch_dequant(void* dst, const void* qv, const void* qi, const void* sc, const void* zr,
                           const int64_t* qv_off, const int64_t* qi_off, const int64_t* g_off, int slot, int N,
                           int K, int G, cudaStream_t stream) {
  constexpr int SPAN = SPARSE ? 2 * 32 / BITS : 32 / BITS;
  const int64_t threads = static_cast<int64_t>(N) * (K / SPAN);
  const int block = 256;
  dequant_kernel<T, BITS, SPARSE><<<static_cast<unsigned>((threads + block - 1) / block), block, 0, stream>>>(
      static_cast<T*>(dst), static_cast<const uint32_t*>(qv), static_cast<const uint32_t*>(qi),
      static_cast<const __half*>(sc), static_cast<const __half*>(zr), qv_off, qi_off, g_off, slot, N, K, G);
  return cudaGetLastError();
}

}  // namespace

// The entries' dispatch: CALL(T, BITS, SPARSE) (a statement that returns) for the call's dtype (0 float16,
// 1 bfloat16), bits (2, 4) and sparse; falls through for any other combination.
#define DS_BY_CONFIG(CALL)                                        \
  if (dtype == 0) {                                               \
    if (bits == 4 && sparse) CALL(__half, 4, true)                \
    if (bits == 2 && sparse) CALL(__half, 2, true)                \
    if (bits == 4 && !sparse) CALL(__half, 4, false)              \
    if (bits == 2 && !sparse) CALL(__half, 2, false)              \
  } else if (dtype == 1) {                                        \
    if (bits == 4 && sparse) CALL(__nv_bfloat16, 4, true)         \
    if (bits == 2 && sparse) CALL(__nv_bfloat16, 2, true)         \
    if (bits == 4 && !sparse) CALL(__nv_bfloat16, 4, false)       \
    if (bits == 2 && !sparse) CALL(__nv_bfloat16, 2, false)       \
  }

extern "C" {

// One SBMM call (kernels/sbmm.py ``sbmm_cuda`` passes the arguments). dtype: 0 float16, 1 bfloat16;
// block_m: the metadata's tokens per work tile (<= 16); splits: K splits (> 1 needs ws of
// [splits, ws_rows, N] float32, ws_rows = the length of ``order``). Returns a cudaError_t.
int deltaserve_sbmm(const void* x, void* out, float* ws, const int32_t* order, const int32_t* tiles, const void* qv,
                    const void* qi, const void* sc, const void* zr, const int64_t* qv_off, const int64_t* qi_off,
                    const int64_t* g_off, int N, int K, int G, int64_t x_stride, int64_t out_stride, int bits,
                    int sparse, int dtype, int block_m, int grid_tiles, int splits, int ws_rows, void* stream) {
  if (K % KS != 0 || (G != 32 && G != 64 && G != 128) || block_m < 1 || block_m > 16 || splits < 1 ||
      grid_tiles < 0) {
    return cudaErrorInvalidValue;
  }
  if (grid_tiles == 0) return cudaSuccess;
  const int nt = block_m <= 8 ? 1 : 2;
  auto st = static_cast<cudaStream_t>(stream);
#define DS_SBMM_CFG(TY, B, SP)                                                                                        \
  return static_cast<int>(by_tile<TY, B, SP>(nt, x, out, ws, order, tiles, qv, qi, sc, zr, qv_off, qi_off, g_off, N, \
                                             K, G, x_stride, out_stride, grid_tiles, splits, ws_rows, st));
  DS_BY_CONFIG(DS_SBMM_CFG)
#undef DS_SBMM_CFG
  return static_cast<int>(cudaErrorInvalidValue);
}

// One slot's delta, dense, into dst [N, K] (contiguous, 16-byte aligned) of dtype 0 float16 / 1 bfloat16
// (kernels/sbmm.py ``dequantize_slot``). K % 8 (dense 4-bit), % 16 (dense 2-bit) or % 32 (2:4) must be 0,
// as the packed format requires, and G % 4 == 0. Returns a cudaError_t.
int deltaserve_dequant(void* dst, const void* qv, const void* qi, const void* sc, const void* zr, const int64_t* qv_off,
                       const int64_t* qi_off, const int64_t* g_off, int slot, int N, int K, int G, int bits,
                       int sparse, int dtype, void* stream) {
  const int span = (sparse ? 2 : 1) * 32 / (bits > 0 ? bits : 1);
  if ((bits != 2 && bits != 4) || N < 0 || K <= 0 || K % span != 0 || G <= 0 || G % 4 != 0 || K % G != 0) {
    return cudaErrorInvalidValue;
  }
  if (N == 0) return cudaSuccess;
  auto st = static_cast<cudaStream_t>(stream);
#define DS_DEQ(TY, B, SP) \
  return static_cast<int>(launch_dequant<TY, B, SP>(dst, qv, qi, sc, zr, qv_off, qi_off, g_off, slot, N, K, G, st));
  DS_BY_CONFIG(DS_DEQ)
#undef DS_DEQ
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* deltaserve_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"

#undef DS_BY_CONFIG

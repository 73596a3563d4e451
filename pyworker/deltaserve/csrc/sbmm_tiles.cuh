// The tiles and register-level primitives of csrc/sbmm.cu (included by it, inside its anonymous namespace):
// the block's shape (ROWS rows, KS-column stages), its shared-memory layouts over the plain and the
// repacked pool, cp.async, a lane's codes and their dequantisation (RowScale), and the MMA instructions.
// Not a standalone header: sbmm.cu's comment says what each piece serves; cuda_ext hashes this file
// with it, so a change here rebuilds the op.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace {

constexpr int WARPS = 4;
constexpr int ROWS = 32 * WARPS;  // output rows per block
constexpr int KS = 256;           // input columns per stage (one pipelined copy)
constexpr int LDX = KS + 8;       // x_s row stride in elements (16 bytes of padding: no bank conflicts)
#ifndef SBMM_STAGES
#define SBMM_STAGES 2
#endif
constexpr int STAGES = SBMM_STAGES;  // stages in flight (cp.async)
#ifndef SBMM_MIN_BLOCKS
#define SBMM_MIN_BLOCKS 4
#endif
constexpr int MAX_NT = 2;  // most 8-token fragments of one work tile (16 tokens)
constexpr int SMEM_PER_SM = 228 * 1024;  // sm_90's shared memory per SM (sm_80 holds fewer blocks: 164 KB)
// Blocks per SM a kernel's launch bounds ask registers for: as many as its ``smem`` bytes of shared memory per
// block (+ 1 KB the runtime reserves) let an SM hold, at most SBMM_MIN_BLOCKS (a plain-layout 16-token tile
// fits 3, and gets the registers of 3).
__host__ __device__ constexpr int min_blocks(int smem) {
  return SMEM_PER_SM / (smem + 1024) < 1 ? 1
         : SMEM_PER_SM / (smem + 1024) < SBMM_MIN_BLOCKS ? SMEM_PER_SM / (smem + 1024)
                                                          : SBMM_MIN_BLOCKS;
}

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
  static constexpr int BYTES = STAGES * STAGE;
  static constexpr int KSTEP = SPARSE ? 32 : 16;                    // input columns per MMA
  static constexpr int WK = KSTEP / (SPARSE ? 2 : 1) * BITS / 32;   // qvalues words per row and k-step (2 or 1)
};

// Shared-memory layout of one block over a repacked pool (kernels/sbmm/repack.py), per stage: the block's
// words exactly as global memory holds them (one contiguous run per kind, lanes read consecutive words:
// no padding, no bank conflicts), then the tile's x columns as above.
template <int BITS, bool SPARSE, int NT, int G> struct FragLayout {
  static constexpr int TM = 8 * NT;
  static constexpr int QB = (SPARSE ? KS / 2 : KS) * BITS / 8;      // qvalues bytes per row and stage
  static constexpr int IB = SPARSE ? KS / 2 * 2 / 8 : 0;            // qindices bytes per row and stage
  static constexpr int GB = KS / G * 2;                             // scale bytes per row and stage
  static constexpr int Q_OFF = 0, I_OFF = ROWS * QB, S_OFF = I_OFF + ROWS * IB, Z_OFF = S_OFF + ROWS * GB;
  static constexpr int X_OFF = Z_OFF + ROWS * GB;
  static constexpr int STAGE = X_OFF + TM * LDX * 2;
  static constexpr int BYTES = STAGES * STAGE;
  static constexpr int KSTEP = SPARSE ? 32 : 16;
  static constexpr int WPW = 32 * QB / 4;                           // qvalues words per warp and stage
};

// The x rows of one work tile that a block copies each stage (both mainloops' share of a stage): thread tid
// copies 16-byte pieces i of rows tid / XP + i * (ROWS / XP), XP pieces a row. The tile's nf fragments (its
// tokens rounded up to 8) are copied, rows past the tile's end zero-filled; rows past the last fragment are
// never copied (nor read: the MMAs take only nf fragments).
// The 8-token fragments a work tile of ``tokens`` tokens fills, at most NT (the kernel's instantiation): the
// MMAs, the x copies and the epilogue all stop there.
template <int NT> __device__ __forceinline__ int filled_fragments(int tokens) { return min(NT, (tokens + 7) / 8); }

template <typename T, int NT> struct XTile {
  static constexpr int XP = KS / 8, XN = 8 * NT * XP / ROWS;
  static_assert(ROWS % XP == 0 && XN >= 1, "x piece split");
  int row[XN];  // token of each piece's row (-1: zero-filled)
  int nf;
  __device__ __forceinline__ XTile(const int32_t* order, int first, int end) : nf(filled_fragments<NT>(end - first)) {
#pragma unroll
    for (int i = 0; i < XN; ++i) {
      const int m = threadIdx.x / XP + i * (ROWS / XP);
      row[i] = first + m < end ? order[first + m] : -1;
    }
  }
  // Stage s (columns s * KS ..) of x (x_stride elements a token) into x_s (LDX elements a row).
  __device__ __forceinline__ void issue(unsigned char* x_s, const T* x, int64_t x_stride, int s) const {
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < XN; ++i) {
      const int m = tid / XP + i * (ROWS / XP);
      if (m < nf * 8) {
        const bool ok = row[i] >= 0;
        const T* src = ok ? x + static_cast<int64_t>(row[i]) * x_stride + (tid % XP) * 8 + s * KS : x;
        cp_async<16>(x_s + (m * LDX + (tid % XP) * 8) * 2, src, ok);
      }
    }
  }
};

// The codes of one row in lane t's A registers for one k-step (``w``: the row's k-step words), each
// pair spread to bits 0 and 16: ``lo`` the pair of its first register (2:4 chunk t / dense columns
// 2t, 2t + 1), ``hi`` of its second (chunk t + 4 / columns 2t + 8, 2t + 9).
template <int BITS> __device__ __forceinline__ void lane_codes(const uint32_t* w, int t, uint32_t& lo, uint32_t& hi) {
  if constexpr (BITS == 4) {  // byte t of each word: its low nibble to bit 0, its high nibble to bit 16
    const uint2 v = *reinterpret_cast<const uint2*>(w);
    const uint32_t sel = 0x4440u | static_cast<uint32_t>(t);
    lo = (__byte_perm(v.x, 0, sel) * 0x1001u) & 0x000F000Fu;
    hi = (__byte_perm(v.y, 0, sel) * 0x1001u) & 0x000F000Fu;
  } else {  // nibbles t and t + 4 of the word: its low 2 bits to bit 0, its high 2 bits to bit 16
    const uint32_t v = *w;
    lo = (((v >> (4 * t)) & 0xFu) * 0x4001u) & 0x00030003u;
    hi = (((v >> (4 * t + 16)) & 0xFu) * 0x4001u) & 0x00030003u;
  }
}

// One row's (scale, zero) of the current group, and the dequantisation of a spread code pair with it:
// pack.dequantize's value. zero * scale is exact in fp32 (11 x 11 significant bits), so
// fma(code, scale, -zero * scale) is (code - zero) * scale rounded once to fp32, as pack.dequantize
// computes it wherever code - zero is exact in fp32 (any zero the compressor writes); then once to T.
template <typename T, bool HALF2> struct RowScale {
  float s, nzs;  // scale, -zero * scale
  __device__ __forceinline__ void set(__half sc, __half zr) {
    s = __half2float(sc);
    nzs = -(__half2float(zr) * s);
  }
  __device__ __forceinline__ uint32_t operator()(uint32_t codes) const {
    // Each code under the exponent of 2^23 (a byte permute puts 0x4B above it), minus 2^23: exact.
    const float c0 = __uint_as_float(__byte_perm(codes, 0x4B000000u, 0x7410u)) - 8388608.0f;
    const float c1 = __uint_as_float(__byte_perm(codes, 0x4B000000u, 0x7432u)) - 8388608.0f;
    return pack2<T>(__fmaf_rn(c0, s, nzs), __fmaf_rn(c1, s, nzs));
  }
};
// float16 with integral zeros in (-1024, 1024) (a block whose slot's ``Slice::half2`` flag says so, set
// when the slot is stored): 0x6400 | code is 1024 + code, 1024 + zero is exact too, so their half2 difference is
// code - zero exactly and one half2 multiply rounds (code - zero) * scale once: the same value in
// half the instructions.
template <> struct RowScale<__half, true> {
  __half2 s, z;  // scale, 1024 + zero
  __device__ __forceinline__ void set(__half sc, __half zr) {
    s = __half2half2(sc);
    z = __half2half2(__hadd(zr, __ushort_as_half(0x6400)));
  }
  __device__ __forceinline__ uint32_t operator()(uint32_t codes) const {
    const uint32_t q = codes | 0x64006400u;
    const __half2 v = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&q), z), s);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// B fragment of one k-step (KSTEP = 8 BREGS columns from ``x``, the fragment's 8 token rows in shared memory,
// LDX apart): lane (g, t) gets token g's columns 2t + 8r, 2t + 8r + 1 in register r (the MMA's B layout),
// one ldmatrix for all of them: lane i names row i % 8 of matrix i / 8 (columns 8 (i / 8) ..).
template <int BREGS, typename T>
__device__ __forceinline__ void load_b(uint32_t (&b)[BREGS], const T* x, int lane) {
  const unsigned a =
      static_cast<unsigned>(__cvta_generic_to_shared(x + (lane & 7) * LDX + 8 * ((lane >> 3) % BREGS)));
  if constexpr (BREGS == 4) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(a));
  } else {
    static_assert(BREGS == 2, "k-steps of 16 or 32 columns");
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(b[0]), "=r"(b[1]) : "r"(a));
  }
}

// d += A (16 x KSTEP) B (KSTEP x 8): 2:4 ``mma.sp`` with metadata ``e`` (b: 4 registers), dense ``mma`` (b: 2).
// TY: the PTX type of A and B ("f16" / "bf16"); one instruction text for both dtypes.
#define DS_MMA_SP(TY)                                                                                            \
  asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32." TY "." TY                         \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;\n"                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e))
#define DS_MMA_DENSE(TY)                                                                                         \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY                                                \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
template <typename T, bool SPARSE> __device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b,
                                                                       uint32_t e) {
  constexpr bool f16 = std::is_same<T, __half>::value;
  if constexpr (SPARSE && f16) {
    DS_MMA_SP("f16");
  } else if constexpr (SPARSE) {
    DS_MMA_SP("bf16");
  } else if constexpr (f16) {
    DS_MMA_DENSE("f16");
  } else {
    DS_MMA_DENSE("bf16");
  }
}
#undef DS_MMA_SP
#undef DS_MMA_DENSE

// One k-step of a block's warp over the tile's nf real fragments (of NT): acc[mt][f] += A[mt] B[f], B[f] loaded
// from ``x`` (the k-step's first column of fragment 0's rows) as it is used, so one fragment's B is live at a time.
template <typename T, bool SPARSE, int NT, int BREGS>
__device__ __forceinline__ void mma_fragments(float (&acc)[2][NT][4], const uint32_t (&a)[2][4], const uint32_t (&e)[2],
                                              const T* x, int nf, int lane) {
#pragma unroll
  for (int f = 0; f < NT; ++f) {
    if (f < nf) {
      uint32_t b[BREGS];  // k = 2t + 8r (+1), token g of fragment f
      load_b(b, x + f * 8 * LDX, lane);
      mma<T, SPARSE>(acc[0][f], a[0], b, e[0]);
      mma<T, SPARSE>(acc[1][f], a[1], b, e[1]);
    }
  }
}


}  // namespace

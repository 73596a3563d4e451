// The dense dequantisers of csrc/sbmm.cu (``deltaserve_dequant``; included by it after sbmm_tiles.cuh):
// one slot's delta as a dense [N, K] tensor of the activation dtype, from the plain pool
// (``dequant_kernel``) or the repacked one (``dequant_frag_kernel``), pack.dequantize's values bit for bit.
#pragma once

#include "sbmm_tiles.cuh"

namespace {

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

// dst[n, k] = delta[n, k] of one slot over a repacked pool (kernels/sbmm/repack.py; N % 128 == 0, K % 256
// == 0, G in 32 / 64 / 128). Block = (stage, row block), 4 warps of 32 rows, as sbmm_mainloop_frag's: lane
// (g, t) reads, per k-step and row tile mt, the one word whose fields are its four A registers' code pairs
// (consecutive lanes, consecutive words), its rows' scales / zeros as one 8-byte word per group and, 2:4,
// the metadata words of its rows (half jhi of the plain qindices word: chunks 4 jhi .. 4 jhi + 3, row g in
// the low 16 bits, row g + 8 in the high). Register j holds row 16 mt + g + 8 (j & 1) and 2:4 chunk
// t + 4 (j >> 1) (its two kept values, written with the chunk's pruned columns as zeros: one 8-byte store)
// or dense columns 2t + 8 (j >> 1), + 1 (one 4-byte store); every element of dst is written once. The
// arithmetic is dequant_kernel's: fp32 (code - zero) * scale, rounded once to T.
template <typename T, int BITS, bool SPARSE, int G>
__global__ void __launch_bounds__(ROWS) dequant_frag_kernel(T* __restrict__ dst, const uint32_t* __restrict__ qvalues,
                                                            const uint32_t* __restrict__ qindices,
                                                            const __half* __restrict__ scales,
                                                            const __half* __restrict__ zeros,
                                                            const int64_t* __restrict__ qv_offsets,
                                                            const int64_t* __restrict__ qi_offsets,
                                                            const int64_t* __restrict__ group_offsets, int slot,
                                                            int K) {
  using L = FragLayout<BITS, SPARSE, 1, G>;
  constexpr int KSTEP = L::KSTEP, GS = KS / G, STEPS = KS / KSTEP;
  constexpr int QW = ROWS * L::QB / 4, IW = ROWS * L::IB / 4, GH = ROWS * GS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t chunk = static_cast<int64_t>(blockIdx.y) * (K / KS) + blockIdx.x;  // (row block, stage)
  const uint32_t* q = qvalues + qv_offsets[slot] + chunk * QW + warp * L::WPW + lane;
  const uint32_t* qi = SPARSE ? qindices + qi_offsets[slot] + chunk * IW + warp * (STEPS * 32) + g * 2 : nullptr;
  const uint2* sc = reinterpret_cast<const uint2*>(scales + group_offsets[slot] + chunk * GH) + warp * GS * 8 + g;
  const uint2* zr = reinterpret_cast<const uint2*>(zeros + group_offsets[slot] + chunk * GH) + warp * GS * 8 + g;
  T* rows = dst + (static_cast<int64_t>(blockIdx.y) * ROWS + warp * 32 + g) * K + blockIdx.x * KS;
#pragma unroll 2
  for (int ks = 0; ks < STEPS; ++ks) {
    const int kk = ks * KSTEP;
    const uint2 sv = sc[kk / G * 8], zv = zr[kk / G * 8];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint32_t sp = mt ? sv.y : sv.x, zp = mt ? zv.y : zv.x;  // rows g (low half), g + 8 (high)
      const float s[2] = {__half2float(__ushort_as_half(static_cast<unsigned short>(sp & 0xFFFFu))),
                          __half2float(__ushort_as_half(static_cast<unsigned short>(sp >> 16)))};
      const float z[2] = {__half2float(__ushort_as_half(static_cast<unsigned short>(zp & 0xFFFFu))),
                          __half2float(__ushort_as_half(static_cast<unsigned short>(zp >> 16)))};
      const uint32_t w = BITS == 4 ? q[(ks * 2 + mt) * 32] : q[((ks / 2) * 2 + mt) * 32];
      const int base = BITS == 4 ? 0 : (ks % 2) * 8;
      uint32_t e[2] = {0, 0};
      if constexpr (SPARSE) {
        e[0] = qi[(ks * 2 + mt) * 16];
        e[1] = qi[(ks * 2 + mt) * 16 + 1];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int jrow = j & 1, jhi = j >> 1;
        const float v0 = (static_cast<float>((w >> (base + j * BITS)) & MASK) - z[jrow]) * s[jrow];
        const float v1 = (static_cast<float>((w >> (base + j * BITS + 16)) & MASK) - z[jrow]) * s[jrow];
        T* row = rows + static_cast<int64_t>(16 * mt + 8 * jrow) * K + kk;
        if constexpr (SPARSE) {
          const uint32_t nib = e[jhi] >> (16 * jrow + 4 * t), p0 = nib & 3, p1 = (nib >> 2) & 3;
          float v[4];
#pragma unroll
          for (int c = 0; c < 4; ++c) v[c] = c == p0 ? v0 : c == p1 ? v1 : 0.f;
          *reinterpret_cast<uint2*>(row + 4 * (t + 4 * jhi)) = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
        } else {
          *reinterpret_cast<uint32_t*>(row + 2 * t + 8 * jhi) = pack2<T>(v0, v1);
        }
      }
    }
  }
}

// One slot's dense delta: the plain pool's dequant_kernel (layout 0) or the repacked pool's
// dequant_frag_kernel (layout 1: N % 128 == 0, K % 256 == 0, G in 32 / 64 / 128, else cudaErrorInvalidValue).
template <typename T, int BITS, bool SPARSE>
cudaError_t launch_dequant(void* dst, const void* qv, const void* qi, const void* sc, const void* zr,
                           const int64_t* qv_off, const int64_t* qi_off, const int64_t* g_off, int slot, int N,
                           int K, int G, int layout, cudaStream_t stream) {
  auto d = static_cast<T*>(dst);
  auto q = static_cast<const uint32_t*>(qv);
  auto i = static_cast<const uint32_t*>(qi);
  auto s = static_cast<const __half*>(sc);
  auto z = static_cast<const __half*>(zr);
  if (layout == 1) {
    if (N % ROWS != 0 || K % KS != 0) return cudaErrorInvalidValue;
    const dim3 grid(K / KS, N / ROWS);
#define DS_DEQ_FRAG(GV) \
  dequant_frag_kernel<T, BITS, SPARSE, GV><<<grid, ROWS, 0, stream>>>(d, q, i, s, z, qv_off, qi_off, g_off, slot, K)
    if (G == 32) {
      DS_DEQ_FRAG(32);
    } else if (G == 64) {
      DS_DEQ_FRAG(64);
    } else if (G == 128) {
      DS_DEQ_FRAG(128);
    } else {
      return cudaErrorInvalidValue;
    }
#undef DS_DEQ_FRAG
    return cudaGetLastError();
  }
  constexpr int SPAN = SPARSE ? 2 * 32 / BITS : 32 / BITS;
  const int64_t threads = static_cast<int64_t>(N) * (K / SPAN);
  const int block = 256;
  dequant_kernel<T, BITS, SPARSE><<<static_cast<unsigned>((threads + block - 1) / block), block, 0, stream>>>(
      d, q, i, s, z, qv_off, qi_off, g_off, slot, N, K, G);
  return cudaGetLastError();
}

}  // namespace

// SBMM on tensor cores: every token's compressed-delta product of one linear, one launch per step.
//
// The op, its format and its semantics are kernels/sbmm/'s (__init__.py and layout.py); the packed
// format is formats/packed_delta.py's. This file is a faster implementation of the same op for work
// tiles of at most 16 tokens (decode, short prefill runs), used on CUDA where it builds
// (kernels/cuda_ext.py) and the call fits it (``sbmm.cuda_supports``); ``sbmm_ref`` is the reference
// it is tested against.
//
// Work split: block (row block, work tile, K split) computes ROWS = 128 output rows of one tile's
// tokens (up to 8 * NT: NT = 1 or MAX_NT = 2 fragments of 8, the instantiation the call's fullest tile needs;
// a block computes only the nf fragments its own tile fills, from one dequantisation of its rows) over its
// share of K, in stages of KS = 256 columns. Wider tiles lose: a 64-token instantiation (8 fragments, tried on
// an H200) holds 8x the x rows per stage, so 2 blocks fit an SM instead of 4, and with 2 warps per scheduler
// its dequantisation's dependent instructions stall it (64 rows of one delta: 243 us per Llama-2-7B layer
// against 162 us as four 16-token tiles). A call
// may hold up to three linears of one fused module (``Slice``: q, k, v or gate, up, each its own pool and
// columns of out): their row blocks follow each other along the grid's x, one launch for the module.
//
//     stage s (cp.async, STAGES in flight; consecutive threads copy consecutive 16 bytes of a row):
//       raw words   [ROWS][qvalues bytes + 16]   (4-bit 2:4: 64 + 16 bytes per row; +16: no bank conflicts)
//                   [ROWS][qindices bytes + 16]  (2:4 only: 32 + 16)
//       scales      [ROWS][16 bytes], zeros [ROWS][16 bytes]   (KS / G per row: G = 32, 64 or 128)
//       x           [8 * NT tokens][KS + 8]      (the tile's rows through ``order``; past its end zeros, past
//                                                  its nf fragments not copied)
//     warp = 32 rows = two MMA row tiles of 16; per k-step (2:4: 32 columns, dense: 16), per row tile:
//       A (the delta, 16 rows) is built in registers, straight in the MMA's fragment layout: lane
//         (g = lane / 4, t = lane % 4) holds rows g and g + 8, 2:4 chunks t and t + 4 (dense: columns
//         2t, 2t + 1 and 2t + 8, 2t + 9). With the packed format that is byte t of the row's two
//         words (4-bit) or nibbles t and t + 4 of its word (2-bit): a byte permute spreads each pair
//         of codes to the two halves of a register, which become (code - zero) * scale there:
//         pack.dequantize's values (RowScale: fp32, or half2 where that is exact too).
//       2:4: the qindices word of the k-step is the MMA's sparsity metadata as it is (2 bits a kept
//         value, chunk c at nibble c): lane t = 0 passes the low halves of rows g and g + 8, lane 1
//         the high halves; ``mma.sp::ordered_metadata.m16n8k32`` then skips the pruned columns in
//         hardware. Dense: ``mma.m16n8k16``. B (x) fragments come from shared memory (one ldmatrix each),
//         one fragment at a time through both row tiles' A; fp32 accumulators.
//     The half2 or the fp32 dequantisation is picked per block from the slot's flag (``Slice::half2``).
//     end: out[order[p], row] = dtype(out + acc)  (one split: the op's one rounding), or
//          ws[split, p, row] = acc; the split of the (tile, row block) that arrives last (an atomic
//          counter, reset by it) adds the splits in a fixed order to out: one rounding, deterministic.
//
// Repacked pools (``layout`` 1; kernels/sbmm/repack.py owns the permutation, done once at upload): a
// block's stage is one contiguous run of each kind, in the order the lanes read it, copied in 16-byte
// pieces with no padding; lane (g, t) reads one word per row tile and k-step (2-bit: per two k-steps)
// whose fields are its four A registers' code pairs at bits s and s + 16, so a register is a shift and a
// LOP3 (| 0x6400: the half2 path) before the same hsub2 / hmul2 (or fp32 fma) as above: the same values,
// bit for bit. Its 2:4 metadata is one word as the MMA takes it, its rows' scales / zeros one 8-byte
// word per group. Every slice of such a call has out % 128 == 0 (no rows past N).
//
// The grid is one dimension over (row block, real tile, split), and the arguments depend on the step's
// metadata tensors only, so the launch can be captured in a graph: a captured grid has the most blocks any
// tile count up to the table's takes, and its blocks recompute the tile count (``tile_count``, on the
// device) and the split from it, exactly as an eager launch of that step splits; the blocks past the step's
// work return at once. (A grid of table rows x the most splits made a block for every padding row and
// unused split: on an H200, 16 decode rows of one delta paid 13 us a layer for them.)
//
// A second entry, ``deltaserve_dequant``, writes one slot's delta as a dense [N, K] tensor of the
// activation dtype (kernels/sbmm/dequant.py ``dequantize_slot``: long prefill segments multiply it with one
// cuBLAS matmul), from either layout: plain, one thread per qvalues word (its 8 / 16 codes, their 2:4
// positions, 16-byte stores); repacked, the lanes of the mainloop above reading their words as it does and
// writing each A register's values where they belong. Both compute fp32 (code - zero) * scale rounded once
// (pack.dequantize's arithmetic, bit for bit).
//
// Files: sbmm_tiles.cuh holds the block's shape, shared-memory layouts and register primitives (lane_codes,
// RowScale, mma); sbmm_dequant.cuh the dequantisers; this file the SBMM kernel and the C entries.
//
// Requirements (checked by the caller, kernels/sbmm/cuda.py ``cuda_supports``): float16 or bfloat16
// activations, K % 256 == 0, G in {32, 64, 128}, x rows 16-byte aligned, slot offsets of qvalues /
// qindices multiples of 4 words and of scales / zeros multiples of 2. sm_80 or newer (``mma.sp``).

#include <algorithm>
#include <climits>

#include "sbmm_tiles.cuh"
#include "sbmm_dequant.cuh"

namespace {

// One linear of a call: a fused module (qkv, gate_up) passes one per HF projection it holds, each with its
// own pool, writing its own columns of out; a plain call passes one at column 0.
struct Slice {
  const uint32_t* qv;
  const uint32_t* qi;       // 2:4 position words (unused when dense)
  const __half* sc;
  const __half* zr;
  const int64_t* qv_off;    // per-slot element offsets into the buffers above
  const int64_t* qi_off;
  const int64_t* g_off;
  const uint8_t* half2;     // per-slot flags: 1 where half2 dequantisation is exact (float16 only; may be null)
  int n;                    // the slice's rows (output features)
  int col;                  // its first column of out (and of the workspace)
  int rb0;                  // its first row block in the grid's x dimension
};
constexpr int MAX_SLICES = 3;

template <typename T> struct Call {
  Slice sl[MAX_SLICES];
  int slices;
  const T* x;
  T* out;
  float* ws;                 // [max splits, ws_rows, ws_cols] float32 partials (null when the grid has one split)
  int* counters;             // [grid tiles, row blocks] arrival counts of the splits, zero between launches
  const int32_t* order;
  const int32_t* tiles;
  const int32_t* tile_count; // [1] real work tiles of the step (device), or null: split = the grid's z
  int K;
  int64_t x_stride, out_stride;
  int ws_rows, ws_cols;
  int slots;                 // blocks the device runs at once (blocks per SM x SMs): the split rule's wave size
  int row_blocks;            // of all slices
  int grid_tiles;            // rows of the tile table the launch covers (eager: the step's real tiles)
  int max_splits;            // the grid's K splits (captured: the most any tile count takes)
};

// K splits of a launch with ``row_blocks`` x ``tiles`` blocks per split, ``stages`` stages of KS columns: the
// most of 1, 2, 4, .. up to ``cap`` whose blocks all fit one wave of ``slots`` (the kernel's blocks per SM x
// SMs, ``deltaserve_sbmm_blocks_per_sm``), each split keeping >= 2 stages. A launch of few tiles is a chain of
// latencies per block (its tile, its stages, the split-K sum), so it wants every block resident at once: the
// rule before (the fewest splits that reach ``slots`` blocks) made 1.45-1.94 waves of one tile's blocks, and
// this one takes 6-14 % off what one to four deltas add to a layer's base matmuls (bench/README.md, H200). The
// host sizes the grid with it (``deltaserve_sbmm_split``); the blocks of a captured launch recompute it from
// the step's real tile count, so a graph replay splits as an eager launch of the same step would.
__host__ __device__ inline int split_for(int row_blocks, int tiles, int stages, int slots, int cap) {
  const long long blocks = static_cast<long long>(row_blocks) * (tiles > 0 ? tiles : 1);
  int split = 1;
  while (split < cap && split < 16 && blocks * split * 2 <= slots && stages >= 4 * split) split *= 2;
  return split;
}

// Blocks of a launch over ``tiles`` work tiles (of a table of ``grid_tiles``): row blocks x tiles x their split.
// A captured launch's grid is the most any tile count up to ``grid_tiles`` takes, so a replay with fewer real
// tiles has no block per padding row (only the blocks past its own count, which exit at once).
__host__ __device__ inline long long launch_blocks(int row_blocks, int tiles, int stages, int slots, int cap) {
  return static_cast<long long>(row_blocks) * tiles * split_for(row_blocks, tiles, stages, slots, cap);
}

// The block's share of one tile x 128 rows of one slice, over stages [s_lo, s_hi): acc += delta x^T.
template <typename T, int BITS, bool SPARSE, int NT, int G, bool HALF2>
__device__ __forceinline__ void sbmm_mainloop(const Call<T>& c, const Slice& sl, int slot, int row0, int first,
                                              int end, int s_lo, int s_hi, float (&acc)[2][NT][4]) {
  using L = Layout<BITS, SPARSE, NT>;
  constexpr int KSTEP = L::KSTEP, BREGS = KSTEP / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int N = sl.n, K = c.K;

  // The slot's blocks; row strides in elements.
  const int64_t qv_row = K / (SPARSE ? 2 : 1) * BITS / 32, qi_row = SPARSE ? K / 32 : 0, g_row = K / G;
  const uint32_t* qv = sl.qv + sl.qv_off[slot];
  const uint32_t* qi = SPARSE ? sl.qi + sl.qi_off[slot] : sl.qv;
  const __half* sc = sl.sc + sl.g_off[slot];
  const __half* zr = sl.zr + sl.g_off[slot];
  constexpr int gb = KS / G * 2;  // scale bytes per row and stage (16, 8 or 4: G = 32, 64, 128)
  // Stage s's packed words, scales and x columns -> buffer s % STAGES (one commit group per call,
  // empty past the split). Consecutive threads copy consecutive 16 bytes of a row: coalesced. A
  // thread copies the same pieces of every stage, so their sources are set up once: piece i of a
  // kind is row (thread / pieces per row) + i * (ROWS / pieces per row), at the thread's column.
  constexpr int QP = L::QB / 16, IP = SPARSE ? L::IB / 16 : 1, GP = gb / 4;  // pieces per row
  static_assert(ROWS % QP == 0 && ROWS % IP == 0 && ROWS % GP == 0, "piece split");
  constexpr int QN = QP, IN = SPARSE ? IP : 0, GN = GP;  // pieces per thread and stage
  const int tid = threadIdx.x;
  const uint32_t* q_src = qv + (row0 + tid / QP) * qv_row + (tid % QP) * 4;
  const uint32_t* i_src = qi + (row0 + tid / IP) * qi_row + (tid % IP) * 4;
  const int64_t g_at = (row0 + tid / GP) * g_row + (tid % GP) * 2;
  const XTile<T, NT> xt(c.order, first, end);  // the tile's x rows, nf fragments of them
  const int nf = xt.nf;
  auto issue = [&](int s) {
    if (s < s_hi) {
      unsigned char* buf = smem + (s % STAGES) * L::STAGE;
#pragma unroll
      for (int i = 0; i < QN; ++i) {
        const int r = tid / QP + i * (ROWS / QP);
        const bool ok = row0 + r < N;
        cp_async<16>(buf + L::Q_OFF + r * L::QS + (tid % QP) * 16,
                     ok ? q_src + i * (ROWS / QP) * qv_row + s * (L::QB / 4) : qv, ok);
      }
      if constexpr (SPARSE) {
#pragma unroll
        for (int i = 0; i < IN; ++i) {
          const int r = tid / IP + i * (ROWS / IP);
          const bool ok = row0 + r < N;
          cp_async<16>(buf + L::I_OFF + r * L::IS + (tid % IP) * 16,
                       ok ? i_src + i * (ROWS / IP) * qi_row + s * (L::IB / 4) : qi, ok);
        }
      }
#pragma unroll
      for (int i = 0; i < GN; ++i) {
        const int r = tid / GP + i * (ROWS / GP);
        const bool ok = row0 + r < N;
        const int64_t at = g_at + i * (ROWS / GP) * g_row + s * (KS / G);
        cp_async<4>(buf + L::S_OFF + r * L::GS + (tid % GP) * 4, ok ? sc + at : sc, ok);
        cp_async<4>(buf + L::Z_OFF + r * L::GS + (tid % GP) * 4, ok ? zr + at : zr, ok);
      }
      xt.issue(buf + L::X_OFF, c.x, c.x_stride, s);
    }
    cp_async_commit();
  };

  // This lane's rows: row tile mt holds block rows warp * 32 + mt * 16 + g (+ 8). Rows past N were
  // zero-filled; their all-zero 2:4 metadata would be invalid for the MMA, so they get positions 0, 1.
  uint32_t meta_fix[2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int ra = row0 + warp * 32 + mt * 16 + g;
    meta_fix[mt] = (ra < N ? 0u : 0x00004444u) | (ra + 8 < N ? 0u : 0x44440000u);
  }
  const uint32_t meta_sel = (t & 1) ? 0x7632u : 0x5410u;  // lane t = 0: low halves of both rows; 1: high

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(s_lo + i);

  for (int s = s_lo; s < s_hi; ++s) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of stage s have landed
    __syncthreads();              // everyone's have; everyone is done with stage s - 1's buffer
    issue(s + STAGES - 1);
    const unsigned char* buf = smem + (s % STAGES) * L::STAGE;
    const T* x_s = reinterpret_cast<const T*>(buf + L::X_OFF);
#ifdef SBMM_NO_COMPUTE  // bench only: the copies without the math (what the memory side alone reaches)
    if (buf[threadIdx.x] == 0xFF && buf[threadIdx.x + 1] == 0xFE) acc[0][0][0] += 1.f;
    continue;
#endif
#pragma unroll
    for (int ks = 0; ks < KS / KSTEP; ++ks) {
      const int kk = ks * KSTEP, gi = kk / G;
      uint32_t a[2][4], e[2] = {0, 0};  // per row tile: A, 2:4 metadata
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int ra = warp * 32 + mt * 16 + g, rb = ra + 8;
        uint32_t lo_a, hi_a, lo_b, hi_b;
        lane_codes<BITS>(reinterpret_cast<const uint32_t*>(buf + L::Q_OFF + ra * L::QS) + ks * L::WK, t, lo_a, hi_a);
        lane_codes<BITS>(reinterpret_cast<const uint32_t*>(buf + L::Q_OFF + rb * L::QS) + ks * L::WK, t, lo_b, hi_b);
        RowScale<T, HALF2> sa, sb;
        sa.set(reinterpret_cast<const __half*>(buf + L::S_OFF + ra * L::GS)[gi],
               reinterpret_cast<const __half*>(buf + L::Z_OFF + ra * L::GS)[gi]);
        sb.set(reinterpret_cast<const __half*>(buf + L::S_OFF + rb * L::GS)[gi],
               reinterpret_cast<const __half*>(buf + L::Z_OFF + rb * L::GS)[gi]);
        a[mt][0] = sa(lo_a), a[mt][1] = sb(lo_b), a[mt][2] = sa(hi_a), a[mt][3] = sb(hi_b);
        if constexpr (SPARSE) {
          const uint32_t ia = reinterpret_cast<const uint32_t*>(buf + L::I_OFF + ra * L::IS)[ks];
          const uint32_t ib = reinterpret_cast<const uint32_t*>(buf + L::I_OFF + rb * L::IS)[ks];
          e[mt] = __byte_perm(ia, ib, meta_sel) | meta_fix[mt];
        }
      }
      mma_fragments<T, SPARSE, NT, BREGS>(acc, a, e, x_s + kk, nf, lane);
    }
  }
  cp_async_wait<0>();
}

// sbmm_mainloop over a repacked pool (kernels/sbmm/repack.py: out % 128 == 0, so no row is past N): a
// stage of the block is one contiguous run of each kind in global memory, copied in 16-byte pieces
// (consecutive threads, consecutive pieces), and lane (g, t)'s A registers of a k-step and row tile are
// the fields of one word: register j = (w >> (s + BITS j)) & mask, field pairs at bits 0 and 16 (4-bit:
// s = 0; 2-bit: two k-steps a word, s = 0 / 8), dequantised as RowScale does (half2: | 0x6400 then one
// hsub2 and one hmul2; fp32 otherwise). The 2:4 metadata of lane t = 0 / 1 is one word as it is; the
// scales / zeros of its four rows for a group are one 8-byte word each.
template <typename T, int BITS, bool SPARSE, int NT, int G, bool HALF2>
__device__ __forceinline__ void sbmm_mainloop_frag(const Call<T>& c, const Slice& sl, int slot, int row0, int first,
                                                   int end, int s_lo, int s_hi, float (&acc)[2][NT][4]) {
  using L = FragLayout<BITS, SPARSE, NT, G>;
  constexpr int KSTEP = L::KSTEP, BREGS = KSTEP / 8, GS = KS / G, STEPS = KS / KSTEP;
  constexpr uint32_t MASK2 = BITS == 4 ? 0x000F000Fu : 0x00030003u;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int stages = c.K / KS, tid = threadIdx.x;
  const int64_t rb = row0 / ROWS;
  // Words (halves) of one (row block, stage) chunk of each kind; the row block's chunks follow each other.
  constexpr int QW = ROWS * L::QB / 4, IW = ROWS * L::IB / 4, GH = ROWS * GS;
  const uint32_t* qv = sl.qv + sl.qv_off[slot] + rb * stages * QW + tid * 4;
  const uint32_t* qi = SPARSE ? sl.qi + sl.qi_off[slot] + rb * stages * IW + tid * 4 : nullptr;
  const __half* sc = sl.sc + sl.g_off[slot] + rb * stages * GH + tid * 8;
  const __half* zr = sl.zr + sl.g_off[slot] + rb * stages * GH + tid * 8;
  constexpr int QN = L::QB / 16, IN = L::IB / 16, GP = GH * 2 / 16;  // pieces per thread (qv, qi); scale pieces
  static_assert(GP <= ROWS, "one scale piece per thread at most");
  const XTile<T, NT> xt(c.order, first, end);  // the tile's x rows, nf fragments of them
  const int nf = xt.nf;
  auto issue = [&](int s) {
    if (s < s_hi) {
      unsigned char* buf = smem + (s % STAGES) * L::STAGE;
#pragma unroll
      for (int i = 0; i < QN; ++i)
        cp_async<16>(buf + L::Q_OFF + (tid + i * ROWS) * 16, qv + s * QW + i * ROWS * 4, true);
      if constexpr (SPARSE) {
#pragma unroll
        for (int i = 0; i < IN; ++i)
          cp_async<16>(buf + L::I_OFF + (tid + i * ROWS) * 16, qi + s * IW + i * ROWS * 4, true);
      }
      if (GP == ROWS || tid < GP) {
        cp_async<16>(buf + L::S_OFF + tid * 16, sc + s * GH, true);
        cp_async<16>(buf + L::Z_OFF + tid * 16, zr + s * GH, true);
      }
      xt.issue(buf + L::X_OFF, c.x, c.x_stride, s);
    }
    cp_async_commit();
  };

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(s_lo + i);

  for (int s = s_lo; s < s_hi; ++s) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue(s + STAGES - 1);
    const unsigned char* buf = smem + (s % STAGES) * L::STAGE;
    const T* x_s = reinterpret_cast<const T*>(buf + L::X_OFF);
    const uint32_t* q_s = reinterpret_cast<const uint32_t*>(buf + L::Q_OFF) + warp * L::WPW + lane;
    const uint32_t* i_s = reinterpret_cast<const uint32_t*>(buf + L::I_OFF) + warp * (STEPS * 32) + g * 2 + (t & 1);
    const uint2* sc_s = reinterpret_cast<const uint2*>(buf + L::S_OFF) + warp * GS * 8 + g;
    const uint2* zr_s = reinterpret_cast<const uint2*>(buf + L::Z_OFF) + warp * GS * 8 + g;
#ifdef SBMM_NO_COMPUTE
    if (buf[threadIdx.x] == 0xFF && buf[threadIdx.x + 1] == 0xFE) acc[0][0][0] += 1.f;
    continue;
#endif
#pragma unroll
    for (int ks = 0; ks < STEPS; ++ks) {
      const int kk = ks * KSTEP, gi = kk / G;
      uint32_t a[2][4], e[2] = {0, 0};
      const uint2 sv = sc_s[gi * 8], zv = zr_s[gi * 8];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t sp = mt ? sv.y : sv.x, zp = mt ? zv.y : zv.x;  // rows g (low half), g + 8 (high)
        RowScale<T, HALF2> rs[2];
        rs[0].set(__ushort_as_half(static_cast<unsigned short>(sp & 0xFFFFu)),
                  __ushort_as_half(static_cast<unsigned short>(zp & 0xFFFFu)));
        rs[1].set(__ushort_as_half(static_cast<unsigned short>(sp >> 16)),
                  __ushort_as_half(static_cast<unsigned short>(zp >> 16)));
        const uint32_t w = BITS == 4 ? q_s[(ks * 2 + mt) * 32] : q_s[((ks / 2) * 2 + mt) * 32];
        const int base = BITS == 4 ? 0 : (ks % 2) * 8;
#pragma unroll
        for (int j = 0; j < 4; ++j) a[mt][j] = rs[j & 1]((w >> (base + j * BITS)) & MASK2);
        if constexpr (SPARSE) e[mt] = i_s[(ks * 2 + mt) * 16];
      }
      mma_fragments<T, SPARSE, NT, BREGS>(acc, a, e, x_s + kk, nf, lane);
    }
  }
  cp_async_wait<0>();
}

// out[order[at + u], col] = T(out + v[u]) for u < min(F, n), the op's one rounding: the F loads are issued
// before any store, so their latencies overlap.
template <typename T, int F>
__device__ __forceinline__ void add_to_out(const Call<T>& c, int64_t col, int at, int n, const float (&v)[F]) {
  T* o[F];
  float old[F];
#pragma unroll
  for (int u = 0; u < F; ++u) {
    if (u >= n) continue;
    o[u] = c.out + static_cast<int64_t>(c.order[at + u]) * c.out_stride + col;
    old[u] = to_float(*o[u]);
  }
#pragma unroll
  for (int u = 0; u < F; ++u)
    if (u < n) *o[u] = from_float<T>(old[u] + v[u]);
}

// Dynamic shared memory of one block of the kernel below: its STAGES stages over the plain or repacked pool.
template <int BITS, bool SPARSE, int NT, int G, bool FRAG>
constexpr int SMEM_BYTES = FRAG ? FragLayout<BITS, SPARSE, NT, G>::BYTES : Layout<BITS, SPARSE, NT>::BYTES;

// Block (row block of some slice, work tile, K split): the grid is one dimension, row blocks fastest, then the
// step's real tiles (the table lists them first), then splits. With one split it adds its products to out (the
// op's one rounding); with several it writes its float32 partials to the workspace, and the split that arrives
// last adds all of them, in split order, to out (deterministic; the counter is zero again after it).
template <typename T, int BITS, bool SPARSE, int NT, int G, bool FRAG>
__global__ void __launch_bounds__(ROWS, min_blocks(SMEM_BYTES<BITS, SPARSE, NT, G, FRAG>))
    sbmm_kernel(const __grid_constant__ Call<T> c) {
  const int stages = c.K / KS;
  const int tiles = c.tile_count == nullptr ? c.grid_tiles : min(*c.tile_count, c.grid_tiles);
  const int splits = c.tile_count == nullptr ? c.max_splits
                                             : split_for(c.row_blocks, tiles, stages, c.slots, c.max_splits);
  const long long id = blockIdx.x;
  if (id >= static_cast<long long>(c.row_blocks) * tiles * splits) return;  // past this step's work
  const int rb = static_cast<int>(id % c.row_blocks), tile = static_cast<int>(id / c.row_blocks % tiles);
  const int split = static_cast<int>(id / (static_cast<long long>(c.row_blocks) * tiles));
  const int slot = c.tiles[tile * 3 + 2];
  if (slot < 0) return;  // a padding row of the tile table
  const int first = c.tiles[tile * 3], end = c.tiles[tile * 3 + 1];

  Slice sl = c.sl[0];  // the slice whose row blocks hold rb (constant indices: no local copy)
#pragma unroll
  for (int i = 1; i < MAX_SLICES; ++i)
    if (i < c.slices && rb >= c.sl[i].rb0) sl = c.sl[i];
  const int row0 = (rb - sl.rb0) * ROWS;

  const int per = (stages + splits - 1) / splits;
  const int s_lo = min(stages, split * per), s_hi = min(stages, s_lo + per);

  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][f][j] = 0.f;
  if constexpr (FRAG) {
    if constexpr (std::is_same<T, __half>::value) {
      if (sl.half2 != nullptr && sl.half2[slot])
        sbmm_mainloop_frag<T, BITS, SPARSE, NT, G, true>(c, sl, slot, row0, first, end, s_lo, s_hi, acc);
      else
        sbmm_mainloop_frag<T, BITS, SPARSE, NT, G, false>(c, sl, slot, row0, first, end, s_lo, s_hi, acc);
    } else {
      sbmm_mainloop_frag<T, BITS, SPARSE, NT, G, false>(c, sl, slot, row0, first, end, s_lo, s_hi, acc);
    }
  } else if constexpr (std::is_same<T, __half>::value) {
    if (sl.half2 != nullptr && sl.half2[slot])
      sbmm_mainloop<T, BITS, SPARSE, NT, G, true>(c, sl, slot, row0, first, end, s_lo, s_hi, acc);
    else
      sbmm_mainloop<T, BITS, SPARSE, NT, G, false>(c, sl, slot, row0, first, end, s_lo, s_hi, acc);
  } else {
    sbmm_mainloop<T, BITS, SPARSE, NT, G, false>(c, sl, slot, row0, first, end, s_lo, s_hi, acc);
  }

  // The accumulators go through shared memory (the stages are done) as a [tokens][ROWS + 4] float tile
  // (+ 4: the lanes' stores hit 32 banks), then thread r writes row row0 + r of every token, FIX tokens at a
  // time: coalesced, and a loop whatever the tile's width. Accumulator j of (mt, f): row g (+ 8 for j >= 2) of
  // row tile mt, token f * 8 + 2t (+ 1 for odd j).
  constexpr int FIX = 8, ACC_LD = ROWS + 4;
  static_assert(8 * NT * ACC_LD * 4 <= SMEM_BYTES<BITS, SPARSE, NT, G, FRAG>, "the accumulator tile fits");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int N = sl.n, nf = filled_fragments<NT>(end - first), r = threadIdx.x, tokens = end - first;
  extern __shared__ __align__(128) unsigned char smem[];
  float* acc_s = reinterpret_cast<float*>(smem);
  __syncthreads();  // every warp is done reading the last stage
#pragma unroll
  for (int f = 0; f < NT; ++f) {
    if (f < nf) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {  // e = (j, mt, h)
        const int j = e >> 2, mt = (e >> 1) & 1, h = e & 1;
        acc_s[(f * 8 + 2 * t + j) * ACC_LD + warp * 32 + mt * 16 + g + 8 * h] = acc[mt][f][2 * h + j];
      }
    }
  }
  __syncthreads();
  if (row0 + r < N) {  // blockDim.x == ROWS: thread r owns row row0 + r
    for (int m0 = 0; m0 < tokens; m0 += FIX) {
      if (splits == 1) {
        float v[FIX];
#pragma unroll
        for (int u = 0; u < FIX; ++u) v[u] = m0 + u < tokens ? acc_s[(m0 + u) * ACC_LD + r] : 0.f;
        add_to_out<T, FIX>(c, sl.col + row0 + r, first + m0, tokens - m0, v);
      } else {
        float* w = c.ws + (static_cast<int64_t>(split) * c.ws_rows + first + m0) * c.ws_cols + sl.col + row0 + r;
#pragma unroll
        for (int u = 0; u < FIX; ++u)
          if (m0 + u < tokens) w[static_cast<int64_t>(u) * c.ws_cols] = acc_s[(m0 + u) * ACC_LD + r];
      }
    }
  }
  if (splits == 1) return;

  // Split-K fixup: the last of the tile's splits of this row block to arrive sums them (threadFenceReduction):
  // thread r adds row row0 + r of the tile's tokens, FIX tokens at a time (their loads in flight together),
  // each token's splits in split order.
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* count = c.counters + static_cast<int64_t>(tile) * c.row_blocks + rb;
    last = atomicAdd(count, 1) == splits - 1;
    if (last) atomicExch(count, 0);  // ready for the next launch (graph replays reuse the buffer)
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (row0 + r >= N) return;
  for (int m0 = 0; m0 < tokens; m0 += FIX) {
    float total[FIX];
#pragma unroll
    for (int u = 0; u < FIX; ++u) total[u] = 0.f;
    for (int z = 0; z < splits; ++z) {
      const float* wz = c.ws + static_cast<int64_t>(z) * c.ws_rows * c.ws_cols + sl.col + row0 + r;
#pragma unroll
      for (int u = 0; u < FIX; ++u)
        if (m0 + u < tokens) total[u] += __ldcg(wz + static_cast<int64_t>(first + m0 + u) * c.ws_cols);
    }
    add_to_out<T, FIX>(c, sl.col + row0 + r, first + m0, tokens - m0, total);
  }
}

// The kernel's shared memory above the 48 KB default, once per instantiation; its bytes per block.
template <typename T, int BITS, bool SPARSE, int NT, int G, bool FRAG> cudaError_t configure(int* bytes) {
  constexpr int need = SMEM_BYTES<BITS, SPARSE, NT, G, FRAG>;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(sbmm_kernel<T, BITS, SPARSE, NT, G, FRAG>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, need);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  *bytes = need;
  return cudaSuccess;
}

struct Launch {
  template <typename T, int BITS, bool SPARSE, int NT, int G, bool FRAG>
  static cudaError_t run(const Call<T>& c, cudaStream_t stream) {
    int bytes = 0;
    const cudaError_t e = configure<T, BITS, SPARSE, NT, G, FRAG>(&bytes);
    if (e != cudaSuccess) return e;
    long long blocks = static_cast<long long>(c.row_blocks) * c.grid_tiles * c.max_splits;  // eager: the step's
    if (c.tile_count != nullptr) {  // captured: the most blocks any real tile count takes
      blocks = 0;
      for (int t = 1; t <= c.grid_tiles; ++t)
        blocks = std::max(blocks, launch_blocks(c.row_blocks, t, c.K / KS, c.slots, c.max_splits));
    }
    if (blocks < 1 || blocks > INT_MAX) return cudaErrorInvalidValue;
    sbmm_kernel<T, BITS, SPARSE, NT, G, FRAG><<<static_cast<unsigned>(blocks), ROWS, bytes, stream>>>(c);
    return cudaGetLastError();
  }
};

// Blocks of the kernel one SM holds at once (its registers and shared memory): the split rule's wave per SM.
struct Occupancy {
  template <typename T, int BITS, bool SPARSE, int NT, int G, bool FRAG> static cudaError_t run(int* blocks) {
    int bytes = 0;
    const cudaError_t e = configure<T, BITS, SPARSE, NT, G, FRAG>(&bytes);
    if (e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, sbmm_kernel<T, BITS, SPARSE, NT, G, FRAG>, ROWS, bytes);
  }
};

// 8-token fragments of the instantiation that takes work tiles of up to ``block_m`` tokens (1 or MAX_NT = 2).
inline int fragments_for(int block_m) { return block_m <= 8 ? 1 : MAX_NT; }

// OP::run<T, BITS, SPARSE, NT, G, FRAG>(args) for the call's token fragments (nt), group size (G) and pool
// layout (frag: repacked).
template <typename OP, typename T, int BITS, bool SPARSE, typename... A>
cudaError_t by_tile(int nt, int G, bool frag, A... args) {
#define DS_SBMM_AT(V, GS)                                                       \
  if (nt == V && G == GS && frag) return OP::template run<T, BITS, SPARSE, V, GS, true>(args...); \
  if (nt == V && G == GS) return OP::template run<T, BITS, SPARSE, V, GS, false>(args...);
  DS_SBMM_AT(1, 32) DS_SBMM_AT(1, 64) DS_SBMM_AT(1, 128)
  DS_SBMM_AT(2, 32) DS_SBMM_AT(2, 64) DS_SBMM_AT(2, 128)
#undef DS_SBMM_AT
  return cudaErrorInvalidValue;
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

// One SBMM call (kernels/sbmm/cuda.py ``launch_cuda`` passes the arguments) over ``slices`` linears (1 to 3: a
// fused module's projections, each its own pool, writing columns col[i] .. + n[i] of out). Per slice i:
// qv[i] .. g_off[i] its pool's buffers and offset tables, half2[i] its per-slot half2 flags (null: fp32
// dequantisation). dtype: 0 float16, 1 bfloat16; block_m: the most tokens of any work tile (<= 16);
// max_splits: the grid's K splits (``deltaserve_sbmm_split``); > 1 needs ws of [max_splits, ws_rows, ws_cols]
// float32 (ws_rows = the length of ``order``, ws_cols >= every col + n) and counters of [grid_tiles, row
// blocks] int32, zero. tile_count: the step's real tiles on the device (the blocks recompute the split from it;
// null: max_splits is the split). slots: blocks the device runs at once. layout: 0 the format's (plain), 1
// repacked (kernels/sbmm/repack.py; every n a multiple of 128). Returns a cudaError_t.
int deltaserve_sbmm(const void* x, void* out, float* ws, int* counters, const int32_t* order, const int32_t* tiles,
                    const int32_t* tile_count, const void* const* qv, const void* const* qi, const void* const* sc,
                    const void* const* zr, const int64_t* const* qv_off, const int64_t* const* qi_off,
                    const int64_t* const* g_off, const uint8_t* const* half2, const int* n, const int* col,
                    int slices, int K, int G, int64_t x_stride, int64_t out_stride, int bits, int sparse, int dtype,
                    int block_m, int grid_tiles, int max_splits, int ws_rows, int ws_cols, int slots, int layout,
                    void* stream) {
  if (K % KS != 0 || (G != 32 && G != 64 && G != 128) || block_m < 1 || block_m > 8 * MAX_NT || max_splits < 1 ||
      max_splits > 16 || grid_tiles < 0 || slices < 1 || slices > MAX_SLICES || slots < 1 ||
      (max_splits > 1 && (ws == nullptr || counters == nullptr)) || (layout != 0 && layout != 1)) {
    return cudaErrorInvalidValue;
  }
  if (grid_tiles == 0) return cudaSuccess;
  int row_blocks = 0;
  Slice sl[MAX_SLICES] = {};
  for (int i = 0; i < slices; ++i) {
    if (n[i] < 1 || col[i] < 0 || (layout == 1 && n[i] % ROWS != 0)) return cudaErrorInvalidValue;
    sl[i] = Slice{static_cast<const uint32_t*>(qv[i]), static_cast<const uint32_t*>(qi[i]),
                  static_cast<const __half*>(sc[i]), static_cast<const __half*>(zr[i]), qv_off[i], qi_off[i],
                  g_off[i], dtype == 0 ? half2[i] : nullptr, n[i], col[i], row_blocks};
    row_blocks += (n[i] + ROWS - 1) / ROWS;
  }
  const int nt = fragments_for(block_m);
  auto st = static_cast<cudaStream_t>(stream);
#define DS_SBMM_CFG(TY, B, SP)                                                                                   \
  {                                                                                                              \
    Call<TY> c{};                                                                                                \
    for (int i = 0; i < MAX_SLICES; ++i) c.sl[i] = sl[i];                                                        \
    c.slices = slices;                                                                                           \
    c.x = static_cast<const TY*>(x);                                                                             \
    c.out = static_cast<TY*>(out);                                                                               \
    c.ws = max_splits > 1 ? ws : nullptr;                                                                        \
    c.counters = counters;                                                                                       \
    c.order = order;                                                                                             \
    c.tiles = tiles;                                                                                             \
    c.tile_count = tile_count;                                                                                   \
    c.K = K;                                                                                                     \
    c.x_stride = x_stride;                                                                                       \
    c.out_stride = out_stride;                                                                                   \
    c.ws_rows = ws_rows;                                                                                         \
    c.ws_cols = ws_cols;                                                                                         \
    c.slots = slots;                                                                                             \
    c.row_blocks = row_blocks;                                                                                   \
    c.grid_tiles = grid_tiles;                                                                                   \
    c.max_splits = max_splits;                                                                                   \
    return static_cast<int>(by_tile<Launch, TY, B, SP>(nt, G, layout == 1, c, st));                             \
  }
  DS_BY_CONFIG(DS_SBMM_CFG)
#undef DS_SBMM_CFG
  return static_cast<int>(cudaErrorInvalidValue);
}

// The K splits a launch of ``row_blocks`` x ``tiles`` blocks per split over ``K`` input columns takes when
// ``slots`` blocks run at once (split_for, with no cap): the grid's z for an eager call; with one tile, the
// most any step takes (a captured launch's grid).
int deltaserve_sbmm_split(int row_blocks, int tiles, int K, int slots) {
  return split_for(row_blocks, tiles, K / KS, slots > 0 ? slots : 1, 16);
}

// Blocks per SM of the launch deltaserve_sbmm makes for work tiles of up to ``block_m`` tokens with this
// config, group size and layout (its ``slots`` is this x the SMs), into *blocks. Returns a cudaError_t.
int deltaserve_sbmm_blocks_per_sm(int bits, int sparse, int dtype, int block_m, int G, int layout, int* blocks) {
  if (block_m < 1 || block_m > 8 * MAX_NT || (G != 32 && G != 64 && G != 128) || (layout != 0 && layout != 1) ||
      blocks == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int nt = fragments_for(block_m);
#define DS_OCC(TY, B, SP) return static_cast<int>(by_tile<Occupancy, TY, B, SP>(nt, G, layout == 1, blocks));
  DS_BY_CONFIG(DS_OCC)
#undef DS_OCC
  return static_cast<int>(cudaErrorInvalidValue);
}

// One slot's delta, dense, into dst [N, K] (contiguous, 16-byte aligned) of dtype 0 float16 / 1 bfloat16
// (kernels/sbmm/dequant.py ``dequantize_slot``) from a pool of ``layout`` 0 (the format's) or 1 (repacked,
// kernels/sbmm/repack.py: N % 128 == 0, K % 256 == 0, G in 32 / 64 / 128). K % 8 (dense 4-bit), % 16 (dense
// 2-bit) or % 32 (2:4) must be 0, as the packed format requires, and G % 4 == 0. Returns a cudaError_t.
int deltaserve_dequant(void* dst, const void* qv, const void* qi, const void* sc, const void* zr, const int64_t* qv_off,
                       const int64_t* qi_off, const int64_t* g_off, int slot, int N, int K, int G, int bits,
                       int sparse, int dtype, int layout, void* stream) {
  const int span = (sparse ? 2 : 1) * 32 / (bits > 0 ? bits : 1);
  if ((bits != 2 && bits != 4) || N < 0 || K <= 0 || K % span != 0 || G <= 0 || G % 4 != 0 || K % G != 0 ||
      (layout != 0 && layout != 1)) {
    return cudaErrorInvalidValue;
  }
  if (N == 0) return cudaSuccess;
  auto st = static_cast<cudaStream_t>(stream);
#define DS_DEQ(TY, B, SP)                                                                                        \
  return static_cast<int>(                                                                                       \
      launch_dequant<TY, B, SP>(dst, qv, qi, sc, zr, qv_off, qi_off, g_off, slot, N, K, G, layout, st));
  DS_BY_CONFIG(DS_DEQ)
#undef DS_DEQ
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* deltaserve_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"

#undef DS_BY_CONFIG

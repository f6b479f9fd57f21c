// tierserve: CPU kernels for serving in fp32, built at first use by kernels/cpu_native.py.
//
// ts_paged_attention_f32 attends every query row of a flat batch (decodes and
// prefill chunks alike) causally over its sequence's paged K/V, reading the cache in place: no
// gather into a padded copy, no mask tensor. The cache layout is [num_blocks, block_size,
// kv_heads, head_dim] (kernels/reference.py); this step's K/V are already stored.
//
// Work item: some KV heads and up to row_tile query rows: consecutive rows of one prefill
// chunk, or the decode rows of sequences whose block tables start with the same block (a prefix
// the prefix cache shares, then read once for the whole group); items run in parallel under
// OpenMP (the libgomp torch loaded, so one thread pool). An item's query vectors (its rows x the
// query heads sharing the KV head) walk the keys in runs of kKeyTile with an online softmax,
// KV head by KV head so that every vector using a run's keys reads them from the L1 cache; the
// next run (after an item's last run, the first run of the next item the thread takes) is
// prefetched a share at a time while this one is computed. With AVX-512
// and a head_dim of 32, 64 or 128, the query heads of one KV head go together: their queries
// and value sums stay in registers and each key and value is loaded once for all of them. With
// AVX2 and FMA and a head_dim that is a multiple of 8, one vector at a time: scores are 8-key
// FMA partial sums reduced by horizontal adds, exp is a vector polynomial, and the value sum
// keeps two accumulator sets to hide FMA latency; otherwise a portable loop does the same math.
// The order of the sums differs from torch's SDPA: results agree to rounding, not bits.
// An attention window (window > 0) limits each row to its last `window` positions, itself
// included: the key runs start at the run holding the item's first visible key (runs wholly
// before a row's window are skipped, so a decode's cost is bounded by the window, not the
// context) and a row's part of a run starts at its own first key. Soft-capping (softcap > 0)
// maps each scaled score s to softcap * tanh(s / softcap) before the softmax (tanh from the same
// polynomial exp; a few ulp).
//
// The fused row-wise ops around it (each one pass over its rows instead of several torch ops and
// temporaries; rows in parallel): ts_rms_norm_f32 (optionally adding a delta into the residual
// first), ts_silu_mul_f32 (SwiGLU's silu(gate) * up), ts_qk_norm_f32 (RMSNorm of each q and k
// head over head_dim, in place: Qwen3's, before the rotary embedding) and ts_rope_store_f32
// (rotary embedding of q and k in place, then k and v stored at their cache slots). ts_linear_f32 multiplies rows by
// a weight that ts_pack_linear_f32 laid out in panels of 16 output features (see below);
// ts_linear_q does the same on a weight that ts_pack_linear_q found to be an exact Q4_1/Q8_0
// dequantization and keeps in that form (see "quantized weights"), with the same bits.
// ts_moe_route_f32 and ts_moe_combine_f32 are a mixture-of-experts layer's router choice (softmax,
// top k) and weighted sum of its experts' outputs, per row in a fixed order.
// ts_signatures describes every export's argument kinds from its C++ type, for the loader to
// check its own declarations against (see "the boundary", at the end).
//
// Row independence, by construction: every value a kernel writes for a row is computed from that
// row's inputs (and, for attention, its sequence's cache) in an order fixed by the row's own
// sizes and position: never by how many rows share the call, where the row sits in it, which
// work item or thread takes it, or where its memory is aligned. Sums run in explicit lanes with
// a fixed final tree (no `omp simd reduction`, which lets the compiler choose the order), key
// runs start at fixed positions, a linear output is one chain of multiply-adds over k in order,
// and the build passes -ffp-contract=off so that only the explicit fmadd()/intrinsics fuse. The
// deterministic mode (docs/determinism.md) rests on this; tests/kernels check it on this CPU and
// on a portable build.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxVecs = 64;    // query vectors per item: row tile x query heads per KV head
constexpr int kMaxDim = 256;    // head_dim
constexpr int kKeyTile = 32;    // keys per softmax run
constexpr float kNegBig = -1e30f;
// Below this many elements a row-wise op runs on the calling thread: waking a sleeping OpenMP
// worker (OMP_WAIT_POLICY=PASSIVE) costs more than the work (torch's grain size is 32768).
constexpr int64_t kParallelElems = 1 << 16;
// Likewise for attention, in query-vector x key products.
constexpr int64_t kParallelProducts = 1 << 12;

// a * b + c, fused where the CPU has FMA (the build fuses nothing else: -ffp-contract=off).
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// Sums in kLanes explicit lanes (element i in lane i % kLanes), then a fixed pairwise tree: the
// order depends only on n. The compiler may vectorize the lane loops; it may not reorder them.
constexpr int kLanes = 16;
inline float lane_tree(float (&part)[kLanes]) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}
inline float dot_fixed(const float* a, const float* b, int n) {
  float part[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] = fmadd(a[i + l], b[i + l], part[l]);
  for (int l = 0; i + l < n; ++l) part[l] = fmadd(a[i + l], b[i + l], part[l]);
  return lane_tree(part);
}

// exp(x) for the softmax's x <= 0, to ~2 ulp (Cephes' expf); written without calls or branches
// so that the compiler vectorizes the loops that use it. x below -87 is clamped (exp < 2e-38).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x <= -87.0f ? 0.0f : p * two_n;
}

// cap * tanh(s / cap) (soft-capping; inv_cap = 1 / cap), to a few ulp of tanh: an odd Taylor
// polynomial where |x| < 1/8 (where 1 - e^-2|x| would cancel), else (1 - e^-2|x|) / (1 + e^-2|x|).
// Branchless, so that the loop over a run's scores vectorizes; elementwise, so its bits do not
// depend on the lanes the compiler picks.
inline float soft_cap(float s, float cap, float inv_cap) {
  const float x = s * inv_cap;
  const float ax = x < 0.0f ? -x : x;
  const float x2 = ax * ax;
  float poly = 62.0f / 2835.0f;
  poly = poly * x2 - 17.0f / 315.0f;
  poly = poly * x2 + 2.0f / 15.0f;
  poly = poly * x2 - 1.0f / 3.0f;
  poly = (poly * x2) * ax + ax;
  const float t = fast_exp(-2.0f * ax);
  const float big = (1.0f - t) / (1.0f + t);
  const float th = ax < 0.125f ? poly : big;
  return (x < 0.0f ? -th : th) * cap;
}
inline void soft_cap_run(float* s, int n, float cap) {
  if (cap <= 0.0f) return;
  const float inv = 1.0f / cap;
  for (int j = 0; j < n; ++j) s[j] = soft_cap(s[j], cap, inv);
}

// A work item: up to kMaxVecs query rows, each with its own sequence's block table and visible
// keys, and `heads` consecutive KV heads. The rows of a prefill tile are consecutive rows of one
// sequence; decode rows of sequences whose block tables start with the same block (a prefix the
// prefix cache shares) are grouped into one item, which then reads each shared key run from
// memory once for all of them instead of once per sequence.
struct Item {
  int rows;
  int heads;
  const float* k_cache;  // at the item's first KV head of block 0, position 0
  const float* v_cache;
  const float* q[kMaxVecs];        // row r's query at the item's first query head
  float* out[kMaxVecs];            // likewise
  const int32_t* table[kMaxVecs];  // row r's block table
  int visible[kMaxVecs];           // keys row r sees end here (its position + 1)
  int first[kMaxVecs];             // row r's first visible key (0 without a window)

  int keys() const {  // keys any row sees
    int n = 0;
    for (int r = 0; r < rows; ++r) n = std::max(n, visible[r]);
    return n;
  }
  int first_run() const {  // the start of the first run holding a key some row sees
    int f = first[0];
    for (int r = 1; r < rows; ++r) f = std::min(f, first[r]);
    return f / kKeyTile * kKeyTile;
  }
};

// The state both attention loops keep for an item's query vectors (rows x the query heads of
// its KV heads): the queries pre-scaled, each vector's running max and sum, the keys it sees
// (causal, from its window's first), its KV head's offset within a cache position, and its
// output accumulator; and the soft cap of the scores (0: none).
struct VecState {
  int nvec;
  int per_row;
  int D;
  float cap;
  float* qs;   // [nvec, D], in a per-thread scratch buffer
  float* acc;  // [nvec, D]
  float m[kMaxVecs];
  float l[kMaxVecs];
  int visible[kMaxVecs];
  int first[kMaxVecs];
  int koff[kMaxVecs];

  VecState(const Item& it, int group, int d, float scale, float softcap)
      : nvec(it.rows * it.heads * group), per_row(it.heads * group), D(d), cap(softcap) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(2 * kMaxVecs * kMaxDim))
      scratch.resize(2 * kMaxVecs * kMaxDim);
    qs = scratch.data();
    acc = qs + nvec * D;
    for (int r = 0; r < it.rows; ++r) {
      for (int g = 0; g < per_row; ++g) {
        const int v = r * per_row + g;
        koff[v] = (g / group) * D;  // the vector's KV head within the item
        const float* src = it.q[r] + static_cast<int64_t>(g) * D;
        for (int i = 0; i < D; ++i) qs[v * D + i] = src[i] * scale;
        m[v] = kNegBig;
        l[v] = 0.0f;
        visible[v] = it.visible[r];
        first[v] = it.first[r];
      }
    }
    std::memset(acc, 0, sizeof(float) * nvec * D);
  }

  // out = acc / l for every vector, at its row and query head.
  void write_out(const Item& it) const {
    for (int r = 0; r < it.rows; ++r) {
      for (int g = 0; g < per_row; ++g) {
        const int v = r * per_row + g;
        const float inv = 1.0f / l[v];
        float* dst = it.out[r] + static_cast<int64_t>(g) * D;
        for (int i = 0; i < D; ++i) dst[i] = acc[v * D + i] * inv;
      }
    }
  }
};

// The cache positions of one run of keys (kKeyTile positions from a multiple of kKeyTile) for
// an item's rows. Adjacent rows that read the same positions share one set of pointers: rows of
// one sequence, or rows of sequences whose tables hold the same blocks over the whole run.
struct RunSources {
  int sets = 0;
  int set_of[kMaxVecs];  // row -> its set, -1 when the row sees no key of the run
  int len[kMaxVecs];     // keys a set holds pointers for
  int beg[kMaxVecs];     // a set's first key some row of it sees (> 0 inside a window only)
  const float** kp;      // [set * kKeyTile + key], at the item's first KV head
  const float** vp;

  explicit RunSources(int slot) {
    // Two per thread (the current run and the next one, prefetched).
    thread_local std::vector<const float*> pool(4 * kMaxVecs * kKeyTile);
    kp = pool.data() + static_cast<size_t>(slot) * 2 * kMaxVecs * kKeyTile;
    vp = kp + kMaxVecs * kKeyTile;
  }

  void fill(const Item& it, int set, int row, int from, int to, int p0, int block_size,
            int64_t pos_stride) {
    for (int j = from; j < to; ++j) {
      const int p = p0 + j;
      const int b = p / block_size;
      const int64_t slot = static_cast<int64_t>(it.table[row][b]) * block_size + (p - b * block_size);
      kp[set * kKeyTile + j] = it.k_cache + slot * pos_stride;
      vp[set * kKeyTile + j] = it.v_cache + slot * pos_stride;
    }
  }

  // The sets of the run starting at p0.
  void build(const Item& it, int p0, int block_size, int64_t pos_stride) {
    sets = 0;
    int last = -1;  // the last row given a set
    for (int r = 0; r < it.rows; ++r) {
      const int n = std::min(kKeyTile, it.visible[r] - p0);
      if (n <= 0 || it.first[r] >= p0 + kKeyTile) {  // before or after the row's window
        set_of[r] = -1;
        continue;
      }
      if (last >= 0) {
        const int s = set_of[last];
        bool same = it.table[r] == it.table[last];
        if (!same && n == len[s]) {
          same = true;
          for (int b = p0 / block_size; b <= (p0 + n - 1) / block_size; ++b)
            if (it.table[r][b] != it.table[last][b]) {
              same = false;
              break;
            }
        }
        if (same) {
          if (n > len[s]) {  // a later row of the same sequence sees more keys
            fill(it, s, r, len[s], n, p0, block_size, pos_stride);
            len[s] = n;
          }
          beg[s] = std::min(beg[s], std::max(0, it.first[r] - p0));
          set_of[r] = s;
          last = r;
          continue;
        }
      }
      const int s = sets++;
      fill(it, s, r, 0, n, p0, block_size, pos_stride);
      len[s] = n;
      beg[s] = std::max(0, it.first[r] - p0);
      set_of[r] = s;
      last = r;
    }
  }
};

// Issues the prefetches of a run's keys and values (every set; each position's heads of the
// item, which are contiguous), a share at a time: spread over the previous run's vectors rather
// than in one burst that stalls once the miss buffers are full. Their blocks may be anywhere in
// the pool, so the hardware prefetcher cannot see them coming, and decode attention is bound by
// these reads. Measured on an AVX-512 EPYC: the low-locality hint (prefetcht2) made decode
// attention a quarter faster than the default one (prefetcht0); prefetching whole positions
// (their heads are contiguous) rather than a head at a time, and in small shares (a vector's or
// a key step's worth), mattered as much; prefetching two or three runs ahead, or runs of 64
// keys, did not help. Later, on the same CPU, with an A/B of two builds in one process (the same
// output bits): pacing by cache line rather than by position made decode attention 5-8% faster,
// and prefetching the first run of the thread's next work item during the last run of this one
// (the items are claimed one ahead, see ts_paged_attention_f32) 3-18% more, the most where
// contexts are short and first runs a large share of the reads.
struct Prefetcher {
  const RunSources* next = nullptr;
  int pos_bytes = 0;  // one position of the item's heads
  int64_t total = 0;  // (set, key) pairs
  int64_t done = 0;
  int s = 0, j = 0;

  void start(const RunSources& n, int item_heads, int d) {
    next = &n;
    pos_bytes = d * item_heads * 4;
    lines_per_pos = (pos_bytes + 63) / 64;
    line = 0;
    total = 0;
    for (int i = 0; i < n.sets; ++i) total += n.len[i] - n.beg[i];
    done = 0;
    s = 0;
    j = n.sets > 0 ? n.beg[0] : 0;
  }
  // On to the next (set, key) pair: a set's keys before its window are not read, so not fetched.
  inline void advance() {
    if (++j == next->len[s]) {
      ++s;
      j = s < next->sets ? next->beg[s] : 0;
    }
  }

  // With AVX-512 the issue is paced by line: a unit is one 64-byte line of a position's keys and
  // the same line of its values, and each key step of the run (tick(), one per key in the score
  // loop and one in the value loop of every chunk of vectors) issues an equal share of the
  // units, so that no more than a few lines are requested at once.
  int lines_per_pos = 0, line = 0, per_tick = 0;
  void pace(int64_t ticks) {
    const int64_t units = total * lines_per_pos;
    per_tick = ticks > 0 ? static_cast<int>((units + ticks - 1) / ticks) : 0;
  }
  inline void unit() {
    __builtin_prefetch(reinterpret_cast<const char*>(next->kp[s * kKeyTile + j]) + 64 * line, 0, 1);
    __builtin_prefetch(reinterpret_cast<const char*>(next->vp[s * kKeyTile + j]) + 64 * line, 0, 1);
    if (++line == lines_per_pos) {
      line = 0;
      ++done;
      advance();
    }
  }
  inline void tick() {
    for (int n = per_tick; n > 0 && done < total; --n) unit();
  }
  // Whatever the ticks left (a unit part-issued by the line pacing included).
  void finish() {
    while (done < total) unit();
  }

  // Issue the pairs up to `upto` (of `total`).
  void issue(int64_t upto) {
    for (; done < upto && done < total; ++done) {
      const char* kb = reinterpret_cast<const char*>(next->kp[s * kKeyTile + j]);
      const char* vb = reinterpret_cast<const char*>(next->vp[s * kKeyTile + j]);
      for (int o = 0; o < pos_bytes; o += 64) {
        __builtin_prefetch(kb + o, 0, 1);
        __builtin_prefetch(vb + o, 0, 1);
      }
      advance();
    }
  }
};

// Both loops below visit the item's vectors KV head by KV head (then row, then the head's
// query heads), so that a run's keys and values of one head are read while still in the L1
// cache by every row and query head that uses them. The order in which vectors are visited
// changes nothing in any vector's own arithmetic.

// The portable loop: one query vector at a time over runs of keys that start at fixed positions
// (multiples of kKeyTile), each vector stopping at the keys it sees.
template <int DT>
void attend_generic(const Item& it, int group, int d_runtime, int block_size, int64_t pos_stride,
                    float scale, float softcap) {
  const int D = DT ? DT : d_runtime;
  VecState st(it, group, D, scale, softcap);
  RunSources cur(0);
  alignas(64) float s[kKeyTile];
  const int total = it.keys();
  for (int p0 = it.first_run(); p0 < total; p0 += kKeyTile) {
    cur.build(it, p0, block_size, pos_stride);
    for (int h = 0; h < it.heads; ++h) {
      for (int r = 0; r < it.rows; ++r) {
        const int set = cur.set_of[r];
        if (set < 0) continue;
        const int skip = std::max(0, it.first[r] - p0);  // keys of the run before its window
        const float* const* kp = cur.kp + set * kKeyTile + skip;
        const float* const* vp = cur.vp + set * kKeyTile + skip;
        for (int g = 0; g < group; ++g) {
          const int v = r * st.per_row + h * group + g;
          const int lim = std::min(kKeyTile, st.visible[v] - p0) - skip;  // keys of the run it sees
          const float* qv = st.qs + v * D;
          for (int j = 0; j < lim; ++j) s[j] = dot_fixed(qv, kp[j] + st.koff[v], D);
          soft_cap_run(s, lim, st.cap);
          float mb = st.m[v];
          for (int j = 0; j < lim; ++j) mb = std::max(mb, s[j]);
          const float alpha = fast_exp(st.m[v] - mb);
          st.m[v] = mb;
          float sum = 0.0f;
          for (int j = 0; j < lim; ++j) {
            s[j] = fast_exp(s[j] - mb);
            sum += s[j];
          }
          st.l[v] = st.l[v] * alpha + sum;
          float* a = st.acc + v * D;
          for (int i = 0; i < D; ++i) a[i] *= alpha;
          for (int j = 0; j < lim; ++j) {
            const float* vj = vp[j] + st.koff[v];
            const float pj = s[j];
            for (int i = 0; i < D; ++i) a[i] = fmadd(pj, vj[i], a[i]);
          }
        }
      }
    }
  }
  st.write_out(it);
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight 8-lane partial sums -> one vector of their eight totals.
inline __m256 reduce8(const __m256* p) {
  const __m256 t0 = _mm256_hadd_ps(p[0], p[1]);
  const __m256 t1 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 t2 = _mm256_hadd_ps(p[4], p[5]);
  const __m256 t3 = _mm256_hadd_ps(p[6], p[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // lanes: k0 k1 k2 k3 | k0 k1 k2 k3 (halves)
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // k4..k7 likewise
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// fast_exp on eight lanes.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LE_OQ), y);
}
// The online softmax of one run for vector v: the scores s[0 .. lim) (s 32-byte aligned, room
// for lim rounded up to 8) become exp(score - new max), the vector's running max and sum move
// on; returns alpha, the factor its value sum is rescaled by.
inline float run_softmax(VecState& st, int v, float* s, int lim) {
  const int lim8 = (lim + 7) & ~7;
  for (int j = lim; j < lim8; ++j) s[j] = kNegBig;
  __m256 mx = _mm256_set1_ps(st.m[v]);
  for (int j = 0; j < lim8; j += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(s + j));
  __m128 hm = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  hm = _mm_max_ps(hm, _mm_movehl_ps(hm, hm));
  hm = _mm_max_ss(hm, _mm_shuffle_ps(hm, hm, 1));
  const float mb = _mm_cvtss_f32(hm);
  const float alpha = fast_exp(st.m[v] - mb);
  st.m[v] = mb;
  __m256 sm = _mm256_setzero_ps();
  const __m256 mbv = _mm256_set1_ps(mb);
  for (int j = 0; j < lim8; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s + j), mbv));
    _mm256_store_ps(s + j, e);
    sm = _mm256_add_ps(sm, e);
  }
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(sm), _mm256_extractf128_ps(sm, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
  st.l[v] = st.l[v] * alpha + _mm_cvtss_f32(t);
  return alpha;
}

// acc[0 .. 8 CN) = alpha * acc + sum_j p[j] * value_j[off .. off + 8 CN): CN 8-lane chunks kept
// in registers (a compile-time count, so the compiler does not spill them), two accumulator
// sets over alternate keys to hide the FMA latency.
template <int CN>
inline void value_sum(float* a, const float* const* vp, int64_t off, const float* p, int n,
                      __m256 alpha) {
  __m256 r0[CN], r1[CN];
  for (int c = 0; c < CN; ++c) {
    r0[c] = _mm256_mul_ps(alpha, _mm256_loadu_ps(a + 8 * c));
    r1[c] = _mm256_setzero_ps();
  }
  int j = 0;
  for (; j + 1 < n; j += 2) {
    const __m256 pa = _mm256_set1_ps(p[j]);
    const __m256 pb = _mm256_set1_ps(p[j + 1]);
    const float* va = vp[j] + off;
    const float* vb = vp[j + 1] + off;
    for (int c = 0; c < CN; ++c) {
      r0[c] = _mm256_fmadd_ps(pa, _mm256_loadu_ps(va + 8 * c), r0[c]);
      r1[c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vb + 8 * c), r1[c]);
    }
  }
  if (j < n) {
    const __m256 pa = _mm256_set1_ps(p[j]);
    const float* va = vp[j] + off;
    for (int c = 0; c < CN; ++c) r0[c] = _mm256_fmadd_ps(pa, _mm256_loadu_ps(va + 8 * c), r0[c]);
  }
  for (int c = 0; c < CN; ++c) _mm256_storeu_ps(a + 8 * c, _mm256_add_ps(r0[c], r1[c]));
}

#if defined(__AVX512F__)
// GN query vectors of one KV head (consecutive in the item's state, from v0) over one run of
// lim keys, with AVX-512: each key's and each value's 16-lane chunks are loaded once for all GN
// vectors, whose queries stay in registers (GN x D/16 of the 32), and the GN value sums are
// kept in registers across the run. The same steps as the vector-at-a-time loop (scores, the
// run's max, exp, the running sum, alpha, the value sum), in an order fixed by the vector, D
// and the run alone.
template <int D, int GN>
inline void group_run_avx512(VecState& st, int v0, const float* const* kp,
                             const float* const* vp, int lim, Prefetcher& pf) {
  constexpr int C = D / 16;
  static_assert(C * GN <= 16, "queries in at most half the registers");
  alignas(64) float s[GN][kKeyTile];
  const int koff = st.koff[v0];
  __m512 qr[GN][C];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < C; ++c) qr[g][c] = _mm512_loadu_ps(st.qs + (v0 + g) * D + 16 * c);
  // Scores: per key, one FMA chain per vector over the 16-lane chunks, folded to 8 lanes; eight
  // keys' folds then reduce to eight scores (reduce8).
  for (int j0 = 0; j0 < lim; j0 += 8) {
    __m256 part[GN][8];
    for (int jj = 0; jj < 8; ++jj) {
      if (j0 + jj < lim) {
        const float* kj = kp[j0 + jj] + koff;
        __m512 kc[C];
        for (int c = 0; c < C; ++c) kc[c] = _mm512_loadu_ps(kj + 16 * c);
        pf.tick();
        for (int g = 0; g < GN; ++g) {
          __m512 a = _mm512_mul_ps(qr[g][0], kc[0]);
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qr[g][c], kc[c], a);
          part[g][jj] = _mm256_add_ps(_mm512_castps512_ps256(a),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
        }
      } else {
        for (int g = 0; g < GN; ++g) part[g][jj] = _mm256_setzero_ps();
      }
    }
    for (int g = 0; g < GN; ++g) _mm256_store_ps(s[g] + j0, reduce8(part[g]));
  }
  float alpha[GN];
  for (int g = 0; g < GN; ++g) {
    soft_cap_run(s[g], lim, st.cap);
    alpha[g] = run_softmax(st, v0 + g, s[g], lim);
  }
  // Value sums: acc = alpha * acc + sum_j p_j v_j, every vector's chunks in registers.
  __m512 acc[GN][C];
  for (int g = 0; g < GN; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int c = 0; c < C; ++c)
      acc[g][c] = _mm512_mul_ps(al, _mm512_loadu_ps(st.acc + (v0 + g) * D + 16 * c));
  }
  for (int j = 0; j < lim; ++j) {
    pf.tick();
    const float* vj = vp[j] + koff;
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = _mm512_loadu_ps(vj + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 pj = _mm512_set1_ps(s[g][j]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pj, vc[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(st.acc + (v0 + g) * D + 16 * c, acc[g][c]);
}

// The vectors v0 .. v0 + n - 1 of one KV head over a run, in chunks of as many as fit.
template <int D>
constexpr int kGroupMax = 16 / (D / 16) < 4 ? 16 / (D / 16) : 4;
template <int D>
inline void heads_run_avx512(VecState& st, int v0, int n, const float* const* kp,
                             const float* const* vp, int lim, Prefetcher& pf) {
  constexpr int kMax = kGroupMax<D>;
  int g = 0;
  for (; g + kMax <= n; g += kMax) group_run_avx512<D, kMax>(st, v0 + g, kp, vp, lim, pf);
  switch (n - g) {
    case 3: if constexpr (kMax > 3) group_run_avx512<D, 3>(st, v0 + g, kp, vp, lim, pf); break;
    case 2: if constexpr (kMax > 2) group_run_avx512<D, 2>(st, v0 + g, kp, vp, lim, pf); break;
    case 1: if constexpr (kMax > 1) group_run_avx512<D, 1>(st, v0 + g, kp, vp, lim, pf); break;
    default: break;
  }
}
#endif  // AVX-512

template <int DT>
void attend_avx2(const Item& it, int group, int d_runtime, int block_size, int64_t pos_stride,
                 float scale, float softcap, const Item* after) {
  const int D = DT ? DT : d_runtime;
  const int C = D / 8;
  VecState st(it, group, D, scale, softcap);
  RunSources runs[2] = {RunSources(0), RunSources(1)};
  Prefetcher pf;
  alignas(64) float s[kKeyTile];
  const int total = it.keys();
  const int start = it.first_run();
  runs[0].build(it, start, block_size, pos_stride);
  for (int p0 = start, cur_i = 0; p0 < total; p0 += kKeyTile, cur_i ^= 1) {
    const RunSources& cur = runs[cur_i];
    RunSources& next = runs[cur_i ^ 1];
    if (p0 + kKeyTile < total) {
      next.build(it, p0 + kKeyTile, block_size, pos_stride);
    } else if (after != nullptr) {
      // the thread's next item's first run
      next.build(*after, after->first_run(), block_size, pos_stride);
    } else {
      next.sets = 0;
    }
    pf.start(next, it.heads, D);
    int active = 0;  // vectors that see keys of this run
    for (int r = 0; r < it.rows; ++r) active += cur.set_of[r] >= 0 ? it.heads * group : 0;
#if defined(__AVX512F__)
    if constexpr (DT == 32 || DT == 64 || DT == 128) {
      int64_t ticks = 0;  // key steps of this run: two per key (scores, values) per chunk of vectors
      for (int r = 0; r < it.rows; ++r)
        if (cur.set_of[r] >= 0)
          ticks += static_cast<int64_t>(it.heads) * ((group + kGroupMax<DT> - 1) / kGroupMax<DT>) *
                   2 * (std::min(kKeyTile, it.visible[r] - p0) - std::max(0, it.first[r] - p0));
      pf.pace(ticks);
    }
#endif
    int visited = 0;
    for (int h = 0; h < it.heads; ++h) {
      for (int r = 0; r < it.rows; ++r) {
        const int set = cur.set_of[r];
        if (set < 0) continue;
        const int skip = std::max(0, it.first[r] - p0);  // keys of the run before its window
        const float* const* kp = cur.kp + set * kKeyTile + skip;
        const float* const* vp = cur.vp + set * kKeyTile + skip;
        const int lim = std::min(kKeyTile, it.visible[r] - p0) - skip;  // keys of the run it sees
#if defined(__AVX512F__)
        if constexpr (DT == 32 || DT == 64 || DT == 128) {
          heads_run_avx512<DT>(st, r * st.per_row + h * group, group, kp, vp, lim, pf);
          continue;
        }
#endif
        for (int g = 0; g < group; ++g) {
          const int v = r * st.per_row + h * group + g;
          pf.issue(pf.total * ++visited / active);
          const float* qv = st.qs + v * D;
          for (int j0 = 0; j0 < lim; j0 += 8) {
            __m256 p[8];
            for (int jj = 0; jj < 8; ++jj) {
              __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
              if (j0 + jj < lim) {
                const float* kj = kp[j0 + jj] + st.koff[v];
                int c = 0;
                for (; c + 1 < C; c += 2) {
                  a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * c), _mm256_loadu_ps(kj + 8 * c), a0);
                  a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * c + 8), _mm256_loadu_ps(kj + 8 * c + 8), a1);
                }
                if (c < C)
                  a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * c), _mm256_loadu_ps(kj + 8 * c), a0);
              }
              p[jj] = _mm256_add_ps(a0, a1);
            }
            _mm256_store_ps(s + j0, reduce8(p));
          }
          soft_cap_run(s, lim, st.cap);
          const float alpha = run_softmax(st, v, s, lim);
          float* a = st.acc + v * D;
          const __m256 al = _mm256_set1_ps(alpha);
          int c0 = 0;
          for (; c0 + 4 <= C; c0 += 4) value_sum<4>(a + 8 * c0, vp, st.koff[v] + 8 * c0, s, lim, al);
          switch (C - c0) {
            case 3: value_sum<3>(a + 8 * c0, vp, st.koff[v] + 8 * c0, s, lim, al); break;
            case 2: value_sum<2>(a + 8 * c0, vp, st.koff[v] + 8 * c0, s, lim, al); break;
            case 1: value_sum<1>(a + 8 * c0, vp, st.koff[v] + 8 * c0, s, lim, al); break;
            default: break;
          }
        }
      }
    }
    pf.finish();
  }
  st.write_out(it);
}

#endif  // AVX2 and FMA

template <int DT>
void attend(const Item& it, int group, int d_runtime, int block_size, int64_t pos_stride,
            float scale, float softcap, const Item* after) {
#if defined(__AVX2__) && defined(__FMA__)
  if ((DT ? DT : d_runtime) % 8 == 0) {
    attend_avx2<DT>(it, group, d_runtime, block_size, pos_stride, scale, softcap, after);
    return;
  }
#endif
  attend_generic<DT>(it, group, d_runtime, block_size, pos_stride, scale, softcap);
}

// ----------------------------------------------------------------------------- linear layers
//
// y = x W^T (+ b) with W pre-packed in panels of kPanel output features: packed[p][k][j] =
// W[p * kPanel + j][k] (zero rows pad the last panel). A micro-kernel keeps R rows x NP panels
// of y in registers and walks k: per k it loads each panel's 16 weights once and broadcasts one
// x element per row, R x NP vector FMAs for R + NP loads, so a decode step's few rows run at the
// FMA rate instead of a general GEMM's small-M path. With AVX-512 a panel is one 16-lane
// register and the tiles are up to kTileRows rows x 2 panels (2 kTileRows accumulators of the
// 32 registers); with AVX2 a panel is two 8-lane halves and the tiles 6 rows x 1 panel (12 of
// the 16). Threads split the panels (each streams its own contiguous part of the weights); rows
// go in blocks of about kRowBlockBytes of x, which stays in the L2 cache while the panels pass
// (each block streams the weights once more: the larger the block, the fewer passes). The
// micro-kernels prefetch each panel kPrefetchK steps of k ahead: the hardware prefetcher alone
// falls behind once the FMAs keep the core busy (measured: 10-20% at 8-128 rows).
//
// Whatever the tile, the ISA or the thread, each output is one chain of FMAs over k in order,
// then the bias: tiles decide only which outputs are computed together. A vector FMA rounds each
// lane once, as the scalar one does, so the AVX-512, AVX2 and scalar-FMA paths of one build give
// the same bits (tests/kernels checks the AVX-512 build against an AVX2 one).
constexpr int kPanel = 16;
constexpr int64_t kRowBlockBytes = 1 << 20;
constexpr int64_t kRowBlockMin = 96;
constexpr int64_t kPrefetchK = 32;
#if defined(__AVX512F__)
constexpr int kTileRows = 12;  // 14 measured the same; 8 and 6 4-7% slower
static_assert(kTileRows <= 14, "2 kTileRows accumulators + 2 weights in 32 registers");
#endif
// Below this many multiply-adds a product runs on the calling thread (see kParallelElems).
constexpr int64_t kParallelMacs = 1 << 17;

struct LinearArgs {
  const float* x;
  int64_t x_stride;
  int64_t k;
  int64_t n;
  const float* bias;
  float* y;
  int64_t y_stride;
};

// Stores acc (R rows x NP panels, as 16 NP floats per row) into y's columns col .. col + ncols,
// adding the bias. The micro-kernels share it for a last panel that is not whole.
template <int R, int NP>
inline void store_tile(const LinearArgs& a, const float (&acc)[R][kPanel * NP], int64_t row,
                       int64_t col) {
  const int ncols = static_cast<int>(std::min<int64_t>(kPanel * NP, a.n - col));
  for (int r = 0; r < R; ++r) {
    float* dst = a.y + (row + r) * a.y_stride + col;
    for (int c = 0; c < ncols; ++c) dst[c] = acc[r][c] + (a.bias ? a.bias[col + c] : 0.0f);
  }
}

// The accumulators of a tile, by ISA: AVX-512 one register per panel, AVX2 two, else floats.
#if defined(__AVX512F__)
template <int R, int NP>
struct Acc {
  __m512 v[R][NP];
  void zero() {
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) v[r][q] = _mm512_setzero_ps();
  }
  // Row r, panel q += x * w (w: the panel's 16 weights at one k).
  void fma(int r, int q, float x, __m512 w) { v[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(x), w, v[r][q]); }
  void store(const LinearArgs& a, int64_t row, int64_t col) {
    if (col + kPanel * NP <= a.n) {  // whole panels: straight to y
#pragma GCC unroll 14
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) {
          __m512 out = v[r][q];
          if (a.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(a.bias + col + kPanel * q));
          _mm512_storeu_ps(a.y + (row + r) * a.y_stride + col + kPanel * q, out);
        }
      return;
    }
    alignas(64) float acc[R][kPanel * NP];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < NP; ++q) _mm512_store_ps(&acc[r][kPanel * q], v[r][q]);
    store_tile<R, NP>(a, acc, row, col);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
template <int R, int NP>
struct Acc {
  __m256 v[R][2 * NP];
  void zero() {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 2 * NP; ++j) v[r][j] = _mm256_setzero_ps();
  }
  // Row r, half j of the tile's panels (8 outputs) += x * w.
  void fma(int r, int j, float x, __m256 w) { v[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(x), w, v[r][j]); }
  void store(const LinearArgs& a, int64_t row, int64_t col) {
    if (col + kPanel * NP <= a.n) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < 2 * NP; ++j) {
          __m256 out = v[r][j];
          if (a.bias) out = _mm256_add_ps(out, _mm256_loadu_ps(a.bias + col + 8 * j));
          _mm256_storeu_ps(a.y + (row + r) * a.y_stride + col + 8 * j, out);
        }
      return;
    }
    alignas(64) float acc[R][kPanel * NP];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2 * NP; ++j) _mm256_store_ps(&acc[r][8 * j], v[r][j]);
    store_tile<R, NP>(a, acc, row, col);
  }
};
#else
template <int R, int NP>
struct Acc {
  float v[R][kPanel * NP];
  void zero() {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kPanel * NP; ++c) v[r][c] = 0.0f;
  }
  // Row r, panel q += x * w[0 .. 15].
  void fma(int r, int q, float x, const float* w) {
#pragma omp simd
    for (int j = 0; j < kPanel; ++j) v[r][q * kPanel + j] = fmadd(x, w[j], v[r][q * kPanel + j]);
  }
  void store(const LinearArgs& a, int64_t row, int64_t col) { store_tile<R, NP>(a, v, row, col); }
};
#endif

// R rows x NP panels of y from fp32 panels: w is the first panel's weights ([k][16]), the next
// panel pstride floats on; col the first panel's first output.
template <int R, int NP>
inline void linear_tile(const LinearArgs& a, int64_t row, const float* w, int64_t col) {
  const float* x = a.x + row * a.x_stride;
  const int64_t pstride = a.k * kPanel;
  Acc<R, NP> acc;
  acc.zero();
  for (int64_t k = 0; k < a.k; ++k) {
#if defined(__AVX512F__)
    __m512 wv[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      wv[q] = _mm512_loadu_ps(w + q * pstride + k * kPanel);
      __builtin_prefetch(w + q * pstride + (k + kPrefetchK) * kPanel);  // no fault past the end
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k], wv[q]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 wv[2 * NP];
#pragma GCC unroll 2
    for (int q = 0; q < NP; ++q) {
      wv[2 * q] = _mm256_loadu_ps(w + q * pstride + k * kPanel);
      wv[2 * q + 1] = _mm256_loadu_ps(w + q * pstride + k * kPanel + 8);
      __builtin_prefetch(w + q * pstride + (k + kPrefetchK) * kPanel);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 2 * NP; ++j) acc.fma(r, j, x[r * a.x_stride + k], wv[j]);
#else
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k], w + q * pstride + k * kPanel);
#endif
  }
  acc.store(a, row, col);
}

#if defined(__AVX512F__)
// The last rows % kTileRows rows (0 < rem < R): the tile of exactly rem rows.
template <int R>
inline void linear_rest(const LinearArgs& a, int64_t row, int rem, const float* w, int64_t col,
                        bool pair) {
  if constexpr (R > 1) {
    if (rem == R - 1) {
      if (pair) linear_tile<R - 1, 2>(a, row, w, col); else linear_tile<R - 1, 1>(a, row, w, col);
      return;
    }
    linear_rest<R - 1>(a, row, rem, w, col, pair);
  }
}

// Rows row .. row + rows - 1 against panel p (weights at w) and, with pair, panel p + 1: tiles
// of kTileRows rows x 2 panels, the rows left over in one tile of their count.
void pair_rows(const LinearArgs& a, int64_t row, int64_t rows, const float* w, int64_t p,
               bool pair) {
  const int64_t end = row + rows;
  const int64_t tail = end - (rows % kTileRows);  // the first row past the whole tiles
  const int64_t col = p * kPanel;
  for (int64_t r = row; r < tail; r += kTileRows) {
    if (pair) linear_tile<kTileRows, 2>(a, r, w, col); else linear_tile<kTileRows, 1>(a, r, w, col);
  }
  if (end > tail) linear_rest<kTileRows>(a, tail, static_cast<int>(end - tail), w, col, pair);
}
#else
// Rows row .. row + rows - 1 against panel p (weights at w) and, with pair, panel p + 1: blocks
// of 6 rows per panel (12 accumulators), a short remainder against both panels at once (more
// FMAs per broadcast).
void pair_rows(const LinearArgs& a, int64_t row, int64_t rows, const float* w, int64_t p,
               bool pair) {
  const int64_t pstride = a.k * kPanel;
  const int64_t col = p * kPanel;
  const int64_t end = row + rows;
  const int64_t tail = end - (rows % 6);  // the first row past the blocks of 6
  for (int pp = 0; pp < (pair ? 2 : 1); ++pp)
    for (int64_t r = row; r < tail; r += 6) linear_tile<6, 1>(a, r, w + pp * pstride, col + pp * kPanel);
  const int64_t m = tail;
  const float* w1 = w + pstride;
  switch (end - m) {
    case 5:
      linear_tile<5, 1>(a, m, w, col);
      if (pair) linear_tile<5, 1>(a, m, w1, col + kPanel);
      break;
    case 4:
      linear_tile<4, 1>(a, m, w, col);
      if (pair) linear_tile<4, 1>(a, m, w1, col + kPanel);
      break;
    case 3:
      if (pair) linear_tile<3, 2>(a, m, w, col); else linear_tile<3, 1>(a, m, w, col);
      break;
    case 2:
      if (pair) linear_tile<2, 2>(a, m, w, col); else linear_tile<2, 1>(a, m, w, col);
      break;
    case 1:
      if (pair) linear_tile<1, 2>(a, m, w, col); else linear_tile<1, 1>(a, m, w, col);
      break;
    default:
      break;
  }
}
#endif

// Panels p0 .. p1 - 1 (the calling thread's share) for rows in blocks of row_block, each pair of
// panels through pair_rows with its weights from weights(p, pair): the packed fp32 panels
// themselves, or the quantized ones dequantized into a scratch buffer.
template <typename Weights>
void linear_panels(const LinearArgs& a, int64_t m, int64_t row_block, int64_t p0, int64_t p1,
                   Weights weights) {
  for (int64_t row = 0; row < m; row += row_block) {
    const int64_t rows = std::min(row_block, m - row);
    for (int64_t p = p0; p < p1; p += 2) {
      const bool pair = p + 1 < p1;
      pair_rows(a, row, rows, weights(p, pair), p, pair);
    }
  }
}

// ----------------------------------------------------------------------------- quantized weights
//
// Most small models ship quantized (a GGUF's Q4_1 or Q8_0, ...), and the engine runs them in
// fp32 as their loader dequantizes them. A decode step multiplies a few rows by every weight, so
// its time is the time to stream the weights from memory: 540 MB of fp32 a step for
// SmolLM2-135M, against about 100 MB as the file stores them. So a layer whose fp32 weight is
// exactly such a dequantization keeps it in that form, and the kernel dequantizes as it goes.
//
// A block is 32 consecutive inputs of one output. Q4: w = fma(d, q, m) with d and m fp16 and q
// in 0 .. 15, m the block's least weight (GGUF's Q4_1). Q8: w = d * q with d fp16
// and q in -128 .. 127 (Q8_0). d * q is exact in fp32 (11 significant bits times 4 or 8), so the
// one rounding of the FMA gives what the loader's dequantization (d * q + m in fp32) gave: the
// same fp32 weight, and the kernel then runs the same FMA chain over k on it as on the fp32
// panels (same bits). ts_pack_linear_q finds d, m and q from the fp32 weight and checks that
// they give back every weight exactly, or refuses the layer (which stays fp32).
//
// Layout: panels of 16 outputs as for fp32; a panel is k / 32 blocks, a block is
//   Q4: d[16], m[16] (fp16), then 16 lines of 16 bytes: byte j of line i holds output j's q for
//       input 2i (low nibble) and 2i + 1 (high nibble)     (320 bytes: 6.4x smaller than fp32)
//   Q8: d[16] (fp16), then 32 lines of 16 int8: line i output j's q for input i   (544 bytes)
// Zero weights pad the last panel (d = m = 0).
constexpr int kQBlock = 32;
constexpr int64_t kQ4Bytes = 2 * 2 * kPanel + kQBlock / 2 * kPanel;
constexpr int64_t kQ8Bytes = 2 * kPanel + kQBlock * kPanel;
// Up to twice this many rows (one or two tiles) a step's products dequantize as they go, in
// registers with AVX-512 or AVX2 and F16C, else a block at a time into a small buffer (each tile
// pays the dequantization: right for the few rows of a decode step); more rows dequantize each
// pair of panels into a per-thread scratch buffer (2 k 16 floats, kept for the thread's life)
// once per block of rows and run the fp32 tiles on it.
#if defined(__AVX512F__)
constexpr int kQFusedRows = 8;  // 2 x 8 accumulators, d, m and the weights within 32 registers
#else
constexpr int kQFusedRows = 4;
#endif

inline int64_t q_block_bytes(int bits) { return bits == 4 ? kQ4Bytes : kQ8Bytes; }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    std::memcpy(&bits, &mag, sizeof bits);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// f as fp16 if it is one exactly (finite), else false.
inline bool half_exact(float f, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const int e = static_cast<int>((bits >> 23) & 0xffu) - 127;
  const uint32_t man = bits & 0x7fffffu;
  if ((bits & 0x7fffffffu) == 0) {
    *out = sign;
    return true;
  }
  if (e == 128) return false;  // inf, nan
  if (e >= -14 && e <= 15) {
    if (man & 0x1fffu) return false;
    *out = static_cast<uint16_t>(sign | ((e + 15) << 10) | (man >> 13));
    return true;
  }
  if (e < -24 || e > 15) return false;
  const float scaled = std::fabs(f) * 16777216.0f;  // a subnormal fp16: an integer of 2^-24
  const float whole = std::floor(scaled);
  if (scaled != whole || whole >= 1024.0f) return false;
  *out = static_cast<uint16_t>(sign | static_cast<uint16_t>(whole));
  return true;
}

// The fp16 at or below the positive finite f (round toward zero), or 0 when f is below fp16's
// least subnormal, or 0x7bff (the largest) above its range.
inline uint16_t half_below(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const int e = static_cast<int>((bits >> 23) & 0xffu) - 127;
  if (e > 15) return 0x7bffu;
  if (e >= -14) return static_cast<uint16_t>(((e + 15) << 10) | ((bits & 0x7fffffu) >> 13));
  const float scaled = std::floor(f * 16777216.0f);
  return static_cast<uint16_t>(scaled < 1024.0f ? scaled : 1023.0f);
}

inline bool same_bits(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  return x == y;
}

// One block of 32 weights w (output j of a panel, inputs b * 32 ..) as Q4 or Q8 into the
// panel's block: true if d, m and q give back every weight exactly.
bool quantize_block(const float* w, int bits, int j, uint8_t* blk) {
  float lo = w[0], hi = w[0], amax = 0.0f;
  for (int i = 0; i < kQBlock; ++i) {
    if (!(std::fabs(w[i]) <= 3.4e38f)) return false;  // inf, nan
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
    amax = std::max(amax, std::fabs(w[i]));
  }
  uint16_t* d16 = reinterpret_cast<uint16_t*>(blk);
  int q[kQBlock];
  if (bits == 4) {
    uint16_t mh;
    if (!half_exact(lo, &mh)) return false;
    const float m = half_to_float(mh);
    // w = fma(d, q, m): the least weight is q = 0 (m itself), the greatest q = 15, as the
    // reference quantizer (llama.cpp without an importance matrix, the gguf package) writes
    // them. A quantizer that leaves 0 or 15 unused fails the check: the layer stays fp32.
    const uint16_t base = hi > lo ? half_below((hi - lo) / 15.0f) : 0;
    bool found = false;
    uint16_t dh = 0;
    for (int c = -1; c <= 2 && !found; ++c) {
      if (hi == lo && c) continue;
      const int cand = static_cast<int>(base) + c;
      if (cand < 0 || cand > 0x7bff) continue;
      dh = static_cast<uint16_t>(cand);
      const float d = half_to_float(dh);
      found = true;
      for (int i = 0; i < kQBlock && found; ++i) {
        // Clamped before the cast: t is far out of int range where the range dwarfs d.
        const float t = d > 0.0f ? (w[i] - m) / d : 0.0f;
        const int qi = static_cast<int>(std::min(15.0f, std::max(0.0f, t)) + 0.5f);
        q[i] = qi;
        found = same_bits(fmadd(d, static_cast<float>(qi), m), w[i]);
      }
    }
    if (!found) return false;
    d16[j] = dh;
    d16[kPanel + j] = mh;
    uint8_t* lines = blk + 4 * kPanel;
    for (int i = 0; i < kQBlock; i += 2)
      lines[i / 2 * kPanel + j] = static_cast<uint8_t>(q[i] | (q[i + 1] << 4));
    return true;
  }
  // Q8: w = d * q with q an int8. Q8_0: d = amax / 127 > 0, so the greatest magnitude is
  // q = 127 (or -128). Q5_0 (d * (q5 - 16)) and Q4_0 (d * (q4 - 8)) fit the same form: their
  // reference quantizers set d = (the weight of greatest magnitude) / -16 (or / -8), so that
  // weight is q = -16 (-8) and d has either sign; a zero weight is then d * 0, +0 or -0 by d's
  // sign, which the check below holds to. Each candidate fails at its first mismatch.
  static const float kDivs[][2] = {{127.0f, 1.0f}, {128.0f, 1.0f}, {16.0f, 1.0f},
                                   {16.0f, -1.0f}, {8.0f, 1.0f}, {8.0f, -1.0f}};
  for (const auto& cand : kDivs) {
    uint16_t dh;
    if (!half_exact(cand[1] * (amax / cand[0]), &dh)) continue;
    const float d = half_to_float(dh);
    bool ok = true;
    for (int i = 0; i < kQBlock && ok; ++i) {
      const float t = d != 0.0f ? w[i] / d : 0.0f;
      const float r = std::nearbyint(t);
      if (!(r >= -128.0f && r <= 127.0f)) {  // (a cast out of range is undefined)
        ok = false;
        break;
      }
      q[i] = static_cast<int>(r);
      // What the kernel computes from the stored integer: a -0 weight (d * -0) is not d * 0.
      ok = same_bits(d * static_cast<float>(q[i]), w[i]);
    }
    if (!ok) continue;
    d16[j] = dh;
    int8_t* lines = reinterpret_cast<int8_t*>(blk + 2 * kPanel);
    for (int i = 0; i < kQBlock; ++i) lines[i * kPanel + j] = static_cast<int8_t>(q[i]);
    return true;
  }
  return false;
}

// Panel p's weights ([k / 32 blocks]) dequantized into out[k][16], the fp32 panel layout: each
// weight fma(d, q, m) (Q4) or d * q (Q8), as the fused tiles compute it.
void dequant_panel(const uint8_t* wq, int64_t k, int bits, float* out) {
  const int64_t blocks = k / kQBlock, bb = q_block_bytes(bits);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = wq + b * bb;
    float* o = out + b * kQBlock * kPanel;
#if defined(__AVX512F__)
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    if (bits == 4) {
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
      const __m512i low = _mm512_set1_epi32(15);
      for (int i = 0; i < kQBlock / 2; ++i) {
        const __m512i qs = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4 * kPanel + i * kPanel)));
        _mm512_storeu_ps(o + 2 * i * kPanel,
                         _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_and_si512(qs, low)), mv));
        _mm512_storeu_ps(o + (2 * i + 1) * kPanel,
                         _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(_mm512_srli_epi32(qs, 4)), mv));
      }
    } else {
      for (int i = 0; i < kQBlock; ++i) {
        const __m512i qs = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * kPanel + i * kPanel)));
        _mm512_storeu_ps(o + i * kPanel, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(qs)));
      }
    }
#else
    const uint16_t* d16 = reinterpret_cast<const uint16_t*>(blk);
    float d[kPanel], m[kPanel];
    for (int j = 0; j < kPanel; ++j) {
      d[j] = half_to_float(d16[j]);
      m[j] = bits == 4 ? half_to_float(d16[kPanel + j]) : 0.0f;
    }
    if (bits == 4) {
      const uint8_t* lines = blk + 4 * kPanel;
      for (int i = 0; i < kQBlock / 2; ++i)
#pragma omp simd
        for (int j = 0; j < kPanel; ++j) {
          const int byte = lines[i * kPanel + j];
          o[(2 * i) * kPanel + j] = fmadd(d[j], static_cast<float>(byte & 15), m[j]);
          o[(2 * i + 1) * kPanel + j] = fmadd(d[j], static_cast<float>(byte >> 4), m[j]);
        }
    } else {
      const int8_t* lines = reinterpret_cast<const int8_t*>(blk + 2 * kPanel);
      for (int i = 0; i < kQBlock; ++i)
#pragma omp simd
        for (int j = 0; j < kPanel; ++j) o[i * kPanel + j] = d[j] * static_cast<float>(lines[i * kPanel + j]);
    }
#endif
  }
}

// R rows x NP panels of y straight from quantized panels (wq: the first panel; the next
// qstride bytes on), dequantizing each weight as it is used: the same FMA chain per output as
// linear_tile on the dequantized panel.
template <int R, int NP, int BITS>
inline void linear_tile_q(const LinearArgs& a, int64_t row, const uint8_t* wq, int64_t qstride,
                          int64_t col) {
  const float* x = a.x + row * a.x_stride;
  constexpr int64_t bb = BITS == 4 ? kQ4Bytes : kQ8Bytes;
  const int64_t blocks = a.k / kQBlock;
  Acc<R, NP> acc;
  acc.zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kQBlock;
#if defined(__AVX512F__)
    __m512 dv[NP], mv[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      const uint8_t* blk = wq + q * qstride + b * bb;
      for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + 4 * bb + off);
      dv[q] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      mv[q] = BITS == 4
                  ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))
                  : _mm512_setzero_ps();
    }
    if constexpr (BITS == 4) {
      const __m512i low = _mm512_set1_epi32(15);
      for (int i = 0; i < kQBlock / 2; ++i) {
        __m512 w0[NP], w1[NP];
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) {
          const uint8_t* line = wq + q * qstride + b * bb + 4 * kPanel + i * kPanel;
          const __m512i qs = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
          w0[q] = _mm512_fmadd_ps(dv[q], _mm512_cvtepi32_ps(_mm512_and_si512(qs, low)), mv[q]);
          w1[q] = _mm512_fmadd_ps(dv[q], _mm512_cvtepi32_ps(_mm512_srli_epi32(qs, 4)), mv[q]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
          for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k0 + 2 * i], w0[q]);
#pragma GCC unroll 4
          for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k0 + 2 * i + 1], w1[q]);
        }
      }
    } else {
      for (int i = 0; i < kQBlock; ++i) {
        __m512 w0[NP];
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) {
          const uint8_t* line = wq + q * qstride + b * bb + 2 * kPanel + i * kPanel;
          const __m512i qs = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line)));
          w0[q] = _mm512_mul_ps(dv[q], _mm512_cvtepi32_ps(qs));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k0 + i], w0[q]);
      }
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 dv[2 * NP], mv[2 * NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      const uint8_t* blk = wq + q * qstride + b * bb;
      for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + 4 * bb + off);
      dv[2 * q] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
      dv[2 * q + 1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
      mv[2 * q] = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32)))
                            : _mm256_setzero_ps();
      mv[2 * q + 1] = BITS == 4
                          ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 48)))
                          : _mm256_setzero_ps();
    }
    if constexpr (BITS == 4) {
      const __m256i low = _mm256_set1_epi32(15);
      for (int i = 0; i < kQBlock / 2; ++i) {
        __m256 w0[2 * NP], w1[2 * NP];
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) {
          const __m128i bytes = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(wq + q * qstride + b * bb + 4 * kPanel + i * kPanel));
          const __m256i lo = _mm256_cvtepu8_epi32(bytes);
          const __m256i hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
          w0[2 * q] = _mm256_fmadd_ps(dv[2 * q], _mm256_cvtepi32_ps(_mm256_and_si256(lo, low)), mv[2 * q]);
          w0[2 * q + 1] =
              _mm256_fmadd_ps(dv[2 * q + 1], _mm256_cvtepi32_ps(_mm256_and_si256(hi, low)), mv[2 * q + 1]);
          w1[2 * q] = _mm256_fmadd_ps(dv[2 * q], _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), mv[2 * q]);
          w1[2 * q + 1] =
              _mm256_fmadd_ps(dv[2 * q + 1], _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), mv[2 * q + 1]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
          for (int j = 0; j < 2 * NP; ++j) acc.fma(r, j, x[r * a.x_stride + k0 + 2 * i], w0[j]);
#pragma GCC unroll 4
          for (int j = 0; j < 2 * NP; ++j) acc.fma(r, j, x[r * a.x_stride + k0 + 2 * i + 1], w1[j]);
        }
      }
    } else {
      for (int i = 0; i < kQBlock; ++i) {
        __m256 w0[2 * NP];
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) {
          const __m128i bytes = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(wq + q * qstride + b * bb + 2 * kPanel + i * kPanel));
          w0[2 * q] = _mm256_mul_ps(dv[2 * q], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
          w0[2 * q + 1] = _mm256_mul_ps(dv[2 * q + 1],
                                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int j = 0; j < 2 * NP; ++j) acc.fma(r, j, x[r * a.x_stride + k0 + i], w0[j]);
      }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // AVX2 without F16C (no such CPU is known): dequantize the block, then the fp32 loop.
    alignas(32) float wb[NP][kQBlock * kPanel];
    for (int q = 0; q < NP; ++q) {
      // A one-block panel: dequant_panel of k = 32 from this block.
      dequant_panel(wq + q * qstride + b * bb, kQBlock, BITS, wb[q]);
    }
    for (int i = 0; i < kQBlock; ++i)
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < NP; ++q) {
          acc.fma(r, 2 * q, x[r * a.x_stride + k0 + i], _mm256_load_ps(wb[q] + i * kPanel));
          acc.fma(r, 2 * q + 1, x[r * a.x_stride + k0 + i], _mm256_load_ps(wb[q] + i * kPanel + 8));
        }
#else
    float wb[NP][kQBlock * kPanel];
    for (int q = 0; q < NP; ++q) dequant_panel(wq + q * qstride + b * bb, kQBlock, BITS, wb[q]);
    for (int i = 0; i < kQBlock; ++i)
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k0 + i], wb[q] + i * kPanel);
#endif
  }
  acc.store(a, row, col);
}

// The fused tile of exactly rem rows (0 < rem <= R), against one panel or a pair.
template <int R, int BITS>
inline void linear_fused_q(const LinearArgs& a, int64_t row, int rem, const uint8_t* wq,
                           int64_t qstride, int64_t col, bool pair) {
  if constexpr (R >= 1) {
    if (rem == R) {
      if (pair) linear_tile_q<R, 2, BITS>(a, row, wq, qstride, col);
      else linear_tile_q<R, 1, BITS>(a, row, wq, qstride, col);
      return;
    }
    linear_fused_q<R - 1, BITS>(a, row, rem, wq, qstride, col, pair);
  }
}

// Panels p0 .. p1 - 1 of a quantized weight for all m rows (one thread's share).
template <int BITS>
void linear_q_panels(const LinearArgs& a, int64_t m, int64_t row_block, const uint8_t* packed,
                     int64_t p0, int64_t p1) {
  const int64_t qstride = a.k / kQBlock * q_block_bytes(BITS);
  if (m <= 2 * kQFusedRows) {  // one or two tiles, each dequantizing in registers
    const int first = static_cast<int>(m <= kQFusedRows ? m : (m + 1) / 2);
    for (int64_t p = p0; p < p1; p += 2) {
      linear_fused_q<kQFusedRows, BITS>(a, 0, first, packed + p * qstride, qstride, p * kPanel,
                                        p + 1 < p1);
      if (m > first)
        linear_fused_q<kQFusedRows, BITS>(a, first, static_cast<int>(m - first),
                                          packed + p * qstride, qstride, p * kPanel, p + 1 < p1);
    }
    return;
  }
  // A pair of panels dequantized at a time, then the fp32 tiles over every row of the block.
  static thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * a.k * kPanel));
  float* s = scratch.data();
  linear_panels(a, m, row_block, p0, p1, [&](int64_t p, bool pair) {
    for (int q = 0; q < (pair ? 2 : 1); ++q)
      dequant_panel(packed + (p + q) * qstride, a.k, BITS, s + q * a.k * kPanel);
    return static_cast<const float*>(s);
  });
}

// ----------------------------------------------------------------------------- K-quant forms
//
// GGUF's K-quants (Q4_K, Q5_K, Q6_K) keep fp16 scales per superblock of 256 inputs and small
// integer scales per sub-block; the loader's dequantization (the gguf package, in fp32, each op
// rounded) gives, per sub-block, Q4_K and Q5_K: w = S * q - M with S = d * sc and M = dmin * m
// (d, dmin fp16; sc, m 6-bit; q 0 .. 15 or 0 .. 31), and Q6_K: w = S * q with S = d * sc (sc
// int8, q -32 .. 31, sub-blocks of 16). S * q is exact in fp32 (at most 11 + 6 + 5 significant
// bits; 11 + 8 + 6 for Q6_K), so Q4_K's and Q5_K's w is the one rounding of S * q - M, which is
// fma(S, q, -M) (or S * q + (-M) without FMA: the same value), and Q6_K's w is S * q itself.
// These forms keep S (and -M) per sub-block as fp32 and q as it is; the kernel computes each
// weight with that one operation, the loader's fp32 weight bit for bit, then the same FMA chain
// over k as on the fp32 panels (same bits, as for Q4/Q8 above).
//
// ts_pack_linear_q finds the form from the fp32 weight alone (the prepared cache holds no GGUF
// types) and checks every weight: per sub-block it estimates S from the gaps between the
// weights, tries the S = fp16 x (1 .. 63) near it, and takes for -M any fp32 that every weight's
// rounding interval allows; Q6_K's S is the greatest magnitude over the greatest |q|. Any S and
// offset that give back every weight exactly will do; a layer with any sub-block of no such form
// stays fp32.
//
// Layout: panels of 16 outputs, k / 32 blocks of 32 inputs each; a block is
//   K4 (Q4_K): S[16], O[16] (fp32, O = -M), then 16 lines of 16 bytes as Q4's (low nibble input
//       2i, high 2i + 1)                                             (384 bytes: 5.3x smaller)
//   K5 (Q5_K): S[16], O[16] (fp32), then 32 lines of 16 bytes: line i output j's q for input i
//                                                                    (640 bytes: 3.2x smaller)
//   K6 (Q6_K): S0[16] (inputs 0 .. 15), S1[16] (16 .. 31) (fp32), then 32 lines of 16 int8
//                                                                    (640 bytes)
// Zero weights pad the last panel (S = O = q = 0). The codes (the `bits` argument of the
// exports) are 100 + the K-quant's bits.
constexpr int kFormK4 = 104, kFormK5 = 105, kFormK6 = 106;
constexpr int64_t kKHead = 2 * 4 * kPanel;  // the two fp32 vectors before the lines
constexpr int64_t kK4Bytes = kKHead + kQBlock / 2 * kPanel;
constexpr int64_t kK5Bytes = kKHead + kQBlock * kPanel;
constexpr int64_t kK6Bytes = kKHead + kQBlock * kPanel;

inline bool is_k_form(int form) { return form == kFormK4 || form == kFormK5 || form == kFormK6; }
inline int64_t k_block_bytes(int form) { return form == kFormK4 ? kK4Bytes : kK5Bytes; }

// The doubles that round to the finite fp32 f lie strictly between *lo and *hi.
inline void rounding_interval(float f, double* lo, double* hi) {
  const double below = static_cast<double>(f) - static_cast<double>(std::nextafter(f, -__builtin_inff()));
  const double above = static_cast<double>(std::nextafter(f, __builtin_inff())) - static_cast<double>(f);
  *lo = static_cast<double>(f) - below / 2;
  *hi = static_cast<double>(f) + above / 2;
}

// The weights w[0 .. 32) (least lo, rounding intervals (a[i], b[i])) as fma(s, q[i], o) with q[i]
// in 0 .. qmax, for this s: each q relative to the least weight's, the offsets every weight's
// interval allows ([olo, ohi] with the least weight's q at 0; s * q0 less with it at q0), then for
// each place q0 the fp32 o nearest the middle (and its neighbours: the bounds were computed in
// double), checked with the kernel's own operation.
bool affine_offset(const float* w, const double* a, const double* b, float s, int qmax, float lo,
                   float* o_out, int* q) {
  int rel[kQBlock], rmax = 0;
  double olo = -1e300, ohi = 1e300;
  for (int i = 0; i < kQBlock; ++i) {
    const double t = std::nearbyint((static_cast<double>(w[i]) - lo) / s);
    if (!(t >= 0.0 && t <= qmax)) return false;
    rel[i] = static_cast<int>(t);
    rmax = std::max(rmax, rel[i]);
    const double p = static_cast<double>(s) * rel[i];  // exact: 24 + 5 bits
    olo = std::max(olo, a[i] - p);
    ohi = std::min(ohi, b[i] - p);
  }
  if (olo > ohi + 1e-30 * std::fabs(ohi)) return false;
  for (int q0 = 0; q0 + rmax <= qmax; ++q0) {
    const float mid = static_cast<float>((olo + ohi) / 2 - static_cast<double>(s) * q0);
    const float inf = __builtin_inff();
    for (const float o : {mid, std::nextafter(mid, -inf), std::nextafter(mid, inf)}) {
      bool ok = std::fabs(o) <= 3.4e38f;
      for (int i = 0; i < kQBlock && ok; ++i)
        ok = same_bits(fmadd(s, static_cast<float>(q0 + rel[i]), o), w[i]);
      if (ok) {
        for (int i = 0; i < kQBlock; ++i) q[i] = q0 + rel[i];
        *o_out = o;
        return true;
      }
    }
  }
  return false;
}

// 32 weights as fma(S, q, O) with S = fp16 x (1 .. 63) (Q4_K's and Q5_K's sub-block scale),
// q in 0 .. qmax, O any fp32; true if found (every weight checked). *d_hint: the fp16 of the
// last block's S (a K-quant shares it over a superblock of 8 blocks), tried first; updated.
bool affine_block(const float* w, int qmax, float* s_out, float* o_out, int* q, uint16_t* d_hint) {
  float lo = w[0], hi = w[0];
  for (int i = 0; i < kQBlock; ++i) {
    if (!(std::fabs(w[i]) <= 3.4e38f)) return false;  // inf, nan
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  if (lo == hi) {  // one value (+0 and -0 compare equal: the check tells them apart)
    for (const float s : {0.0f, -0.0f}) {
      bool ok = true;
      for (int i = 0; i < kQBlock && ok; ++i) ok = same_bits(fmadd(s, 0.0f, w[0]), w[i]);
      if (ok) {
        *s_out = s;
        *o_out = w[0];
        for (int i = 0; i < kQBlock; ++i) q[i] = 0;
        return true;
      }
    }
    return false;
  }
  double a[kQBlock], b[kQBlock];
  for (int i = 0; i < kQBlock; ++i) rounding_interval(w[i], &a[i], &b[i]);
  float v[kQBlock];
  std::memcpy(v, w, sizeof v);
  std::sort(v, v + kQBlock);
  double gap = 1e300;  // the least gap between two distinct weights: S times a small integer
  for (int i = 1; i < kQBlock; ++i)
    if (v[i] > v[i - 1]) gap = std::min(gap, static_cast<double>(v[i]) - v[i - 1]);
  const double span = static_cast<double>(hi) - lo;
  // Each weight is within half an ulp of S q + O: S from the span is this close.
  const double wmax = std::max(std::fabs(static_cast<double>(lo)), std::fabs(static_cast<double>(hi)));
  const double ulp = wmax * 1.1920928955078125e-07;  // 2^-23 wmax: at least an ulp of any weight
  float tried = -1.0f;
  auto attempt = [&](uint16_t h, int sc) {
    const float s = half_to_float(h) * static_cast<float>(sc);  // exact: 11 + 6 bits
    if (s == tried) return false;
    tried = s;
    if (!affine_offset(w, a, b, s, qmax, lo, o_out, q)) return false;
    *s_out = s;
    *d_hint = h;
    return true;
  };
  for (int div = 1; div <= qmax; ++div) {
    const double steps = std::nearbyint(span / (gap / div));
    if (!(steps >= 1.0 && steps <= qmax)) continue;
    const double est = span / steps, tol = 1.5 * ulp / steps + est * 1e-12;
    if (*d_hint) {  // the superblock's d, the scale nearest est
      const double d = half_to_float(*d_hint);
      const int sc = static_cast<int>(std::nearbyint(est / d));
      if (sc >= 1 && sc <= 63 && std::fabs(d * sc - est) <= tol && attempt(*d_hint, sc)) return true;
    }
    for (int sc = 1; sc <= 63; ++sc) {
      const double dlo = (est - tol) / sc, dhi = (est + tol) / sc;
      if (!(dhi > 0.0) || dlo > 65504.0) continue;
      // The fp16 values in [dlo, dhi] (a few at most: stop after 4).
      uint16_t h = dlo > 0.0 ? half_below(static_cast<float>(dlo)) : 1;
      for (int c = 0; c < 4 && h <= 0x7bff; ++c, ++h) {
        const float d = half_to_float(h);
        if (d < dlo) continue;
        if (d > dhi) break;
        if (attempt(h, sc)) return true;
      }
    }
  }
  return false;
}

// 16 weights as s * q (Q6_K's sub-block: s = fp16 x int8, q in -32 .. 31, kept as int8), each
// product exact and checked; -0 weights need a negative s (s * 0 is then -0), +0 a positive one,
// except where s is 0 and every weight a zero (-0 from a negative q).
bool scaled_group(const float* w, float* s_out, int8_t* q) {
  float amax = 0.0f;
  bool neg0 = false, pos0 = false;
  for (int i = 0; i < 16; ++i) {
    if (!(std::fabs(w[i]) <= 3.4e38f)) return false;
    amax = std::max(amax, std::fabs(w[i]));
    if (w[i] == 0.0f) (std::signbit(w[i]) ? neg0 : pos0) = true;
  }
  if (amax == 0.0f) {  // s = 0 (Q6_K's sc 0): +0 * q is -0 for a negative q
    *s_out = 0.0f;
    for (int i = 0; i < 16; ++i) q[i] = std::signbit(w[i]) ? -1 : 0;
    return true;
  }
  if (neg0 && pos0) return false;
  const float sign = neg0 ? -1.0f : 1.0f;
  // The weight of greatest magnitude is s times the greatest |q|: amax / that is s exactly.
  for (int top = 1; top <= 128; ++top) {
    const float s = sign * (amax / static_cast<float>(top));
    bool ok = true;
    for (int i = 0; i < 16 && ok; ++i) {
      const float r = std::nearbyint(w[i] / s);
      ok = r >= -128.0f && r <= 127.0f && same_bits(s * r, w[i]);
      if (ok) q[i] = static_cast<int8_t>(r);
    }
    if (ok) {
      *s_out = s;
      return true;
    }
  }
  return false;
}

// One block of 32 weights w (output j of a panel) in K-quant form `form` into the panel's block:
// true if every weight is given back exactly. d_hint: see affine_block (0 at a row's start).
bool k_quantize_block(const float* w, int form, int j, uint8_t* blk, uint16_t* d_hint) {
  float head[2];
  uint8_t* lines = blk + kKHead;
  if (form == kFormK6) {
    int8_t q[kQBlock];
    if (!scaled_group(w, &head[0], q) || !scaled_group(w + 16, &head[1], q + 16)) return false;
    for (int i = 0; i < kQBlock; ++i) lines[i * kPanel + j] = static_cast<uint8_t>(q[i]);
  } else {
    int q[kQBlock];
    if (!affine_block(w, form == kFormK4 ? 15 : 31, &head[0], &head[1], q, d_hint)) return false;
    if (form == kFormK4) {
      for (int i = 0; i < kQBlock; i += 2)
        lines[i / 2 * kPanel + j] = static_cast<uint8_t>(q[i] | (q[i + 1] << 4));
    } else {
      for (int i = 0; i < kQBlock; ++i) lines[i * kPanel + j] = static_cast<uint8_t>(q[i]);
    }
  }
  std::memcpy(blk + 4 * j, &head[0], 4);
  std::memcpy(blk + 4 * (kPanel + j), &head[1], 4);
  return true;
}

// Block blk of a K form dequantized into out[32][16] (the fp32 panel layout), each weight with
// the kernel's operation: fma(S, q, O) (K4, K5) or S * q (K6).
void k_dequant_block(const uint8_t* blk, int form, float* out) {
  float s[kPanel], o[kPanel];
  std::memcpy(s, blk, sizeof s);
  std::memcpy(o, blk + 4 * kPanel, sizeof o);
  const uint8_t* lines = blk + kKHead;
  for (int i = 0; i < kQBlock; ++i) {
    float* row = out + i * kPanel;
    if (form == kFormK4) {
      const uint8_t* line = lines + i / 2 * kPanel;
      const int shift = (i & 1) * 4;
#pragma omp simd
      for (int j = 0; j < kPanel; ++j)
        row[j] = fmadd(s[j], static_cast<float>((line[j] >> shift) & 15), o[j]);
    } else if (form == kFormK5) {
      const uint8_t* line = lines + i * kPanel;
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) row[j] = fmadd(s[j], static_cast<float>(line[j]), o[j]);
    } else {
      const int8_t* line = reinterpret_cast<const int8_t*>(lines + i * kPanel);
      const float* sc = i < 16 ? s : o;
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) row[j] = sc[j] * static_cast<float>(line[j]);
    }
  }
}

// Panel wq's k / 32 blocks of a K form dequantized into out[k][16].
void k_dequant_panel(const uint8_t* wq, int64_t k, int form, float* out) {
  const int64_t bb = k_block_bytes(form);
  for (int64_t b = 0; b < k / kQBlock; ++b)
    k_dequant_block(wq + b * bb, form, out + b * kQBlock * kPanel);
}

#if defined(__AVX512F__)
// Input i's 16 weights of a K-form block (s, o: its two fp32 vectors), as k_dequant_block.
template <int FORM>
inline __m512 k_weights(const uint8_t* blk, int i, __m512 s, __m512 o) {
  const uint8_t* lines = blk + kKHead;
  const __m128i line = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(lines + (FORM == kFormK4 ? i / 2 : i) * kPanel));
  if constexpr (FORM == kFormK4) {
    __m512i qs = _mm512_cvtepu8_epi32(line);
    qs = (i & 1) ? _mm512_srli_epi32(qs, 4) : _mm512_and_si512(qs, _mm512_set1_epi32(15));
    return _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(qs), o);
  } else if constexpr (FORM == kFormK5) {
    return _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(line)), o);
  } else {
    return _mm512_mul_ps(i < 16 ? s : o, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(line)));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// Half h (outputs 8h .. 8h + 7) of input i's weights of a K-form block (s, o: that half of its
// two fp32 vectors), as k_dequant_block.
template <int FORM>
inline __m256 k_weights(const uint8_t* blk, int i, int h, __m256 s, __m256 o) {
  const uint8_t* lines = blk + kKHead;
  const __m128i line = _mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(lines + (FORM == kFormK4 ? i / 2 : i) * kPanel + 8 * h));
  if constexpr (FORM == kFormK4) {
    __m256i qs = _mm256_cvtepu8_epi32(line);
    qs = (i & 1) ? _mm256_srli_epi32(qs, 4) : _mm256_and_si256(qs, _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(qs), o);
  } else if constexpr (FORM == kFormK5) {
    return _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(line)), o);
  } else {
    return _mm256_mul_ps(i < 16 ? s : o, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(line)));
  }
}
#endif

// R rows x NP panels of y straight from K-form panels (wq: the first panel; the next qstride
// bytes on), each weight computed as it is used: the same FMA chain per output as linear_tile
// on the dequantized panel.
template <int R, int NP, int FORM>
inline void linear_tile_k(const LinearArgs& a, int64_t row, const uint8_t* wq, int64_t qstride,
                          int64_t col) {
  const float* x = a.x + row * a.x_stride;
  constexpr int64_t bb = FORM == kFormK4 ? kK4Bytes : kK5Bytes;
  const int64_t blocks = a.k / kQBlock;
  Acc<R, NP> acc;
  acc.zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kQBlock;
#if defined(__AVX512F__)
    __m512 sv[NP], ov[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      const uint8_t* blk = wq + q * qstride + b * bb;
      for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + 4 * bb + off);
      sv[q] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
      ov[q] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk) + kPanel);
    }
#pragma GCC unroll 2
    for (int i = 0; i < kQBlock; ++i) {
      __m512 wv[NP];
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) wv[q] = k_weights<FORM>(wq + q * qstride + b * bb, i, sv[q], ov[q]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k0 + i], wv[q]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 sv[2 * NP], ov[2 * NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      const uint8_t* blk = wq + q * qstride + b * bb;
      for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + 4 * bb + off);
      const float* f = reinterpret_cast<const float*>(blk);
      sv[2 * q] = _mm256_loadu_ps(f);
      sv[2 * q + 1] = _mm256_loadu_ps(f + 8);
      ov[2 * q] = _mm256_loadu_ps(f + kPanel);
      ov[2 * q + 1] = _mm256_loadu_ps(f + kPanel + 8);
    }
    for (int i = 0; i < kQBlock; ++i) {
      __m256 wv[2 * NP];
#pragma GCC unroll 4
      for (int j = 0; j < 2 * NP; ++j)
        wv[j] = k_weights<FORM>(wq + j / 2 * qstride + b * bb, i, j & 1, sv[j], ov[j]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < 2 * NP; ++j) acc.fma(r, j, x[r * a.x_stride + k0 + i], wv[j]);
    }
#else
    float wb[NP][kQBlock * kPanel];
    for (int q = 0; q < NP; ++q) k_dequant_block(wq + q * qstride + b * bb, FORM, wb[q]);
    for (int i = 0; i < kQBlock; ++i)
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < NP; ++q) acc.fma(r, q, x[r * a.x_stride + k0 + i], wb[q] + i * kPanel);
#endif
  }
  acc.store(a, row, col);
}

// The fused K-form tile of exactly rem rows (0 < rem <= R), against one panel or a pair.
template <int R, int FORM>
inline void linear_fused_k(const LinearArgs& a, int64_t row, int rem, const uint8_t* wq,
                           int64_t qstride, int64_t col, bool pair) {
  if constexpr (R >= 1) {
    if (rem == R) {
      if (pair) linear_tile_k<R, 2, FORM>(a, row, wq, qstride, col);
      else linear_tile_k<R, 1, FORM>(a, row, wq, qstride, col);
      return;
    }
    linear_fused_k<R - 1, FORM>(a, row, rem, wq, qstride, col, pair);
  }
}

// Panels p0 .. p1 - 1 of a K-form weight for all m rows (one thread's share), as
// linear_q_panels: fused tiles for up to 2 kQFusedRows rows, else a pair of panels dequantized
// into the thread's scratch buffer at a time.
template <int FORM>
void linear_k_panels(const LinearArgs& a, int64_t m, int64_t row_block, const uint8_t* packed,
                     int64_t p0, int64_t p1) {
  const int64_t qstride = a.k / kQBlock * k_block_bytes(FORM);
  if (m <= 2 * kQFusedRows) {
    const int first = static_cast<int>(m <= kQFusedRows ? m : (m + 1) / 2);
    for (int64_t p = p0; p < p1; p += 2) {
      linear_fused_k<kQFusedRows, FORM>(a, 0, first, packed + p * qstride, qstride, p * kPanel,
                                        p + 1 < p1);
      if (m > first)
        linear_fused_k<kQFusedRows, FORM>(a, first, static_cast<int>(m - first),
                                          packed + p * qstride, qstride, p * kPanel, p + 1 < p1);
    }
    return;
  }
  static thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * a.k * kPanel));
  float* s = scratch.data();
  linear_panels(a, m, row_block, p0, p1, [&](int64_t p, bool pair) {
    for (int q = 0; q < (pair ? 2 : 1); ++q)
      k_dequant_panel(packed + (p + q) * qstride, a.k, FORM, s + q * a.k * kPanel);
    return static_cast<const float*>(s);
  });
}

// The K forms' halves of ts_pack_linear_q, ts_unpack_linear_q and ts_linear_q (same contracts).
int pack_k(const float* w, int64_t n, int64_t k, int form, uint8_t* packed, int num_threads) {
  if (n <= 0 || k <= 0 || k % kQBlock) return -1;
  const int64_t panels = (n + kPanel - 1) / kPanel, blocks = k / kQBlock;
  const int64_t bb = k_block_bytes(form);
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : failed)
  for (int64_t p = 0; p < panels; ++p) {
    if (failed) continue;
    uint8_t* panel = packed + p * blocks * bb;
    std::memset(panel, 0, static_cast<size_t>(blocks * bb));
    for (int j = 0; j < kPanel && !failed; ++j) {
      const int64_t row = p * kPanel + j;
      if (row >= n) break;
      uint16_t d_hint = 0;
      for (int64_t b = 0; b < blocks && !failed; ++b)
        if (!k_quantize_block(w + row * k + b * kQBlock, form, j, panel + b * bb, &d_hint)) failed = 1;
    }
  }
  return failed ? 1 : 0;
}

int unpack_k(const uint8_t* packed, int64_t n, int64_t k, int form, float* out, int num_threads) {
  if (n <= 0 || k <= 0 || k % kQBlock) return -1;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t qstride = k / kQBlock * k_block_bytes(form);
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t p = 0; p < panels; ++p) k_dequant_panel(packed + p * qstride, k, form, out + p * k * kPanel);
  return 0;
}

int linear_k(const float* x, int64_t x_stride, int64_t m, int64_t k, const uint8_t* packed,
             int form, int64_t n, const float* bias, float* y, int64_t y_stride, int num_threads) {
  if (m < 0 || k <= 0 || n <= 0 || k % kQBlock || (m > 1 && (x_stride < k || y_stride < n)))
    return -1;
  if (m == 0) return 0;
  const LinearArgs a{x, x_stride, k, n, bias, y, y_stride};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t pairs = (panels + 1) / 2;
  const int64_t row_block = std::max(kRowBlockMin, kRowBlockBytes / (4 * k) / 48 * 48);
#pragma omp parallel num_threads(num_threads) if (pairs > 1 && m * n * k >= kParallelMacs)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = std::min(panels, 2 * (pairs * t / nt));
    const int64_t p1 = std::min(panels, 2 * (pairs * (t + 1) / nt));
    if (form == kFormK4) linear_k_panels<kFormK4>(a, m, row_block, packed, p0, p1);
    else if (form == kFormK5) linear_k_panels<kFormK5>(a, m, row_block, packed, p0, p1);
    else linear_k_panels<kFormK6>(a, m, row_block, packed, p0, p1);
  }
  return 0;
}

}  // namespace

extern "C" {

// Limits the caller must respect (checked again here: a violation returns a negative code).
int ts_max_vecs() { return kMaxVecs; }
int ts_max_head_dim() { return kMaxDim; }

// q: [T, hq, D] with row stride q_row_stride (elements), heads contiguous; out likewise.
// k_cache, v_cache: [num_blocks, block_size, hkv, D] contiguous. tables: [S, table_stride]
// int32. seq_lens[s]: positions in the cache after this step; cu_q_lens: [S + 1] prefix sums of
// query rows (sequence s owns rows cu_q_lens[s] .. cu_q_lens[s + 1] - 1, at positions
// seq_lens[s] - q_len .. seq_lens[s] - 1). window > 0: the row at position p sees only keys
// p - window + 1 .. p (0: every key up to p). softcap > 0: scores s (scaled) become
// softcap * tanh(s / softcap) (0: unchanged). A work item is row_tile query rows of a sequence and
// heads_per_item consecutive KV heads (a divisor of hkv). Returns 0, or a negative code without
// touching out: -1 bad heads/sizes, -2 too many query vectors per item, -3 a query
// length outside 1..seq_len, -4 a context longer than the block table, -5 a block id outside
// 0..num_blocks - 1, -6 a negative window or a softcap that is negative or not finite.
int ts_paged_attention_f32(const float* q, int64_t q_row_stride, const float* k_cache,
                           const float* v_cache, const int32_t* tables, int64_t table_stride,
                           const int32_t* seq_lens, const int32_t* cu_q_lens, float* out,
                           int64_t out_row_stride, int num_seqs, int hq, int hkv, int head_dim,
                           int block_size, int num_blocks, float scale, int window, float softcap,
                           int row_tile, int heads_per_item, int num_threads) {
  if (hkv <= 0 || hq % hkv || head_dim > kMaxDim || block_size <= 0 || row_tile <= 0 ||
      heads_per_item <= 0 || hkv % heads_per_item)
    return -1;
  const int group = hq / hkv;
  if (group * heads_per_item * row_tile > kMaxVecs) return -2;
  if (window < 0 || !(softcap >= 0.0f) || softcap > 3.0e38f) return -6;
  int64_t products = 0;
  std::vector<int32_t> decodes;  // sequences with one query row
  for (int s = 0; s < num_seqs; ++s) {
    const int n = cu_q_lens[s + 1] - cu_q_lens[s];
    const int seen = window > 0 ? std::min(seq_lens[s], window) : seq_lens[s];  // keys per row
    products += static_cast<int64_t>(n) * seen * hq;
    if (n <= 0 || n > seq_lens[s]) return -3;
    // Every block the sequence reads must be a block of the cache (never read out of bounds).
    const int64_t blocks = (static_cast<int64_t>(seq_lens[s]) + block_size - 1) / block_size;
    if (blocks > table_stride) return -4;
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id = tables[s * table_stride + b];
      if (id < 0 || id >= num_blocks) return -5;
    }
    if (n == 1) decodes.push_back(s);
  }
  // Work items, listed up front so OpenMP can balance them: (first entry in `rows`, row count)
  // for each group of KV heads. A prefill chunk goes in tiles of row_tile consecutive rows; decode
  // rows of sequences whose first block is the same (the prefix cache shares it) go together, up
  // to row_tile per item, the rest one per item. Grouping decides only which vectors share an
  // item's key runs, never the arithmetic of any one of them.
  std::stable_sort(decodes.begin(), decodes.end(), [&](int32_t a, int32_t b) {
    return tables[a * table_stride] < tables[b * table_stride];
  });
  std::vector<int32_t> rows;  // (sequence, row) pairs
  std::vector<int32_t> items;  // (offset into rows / 2, count) pairs
  for (size_t i = 0; i < decodes.size();) {
    const int32_t first = tables[decodes[i] * table_stride];
    size_t j = i;
    items.push_back(static_cast<int32_t>(rows.size() / 2));
    while (j < decodes.size() && j - i < static_cast<size_t>(row_tile) &&
           tables[decodes[j] * table_stride] == first) {
      rows.push_back(decodes[j]);
      rows.push_back(cu_q_lens[decodes[j]]);
      ++j;
    }
    items.push_back(static_cast<int32_t>(j - i));
    i = j;
  }
  for (int s = 0; s < num_seqs; ++s) {
    const int lo = cu_q_lens[s], hi = cu_q_lens[s + 1];
    if (hi - lo == 1) continue;
    for (int r = lo; r < hi; r += row_tile) {
      items.push_back(static_cast<int32_t>(rows.size() / 2));
      items.push_back(std::min(row_tile, hi - r));
      for (int x = r; x < std::min(hi, r + row_tile); ++x) {
        rows.push_back(s);
        rows.push_back(x);
      }
    }
  }
  const int64_t groups = static_cast<int64_t>(items.size() / 2);
  const int head_groups = hkv / heads_per_item;
  const int64_t work = groups * head_groups;
  const int64_t pos_stride = static_cast<int64_t>(hkv) * head_dim;
  auto make_item = [&](int64_t w, Item& it) {
    const int64_t g = w / head_groups;
    const int h = static_cast<int>(w % head_groups) * heads_per_item;
    const int32_t* entry = rows.data() + 2 * static_cast<int64_t>(items[2 * g]);
    it.rows = items[2 * g + 1];
    it.heads = heads_per_item;
    it.k_cache = k_cache + static_cast<int64_t>(h) * head_dim;
    it.v_cache = v_cache + static_cast<int64_t>(h) * head_dim;
    for (int r = 0; r < it.rows; ++r) {
      const int s = entry[2 * r];
      const int row = entry[2 * r + 1];
      const int q_len = cu_q_lens[s + 1] - cu_q_lens[s];
      it.q[r] = q + row * q_row_stride + static_cast<int64_t>(h) * group * head_dim;
      it.out[r] = out + row * out_row_stride + static_cast<int64_t>(h) * group * head_dim;
      it.table[r] = tables + s * table_stride;
      it.visible[r] = seq_lens[s] - q_len + (row - cu_q_lens[s]) + 1;
      it.first[r] = window > 0 ? std::max(0, it.visible[r] - window) : 0;
    }
  };
  // Each thread claims items from a shared counter (as a dynamic schedule would), one ahead of
  // the one it computes, so that it knows which item comes next and prefetches its first run.
  std::atomic<int64_t> next_work{0};
#pragma omp parallel num_threads(num_threads) if (work > 1 && products >= kParallelProducts)
  {
    Item pair[2];
    int cur = 0;
    int64_t w = next_work.fetch_add(1);
    if (w < work) make_item(w, pair[0]);
    while (w < work) {
      const int64_t w2 = next_work.fetch_add(1);
      const Item* after = nullptr;
      if (w2 < work) {
        make_item(w2, pair[cur ^ 1]);
        after = &pair[cur ^ 1];
      }
      const Item& it = pair[cur];
      switch (head_dim) {
        case 32: attend<32>(it, group, head_dim, block_size, pos_stride, scale, softcap, after); break;
        case 64: attend<64>(it, group, head_dim, block_size, pos_stride, scale, softcap, after); break;
        case 128: attend<128>(it, group, head_dim, block_size, pos_stride, scale, softcap, after); break;
        default: attend<0>(it, group, head_dim, block_size, pos_stride, scale, softcap, after); break;
      }
      w = w2;
      cur ^= 1;
    }
  }
  return 0;
}

// x: [rows, hidden] with row stride x_stride. With delta (row stride delta_stride), first
// x += delta in place (the residual stream). Then out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w.
int ts_rms_norm_f32(float* x, int64_t x_stride, const float* delta, int64_t delta_stride,
                    const float* weight, float* out, int64_t out_stride, int64_t rows, int hidden,
                    float eps, int num_threads) {
  if (rows < 0 || hidden <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows > 1 && rows * hidden >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * x_stride;
    if (delta != nullptr) {
      const float* dr = delta + r * delta_stride;
#pragma omp simd
      for (int i = 0; i < hidden; ++i) xr[i] += dr[i];
    }
    const float ss = dot_fixed(xr, xr, hidden);
    const float inv = 1.0f / __builtin_sqrtf(ss / static_cast<float>(hidden) + eps);
    float* orow = out + r * out_stride;
#pragma omp simd
    for (int i = 0; i < hidden; ++i) orow[i] = xr[i] * inv * weight[i];
  }
  return 0;
}

// gate_up: [rows, 2 * inter] laid out [gate | up] with row stride gu_stride; out: [rows, inter]
// contiguous. out = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
int ts_silu_mul_f32(const float* gate_up, int64_t gu_stride, float* out, int64_t rows, int inter,
                    int num_threads) {
  if (rows < 0 || inter <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows > 1 && rows * inter >= kParallelElems / 2)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * gu_stride;
    const float* u = g + inter;
    float* o = out + r * inter;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= inter; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
  }
  return 0;
}

// Gemma's MLP: as ts_silu_mul_f32, out = gelu_tanh(gate) * up with
// gelu_tanh(g) = 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), and
// tanh(z) = 1 - 2 / (1 + exp(2 z)) (exp(2 z) overflowing to +inf gives tanh 1; a very negative z
// gives -1). Each element is computed alone, so a row's bits depend neither on the other rows
// nor on how many there are.
int ts_gelu_tanh_mul_f32(const float* gate_up, int64_t gu_stride, float* out, int64_t rows,
                         int inter, int num_threads) {
  if (rows < 0 || inter <= 0) return -1;
  const float c2 = 2.0f * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  const float cubic = 0.044715f;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows > 1 && rows * inter >= kParallelElems / 2)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * gu_stride;
    const float* u = g + inter;
    float* o = out + r * inter;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    const __m256 half = _mm256_set1_ps(0.5f), c2v = _mm256_set1_ps(c2);
    const __m256 cubicv = _mm256_set1_ps(cubic);
    for (; i + 8 <= inter; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
      const __m256 z2 = _mm256_mul_ps(c2v, _mm256_add_ps(gv, _mm256_mul_ps(cubicv, g3)));
      const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, exp8(z2))));
      const __m256 act = _mm256_mul_ps(_mm256_mul_ps(half, gv), _mm256_add_ps(one, th));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; ++i) {
      const float gi = g[i];
      const float z2 = c2 * (gi + cubic * (gi * gi * gi));
      const float th = 1.0f - 2.0f / (1.0f + fast_exp(z2));
      o[i] = 0.5f * gi * (1.0f + th) * u[i];
    }
  }
  return 0;
}

// qkv: [rows, hq + 2 * hkv, head_dim] as for ts_rope_store_f32. Each q head becomes
// x / sqrt(mean(x^2) + eps) * q_weight and each k head the same with k_weight (both [head_dim]),
// in place; v heads are left alone. The sum of squares is ts_rms_norm_f32's (16 lanes, a fixed
// tree over head_dim), so a head's bits depend on that head alone.
int ts_qk_norm_f32(float* qkv, int64_t qkv_stride, const float* q_weight, const float* k_weight,
                   int64_t rows, int hq, int hkv, int head_dim, float eps, int num_threads) {
  if (rows < 0 || head_dim <= 0 || hq <= 0 || hkv <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows > 1 && rows * (hq + hkv) * head_dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = qkv + r * qkv_stride;
    for (int h = 0; h < hq + hkv; ++h) {
      float* x = row + static_cast<int64_t>(h) * head_dim;
      const float* w = h < hq ? q_weight : k_weight;
      const float ss = dot_fixed(x, x, head_dim);
      const float inv = 1.0f / __builtin_sqrtf(ss / static_cast<float>(head_dim) + eps);
#pragma omp simd
      for (int i = 0; i < head_dim; ++i) x[i] = x[i] * inv * w[i];
    }
  }
  return 0;
}

// qkv: [rows, hq + 2 * hkv, head_dim] (row stride qkv_stride, heads contiguous): q heads, then
// k heads, then v heads. cos, sin: [rows, head_dim / 2] contiguous (this step's positions).
// Rotates q and k in place ("rotate half": x1 cos - x2 sin, x2 cos + x1 sin), then copies each
// row's k and v heads to cache slot slots[r] of k_cache / v_cache ([slots, hkv, head_dim]).
int ts_rope_store_f32(float* qkv, int64_t qkv_stride, const float* cos, const float* sin,
                      const int64_t* slots, float* k_cache, float* v_cache, int64_t num_slots,
                      int64_t rows, int hq, int hkv, int head_dim, int num_threads) {
  if (rows < 0 || head_dim <= 0 || head_dim % 2 || hq <= 0 || hkv <= 0) return -1;
  for (int64_t r = 0; r < rows; ++r)
    if (slots[r] < 0 || slots[r] >= num_slots) return -5;
  const int half = head_dim / 2;
  const int64_t kv_width = static_cast<int64_t>(hkv) * head_dim;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows > 1 && rows * (hq + 2 * hkv) * head_dim >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = qkv + r * qkv_stride;
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int h = 0; h < hq + hkv; ++h) {
      float* x1 = row + static_cast<int64_t>(h) * head_dim;
      float* x2 = x1 + half;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
    const float* k = row + static_cast<int64_t>(hq) * head_dim;
    std::memcpy(k_cache + slots[r] * kv_width, k, sizeof(float) * kv_width);
    std::memcpy(v_cache + slots[r] * kv_width, k + kv_width, sizeof(float) * kv_width);
  }
  return 0;
}

// w: [n, k] row-major -> packed: [ceil(n / 16), k, 16], W[p * 16 + j][k] at packed[p][k][j],
// zeros past row n - 1.
int ts_pack_linear_f32(const float* w, int64_t n, int64_t k, float* packed, int num_threads) {
  if (n <= 0 || k <= 0) return -1;
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < k; ++kk)
      for (int j = 0; j < kPanel; ++j) {
        const int64_t row = p * kPanel + j;
        packed[(p * k + kk) * kPanel + j] = row < n ? w[row * k + kk] : 0.0f;
      }
  return 0;
}

// y[m, n] = x[m, k] W^T + bias, W packed by ts_pack_linear_f32; x and y rows strided (elements),
// columns contiguous; bias [n] or null. Returns 0, or -1 on sizes or strides that do not fit.
int ts_linear_f32(const float* x, int64_t x_stride, int64_t m, int64_t k, const float* packed,
                  int64_t n, const float* bias, float* y, int64_t y_stride, int num_threads) {
  if (m < 0 || k <= 0 || n <= 0 || (m > 1 && (x_stride < k || y_stride < n))) return -1;
  if (m == 0) return 0;
  const LinearArgs a{x, x_stride, k, n, bias, y, y_stride};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t pairs = (panels + 1) / 2;
  // A multiple of 48 rows: whole tiles of 6, 12 or 16 rows.
  const int64_t row_block = std::max(kRowBlockMin, kRowBlockBytes / (4 * k) / 48 * 48);
#pragma omp parallel num_threads(num_threads) if (pairs > 1 && m * n * k >= kParallelMacs)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Each thread a contiguous run of panel pairs (its own stretch of the weights).
    const int64_t p0 = std::min(panels, 2 * (pairs * t / nt));
    const int64_t p1 = std::min(panels, 2 * (pairs * (t + 1) / nt));
    linear_panels(a, m, row_block, p0, p1,
                  [&](int64_t p, bool) { return packed + p * k * kPanel; });
  }
  return 0;
}

// w: [n, k] row-major fp32 -> packed: its quantized panels (see "quantized weights"), bits 4 or
// 8, or a K form's code (104, 105, 106: see "K-quant forms"); packed holds ceil(n / 16) * (k / 32)
// blocks of 320 (Q4), 544 (Q8), 384 (K4) or 640 (K5, K6) bytes. Returns 0; 1
// when some block of w is not such a dequantization exactly (packed is then of no use); -1 on
// sizes that do not fit (k not a multiple of 32, bits none of these).
int ts_pack_linear_q(const float* w, int64_t n, int64_t k, int32_t bits, uint8_t* packed,
                     int num_threads) {
  if (is_k_form(bits)) return pack_k(w, n, k, bits, packed, num_threads);
  if (n <= 0 || k <= 0 || k % kQBlock || (bits != 4 && bits != 8)) return -1;
  const int64_t panels = (n + kPanel - 1) / kPanel, blocks = k / kQBlock;
  const int64_t bb = q_block_bytes(bits);
  int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : failed)
  for (int64_t p = 0; p < panels; ++p) {
    if (failed) continue;  // this thread has already found a block of no such form
    uint8_t* panel = packed + p * blocks * bb;
    std::memset(panel, 0, static_cast<size_t>(blocks * bb));  // padding outputs: d = m = q = 0
    for (int j = 0; j < kPanel && !failed; ++j) {
      const int64_t row = p * kPanel + j;
      if (row >= n) break;
      for (int64_t b = 0; b < blocks && !failed; ++b)
        if (!quantize_block(w + row * k + b * kQBlock, bits, j, panel + b * bb)) failed = 1;
    }
  }
  return failed ? 1 : 0;
}

// The fp32 panels (ts_pack_linear_f32's layout, [ceil(n / 16), k, 16]) of a quantized weight.
int ts_unpack_linear_q(const uint8_t* packed, int64_t n, int64_t k, int32_t bits, float* out,
                       int num_threads) {
  if (is_k_form(bits)) return unpack_k(packed, n, k, bits, out, num_threads);
  if (n <= 0 || k <= 0 || k % kQBlock || (bits != 4 && bits != 8)) return -1;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t qstride = k / kQBlock * q_block_bytes(bits);
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t p = 0; p < panels; ++p) dequant_panel(packed + p * qstride, k, bits, out + p * k * kPanel);
  return 0;
}

// ts_linear_f32 on a weight packed by ts_pack_linear_q: the same bits as ts_linear_f32 on
// its fp32 panels. Returns 0, or -1 on sizes or strides that do not fit.
int ts_linear_q(const float* x, int64_t x_stride, int64_t m, int64_t k, const uint8_t* packed,
                int32_t bits, int64_t n, const float* bias, float* y, int64_t y_stride,
                int num_threads) {
  if (is_k_form(bits)) return linear_k(x, x_stride, m, k, packed, bits, n, bias, y, y_stride, num_threads);
  if (m < 0 || k <= 0 || n <= 0 || k % kQBlock || (bits != 4 && bits != 8) ||
      (m > 1 && (x_stride < k || y_stride < n)))
    return -1;
  if (m == 0) return 0;
  const LinearArgs a{x, x_stride, k, n, bias, y, y_stride};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t pairs = (panels + 1) / 2;
  const int64_t row_block = std::max(kRowBlockMin, kRowBlockBytes / (4 * k) / 48 * 48);
#pragma omp parallel num_threads(num_threads) if (pairs > 1 && m * n * k >= kParallelMacs)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = std::min(panels, 2 * (pairs * t / nt));
    const int64_t p1 = std::min(panels, 2 * (pairs * (t + 1) / nt));
    if (bits == 4) linear_q_panels<4>(a, m, row_block, packed, p0, p1);
    else linear_q_panels<8>(a, m, row_block, packed, p0, p1);
  }
  return 0;
}

// ----------------------------------------------------------------------------- mixture of experts
//
// The router's choice and the weighted sum of the chosen experts' outputs (the experts
// themselves run on ts_linear_f32 / ts_silu_mul_f32, one call per expert on the rows routed to
// it). Both are per row and fixed-order: a row's weights, experts and sum depend on that row
// alone, whichever rows share the call (the deterministic mode's promise; docs/determinism.md).

// logits: [rows, experts] with row stride logits_stride. Per row: p = softmax(logits) (the max
// subtracted, exp, the sum in expert order, each divided by it), then the top_k experts by p in
// rank order (ties: the lower index first); with renorm, their p divided by the sum of the k
// (in rank order). Writes weights [rows, top_k] and ids [rows, top_k] (int64). Then, on the
// calling thread, a counting sort of the pairs (row r, rank j), pair id r * top_k + j, by
// expert and then pair id: sorted_rows [rows * top_k] (each sorted pair's row), pair_pos
// [rows * top_k] (where pair id p landed) and counts [experts] (pairs per expert).
int ts_moe_route_f32(const float* logits, int64_t logits_stride, int64_t rows, int experts,
                     int top_k, int renorm, float* weights, int64_t* ids, int64_t* sorted_rows,
                     int64_t* pair_pos, int64_t* counts, int num_threads) {
  if (rows < 0 || experts <= 0 || top_k <= 0 || top_k > experts ||
      (rows > 1 && logits_stride < experts))
    return -1;
#pragma omp parallel num_threads(num_threads) if (rows > 1 && rows * experts >= kParallelElems)
  {
    std::vector<float> prob(static_cast<size_t>(experts));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* l = logits + r * logits_stride;
      float mx = l[0];
      for (int e = 1; e < experts; ++e) mx = l[e] > mx ? l[e] : mx;
      float sum = 0.0f;
      for (int e = 0; e < experts; ++e) {
        prob[e] = fast_exp(l[e] - mx);
        sum += prob[e];
      }
      for (int e = 0; e < experts; ++e) prob[e] = prob[e] / sum;
      float* w = weights + r * top_k;
      int64_t* id = ids + r * top_k;
      // Rank j: the best (p descending, index ascending) of those after rank j - 1's.
      float prev_p = 0.0f;
      int prev_e = -1;
      for (int j = 0; j < top_k; ++j) {
        int best = -1;
        for (int e = 0; e < experts; ++e) {
          const bool after = prev_e < 0 || prob[e] < prev_p || (prob[e] == prev_p && e > prev_e);
          if (after && (best < 0 || prob[e] > prob[best])) best = e;
        }
        if (best < 0) best = 0;  // only for NaN probabilities: keep the output defined
        w[j] = prob[best];
        id[j] = best;
        prev_p = prob[best];
        prev_e = best;
      }
      if (renorm) {
        float total = 0.0f;
        for (int j = 0; j < top_k; ++j) total += w[j];
        for (int j = 0; j < top_k; ++j) w[j] = w[j] / total;
      }
    }
  }
  const int64_t pairs = rows * top_k;
  for (int e = 0; e < experts; ++e) counts[e] = 0;
  for (int64_t p = 0; p < pairs; ++p) ++counts[ids[p]];
  std::vector<int64_t> next(static_cast<size_t>(experts));
  int64_t start = 0;
  for (int e = 0; e < experts; ++e) {
    next[e] = start;
    start += counts[e];
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t at = next[ids[p]]++;
    sorted_rows[at] = p / top_k;
    pair_pos[p] = at;
  }
  return 0;
}

// ys: [rows * top_k, hidden] contiguous, the experts' outputs in sorted-pair order; pair_pos
// and weights as ts_moe_route_f32 wrote them. out[r] = sum over ranks j in order of
// weights[r, j] * ys[pair_pos[r * top_k + j]] (each product rounded, then added). With shared
// (row stride shared_stride) and shared_gate [rows], then out[r] += sigmoid(shared_gate[r]) *
// shared[r] (Qwen2-MoE's gated shared expert).
int ts_moe_combine_f32(const float* ys, const int64_t* pair_pos, const float* weights,
                       int64_t rows, int top_k, int hidden, const float* shared,
                       int64_t shared_stride, const float* shared_gate, float* out,
                       int num_threads) {
  if (rows < 0 || top_k <= 0 || hidden <= 0 || (shared != nullptr) != (shared_gate != nullptr) ||
      (shared != nullptr && rows > 1 && shared_stride < hidden))
    return -1;
  const int64_t pairs = rows * top_k;
  for (int64_t p = 0; p < pairs; ++p)
    if (pair_pos[p] < 0 || pair_pos[p] >= pairs) return -5;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows > 1 && rows * top_k * hidden >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * hidden;
    const float* w = weights + r * top_k;
    const float* y0 = ys + pair_pos[r * top_k] * hidden;
#pragma omp simd
    for (int i = 0; i < hidden; ++i) o[i] = w[0] * y0[i];
    for (int j = 1; j < top_k; ++j) {
      const float* y = ys + pair_pos[r * top_k + j] * hidden;
      const float wj = w[j];
#pragma omp simd
      for (int i = 0; i < hidden; ++i) {
        const float term = wj * y[i];
        o[i] = o[i] + term;
      }
    }
    if (shared != nullptr) {
      const float g = shared_gate[r];
      float gate;
      if (g >= 0.0f) {
        gate = 1.0f / (1.0f + fast_exp(-g));
      } else {
        const float e = fast_exp(g);
        gate = e / (1.0f + e);
      }
      const float* s = shared + r * shared_stride;
#pragma omp simd
      for (int i = 0; i < hidden; ++i) {
        const float term = gate * s[i];
        o[i] = o[i] + term;
      }
    }
  }
  return 0;
}

}  // extern "C"

// ----------------------------------------------------------------------------- the boundary
//
// kernels/cpu_native.py calls the functions above through ctypes, which trusts its own
// declaration of each: an argument added, dropped or retyped on one side only would shift every
// later argument, and a kernel would write through the wrong pointer. So the library describes
// its exports itself, from the functions' C++ types (not from a hand-kept copy that could drift),
// and the loader compares that with its declarations and refuses to load on any difference.
namespace sig {

// A type without a kind here does not compile: add it here and to cpu_native's kinds.
template <typename T>
struct Kind {
  static_assert(sizeof(T) == 0, "no descriptor for this argument type");
};
template <> struct Kind<int32_t> { static constexpr const char* name = "i32"; };
template <> struct Kind<int64_t> { static constexpr const char* name = "i64"; };
template <> struct Kind<float> { static constexpr const char* name = "f32"; };
template <> struct Kind<float*> { static constexpr const char* name = "f32*"; };
template <> struct Kind<const float*> { static constexpr const char* name = "const f32*"; };
template <> struct Kind<const int32_t*> { static constexpr const char* name = "const i32*"; };
template <> struct Kind<const int64_t*> { static constexpr const char* name = "const i64*"; };
template <> struct Kind<int64_t*> { static constexpr const char* name = "i64*"; };
template <> struct Kind<uint8_t*> { static constexpr const char* name = "u8*"; };
template <> struct Kind<const uint8_t*> { static constexpr const char* name = "const u8*"; };

// One line per function: "name ret(arg, arg, ...)".
template <typename R, typename... A>
void describe(std::string& out, const char* name, R (*)(A...)) {
  const char* args[] = {Kind<A>::name..., nullptr};  // the sentinel: a function may take none
  out += name;
  out += ' ';
  out += Kind<R>::name;
  out += '(';
  for (size_t i = 0; i < sizeof...(A); ++i) {
    if (i) out += ", ";
    out += args[i];
  }
  out += ")\n";
}

}  // namespace sig

// Every extern "C" function above, once (tests/kernels check the library exports no other).
#define TS_EXPORTS(X)          \
  X(ts_max_vecs)               \
  X(ts_max_head_dim)           \
  X(ts_paged_attention_f32)    \
  X(ts_rms_norm_f32)           \
  X(ts_silu_mul_f32)           \
  X(ts_gelu_tanh_mul_f32)      \
  X(ts_qk_norm_f32)            \
  X(ts_rope_store_f32)         \
  X(ts_pack_linear_f32)        \
  X(ts_linear_f32)             \
  X(ts_pack_linear_q)          \
  X(ts_unpack_linear_q)        \
  X(ts_linear_q)                \
  X(ts_moe_route_f32)          \
  X(ts_moe_combine_f32)

extern "C" const char* ts_signatures() {
  static const std::string table = [] {
    std::string s;
#define TS_DESCRIBE(fn) sig::describe(s, #fn, &fn);
    TS_EXPORTS(TS_DESCRIBE)
#undef TS_DESCRIBE
    return s;
  }();
  return table.c_str();
}

// The attention of a LISA shared layer (lowrank layout) on CPU, reading vLLM's paged caches in place.
// Reference and fallback: lowrank.attend (torch). Built at first use by lowrank.lisa_kernel (torch cpp_extension).
//
// A shared layer scores query head h as S[h] = scale[h] * S_below[source[h]] + own[h] . k_lr[key(h)]: the layer below's
// scores of its head source[h] (its query features below[source[h]] against the key parts below this layer: the
// root's K, as the CPU backend's ISA lays it out in its cache, and the low-rank keys of the chain's earlier shared
// layers, transposed per block in theirs), scaled, plus this layer's low-rank term. Align maps several heads to one
// source (SmolLM2: 2 to 6 sources for 9 heads), so S_below is computed once per source, not per head: fewer
// multiply-adds than a full layer's attention.
//
// Per (request, tile of query rows, query heads) it walks the request's block table: per block, the sources' scores
// below, then per KV head its query heads' scores, masked causally (and by the window), an online (flash-style)
// softmax and the values of this layer's own cache (one KV group's score rows stay in cache through the three).
// Everything is computed in fp32; caches may be fp32, bf16, fp16 or fp8 bytes (e4m3 / e5m2, times the layer's scale).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;     // columns of a score tile (a 512-bit register of fp32)
constexpr int ROW_TILE = 32;  // a prefill's query rows per work item
// rows of a micro-kernel call (its accumulators stay in registers): scores 8 (x 2 vectors of keys), values 6 (x 4
// vectors: a 64-wide head in one sweep of the probabilities; 8 x 2 took 3-7% longer at prefill)
constexpr int SCORE_ROWS = 8;
constexpr int VALUE_ROWS = 6;

enum Format { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4 };
// key tiles read in place: fp32 or bf16 rows (a feature's positions consecutive), bf16 packed for AMX; NONE: gathered
enum InPlace { NONE = 0, F32_ROWS = 1, BF16_ROWS = 2, AMX_PAIRS = 3 };

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

const float* fp8_table(int format) {
  static const std::vector<float> tables = [] {
    std::vector<float> t(512);
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
      t[256 + b] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(b), c10::Float8_e5m2::from_bits()));
    }
    return t;
  }();
  return tables.data() + (format == E5M2 ? 256 : 0);
}

// Calls f(get) with get(index) -> float for the element type of `format` (the switch stays outside the loops).
template <typename F>
inline void with_reader(const void* data, int format, float scale, F&& f) {
  switch (format) {
    case F32: {
      auto p = static_cast<const float*>(data);
      f([p](int64_t k) { return p[k]; });
      break;
    }
    case BF16: {
      auto p = static_cast<const c10::BFloat16*>(data);
      f([p](int64_t k) { return static_cast<float>(p[k]); });
      break;
    }
    case F16: {
      auto p = static_cast<const c10::Half*>(data);
      f([p](int64_t k) { return static_cast<float>(p[k]); });
      break;
    }
    default: {  // fp8 bytes, dequantized as the reference does: the format's value times the layer's scale
      auto p = static_cast<const uint8_t*>(data);
      const float* lut = fp8_table(format);
      f([p, lut, scale](int64_t k) { return lut[p[k]] * scale; });
    }
  }
}

// fp32 vectors of LANES (gcc's vector extension: registers of the widest ISA -march=native gives, split where narrower)
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vec load(const float* p) { return *reinterpret_cast<const vec_unaligned*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_unaligned*>(p) = v; }
const ivec LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  // a lane's column in its vector

// exp(x) for x <= 0 (a score minus its running maximum; -inf where hidden): 2^n * p(r), relative error ~1e-7; 0 below
// -87 (where fp32 underflows anyway)
inline vec exp_nonpositive(vec x) {
  const ivec low = x < -87.0f;
  x = low ? vec{} - 87.0f : x;
  const vec magic = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec n = (x * 1.44269504088896341f + magic) - magic;
  const vec r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  vec p = vec{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  const vec result = p * reinterpret_cast<const vec&>(bits);
  return low ? vec{} : result;
}

// a vector's sum and maximum: in a tree of shuffles where AVX-512 has them (a lane-by-lane chain is a row's longest
// dependency in the softmax)
inline float sum_of(vec v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += v[l];
  return s;
#endif
}

inline float max_of(vec v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int l = 1; l < LANES; ++l) m = std::max(m, v[l]);
  return m;
#endif
}

// The matrix M of a rank update, row i's LANES columns from column j as fp32 (`M(i, j)`; one element of values:
// `at(i, j)`), read where it lies: fp32 rows, bf16 rows (a bf16 is an fp32's high half: widened as loaded), or the root's K as vLLM
// packs it for AMX (per tile of 16 positions, a feature pair's 16 x 2 bf16: one uint32 per position, the even feature
// in its low half).
typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(2)));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t)), aligned(4)));

inline vec as_floats(uvec bits) {
  vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

struct F32Rows {
  const float* m;
  int64_t ld;
  vec operator()(int64_t i, int64_t j) const { return load(m + i * ld + j); }
  float at(int64_t i, int64_t j) const { return m[i * ld + j]; }
};

struct BF16Rows {
  const uint16_t* m;
  int64_t ld;
  vec operator()(int64_t i, int64_t j) const {
    return as_floats(__builtin_convertvector(*reinterpret_cast<const hvec*>(m + i * ld + j), uvec) << 16);
  }
  float at(int64_t i, int64_t j) const {
    return static_cast<float>(c10::BFloat16(m[i * ld + j], c10::BFloat16::from_bits()));
  }
};

struct AMXRows {
  const uint32_t* m;  // the first tile of the positions read
  int64_t tile;       // uint32s per tile of 16 positions (8 x head size)
  vec operator()(int64_t i, int64_t j) const {
    const uvec pairs = *reinterpret_cast<const uvec*>(m + (j >> 4) * tile + (i >> 1) * 16);
    return as_floats((i & 1) ? (pairs & 0xFFFF0000u) : (pairs << 16));
  }
};

// Out[r][j:j+C*LANES] (+)= sum_{i0 <= i < i1} A[r][i] * M[i][j:...] for R rows given by pointers: C vectors of
// columns at a time, the R x C accumulators in registers. Scores: A the queries, M the (transposed) keys; values: A the
// probabilities, M the values. ACCUMULATE is a template argument: chosen at run time, the accumulators' start went
// through the stack.
template <int R, int C, bool ACCUMULATE, typename Rows>
inline void rank_update_tile(float* const* Out, const float* const* A, const Rows& M, int64_t i0, int64_t i1,
                             int64_t j) {
  vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = ACCUMULATE ? load(Out[r] + j + c * LANES) : vec{};
  for (int64_t i = i0; i < i1; ++i) {
    vec m[C];
    for (int c = 0; c < C; ++c) m[c] = M(i, j + c * LANES);
    for (int r = 0; r < R; ++r) {
      const float a = A[r][i];
      for (int c = 0; c < C; ++c) acc[r][c] += a * m[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(Out[r] + j + c * LANES, acc[r][c]);
}

// Column vectors per micro-kernel call for R rows: R x C accumulators and C loaded vectors within the 32 registers.
// Few rows (a decode) take wide tiles, so each row of M (a key feature over the block, a value row) is read once, in
// one sweep; many rows (a prefill) narrow ones, each M vector then feeding R multiply-adds.
template <int R>
constexpr int columns_for() { return R <= 2 ? 8 : (R <= 4 ? 4 : 2); }

template <int R>
struct Scores {
  template <typename Rows>
  static void run(float* const* S, const float* const* Q, const Rows& K, int width, int64_t cols, bool accumulate) {
    if (accumulate)
      columns<true>(S, Q, K, width, cols);
    else
      columns<false>(S, Q, K, width, cols);
  }

  template <bool ACCUMULATE, typename Rows>
  static void columns(float* const* S, const float* const* Q, const Rows& K, int width, int64_t cols) {
    constexpr int C = columns_for<R>();
    int64_t j = 0;
    for (; j + C * LANES <= cols; j += C * LANES) rank_update_tile<R, C, ACCUMULATE>(S, Q, K, 0, width, j);
    for (; j + 2 * LANES <= cols; j += 2 * LANES) rank_update_tile<R, 2, ACCUMULATE>(S, Q, K, 0, width, j);
    if (j < cols) rank_update_tile<R, 1, ACCUMULATE>(S, Q, K, 0, width, j);
  }
};

template <int R>
struct Values {
  template <typename Rows>
  static void run(float* const* O, const float* const* P, const Rows& V, int64_t p0, int64_t p1, int d) {
    static_assert(R <= VALUE_ROWS, "values run VALUE_ROWS rows at a time");
    constexpr int C = R <= 2 ? 8 : 4;
    int64_t j = 0;
    for (; j + C * LANES <= d; j += C * LANES) rank_update_tile<R, C, true>(O, P, V, p0, p1, j);
    for (; j + 4 * LANES <= d; j += 4 * LANES) rank_update_tile<R, 4, true>(O, P, V, p0, p1, j);
    for (; j + 2 * LANES <= d; j += 2 * LANES) rank_update_tile<R, 2, true>(O, P, V, p0, p1, j);
    if (j + LANES <= d) {
      rank_update_tile<R, 1, true>(O, P, V, p0, p1, j);
      j += LANES;
    }
    for (; j < d; ++j)  // a head size not a multiple of LANES (tiny test models)
      for (int r = 0; r < R; ++r) {
        float a = O[r][j];
        for (int64_t p = p0; p < p1; ++p) a += P[r][p] * V.at(p, j);
        O[r][j] = a;
      }
  }
};

// K<n>::run(args...) for the n (1 <= n <= R) given at run time: R instances, chosen by comparisons
template <template <int> class K, int R, typename... A>
inline void run_rows(size_t n, A... args) {
  if constexpr (R > 1) {
    if (n < R) return run_rows<K, R - 1>(n, args...);
  }
  K<R>::run(args...);
}

// Runs K<R>::run over the rows given by pointer arrays (the first two arguments), ROWS at a time.
template <template <int> class K, int ROWS, typename Out, typename In, typename... A>
inline void over_rows(size_t rows, Out* const* out, const In* const* in, A... args) {
  for (size_t r0 = 0; r0 < rows; r0 += ROWS)
    run_rows<K, ROWS>(std::min<size_t>(rows - r0, ROWS), out + r0, in + r0, args...);
}

int format_of(const at::Tensor& cache, int64_t fp8) {
  switch (cache.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    case at::kByte:
      TORCH_CHECK(fp8 == 1 || fp8 == 2, "hfcompress lisa_attention: a uint8 cache needs an fp8 format (1 e4m3, 2 e5m2)");
      return fp8 == 1 ? E4M3 : E5M2;
    default: TORCH_CHECK(false, "hfcompress lisa_attention: unsupported cache dtype ", cache.scalar_type());
  }
}

// One part of the key: where its elements lie in a paged cache.
struct Part {
  const char* data;
  int format;
  int64_t block, block_stride, pos_stride, elem_stride;  // its block size; strides in elements
  std::vector<int64_t> head_base;                 // per part head, its offset in a block (elements)
  std::vector<std::vector<int>> readers;          // per part head, the heads reading it (below heads; own: query heads)
  int width, q_offset;  // q_offset: its features' offset in the query it is scored with (below's, or own)
  float scale;
  const int32_t* table;
  int64_t table_stride;
  int in_place;  // how its key tiles are read in place (InPlace), or NONE: gathered into fp32
  // the root's K as the AMX ISA packs it (bf16 or fp8): per block and KV head [block / 16][head size / 2][16][2]
  bool amx;
  int64_t amx_tile;  // elements of one tile of 16 positions: 16 * head size
};

struct Context {
  const char* below;  // (T, H, below_width): the layer below's query features
  const char* own;    // (T, H, own_width): this layer's low-rank queries
  char* output;
  int io_format;
  int64_t heads, below_width, own_width, d, block, ld, group, window, num_tokens;  // block: the tile of key positions
  std::vector<int64_t> source;  // per query head, the below head whose scores it takes, times align_scale
  std::vector<float> align_scale;
  const int64_t* query_start;
  const int64_t* seq_lens;
  std::vector<Part> parts;  // the parts below this layer, then its own (last)
  // this layer's own cache: per block and KV head its keys, then V (v_offset: after the keys) as [block][d]
  const char* v_data;
  int v_format;
  int64_t v_block, v_block_stride, v_head_stride, v_pos_stride, v_offset;
  float v_scale;
  const int32_t* v_table;
  int64_t v_table_stride;
};

struct Scratch {
  std::vector<float> qb, qo, o, m, l, b, s, keys, values;
  std::vector<int64_t> slot_of, sources;          // per below head, its slot (-1: unread); per slot, its below head
  std::vector<float*> s_rows, o_rows;             // per part head's readers (then per KV head's), their rows
  std::vector<const float*> q_rows, p_rows;
  std::vector<size_t> part_rows;                  // per (part, part head): where its rows start in s_rows / q_rows
};

// n query features from element k of a (T, H, W) tensor of the io format, as floats (the switch outside the loop)
void load_row(float* dst, const char* base, int format, int64_t k, int64_t n) {
  switch (format) {
    case F32: std::memcpy(dst, reinterpret_cast<const float*>(base) + k, n * sizeof(float)); break;
    case BF16: {
      auto p = reinterpret_cast<const c10::BFloat16*>(base) + k;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]);
      break;
    }
    default: {
      auto p = reinterpret_cast<const c10::Half*>(base) + k;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(p[i]);
    }
  }
}

// n outputs src * mul to element k of the output, in the io format
void store_row(char* base, int format, int64_t k, const float* src, float mul, int64_t n) {
  switch (format) {
    case F32: {
      float* p = reinterpret_cast<float*>(base) + k;
      for (int64_t i = 0; i < n; ++i) p[i] = src[i] * mul;
      break;
    }
    case BF16: {
      auto p = reinterpret_cast<c10::BFloat16*>(base) + k;
      for (int64_t i = 0; i < n; ++i) p[i] = c10::BFloat16(src[i] * mul);
      break;
    }
    default: {
      auto p = reinterpret_cast<c10::Half*>(base) + k;
      for (int64_t i = 0; i < n; ++i) p[i] = c10::Half(src[i] * mul);
    }
  }
}

// Calls f(rows) with the keys of part head `ph` in block `blk` at positions [off, off + n) as rows (row i: feature i
// over the positions): in place where the cache allows (`Part::in_place`), else gathered as fp32 into `scratch` (zero
// past n).
template <typename F>
void with_keys(const Context& c, const Part& part, int64_t blk, int64_t off, int ph, int64_t n, float* scratch, F&& f) {
  const int64_t head = blk * part.block_stride + part.head_base[ph];
  const int64_t base = head + off * part.pos_stride;
  switch (part.in_place) {
    case F32_ROWS: return f(F32Rows{reinterpret_cast<const float*>(part.data) + base, part.elem_stride});
    case BF16_ROWS: return f(BF16Rows{reinterpret_cast<const uint16_t*>(part.data) + base, part.elem_stride});
    case AMX_PAIRS: {
      const uint16_t* first = reinterpret_cast<const uint16_t*>(part.data) + head + (off >> 4) * part.amx_tile;
      return f(AMXRows{reinterpret_cast<const uint32_t*>(first), part.amx_tile / 2});
    }
    default: break;
  }
  const int64_t cols = round_up(n, LANES);
  with_reader(part.data, part.format, part.scale, [&](auto get) {
    if (part.amx) {  // per tile of 16 positions and feature pair, 32 elements: position-major, the pair interleaved
      for (int64_t t0 = off; t0 < off + n; t0 += 16) {
        const int64_t tile = head + (t0 >> 4) * part.amx_tile, p0 = t0 - off, m = std::min<int64_t>(16, off + n - t0);
        for (int i = 0; i < part.width; ++i) {
          float* dst = scratch + i * c.ld + p0;
          const int64_t at = tile + (i >> 1) * 32 + (i & 1);
          for (int64_t q = 0; q < m; ++q) dst[q] = get(at + 2 * q);
        }
      }
    } else {  // a feature's positions are consecutive (pos_stride 1): read and written as rows
      for (int i = 0; i < part.width; ++i) {
        float* dst = scratch + i * c.ld;
        const int64_t at = base + i * part.elem_stride;
        for (int64_t p = 0; p < n; ++p) dst[p] = get(at + p * part.pos_stride);
      }
    }
    for (int i = 0; i < part.width; ++i)
      for (int64_t p = n; p < cols; ++p) scratch[i * c.ld + p] = 0.0f;
  });
  f(F32Rows{scratch, c.ld});
}

// Calls f(rows) with V of KV head `kv` in block `blk` at positions off + [p0, n) as rows [position][d]: in place in an
// fp32 or bf16 cache, else gathered as fp32 into `scratch`.
template <typename F>
void with_values(const Context& c, int64_t blk, int64_t off, int64_t kv, int64_t p0, int64_t n, float* scratch, F&& f) {
  const int64_t base = blk * c.v_block_stride + kv * c.v_head_stride + c.v_offset + off * c.v_pos_stride;
  if (c.v_format == F32) return f(F32Rows{reinterpret_cast<const float*>(c.v_data) + base, c.v_pos_stride});
  if (c.v_format == BF16) return f(BF16Rows{reinterpret_cast<const uint16_t*>(c.v_data) + base, c.v_pos_stride});
  with_reader(c.v_data, c.v_format, c.v_scale, [&](auto get) {
    for (int64_t p = p0; p < n; ++p)
      for (int64_t x = 0; x < c.d; ++x) scratch[p * c.d + x] = get(base + p * c.v_pos_stride + x);
  });
  f(F32Rows{scratch, c.d});
}

// Query rows [row0, row0 + rows) of request `req`, the query heads of KV heads [kv0, kv1)
void attend_item(const Context& c, int64_t req, int64_t row0, int64_t rows, int64_t kv0, int64_t kv1, Scratch& s) {
  const int64_t H = c.heads, Wb = c.below_width, Wo = c.own_width, d = c.d, bs = c.block, ld = c.ld;
  const int64_t h0 = kv0 * c.group, h1 = kv1 * c.group;
  const int64_t first = c.query_start[req];
  const int64_t count = std::min(c.query_start[req + 1], c.num_tokens) - first;
  const int64_t pos0 = c.seq_lens[req] - count + row0;  // key position of the first row
  const int64_t hi = pos0 + rows - 1;
  const int64_t lo = c.window > 0 ? std::max<int64_t>(0, pos0 - c.window + 1) : 0;
  const size_t P = c.parts.size();
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

  // the below heads these query heads read, one slot each: their scores are computed once
  s.slot_of.assign(H, -1);
  s.sources.clear();
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t u = c.source[h];
    if (s.slot_of[u] < 0) {
      s.slot_of[u] = static_cast<int64_t>(s.sources.size());
      s.sources.push_back(u);
    }
  }
  const int64_t U = static_cast<int64_t>(s.sources.size());
  s.qb.resize(U * rows * Wb);  // [slot][row][feature]
  for (int64_t u = 0; u < U; ++u)
    for (int64_t r = 0; r < rows; ++r)
      load_row(s.qb.data() + (u * rows + r) * Wb, c.below, c.io_format, ((first + row0 + r) * H + s.sources[u]) * Wb, Wb);
  s.qo.resize(H * rows * Wo);  // [head][row][feature]
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t r = 0; r < rows; ++r)
      load_row(s.qo.data() + (h * rows + r) * Wo, c.own, c.io_format, ((first + row0 + r) * H + h) * Wo, Wo);
  s.o.assign(H * rows * d, 0.0f);
  s.m.assign(H * rows, NEG_INF);
  s.l.assign(H * rows, 0.0f);
  s.b.resize(U * rows * ld);
  s.s.resize(H * rows * ld);
  int max_width = 0;
  for (const Part& part : c.parts) max_width = std::max(max_width, part.width);
  s.keys.resize(max_width * ld);
  s.values.resize(bs * d);
  // the rows each part head's keys meet (all its readers' rows: a key tile is read once for them all): the below
  // parts' into the slots' scores; the own part's into the query heads', per KV head (its query heads' scores, softmax
  // and values follow each other while their rows are in cache); and the rows each KV head's values meet
  s.s_rows.clear();
  s.q_rows.clear();
  s.part_rows.clear();
  for (size_t pi = 0; pi + 1 < P; ++pi) {
    const Part& part = c.parts[pi];
    for (const std::vector<int>& readers : part.readers) {
      s.part_rows.push_back(s.s_rows.size());
      for (int u : readers) {
        const int64_t slot = s.slot_of[u];
        if (slot < 0) continue;
        for (int64_t r = 0; r < rows; ++r) {
          s.s_rows.push_back(s.b.data() + (slot * rows + r) * ld);
          s.q_rows.push_back(s.qb.data() + (slot * rows + r) * Wb + part.q_offset);
        }
      }
    }
  }
  // (KV head kv, own part head ph)'s rows: part_rows' entry own_first + (kv - kv0) * PH + ph
  const Part& own = c.parts.back();
  const size_t own_first = s.part_rows.size(), PH = own.readers.size();
  for (int64_t kv = kv0; kv < kv1; ++kv)
    for (const std::vector<int>& readers : own.readers) {
      s.part_rows.push_back(s.s_rows.size());
      for (int h : readers) {
        if (h / c.group != kv) continue;
        for (int64_t r = 0; r < rows; ++r) {
          s.s_rows.push_back(s.s.data() + (h * rows + r) * ld);
          s.q_rows.push_back(s.qo.data() + (h * rows + r) * Wo);
        }
      }
    }
  s.part_rows.push_back(s.s_rows.size());
  s.o_rows.clear();
  s.p_rows.clear();
  for (int64_t h = h0; h < h1; ++h)  // in order: KV head kv's are rows [(kv - kv0) * group * rows, + group * rows)
    for (int64_t r = 0; r < rows; ++r) {
      s.o_rows.push_back(s.o.data() + (h * rows + r) * d);
      s.p_rows.push_back(s.s.data() + (h * rows + r) * ld);
    }

  for (int64_t b = lo / bs; b <= hi / bs; ++b) {
    const int64_t k0 = b * bs;
    const int64_t n = std::min(bs, hi + 1 - k0);  // positions of this block any row may see
    const int64_t jlo = std::max<int64_t>(lo - k0, 0);
    const int64_t cols = round_up(n, LANES);
    // part pi's scores: its head ph against the rows of part_rows' entry e0 + ph (accumulating: added to theirs)
    const auto score = [&](size_t pi, size_t e0, bool accumulate) {
      const Part& part = c.parts[pi];
      const int64_t blk = part.table[req * part.table_stride + k0 / part.block], off = k0 % part.block;
      for (size_t ph = 0; ph < part.readers.size(); ++ph) {
        const size_t begin = s.part_rows[e0 + ph], end = s.part_rows[e0 + ph + 1];
        if (begin == end) continue;
        with_keys(c, part, blk, off, static_cast<int>(ph), n, s.keys.data(), [&](const auto& keys) {
          over_rows<Scores, SCORE_ROWS>(end - begin, s.s_rows.data() + begin, s.q_rows.data() + begin, keys,
                                        part.width, cols, accumulate);
        });
      }
    };
    // the below parts, for all the slots: the first writes their scores, the next add to them
    size_t entry = 0;
    for (size_t pi = 0; pi + 1 < P; ++pi) {
      score(pi, entry, pi > 0);
      entry += c.parts[pi].readers.size();
    }
    const int64_t vblk = c.v_table[req * c.v_table_stride + k0 / c.v_block], voff = k0 % c.v_block;
    const size_t per_kv = c.group * rows;
    for (int64_t kv = kv0; kv < kv1; ++kv) {
      score(P - 1, own_first + (kv - kv0) * PH, false);
      // S = scale * S_below[source] + own term, then the masked online softmax: S becomes the block's probabilities
      // (0 where hidden) relative to the running maximum
      for (int64_t h = kv * c.group; h < (kv + 1) * c.group; ++h)
        for (int64_t r = 0; r < rows; ++r) {
          float* row = s.s.data() + (h * rows + r) * ld;
          const float* below = s.b.data() + (s.slot_of[c.source[h]] * rows + r) * ld;
          const float scale = c.align_scale[h];
          const int64_t pos = pos0 + r;
          const int64_t a = c.window > 0 ? std::max<int64_t>(jlo, pos - c.window + 1 - k0) : jlo;  // visible: [a, z]
          const int64_t z = std::min<int64_t>(n - 1, pos - k0);
          if (a > z) {
            std::fill(row, row + cols, 0.0f);
            continue;
          }
          // combined, masked (-inf; the cache past a sequence may hold anything) and the maximum, in one pass
          vec top = vec{} + NEG_INF;
          for (int64_t j = 0; j < cols; j += LANES) {
            vec v = load(row + j) + scale * load(below + j);
            if (j < a || j + LANES - 1 > z) {
              const ivec at = LANE_INDEX + static_cast<int32_t>(j);
              v = (at < static_cast<int32_t>(a)) | (at > static_cast<int32_t>(z)) ? vec{} + NEG_INF : v;
            }
            store(row + j, v);
            top = v > top ? v : top;
          }
          const int64_t k = h * rows + r;
          const float m = std::max(s.m[k], max_of(top));
          vec sum{};
          for (int64_t j = 0; j < cols; j += LANES) {
            const vec p = exp_nonpositive(load(row + j) - m);
            store(row + j, p);
            sum += p;
          }
          const float alpha = std::exp(s.m[k] - m);  // 0 at the first visible block (m was -inf)
          if (alpha != 1.0f) {
            float* out = s.o.data() + k * d;
            for (int64_t x = 0; x < d; ++x) out[x] *= alpha;
          }
          s.l[k] = s.l[k] * alpha + sum_of(sum);
          s.m[k] = m;
        }
      const size_t at = (kv - kv0) * per_kv;
      with_values(c, vblk, voff, kv, jlo, n, s.values.data(), [&](const auto& values) {
        over_rows<Values, VALUE_ROWS>(per_kv, s.o_rows.data() + at, s.p_rows.data() + at, values, jlo, n,
                                      static_cast<int>(d));
      });
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t k = h * rows + r;
      store_row(c.output, c.io_format, ((first + row0 + r) * H + h) * d, s.o.data() + k * d, 1.0f / s.l[k], d);
    }
}

void lisa_attention(const at::Tensor& below, const at::Tensor& source, const at::Tensor& align_scale,
                    const at::Tensor& own, const at::Tensor& output, const at::Tensor& query_start,
                    const at::Tensor& seq_lens, int64_t num_tokens, int64_t window, at::TensorList caches,
                    at::TensorList tables, at::IntArrayRef roots, at::TensorList heads, at::IntArrayRef widths,
                    at::IntArrayRef per_cache_head, at::ArrayRef<double> scales, at::IntArrayRef fp8,
                    const at::Tensor& value_cache, const at::Tensor& value_table, int64_t value_offset, double value_scale,
                    int64_t value_fp8) {
  TORCH_CHECK(below.dim() == 3 && below.is_contiguous() && own.dim() == 3 && own.is_contiguous() && output.dim() == 3 &&
              output.is_contiguous(), "hfcompress lisa_attention: below (T, H, Wb), own (T, H, r) queries and output (T, H, d) must be contiguous");
  TORCH_CHECK(below.scalar_type() == output.scalar_type() && own.scalar_type() == output.scalar_type(),
              "hfcompress lisa_attention: query and output dtypes differ");
  TORCH_CHECK(own.size(0) == below.size(0) && own.size(1) == below.size(1) && output.size(1) == below.size(1),
              "hfcompress lisa_attention: below, own and output differ in tokens or heads");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong && query_start.is_contiguous()
              && seq_lens.is_contiguous(), "hfcompress lisa_attention: query_start and seq_lens must be contiguous int64");
  const size_t P = caches.size();
  TORCH_CHECK(P > 1 && tables.size() == P && roots.size() == P && heads.size() == P && widths.size() == P &&
              per_cache_head.size() == P && scales.size() == P && fp8.size() == P, "hfcompress lisa_attention: part lists differ in length");
  Context c;
  c.below = static_cast<const char*>(below.data_ptr());
  c.own = static_cast<const char*>(own.data_ptr());
  c.output = static_cast<char*>(output.data_ptr());
  const int io = format_of(below, 0);
  TORCH_CHECK(io == F32 || io == BF16 || io == F16, "hfcompress lisa_attention: query dtype ", below.scalar_type());
  c.io_format = io;
  c.heads = below.size(1);
  c.below_width = below.size(2);
  c.own_width = own.size(2);
  TORCH_CHECK(source.scalar_type() == at::kLong && source.numel() == c.heads && source.is_contiguous() &&
              align_scale.scalar_type() == at::kFloat && align_scale.numel() == c.heads && align_scale.is_contiguous(),
              "hfcompress lisa_attention: source (int64) and align_scale (float32) need one entry per query head");
  c.source.assign(source.data_ptr<int64_t>(), source.data_ptr<int64_t>() + c.heads);
  c.align_scale.assign(align_scale.data_ptr<float>(), align_scale.data_ptr<float>() + c.heads);
  for (int64_t u : c.source) TORCH_CHECK(u >= 0 && u < c.heads, "hfcompress lisa_attention: source out of range");
  c.d = output.size(2);
  // key positions are walked in tiles of the smallest block size, which divides the others (vLLM splits its blocks
  // into the kernel block sizes a backend takes: a part's cache may have smaller blocks than this layer's)
  c.block = value_cache.size(2);
  for (const at::Tensor& cache : caches) c.block = std::min(c.block, cache.size(2));
  c.ld = round_up(c.block, LANES);
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.stride(3) == 1 && c.heads % value_cache.size(1) == 0,
              "hfcompress lisa_attention: value cache (blocks, KV, block, width) with contiguous rows");
  c.group = c.heads / value_cache.size(1);
  c.window = window;
  c.num_tokens = num_tokens;
  c.query_start = query_start.data_ptr<int64_t>();
  c.seq_lens = seq_lens.data_ptr<int64_t>();
  const int64_t requests = seq_lens.numel();
  TORCH_CHECK(query_start.numel() == requests + 1, "hfcompress lisa_attention: query_start needs requests + 1 entries");

  int64_t offset = 0;
  for (size_t pi = 0; pi < P; ++pi) {
    const at::Tensor& cache = caches[pi];
    TORCH_CHECK(cache.dim() == 4 && cache.size(2) % c.block == 0 && cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
                "hfcompress lisa_attention: part ", pi, ": a cache (blocks, heads, block, row), its block size a multiple of the others'");
    TORCH_CHECK(tables[pi].scalar_type() == at::kInt && tables[pi].stride(1) == 1 && tables[pi].size(0) >= requests,
                "hfcompress lisa_attention: block tables must be int32 rows");
    Part part;
    part.data = static_cast<const char*>(cache.data_ptr());
    part.format = format_of(cache, fp8[pi]);
    part.width = static_cast<int>(widths[pi]);
    const bool own_part = pi + 1 == P;
    part.q_offset = own_part ? 0 : static_cast<int>(offset);
    if (!own_part) offset += part.width;
    part.scale = static_cast<float>(scales[pi]);
    part.table = tables[pi].data_ptr<int32_t>();
    part.table_stride = tables[pi].stride(0);
    part.block = cache.size(2);
    part.block_stride = cache.stride(0);
    int64_t part_heads;
    part.amx = roots[pi] == 2;
    part.amx_tile = 16 * (cache.size(3) / 2);
    if (roots[pi]) {  // the CPU backend: per block and KV head, K (1: as [head size][block]; 2: AMX tiles), then V
      TORCH_CHECK(roots[pi] == 1 || roots[pi] == 2, "hfcompress lisa_attention: root layout 1 (transposed) or 2 (amx)");
      TORCH_CHECK(part.width * 2 <= cache.size(3), "hfcompress lisa_attention: root part wider than its head size");
      TORCH_CHECK(!part.amx || (part.block % 16 == 0 && cache.size(3) % 4 == 0),
                  "hfcompress lisa_attention: an AMX-packed root needs blocks of 16 positions and an even head size");
      part_heads = cache.size(1);
      part.pos_stride = 1;
      part.elem_stride = part.block;
      for (int64_t ph = 0; ph < part_heads; ++ph) part.head_base.push_back(ph * cache.stride(1));
    } else {  // a LowRankCacheAttention cache: per block and cache head, the low-rank keys of its key heads as
              // [per * width][block], then V
      const int64_t per = per_cache_head[pi];
      part_heads = cache.size(1) * per;
      TORCH_CHECK(per * part.width <= cache.size(3), "hfcompress lisa_attention: low-rank keys wider than the cache row");
      part.pos_stride = 1;
      part.elem_stride = part.block;
      for (int64_t ph = 0; ph < part_heads; ++ph)
        part.head_base.push_back(ph / per * cache.stride(1) + ph % per * part.width * part.block);
    }
    // in place: tiles of whole vectors inside its blocks (and, packed for AMX, tiles starting at a tile of 16)
    part.in_place = c.block % LANES ? NONE
                    : part.amx      ? (part.format == BF16 ? AMX_PAIRS : NONE)
                    : part.format == F32 ? F32_ROWS
                    : part.format == BF16 ? BF16_ROWS
                                          : NONE;
    const at::Tensor& map = heads[pi];
    TORCH_CHECK(map.scalar_type() == at::kLong && map.numel() == c.heads && map.is_contiguous(),
                "hfcompress lisa_attention: a part's head map has one int64 per query head");
    // readers: a below part's heads are read by the below heads (query head h reads what its source reads), the
    // own part's by the query heads
    part.readers.assign(part_heads, {});
    std::vector<int64_t> read_by(c.heads, -1);  // below part: per below head, its part head
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t ph = map.data_ptr<int64_t>()[h];
      TORCH_CHECK(ph >= 0 && ph < part_heads, "hfcompress lisa_attention: head map out of range");
      if (own_part) {
        part.readers[ph].push_back(static_cast<int>(h));
        continue;
      }
      const int64_t u = c.source[h];
      TORCH_CHECK(read_by[u] < 0 || read_by[u] == ph, "hfcompress lisa_attention: part ", pi,
                  ": query heads of one source read different heads");
      if (read_by[u] < 0) part.readers[ph].push_back(static_cast<int>(u));
      read_by[u] = ph;
    }
    c.parts.push_back(std::move(part));
  }
  TORCH_CHECK(offset == c.below_width && c.parts.back().width == c.own_width,
              "hfcompress lisa_attention: the parts' widths do not add up to the queries'");
  TORCH_CHECK(value_offset + c.d <= value_cache.size(3), "hfcompress lisa_attention: V past the cache row");
  TORCH_CHECK(value_table.scalar_type() == at::kInt && value_table.stride(1) == 1, "hfcompress lisa_attention: int32 table");
  c.v_data = static_cast<const char*>(value_cache.data_ptr());
  c.v_format = format_of(value_cache, value_fp8);
  TORCH_CHECK(value_cache.size(2) % c.block == 0, "hfcompress lisa_attention: block sizes must divide each other");
  c.v_block = value_cache.size(2);
  c.v_block_stride = value_cache.stride(0);
  c.v_head_stride = value_cache.stride(1);
  c.v_pos_stride = c.d;  // V after the keys: [block][d]
  c.v_offset = value_offset * c.v_block;
  c.v_scale = static_cast<float>(value_scale);
  c.v_table = value_table.data_ptr<int32_t>();
  c.v_table_stride = value_table.stride(0);

  // work items: (request, tile of query rows), all heads (a key tile is read once for all the heads that read it); with
  // fewer tiles than threads, one item per KV head's query heads. A prefill's later rows see more keys: the threads
  // take the items one at a time, costliest first (split in ranges, the thread with a chunk's last rows did 3/4 of it)
  struct Item {
    int64_t req, row, rows, kv0, kv1, cost;
  };
  const int64_t kv = c.heads / c.group;
  std::vector<Item> items;
  for (int64_t r = 0; r < requests; ++r) {
    const int64_t count = std::min(c.query_start[r + 1], num_tokens) - c.query_start[r];
    for (int64_t row = 0; row < count; row += ROW_TILE) {
      const int64_t rows = std::min<int64_t>(ROW_TILE, count - row);
      const int64_t hi = c.seq_lens[r] - count + row + rows;  // keys the tile's last row sees
      const int64_t lo = c.window > 0 ? std::max<int64_t>(0, hi - rows - c.window + 1) : 0;
      items.push_back({r, row, rows, 0, kv, rows * (hi - lo)});
    }
  }
  const int64_t threads = at::get_num_threads();
  if (static_cast<int64_t>(items.size()) < threads && kv > 1) {
    std::vector<Item> split;
    for (const Item& item : items)
      for (int64_t k = 0; k < kv; ++k) split.push_back({item.req, item.row, item.rows, k, k + 1, item.cost});
    items.swap(split);
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, total), 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      const Item& item = items[i];
      attend_item(c, item.req, item.row, item.rows, item.kv0, item.kv1, scratch);
    }
  });
}

}  // namespace

TORCH_LIBRARY(hfcompress, m) {
  m.def(
      "lisa_attention(Tensor below, Tensor source, Tensor align_scale, Tensor own, Tensor(a!) output, Tensor query_start, Tensor seq_lens, int num_tokens, int window, "
      "Tensor[] caches, Tensor[] tables, int[] roots, Tensor[] heads, int[] widths, int[] per_cache_head, float[] scales, "
      "int[] fp8, Tensor value_cache, Tensor value_table, int value_offset, float value_scale, int value_fp8) -> ()");
  m.impl("lisa_attention", c10::DispatchKey::CPU, &lisa_attention);
}

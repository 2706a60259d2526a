// headscope's C++ kernels: `row_state`, the softmax state of every query row of causal attention, and optionally its
// output, in one cache-resident pass over blocks of keys; `weight_rows` (at the end), the per-row statistics of
// probabilities the model's eager function computed.
//
// `row_sums` (after it) adds a block's per-row values up per (sentence, head), as
// headscope/measures/row_sums.py's `_sum_rows` does with some 80 torch operations.
//
// row_state: for each row, over the keys it may see (key <= its position, and the mask's when there is one) but its
// sentence's first key, the same running values as headscope/fused.py's tile step, with the same rescaling when a
// block raises the maximum:
//     m  the largest logit        A  sum e^(s - m)        B  sum e^(s - m) (s - m)
//     n  keys holding exactly m   top  the first of them
//     seen, mean, spread  how many keys, their logits' mean and sum of squared deviations
//     O  sum e^(s - m) v  (when values are given: the output before the first key is put back and A divides it)
// or, given where to write it, the finished output: the first key put back and A dividing, as readoff.py does.
// A block of rows is 64 queries of one head (256 at long context: block_rows_for); a block of keys is 512. Their
// logits (128 or 512 KiB) are one sgemm into a buffer that stays in the core's cache for the two passes over it
// (maximum, then exponentials and sums); with
// values, the exponentials are written back over the logits and one more sgemm adds them times the block's values
// to O, as sdpa's own CPU kernel (a flash-attention forward) does. Threads take (sentence, head, row block) tasks.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

// The BLAS torch is built with (MKL on x86 wheels) exports the Fortran interface.
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t MAX_ROWS = 256;  // query rows per task at most

// Query rows per task when the caller leaves it to the kernel: 64 keep a block's logits (64 x 512 floats, 128 KiB) in
// a core's L2; past 2 MiB of keys and values per KV head (4,096 keys of 64 dimensions), 256, as sdpa's CPU kernel
// takes from 768 rows, read each block of keys four times less often. On SmolLM2's shape (benchmarks/kernel_layer.py,
// benchmarks/README.md) 256 rows took 9-10% less time at 8,192 tokens and 0-7% more at 2,048 and 4,096 (the logits of
// the diagonal block's hidden keys, computed in vain, grow with the block).
int64_t block_rows_for(int64_t keys, int64_t dim) {
  return 2 * keys * dim * static_cast<int64_t>(sizeof(float)) > 2 * (int64_t{1} << 20) ? MAX_ROWS : 64;
}
constexpr int64_t KEYS = 512;

// Horizontal reductions written out: at::vec::vec_reduce_all has no overload taking a lambda on AVX-512 in
// torch 2.13, and every instruction set torch dispatches to (DEFAULT, AVX2, AVX512, aarch64's NEON/SVE) shares
// Vectorized::size() and store(). Once per row and block of 512 keys, so the scalar loop costs nothing measurable.
float reduce_max(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float result = lanes[0];
  for (int64_t i = 1; i < Vec::size(); ++i) result = std::max(result, lanes[i]);
  return result;
}

float reduce_sum(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  float result = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) result += lanes[i];
  return result;
}

struct RowState {
  float m, total, weighted;
  int64_t count, top;
  int64_t seen;         // visible keys folded
  double mean, spread;  // their logits' mean and sum of squared deviations
};

// Merges a block's count, logits' mean and squared deviations about that mean into the row's (Chan et al.'s pairwise
// update, as fused.py's tile step), in double: the block's own deviations are about its mean, so a large mean costs
// no digits.
void merge_moments(RowState& row, int64_t seen, float mean, float spread) {
  const int64_t merged = row.seen + seen;
  const double delta = static_cast<double>(mean) - row.mean, share = static_cast<double>(seen) / merged;
  row.spread += spread + delta * delta * static_cast<double>(row.seen) * share;
  row.mean += delta * share;
  row.seen = merged;
}

// A block with hidden keys (at `lowest`: mask holes, the sentence's first key inside it): its moments over the
// visible keys, in two scalar passes. Rare (padding and sliding-window rows are runs; see one_run).
void merge_masked_moments(RowState& row, const float* s, int64_t n, float lowest) {
  int64_t seen = 0;
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    if (s[j] > lowest) {
      sum += s[j];
      ++seen;
    }
  }
  if (seen == 0) return;
  const float mean = sum / static_cast<float>(seen);
  float spread = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    if (s[j] > lowest) spread += (s[j] - mean) * (s[j] - mean);
  }
  merge_moments(row, seen, mean, spread);
}

// Folds logits s[0..n) (keys key0..key0+n-1, hidden ones already at `lowest`) into a row's state and returns alpha,
// the factor the row's earlier sums were rescaled by. Dense (no key of s hidden, the common case): the block's sum
// rides on the maximum's pass and its squared deviations on the exponentials' pass, so the moments cost no pass of
// their own over the block (two extra passes cost 30% of the kernel at 8,192 tokens). Keep: the exponentials
// e^(s - m') replace the logits in s, for the output's product.
template <bool Dense, bool Keep>
float fold(RowState& row, float* s, int64_t n, int64_t key0, float lowest) {
  if constexpr (!Dense) merge_masked_moments(row, s, n, lowest);
  const int64_t width = Vec::size();
  int64_t j = 0;
  Vec vmax(lowest), vsum(0.f);
  for (; j + width <= n; j += width) {
    const Vec x = Vec::loadu(s + j);
    vmax = at::vec::maximum(vmax, x);
    if constexpr (Dense) vsum = vsum + x;
  }
  float tile_max = reduce_max(vmax), sum = reduce_sum(vsum);
  for (; j < n; ++j) {
    tile_max = std::max(tile_max, s[j]);
    if constexpr (Dense) sum += s[j];
  }
  const float mean = sum / static_cast<float>(n);  // (used only when Dense)
  const float new_m = std::max(row.m, tile_max);
  // The first key holding a maximum this block raises, by a scan that stops at it (before Keep overwrites s).
  int64_t first = -1;
  if (tile_max > row.m) {
    for (first = 0; first < n && s[first] != tile_max; ++first) {
    }
  }
  // The keys holding the maximum, when the block holds it, counted in the exponentials' pass: s - m' is exactly 0
  // where s == m' (eq gives 1 or 0 per lane; a float sum of at most 512 ones is exact). A pass of its own over the
  // block cost as much as the exponentials' pass.
  const bool holds_max = tile_max == new_m;
  Vec total(0.f), weighted(0.f), squares(0.f), hits(0.f), shift(new_m), centre(mean), zero(0.f);
  for (j = 0; j + width <= n; j += width) {
    const Vec x = Vec::loadu(s + j);
    const Vec shifted = x - shift;
    // exp_u20: sdpa's exponential (within 20 ulp, about 2e-6 relative); the statistics are tested to 1e-5.
    const Vec e = shifted.exp_u20();
    total = total + e;
    weighted = at::vec::fmadd(e, shifted, weighted);
    if (holds_max) hits = hits + shifted.eq(zero);
    if constexpr (Dense) {
      const Vec d = x - centre;
      squares = at::vec::fmadd(d, d, squares);
    }
    if constexpr (Keep) e.store(s + j);
  }
  float tile_total = reduce_sum(total), tile_weighted = reduce_sum(weighted), spread = reduce_sum(squares);
  int64_t holding = static_cast<int64_t>(reduce_sum(hits));
  for (; j < n; ++j) {
    const float shifted = s[j] - new_m;
    const float e = std::exp(shifted);
    tile_total += e;
    tile_weighted += e * shifted;
    if (holds_max) holding += shifted == 0.f;
    if constexpr (Dense) spread += (s[j] - mean) * (s[j] - mean);
    if constexpr (Keep) s[j] = e;
  }
  if constexpr (Dense) merge_moments(row, n, mean, spread);
  // alpha * (m - new_m), not (m - new_m) * A: where alpha is 0 the product is 0 (see fused.py).
  const float alpha = std::exp(row.m - new_m);
  row.weighted = alpha * row.weighted + (alpha * (row.m - new_m)) * row.total + tile_weighted;
  row.total = alpha * row.total + tile_total;
  if (first >= 0) row.top = key0 + first;
  row.count = (new_m == row.m ? row.count : 0) + holding;
  row.m = new_m;
  return alpha;
}

// Gemma 2's logit softcapping, c tanh(x / c), on one logit (cap 0: none).
float capped(float x, float cap) { return cap > 0 ? std::tanh(x / cap) * cap : x; }

// A row's finished output from its fold (every visible key but the sentence's first: O in `sums`) and that first key
// (logit s_f, -inf when the row does not see it; its value row `first_value`), as readoff.py's read_off finishes it:
//     m = max(m', s_f)    A = A' e^(m' - m) + e^(s_f - m)    output = (O e^(m' - m) + e^(s_f - m) v_f) / A
// A row that sees no key at all (padding) gets 0s, never NaN: the next layer reads its output.
void finish_row(const RowState& row, float first_logit, const float* first_value, const float* sums, int64_t dim,
                float* output) {
  const bool rest_seen = row.seen > 0;
  const float rest_m = rest_seen ? row.m : -std::numeric_limits<float>::infinity();
  float m = std::max(rest_m, first_logit);
  if (!std::isfinite(m)) m = 0.f;
  const float rest_scale = rest_seen ? std::exp(rest_m - m) : 0.f;
  const float first_weight = std::exp(first_logit - m);  // 0 when the first key is hidden
  float total = (rest_seen ? row.total : 0.f) * rest_scale + first_weight;
  if (!(total > 0.f)) total = 1.f;
  const Vec scale(rest_scale), weight(first_weight), divisor(total);
  int64_t j = 0;
  if (first_weight > 0.f) {
    for (; j + Vec::size() <= dim; j += Vec::size()) {
      ((Vec::loadu(sums + j) * scale + weight * Vec::loadu(first_value + j)) / divisor).store(output + j);
    }
    for (; j < dim; ++j) output[j] = (sums[j] * rest_scale + first_weight * first_value[j]) / total;
  } else {  // the first key's value row is not read (its logit may be any number the row does not see)
    for (; j + Vec::size() <= dim; j += Vec::size()) ((Vec::loadu(sums + j) * scale) / divisor).store(output + j);
    for (; j < dim; ++j) output[j] = sums[j] * rest_scale / total;
  }
}

}  // namespace

// query: (batch, heads, rows, dim) float32, times `scaling` here (the first product's factor: no scaled copy of the
// model's queries); key and value: (batch, kv_heads, keys, dim) float32 (head
// h reads kv head h / (heads / kv_heads)); value may be None (the statistics alone). Any strides with each row's dim
// numbers adjacent: the model's (batch, t, heads, dim) projections, viewed (batch, heads, t, dim), are read in place
// (BLAS takes the distance between rows), not copied;
// positions: (rows,) long, increasing; first_key: (batch,) long, each sentence's first key, left out of the state
// (fused.py's read-off adds it back); mask: (batch or 1, query positions, keys) bool, True = visible, or None for
// plain causal attention; block_rows: query rows per task, 1 to 256 (0: block_rows_for the shape); window: the
// diagonal band's half-width, or -1 for none of the key points below. Returns m, A, B (float32), n, top (long),
// seen (long), mean, spread (float32), each (batch, heads, rows), and with values O (batch, heads, rows, dim)
// float32; rows that see no key keep m = lowest, A = 0 (padding: never read). With a window, four more (batch,
// heads, rows), the key points headscope/model/readoff.py would otherwise recompute by picking single keys: the
// logits of the sentence's first key and of the previous key (softcapped, whether or not the row may see them),
// and over the band's keys the row folded (keys row - window .. row it may see, the first key left out) their
// sum of e^(s - m) (m as above) and how many they are. out (with values): (batch, rows, heads, dim) float32, each
// row's dim numbers adjacent (the layout attention functions return): the rows' finished output is written there
// (the first key's value weighed in, divided by the total over every visible key; rows seeing no key get 0s) and O
// is returned empty (0 rows): no (batch, heads, rows, dim) sums for the caller to finish and copy.
// Patterns (headscope/model/attention/key_patterns.py), for the exemplars and detectors: pattern_keys (patterns, batch,
// keys) long, each sentence's keys sorted so that every row's target keys of a pattern are one ascending run of them,
// pattern_keys[p, b, pattern_begin[p, b, row] .. pattern_end[p, b, row]) (both (patterns, batch, query positions)
// long). Over the target keys the row folds (visible, the first key left out, as everything else), four more results,
// each (patterns, batch, heads, rows), after the key points: sum e^(s - m) (m the row's final maximum above), how many
// they are, the largest e^(s - m) among them and its key (the first holding it; -1: none). Read in the pass that
// computes the exponentials anyway: a row's targets cost a look-up each, not a pass over its keys.
std::vector<at::Tensor> row_state(const at::Tensor& query, const at::Tensor& key, const c10::optional<at::Tensor>& value,
                                  const at::Tensor& positions, const at::Tensor& first_key,
                                  const c10::optional<at::Tensor>& mask, double softcap, int64_t block_rows,
                                  int64_t window, double scaling, const c10::optional<at::Tensor>& out,
                                  const c10::optional<at::Tensor>& pattern_keys,
                                  const c10::optional<at::Tensor>& pattern_begin,
                                  const c10::optional<at::Tensor>& pattern_end) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat, "float32 query and key");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1, "query and key rows of adjacent numbers");
  TORCH_CHECK(positions.is_contiguous() && first_key.is_contiguous(), "contiguous positions and first keys");
  TORCH_CHECK(query.stride(2) <= std::numeric_limits<int>::max() && key.stride(2) <= std::numeric_limits<int>::max(),
              "rows within BLAS's int strides");
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), keys = key.size(2), groups = heads / kv_heads;
  if (block_rows == 0) block_rows = block_rows_for(keys, dim);
  TORCH_CHECK(block_rows >= 1 && block_rows <= MAX_ROWS, "block_rows in 1..", MAX_ROWS, " (0: by the shape)");
  const bool* visible = nullptr;
  int64_t mask_batch = 1, mask_rows = 0;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->size(2) == keys, "mask");
    visible = mask->data_ptr<bool>();
    mask_batch = mask->size(0);
    mask_rows = mask->size(1);
  }
  const float* v = nullptr;
  if (value.has_value()) {
    TORCH_CHECK(value->scalar_type() == at::kFloat && value->stride(3) == 1 && value->sizes() == key.sizes() &&
                    value->stride(2) <= std::numeric_limits<int>::max(),
                "float32 value shaped as the key, rows of adjacent numbers");
    v = value->data_ptr<float>();
  }
  float* finished = nullptr;  // where the finished output goes, when the caller gives a place
  at::IntArrayRef out_stride;
  if (out.has_value()) {
    TORCH_CHECK(v && out->scalar_type() == at::kFloat && out->stride(3) == 1 &&
                    out->sizes() == at::IntArrayRef({batch, rows, heads, dim}),
                "out: float32 (batch, rows, heads, dim), rows of adjacent numbers, with values");
    finished = out->data_ptr<float>();
    out_stride = out->strides();
  }
  const int64_t patterns = pattern_keys.has_value() ? pattern_keys->size(0) : 0;
  const int64_t* target_keys = nullptr;
  const int64_t *run_begin = nullptr, *run_end = nullptr;
  if (patterns) {
    TORCH_CHECK(pattern_begin.has_value() && pattern_end.has_value(), "pattern_begin and pattern_end with pattern_keys");
    for (const at::Tensor* t : {&*pattern_keys, &*pattern_begin, &*pattern_end}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() &&
                      t->sizes() == at::IntArrayRef({patterns, batch, keys}),
                  "pattern tensors: contiguous long (patterns, batch, keys)");
    }
    target_keys = pattern_keys->data_ptr<int64_t>();
    run_begin = pattern_begin->data_ptr<int64_t>();
    run_end = pattern_end->data_ptr<int64_t>();
  }
  auto options = query.options();
  at::Tensor m_out = at::empty({batch, heads, rows}, options);
  at::Tensor total_out = at::empty_like(m_out), weighted_out = at::empty_like(m_out);
  at::Tensor count_out = at::empty({batch, heads, rows}, options.dtype(at::kLong)), top_out = at::empty_like(count_out);
  at::Tensor seen_out = at::empty_like(count_out), mean_out = at::empty_like(m_out), spread_out = at::empty_like(m_out);
  at::Tensor sum_out = at::empty({v && !finished ? batch : 0, heads, rows, dim}, options);
  const bool points = window >= 0;
  const int64_t point_rows = points ? rows : 0;
  at::Tensor first_out = at::empty({batch, heads, point_rows}, options), prev_out = at::empty_like(first_out);
  at::Tensor band_out = at::empty_like(first_out), band_seen_out = at::empty_like(first_out, options.dtype(at::kLong));
  at::Tensor pattern_sum_out = at::empty({patterns, batch, heads, rows}, options);
  at::Tensor pattern_count_out = at::empty_like(pattern_sum_out, options.dtype(at::kLong));
  at::Tensor pattern_best_out = at::empty_like(pattern_sum_out), pattern_key_out = at::empty_like(pattern_count_out);
  float *pattern_sum = pattern_sum_out.data_ptr<float>(), *pattern_best = pattern_best_out.data_ptr<float>();
  int64_t *pattern_count = pattern_count_out.data_ptr<int64_t>(), *pattern_key = pattern_key_out.data_ptr<int64_t>();
  float *first_data = first_out.data_ptr<float>(), *prev_data = prev_out.data_ptr<float>();
  float* band_data = band_out.data_ptr<float>();
  int64_t* band_seen_data = band_seen_out.data_ptr<int64_t>();
  const int64_t* sentence_first = first_key.data_ptr<int64_t>();
  int64_t* seen_data = seen_out.data_ptr<int64_t>();
  float *mean_data = mean_out.data_ptr<float>(), *spread_data = spread_out.data_ptr<float>();
  float* sum_data = sum_out.data_ptr<float>();
  const float* q = query.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const int64_t* position = positions.data_ptr<int64_t>();
  float *m_data = m_out.data_ptr<float>(), *total_data = total_out.data_ptr<float>();
  float* weighted_data = weighted_out.data_ptr<float>();
  int64_t *count_data = count_out.data_ptr<int64_t>(), *top_data = top_out.data_ptr<int64_t>();
  const float lowest = std::numeric_limits<float>::lowest();  // hidden keys, as the eager functions mask them
  const float cap = static_cast<float>(softcap), scale = static_cast<float>(scaling);
  const int64_t row_blocks = (rows + block_rows - 1) / block_rows;
  const at::IntArrayRef query_stride = query.strides(), key_stride = key.strides();
  const at::IntArrayRef value_stride = v ? value->strides() : key.strides();

  // Each masked row's first visible key, and whether it sees every key from there to itself (padding and sliding
  // windows leave such runs; their rows never read the mask again), found once per sentence for all heads.
  // A row seeing nothing is padding: its first key is past itself, so it is skipped.
  std::vector<int64_t> first_seen(visible ? mask_batch * mask_rows : 0);
  std::vector<char> one_run(visible ? mask_batch * mask_rows : 0);
  if (visible) {
    at::parallel_for(0, mask_batch * mask_rows, 256, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        const int64_t row = index % mask_rows;
        const int64_t last = std::min(row, keys - 1);
        const bool* row_mask = visible + index * keys;
        const void* seen = std::memchr(row_mask, 1, last + 1);
        first_seen[index] = seen ? static_cast<const bool*>(seen) - row_mask : last + 1;
        one_run[index] = !seen || std::memchr(row_mask + first_seen[index], 0, last + 1 - first_seen[index]) == nullptr;
      }
    });
  }

  at::parallel_for(0, batch * heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block_rows * KEYS);
    std::vector<float> sums(v ? block_rows * dim : 0);  // the block's O, row-major (rows, dim)
    RowState state[MAX_ROWS];
    float alpha[MAX_ROWS];
    float first_logit[MAX_ROWS], prev_logit[MAX_ROWS], band[MAX_ROWS];
    int64_t band_seen[MAX_ROWS];
    // Each (row, pattern): the next target key to read, the run's end, and where this key block's targets start; its
    // sum of e^(s - m), targets seen, and the largest logit among them (as a logit: exact ties go to the first key)
    // and its key.
    const int64_t slots = MAX_ROWS * patterns;
    std::vector<int64_t> cursor(slots), run_stop(slots), block_from(slots), targets(slots), best_key(slots);
    std::vector<float> target_sum(slots), best_logit(slots);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (heads * row_blocks), h = (task / row_blocks) % heads;
      const int64_t first_row = (task % row_blocks) * block_rows;
      const int64_t n_rows = std::min(block_rows, rows - first_row);
      const int64_t out = (b * heads + h) * rows + first_row;
      const float* block_query = q + b * query_stride[0] + h * query_stride[1] + first_row * query_stride[2];
      const float* head_keys = k + b * key_stride[0] + (h / groups) * key_stride[1];
      const float* head_values = v ? v + b * value_stride[0] + (h / groups) * value_stride[1] : nullptr;
      const bool* sentence_mask = visible ? visible + (mask_batch == 1 ? 0 : b) * mask_rows * keys : nullptr;
      for (int64_t i = 0; i < n_rows; ++i) {
        state[i] = {lowest, 0.f, 0.f, 0, 0, 0, 0.0, 0.0};
        first_logit[i] = prev_logit[i] = lowest;
        band[i] = 0.f;
        band_seen[i] = 0;
        for (int64_t p = 0; p < patterns; ++p) {
          const int64_t slot = i * patterns + p, at = (p * batch + b) * keys + position[first_row + i];
          cursor[slot] = run_begin[at];
          run_stop[slot] = run_end[at];
          target_sum[slot] = 0.f;
          targets[slot] = 0;
          best_logit[slot] = lowest;
          best_key[slot] = -1;
        }
      }
      std::fill(sums.begin(), sums.end(), 0.f);
      const int64_t skip = sentence_first[b];  // the sentence's first key: not folded
      const int64_t stop = std::min(keys, position[first_row + n_rows - 1] + 1);  // causal: no key after the last row
      const int64_t sentence_rows = (mask_batch == 1 ? 0 : b) * mask_rows;
      int64_t first[MAX_ROWS];
      bool run[MAX_ROWS];
      int64_t start = stop;  // no key before the first one any row of the block sees
      for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t row = position[first_row + i];
        first[i] = sentence_mask ? first_seen[sentence_rows + row] : 0;
        run[i] = !sentence_mask || one_run[sentence_rows + row];
        start = std::min(start, first[i]);
      }
      for (int64_t key0 = start; key0 < stop; key0 += KEYS) {
        const int n_keys = static_cast<int>(std::min(KEYS, stop - key0)), block_rows = static_cast<int>(n_rows);
        const int depth = static_cast<int>(dim), ld = static_cast<int>(dim);
        const int ld_query = static_cast<int>(query_stride[2]), ld_key = static_cast<int>(key_stride[2]);
        const float one = 1.f, zero = 0.f;
        // scores (n_rows x n_keys, row-major) = block_query . keys^T, in BLAS's column-major terms.
        sgemm_("T", "N", &n_keys, &block_rows, &depth, &scale, head_keys + key0 * ld_key, &ld_key, block_query,
               &ld_query, &zero, scores.data(), &n_keys);
        for (int64_t i = 0; i < n_rows; ++i) {
          const int64_t row = position[first_row + i];
          float* row_scores = scores.data() + i * n_keys;
          alpha[i] = 1.f;
          // read before the mask and the exponentials overwrite them
          if ((points || finished) && skip >= key0 && skip < key0 + n_keys) {
            first_logit[i] = capped(row_scores[skip - key0], cap);
          }
          if (points && row - 1 >= key0 && row - 1 < key0 + n_keys) {
            prev_logit[i] = capped(row_scores[row - 1 - key0], cap);
          }
          // Keys [key0 + lo, key0 + n_seen) of this block: none before the row's first visible key nor after the
          // row (causal); in a row that is not one run, the keys the mask hides get the lowest logit, as the eager
          // functions give them.
          const int64_t n_seen = std::max<int64_t>(0, std::min<int64_t>(n_keys, row + 1 - key0));
          int64_t lo = std::max<int64_t>(0, first[i] - key0);
          // The sentence's first key: dropped from the front of the row's keys (where it is in a run of them), else
          // hidden like a masked key.
          bool dense = run[i];
          if (skip - key0 == lo) ++lo;
          if (n_seen <= lo) {
            if (v) std::fill(row_scores, row_scores + n_keys, 0.f);  // adds nothing to the output
            continue;
          }
          const bool skip_inside = skip - key0 > lo && skip - key0 < n_seen;
          dense = dense && !skip_inside;
          float* s = row_scores + lo;
          const int64_t n = n_seen - lo;
          if (cap > 0) {
            int64_t j = 0;
            for (; j + Vec::size() <= n; j += Vec::size()) {
              ((Vec::loadu(s + j) / Vec(cap)).tanh() * Vec(cap)).store(s + j);
            }
            for (; j < n; ++j) s[j] = std::tanh(s[j] / cap) * cap;
          }
          if (!run[i]) {
            const bool* row_mask = sentence_mask + row * keys + key0 + lo;
            for (int64_t j = 0; j < n; ++j) s[j] = row_mask[j] ? s[j] : lowest;
          }
          if (skip_inside) s[skip - key0 - lo] = lowest;
          // The patterns' target keys in this block, read as logits before the fold turns them into exponentials:
          // those the row sees (hidden ones, the first key among them, hold `lowest`) are counted, and the largest
          // kept. The runs ascend, so a cursor per (row, pattern) walks each run once over the row's key blocks.
          for (int64_t p = 0; p < patterns; ++p) {
            const int64_t slot = i * patterns + p;
            const int64_t* run = target_keys + (p * batch + b) * keys;
            int64_t c = cursor[slot];
            while (c < run_stop[slot] && run[c] < key0 + lo) ++c;  // keys the row does not see, or the first key
            block_from[slot] = c;
            for (; c < run_stop[slot] && run[c] < key0 + n_seen; ++c) {
              const float x = s[run[c] - key0 - lo];
              if (x > lowest) {
                ++targets[slot];
                if (x > best_logit[slot]) {
                  best_logit[slot] = x;
                  best_key[slot] = run[c];
                }
              }
            }
            cursor[slot] = c;
          }
          // The band's keys in this block, as offsets into s (the row's own key is the last one it folds).
          const int64_t band_from = points ? std::max<int64_t>(0, row - window - key0 - lo) : n;
          if (v) {
            alpha[i] = dense ? fold<true, true>(state[i], s, n, key0 + lo, lowest)
                             : fold<false, true>(state[i], s, n, key0 + lo, lowest);
            // The keys the row does not see weigh nothing (hidden ones inside [lo, n_seen) got e^(lowest - m') = 0).
            std::fill(row_scores, s, 0.f);
            std::fill(row_scores + n_seen, row_scores + n_keys, 0.f);
          } else if (dense) {
            alpha[i] = fold<true, false>(state[i], s, n, key0 + lo, lowest);
          } else {
            alpha[i] = fold<false, false>(state[i], s, n, key0 + lo, lowest);
          }
          if (band_from < n) {
            // e^(s - m) of the band's keys: s holds them already when the output kept the exponentials; hidden keys
            // (and the first key inside the block) weigh 0 either way, and are not counted.
            float sum = 0.f;
            for (int64_t j = band_from; j < n; ++j) {
              sum += v ? s[j] : std::exp(s[j] - state[i].m);
              const int64_t at = key0 + lo + j;
              band_seen[i] += at != skip && (run[i] || sentence_mask[row * keys + at]);
            }
            band[i] = alpha[i] * band[i] + sum;
          }
          // The targets' e^(s - m'), rescaled as the row's other sums are.
          for (int64_t p = 0; p < patterns; ++p) {
            const int64_t slot = i * patterns + p;
            const int64_t* run = target_keys + (p * batch + b) * keys;
            float sum = 0.f;
            for (int64_t c = block_from[slot]; c < cursor[slot]; ++c) {
              const float x = s[run[c] - key0 - lo];
              sum += v ? x : std::exp(x - state[i].m);
            }
            target_sum[slot] = alpha[i] * target_sum[slot] + sum;
          }
        }
        if (v) {
          // O = alpha O + P V, P the block's exponentials (n_rows x n_keys), V its values (n_keys x dim).
          for (int64_t i = 0; i < n_rows; ++i) {
            if (alpha[i] == 1.f) continue;
            float* row_sum = sums.data() + i * dim;
            int64_t j = 0;
            for (; j + Vec::size() <= dim; j += Vec::size()) (Vec::loadu(row_sum + j) * Vec(alpha[i])).store(row_sum + j);
            for (; j < dim; ++j) row_sum[j] *= alpha[i];
          }
          const int ld_value = static_cast<int>(value_stride[2]);
          sgemm_("N", "N", &depth, &block_rows, &n_keys, &one, head_values + key0 * ld_value, &ld_value, scores.data(),
                 &n_keys, &one, sums.data(), &ld);
        }
      }
      for (int64_t i = 0; i < n_rows; ++i) {
        m_data[out + i] = state[i].m;
        total_data[out + i] = state[i].total;
        weighted_data[out + i] = state[i].weighted;
        count_data[out + i] = state[i].count;
        top_data[out + i] = state[i].top;
        seen_data[out + i] = state[i].seen;
        mean_data[out + i] = static_cast<float>(state[i].mean);
        spread_data[out + i] = static_cast<float>(state[i].spread);
      }
      if (finished) {
        for (int64_t i = 0; i < n_rows; ++i) {
          const int64_t row = position[first_row + i];
          const bool first_seen_here = skip <= row && (run[i] ? skip >= first[i] : sentence_mask[row * keys + skip]);
          finish_row(state[i], first_seen_here ? first_logit[i] : -std::numeric_limits<float>::infinity(),
                     head_values + skip * value_stride[2], sums.data() + i * dim, dim,
                     finished + b * out_stride[0] + (first_row + i) * out_stride[1] + h * out_stride[2]);
        }
      } else if (v) {
        std::copy(sums.begin(), sums.begin() + n_rows * dim, sum_data + out * dim);
      }
      for (int64_t p = 0; p < patterns; ++p) {
        const int64_t at = ((p * batch + b) * heads + h) * rows + first_row;
        for (int64_t i = 0; i < n_rows; ++i) {
          const int64_t slot = i * patterns + p;
          pattern_sum[at + i] = target_sum[slot];
          pattern_count[at + i] = targets[slot];
          pattern_best[at + i] = best_key[slot] >= 0 ? std::exp(best_logit[slot] - state[i].m) : 0.f;
          pattern_key[at + i] = best_key[slot];
        }
      }
      if (points) {
        std::copy(first_logit, first_logit + n_rows, first_data + out);
        std::copy(prev_logit, prev_logit + n_rows, prev_data + out);
        std::copy(band, band + n_rows, band_data + out);
        std::copy(band_seen, band_seen + n_rows, band_seen_data + out);
      }
    }
  });
  std::vector<at::Tensor> result = {m_out, total_out, weighted_out, count_out, top_out, seen_out, mean_out, spread_out,
                                    sum_out};
  if (points) result.insert(result.end(), {first_out, prev_out, band_out, band_seen_out});
  if (patterns) result.insert(result.end(), {pattern_sum_out, pattern_count_out, pattern_best_out, pattern_key_out});
  return result;
}

// Per-row statistics of attention rows the model's eager function has already turned into probabilities (short
// texts, where the whole (batch, heads, t, t) matrix is cheaper than a second product): what
// headscope/measures/row_sums.py's weight_row_values computes with some forty tensor passes, in one pass over each row
// (its logarithms vectorised first). Definitions there; in short, for row r (query position row_offset + r) of head h
// and the sentence's first key f:
//     sink = p_f; over the keys off the sink (every key but f, hidden ones at weight 0 included): their mass and
//     -sum p ln p (products in float32, sums in double, as there), their largest weight, the first key holding it
//     and how many do; entropy, max_weight, mass, top_key, top_tied over every key from those and p_f; ln p with p
//     clamped to `tiny` (the model dtype's smallest normal number); the logits' spread as that of ln p over the
//     visible keys (mean first, then squares about it, in double); the diagonal band's mass |key - position| <=
//     window (summed in key order in float32, as there) and how many visible keys it holds; prev_token p_{position-1}.
// weights: (batch, heads, rows, keys) float32 contiguous; visible: (batch or 1, heads or 1, rows, keys) bool
// contiguous; seq_start: (batch,) long. Returns, each (batch, heads, rows): entropy, max_weight, mass, diagonal, sink,
// prev_token, band_visible, logit_std (float32), top_key, rest_top_key, n_visible (long), top_tied, rest_top_tied,
// first_visible (bool), rest_mass, rest_entropy (float64).
std::vector<at::Tensor> weight_rows(const at::Tensor& weights, const at::Tensor& visible, const at::Tensor& seq_start,
                                    int64_t window, int64_t row_offset, double tiny) {
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 4,
              "float32 contiguous (batch, heads, rows, keys) weights");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.is_contiguous() && visible.dim() == 4, "visible");
  TORCH_CHECK(seq_start.scalar_type() == at::kLong && seq_start.is_contiguous(), "seq_start");
  const int64_t batch = weights.size(0), heads = weights.size(1), rows = weights.size(2), keys = weights.size(3);
  const int64_t visible_batch = visible.size(0), visible_heads = visible.size(1);
  TORCH_CHECK(visible.size(2) == rows && visible.size(3) == keys && (visible_batch == 1 || visible_batch == batch) &&
                  (visible_heads == 1 || visible_heads == heads),
              "visible must broadcast to the weights");
  auto floats = weights.options();
  const std::vector<int64_t> shape = {batch, heads, rows};
  std::vector<at::Tensor> out;
  for (int i = 0; i < 8; ++i) out.push_back(at::empty(shape, floats));
  for (int i = 0; i < 3; ++i) out.push_back(at::empty(shape, floats.dtype(at::kLong)));
  for (int i = 0; i < 3; ++i) out.push_back(at::empty(shape, floats.dtype(at::kBool)));
  for (int i = 0; i < 2; ++i) out.push_back(at::empty(shape, floats.dtype(at::kDouble)));
  float *entropy = out[0].data_ptr<float>(), *max_weight = out[1].data_ptr<float>(), *mass = out[2].data_ptr<float>();
  float *diagonal = out[3].data_ptr<float>(), *sink = out[4].data_ptr<float>(), *prev = out[5].data_ptr<float>();
  float *band_visible = out[6].data_ptr<float>(), *logit_std = out[7].data_ptr<float>();
  int64_t *top_key = out[8].data_ptr<int64_t>(), *rest_top_key = out[9].data_ptr<int64_t>();
  int64_t* n_visible = out[10].data_ptr<int64_t>();
  bool *top_tied = out[11].data_ptr<bool>(), *rest_top_tied = out[12].data_ptr<bool>();
  bool* first_visible = out[13].data_ptr<bool>();
  double *rest_mass = out[14].data_ptr<double>(), *rest_entropy = out[15].data_ptr<double>();
  const float* p = weights.data_ptr<float>();
  const bool* shown = visible.data_ptr<bool>();
  const int64_t* start = seq_start.data_ptr<int64_t>();
  const float floor_value = static_cast<float>(tiny);

  at::parallel_for(0, batch * heads * rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> logs(keys);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (heads * rows), h = (index / rows) % heads, r = index % rows;
      const float* row = p + index * keys;
      const bool* row_shown = shown + (((visible_batch == 1 ? 0 : b) * visible_heads + (visible_heads == 1 ? 0 : h)) *
                                       rows + r) * keys;
      const int64_t first = std::min(start[b], keys - 1), position = row_offset + r;
      int64_t j = 0;
      for (; j + Vec::size() <= keys; j += Vec::size()) {
        at::vec::maximum(Vec::loadu(row + j), Vec(floor_value)).log().store(logs.data() + j);
      }
      for (; j < keys; ++j) logs[j] = std::log(std::max(row[j], floor_value));
      // Off the sink, and the visible keys' ln p for the spread.
      double off_mass = 0.0, off_plogp = 0.0, log_sum = 0.0;
      float largest = -std::numeric_limits<float>::infinity();
      int64_t top = first, holding = 0, seen = 0;
      for (j = 0; j < keys; ++j) {
        if (row_shown[j]) {
          ++seen;
          log_sum += logs[j];
        }
        if (j == first) continue;
        const float x = row[j];
        off_mass += x;
        off_plogp += x * logs[j];
        if (x > largest) {
          largest = x;
          top = j;
          holding = 1;
        } else if (x == largest) {
          ++holding;
        }
      }
      const double mean = log_sum / static_cast<double>(std::max<int64_t>(seen, 1));
      double squares = 0.0;
      for (j = 0; j < keys; ++j) {
        if (row_shown[j]) squares += (logs[j] - mean) * (logs[j] - mean);
      }
      float band = 0.f, band_seen = 0.f;
      for (j = std::max<int64_t>(0, position - window); j <= std::min(keys - 1, position + window); ++j) {
        band += row[j];
        band_seen += row_shown[j] ? 1.f : 0.f;
      }
      const float on_first = row[first];
      // torch.special.entr: -x ln x, 0 at 0, -inf below.
      const float on_first_entropy =
          on_first > 0.f ? -on_first * std::log(on_first) : (on_first == 0.f ? 0.f : -INFINITY);
      const float overall = std::max(largest, on_first);
      entropy[index] = static_cast<float>(-off_plogp + static_cast<double>(on_first_entropy));
      max_weight[index] = overall;
      mass[index] = static_cast<float>(off_mass + static_cast<double>(on_first));
      top_key[index] = on_first > largest ? first : top;
      top_tied[index] = static_cast<int64_t>(on_first == overall) + (largest == overall ? holding : 0) > 1;
      rest_mass[index] = off_mass;
      rest_entropy[index] = -off_plogp / off_mass + std::log(off_mass);
      rest_top_key[index] = top;
      rest_top_tied[index] = holding > 1;
      logit_std[index] = static_cast<float>(std::sqrt(squares / static_cast<double>(std::max<int64_t>(seen, 1))));
      diagonal[index] = band;
      sink[index] = on_first;
      prev[index] = position >= 1 && position - 1 < keys ? row[position - 1] : 0.f;
      band_visible[index] = band_seen;
      n_visible[index] = seen;
      first_visible[index] = row_shown[first];
    }
  });
  return out;
}

// A (batch, heads, rows) view of a tensor that broadcasts to it (size-1 dimensions read with stride 0).
template <typename T>
struct RowView {
  const T* data;
  int64_t batch_stride, head_stride, row_stride;
  RowView(const at::Tensor& x, int64_t batch, int64_t heads, int64_t rows) : data(x.data_ptr<T>()) {
    TORCH_CHECK(x.dim() == 3 && (x.size(0) == 1 || x.size(0) == batch) && (x.size(1) == 1 || x.size(1) == heads) &&
                    x.size(2) == rows,
                "a (batch or 1, heads or 1, rows) row value");
    batch_stride = x.size(0) == 1 ? 0 : x.stride(0);
    head_stride = x.size(1) == 1 ? 0 : x.stride(1);
    row_stride = x.stride(2);
  }
  T at(int64_t b, int64_t h, int64_t r) const { return data[b * batch_stride + h * head_stride + r * row_stride]; }
};

// The counts, in the order of row_sums.py's COUNT_NAMES; the values' order is VALUE_NAMES's (see `row_sums`).
enum Count { N_ROWS, NORM_ROWS, PREV_ROWS, EVIDENCE_ROWS, NONFINITE_ROWS, UNNORMALISED_ROWS, OFFSINK_ROWS,
             OFFSINK_NORM_ROWS, OFFSINK_PREV_ROWS, OFFSINK_EVIDENCE_ROWS, COUNTS };
constexpr int VALUES = 13;

// Per (sentence, head): each value summed (float64) over the rows its denominator counts (value_rows[v], a Count),
// then the counts, then how many evidence rows hold their largest weight on each place (the first key, offsets
// 0..max_offset back, anything else, and a last slot for rows that are not evidence), then the same off the sink
// (offsets 0..max_offset, anything else, not evidence). Floats: float32 values but rest_mass and rest_entropy
// (float64), computed as torch computes them there, in float32 where torch does.
at::Tensor row_sums(const std::vector<at::Tensor>& floats, const at::Tensor& rest_mass_, const at::Tensor& rest_entropy_,
                    const at::Tensor& top_key_, const at::Tensor& top_tied_, const at::Tensor& rest_top_key_,
                    const at::Tensor& rest_tied_, const at::Tensor& n_visible_, const at::Tensor& first_visible_,
                    const at::Tensor& query_valid, const at::Tensor& seq_start, int64_t row_offset,
                    double mass_tolerance, double sink_threshold, const std::vector<int64_t>& value_rows,
                    int64_t max_offset, int64_t evidence_from) {
  // floats: entropy, max_weight, mass, diagonal, sink, prev_token, band_visible, logit_std
  TORCH_CHECK(floats.size() == 8 && value_rows.size() == VALUES, "8 float row values and 13 value rows");
  const int64_t batch = floats[0].size(0), heads = floats[0].size(1), rows = floats[0].size(2);
  for (const auto& x : floats) TORCH_CHECK(x.scalar_type() == at::kFloat, "float32 row values");
  TORCH_CHECK(rest_mass_.scalar_type() == at::kDouble && rest_entropy_.scalar_type() == at::kDouble, "float64 rest");
  TORCH_CHECK(top_key_.scalar_type() == at::kLong && rest_top_key_.scalar_type() == at::kLong &&
                  n_visible_.scalar_type() == at::kLong, "long keys and counts");
  TORCH_CHECK(top_tied_.scalar_type() == at::kBool && rest_tied_.scalar_type() == at::kBool &&
                  first_visible_.scalar_type() == at::kBool, "bool ties and first-key visibility");
  TORCH_CHECK(query_valid.scalar_type() == at::kBool && query_valid.is_contiguous() && query_valid.dim() == 2 &&
                  query_valid.size(0) == batch && query_valid.size(1) == rows, "(batch, rows) bool query_valid");
  TORCH_CHECK(seq_start.scalar_type() == at::kLong && seq_start.is_contiguous() && seq_start.numel() == batch,
              "(batch,) long seq_start");
  std::vector<RowView<float>> f;
  for (const auto& x : floats) f.emplace_back(x, batch, heads, rows);
  const RowView<double> rest_mass(rest_mass_, batch, heads, rows), rest_entropy(rest_entropy_, batch, heads, rows);
  const RowView<int64_t> top_key(top_key_, batch, heads, rows), rest_top_key(rest_top_key_, batch, heads, rows);
  const RowView<int64_t> n_visible(n_visible_, batch, heads, rows);
  const RowView<bool> top_tied(top_tied_, batch, heads, rows), rest_tied(rest_tied_, batch, heads, rows);
  const RowView<bool> first_visible(first_visible_, batch, heads, rows);
  const bool* valid_rows = query_valid.data_ptr<bool>();
  const int64_t* start = seq_start.data_ptr<int64_t>();
  const int64_t top_slots = max_offset + 4, rest_slots = max_offset + 3;
  const int64_t slots = VALUES + COUNTS + top_slots + rest_slots;
  at::Tensor out = at::zeros({batch, heads, slots}, seq_start.options().dtype(at::kDouble));
  double* sums = out.data_ptr<double>();
  const float tolerance = static_cast<float>(mass_tolerance), threshold = static_cast<float>(sink_threshold);

  at::parallel_for(0, batch * heads, 8, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / heads, h = index % heads;
      double* slot = sums + index * slots;
      double* counts = slot + VALUES;
      double* top = counts + COUNTS;
      double* rest_top = top + top_slots;
      for (int64_t r = 0; r < rows; ++r) {
        const float entropy = f[0].at(b, h, r), max_weight = f[1].at(b, h, r), mass = f[2].at(b, h, r);
        const float diagonal = f[3].at(b, h, r), sink = f[4].at(b, h, r), prev = f[5].at(b, h, r);
        const float band_visible = f[6].at(b, h, r), logit_std = f[7].at(b, h, r);
        const int64_t seen = n_visible.at(b, h, r), row = row_offset + r, position = row - start[b];
        const bool real = valid_rows[b * rows + r];
        const bool finite = std::isfinite(entropy) && std::isfinite(max_weight) && std::isfinite(mass);
        const bool valid = real && finite;
        const bool evidence = valid && position >= evidence_from;
        // Where the row's largest weight sits (row_sums.py's categories).
        const int64_t key = top_key.at(b, h, r), offset = row - key;
        const bool tied = top_tied.at(b, h, r);
        int64_t category = (tied || offset < 0 || offset > max_offset) ? max_offset + 2 : offset + 1;
        if (key == start[b] && !tied) category = 0;
        if (!evidence) category = max_offset + 3;
        top[category] += 1.0;
        // Off the sink.
        const double off_mass = rest_mass.at(b, h, r);
        const bool offsink = valid && off_mass > 0;
        const int64_t rest_seen = seen - static_cast<int64_t>(first_visible.at(b, h, r));
        const int64_t rest_offset = row - rest_top_key.at(b, h, r);
        const bool offsink_evidence = evidence && offsink;
        int64_t rest_category =
            (rest_tied.at(b, h, r) || rest_offset < 0 || rest_offset > max_offset) ? max_offset + 1 : rest_offset;
        if (!offsink_evidence) rest_category = max_offset + 2;
        rest_top[rest_category] += 1.0;

        bool counted[COUNTS];
        counted[N_ROWS] = valid;
        counted[NORM_ROWS] = valid && seen >= 2;
        counted[PREV_ROWS] = valid && position >= 1;
        counted[EVIDENCE_ROWS] = evidence;
        counted[NONFINITE_ROWS] = real && !finite;
        counted[UNNORMALISED_ROWS] = valid && std::fabs(mass - 1.0f) > tolerance;
        counted[OFFSINK_ROWS] = offsink;
        counted[OFFSINK_NORM_ROWS] = offsink && rest_seen >= 2;
        counted[OFFSINK_PREV_ROWS] = offsink && position >= 2;
        counted[OFFSINK_EVIDENCE_ROWS] = offsink_evidence;
        for (int c = 0; c < COUNTS; ++c) counts[c] += counted[c] ? 1.0 : 0.0;

        const double values[VALUES] = {
            entropy,
            entropy / std::log(static_cast<float>(std::max<int64_t>(seen, 2))),
            diagonal,
            band_visible / static_cast<float>(std::max<int64_t>(seen, 1)),
            sink,
            prev,
            max_weight,
            sink > threshold ? 1.0 : 0.0,
            entropy * entropy,
            logit_std,
            sink <= threshold ? 1.0 : 0.0,
            prev / off_mass,
            rest_entropy.at(b, h, r) / std::log(static_cast<float>(std::max<int64_t>(rest_seen, 2))),
        };
        // Added only where counted: a padding row may hold anything, NaN included, and must add exactly 0.
        for (int v = 0; v < VALUES; ++v) {
          if (counted[value_rows[v]]) slot[v] += values[v];
        }
      }
    }
  });
  return out;
}

// Per (sentence, head) of a layer, what headscope/measures/writes.py's sink_value_ratios and head_write_sums give: the
// sums of write_norm (rows whose norm is finite), of write_ratio = norm / the residual stream's norm (rows whose ratio
// is finite) and of sink_value_ratio = ||v_first|| / the mean ||v_s|| over the keys the row sees (rows seeing the first
// key and another, finite), each followed by how many rows it summed. norms: (batch, heads, t) float32;
// residual_norm: (batch, t) float32; value_norms: (batch, kv_heads, t) float32, query head h reading KV head
// h / (heads / kv_heads); visible: (batch or 1, 1, t, t) bool, the keys each row sees, or none for causal attention
// over the real keys (then the sums over them are running sums).
at::Tensor write_sums(const at::Tensor& norms, const at::Tensor& residual_norm, const at::Tensor& value_norms,
                      const at::Tensor& query_valid, const at::Tensor& seq_start,
                      const c10::optional<at::Tensor>& visible) {
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.dim() == 3, "(b, h, t) norms");
  const int64_t batch = norms.size(0), heads = norms.size(1), t = norms.size(2);
  TORCH_CHECK(residual_norm.scalar_type() == at::kFloat && residual_norm.is_contiguous() &&
                  residual_norm.numel() == batch * t, "(batch, t) float32 residual_norm");
  TORCH_CHECK(value_norms.scalar_type() == at::kFloat && value_norms.is_contiguous() && value_norms.dim() == 3 &&
                  value_norms.size(0) == batch && value_norms.size(2) == t && value_norms.size(1) > 0 &&
                  heads % value_norms.size(1) == 0, "(batch, kv_heads, t) float32 value_norms");
  TORCH_CHECK(query_valid.scalar_type() == at::kBool && query_valid.is_contiguous() && query_valid.numel() == batch * t,
              "(batch, t) bool query_valid");
  TORCH_CHECK(seq_start.scalar_type() == at::kLong && seq_start.is_contiguous() && seq_start.numel() == batch,
              "(batch,) long seq_start");
  const bool masked = visible.has_value();
  const bool* shown = nullptr;
  int64_t shown_batch = 0;
  if (masked) {
    const at::Tensor& mask = *visible;
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 4 &&
                    (mask.size(0) == 1 || mask.size(0) == batch) && mask.size(1) == 1 && mask.size(2) == t &&
                    mask.size(3) == t, "(batch or 1, 1, t, t) bool visible");
    shown = mask.data_ptr<bool>();
    shown_batch = mask.size(0);
  }
  const int64_t kv_heads = value_norms.size(1), group = heads / kv_heads;
  at::Tensor out = at::zeros({batch, heads, 6}, seq_start.options().dtype(at::kDouble));
  double* sums = out.data_ptr<double>();
  const float *written = norms.data_ptr<float>(), *residual = residual_norm.data_ptr<float>();
  const float* values = value_norms.data_ptr<float>();
  const bool* valid = query_valid.data_ptr<bool>();
  const int64_t* start = seq_start.data_ptr<int64_t>();

  at::parallel_for(0, batch * heads, 8, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / heads, h = index % heads;
      const float* norm = written + index * t;
      const float* value = values + (b * kv_heads + h / group) * t;
      const bool* real = valid + b * t;
      const int64_t first = std::min(start[b], t - 1);
      const float on_first = value[first];
      double* slot = sums + index * 6;
      double running = 0.0;  // the value norms of the keys the row sees: float64, as torch's cumsum there
      int64_t count = 0;
      for (int64_t r = 0; r < t; ++r) {
        bool first_seen = r >= first && real[first];
        if (masked && real[r]) {  // the row's own keys (a padding row adds nothing)
          const bool* row = shown + ((shown_batch == 1 ? 0 : b) * t + r) * t;
          running = 0.0;
          count = 0;
          for (int64_t j = 0; j < t; ++j) {
            if (row[j]) {
              running += value[j];
              ++count;
            }
          }
          first_seen = row[first];
        } else if (real[r]) {  // causal: the real keys up to this row
          running += value[r];
          ++count;
        }
        if (!real[r]) continue;
        if (std::isfinite(norm[r])) {
          slot[0] += norm[r];
          slot[1] += 1.0;
          const float ratio = norm[r] / residual[b * t + r];
          if (std::isfinite(ratio)) {
            slot[2] += ratio;
            slot[3] += 1.0;
          }
        }
        const bool sees_first = first_seen && count >= 2;
        const float sink_ratio = on_first / (static_cast<float>(running) / static_cast<float>(count));
        if (sees_first && std::isfinite(sink_ratio)) {
          slot[4] += sink_ratio;
          slot[5] += 1.0;
        }
      }
    }
  });
  return out;
}

// The patterns' readings of probabilities the model computed (the eager path), as row_state folds them from logits:
// for each (pattern, sentence, head, row), over the row's targets (the run pattern_keys[p, b, begin .. end) of row
// row_offset + r; headscope/model/attention/key_patterns.py) that it may see, the sum of their weights (in double),
// how many they are, the largest weight and its key (the first holding it; -1 and 0 without a target). A row's targets
// are a few look-ups, not a pass over its keys. weights: (batch, heads, rows, keys) float32 contiguous; visible:
// (batch or 1, heads or 1, rows, keys) bool contiguous; pattern_keys, pattern_begin, pattern_end: (patterns, batch,
// query positions) long.
std::vector<at::Tensor> pattern_rows(const at::Tensor& weights, const at::Tensor& visible, const at::Tensor& pattern_keys,
                                     const at::Tensor& pattern_begin, const at::Tensor& pattern_end, int64_t row_offset) {
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 4,
              "float32 contiguous (batch, heads, rows, keys) weights");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.is_contiguous() && visible.dim() == 4, "visible");
  const int64_t batch = weights.size(0), heads = weights.size(1), rows = weights.size(2), keys = weights.size(3);
  const int64_t visible_batch = visible.size(0), visible_heads = visible.size(1);
  TORCH_CHECK(visible.size(2) == rows && visible.size(3) == keys && (visible_batch == 1 || visible_batch == batch) &&
                  (visible_heads == 1 || visible_heads == heads),
              "visible must broadcast to the weights");
  const int64_t patterns = pattern_keys.size(0), t = pattern_keys.size(2);
  for (const at::Tensor* x : {&pattern_keys, &pattern_begin, &pattern_end}) {
    TORCH_CHECK(x->scalar_type() == at::kLong && x->is_contiguous() && x->sizes() == at::IntArrayRef({patterns, batch, t}),
                "pattern tensors: contiguous long (patterns, batch, positions)");
  }
  TORCH_CHECK(row_offset >= 0 && row_offset + rows <= t, "rows within the patterns' positions");
  const std::vector<int64_t> shape = {patterns, batch, heads, rows};
  at::Tensor sum_out = at::empty(shape, weights.options().dtype(at::kDouble));
  at::Tensor count_out = at::empty(shape, weights.options().dtype(at::kLong)), key_out = at::empty_like(count_out);
  at::Tensor best_out = at::empty(shape, weights.options());
  double* sums = sum_out.data_ptr<double>();
  int64_t *counts = count_out.data_ptr<int64_t>(), *best_keys = key_out.data_ptr<int64_t>();
  float* bests = best_out.data_ptr<float>();
  const float* p = weights.data_ptr<float>();
  const bool* shown = visible.data_ptr<bool>();
  const int64_t *target_keys = pattern_keys.data_ptr<int64_t>(), *run_begin = pattern_begin.data_ptr<int64_t>(),
                *run_end = pattern_end.data_ptr<int64_t>();
  at::parallel_for(0, patterns * batch * heads * rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t pb = index / (heads * rows), h = (index / rows) % heads, r = index % rows;
      const int64_t b = pb % batch;
      const float* row = p + ((b * heads + h) * rows + r) * keys;
      const bool* row_shown = shown + (((visible_batch == 1 ? 0 : b) * visible_heads + (visible_heads == 1 ? 0 : h)) *
                                       rows + r) * keys;
      const int64_t* run = target_keys + pb * t;
      const int64_t at = pb * t + row_offset + r;
      double sum = 0.0;
      int64_t count = 0, best_key = -1;
      float best = 0.f;
      for (int64_t c = run_begin[at]; c < run_end[at]; ++c) {
        const int64_t key = run[c];
        if (key >= keys || !row_shown[key]) continue;
        ++count;
        sum += row[key];
        if (best_key < 0 || row[key] > best) {
          best = row[key];
          best_key = key;
        }
      }
      sums[index] = sum;
      counts[index] = count;
      bests[index] = best;
      best_keys[index] = best_key;
    }
  });
  return {sum_out, count_out, key_out, best_out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("row_state", &row_state, "per-row softmax state (and output sum) of causal attention logits",
             pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("positions"),
             pybind11::arg("first_key"), pybind11::arg("mask"), pybind11::arg("softcap"),
             pybind11::arg("block_rows") = 0, pybind11::arg("window") = -1, pybind11::arg("scaling") = 1.0,
             pybind11::arg("out") = pybind11::none(), pybind11::arg("pattern_keys") = pybind11::none(),
             pybind11::arg("pattern_begin") = pybind11::none(), pybind11::arg("pattern_end") = pybind11::none());
  module.attr("folds_patterns") = true;  // row_state takes pattern_keys (headscope/model/attention/key_patterns.py)
  module.def("block_rows", &block_rows_for, "query rows per task row_state takes for keys of this many dimensions");
  module.def("weight_rows", &weight_rows, "per-row statistics of attention probabilities");
  module.def("pattern_rows", &pattern_rows, "per-row readings of the patterns' targets in attention probabilities");
  module.def("row_sums", &row_sums, "per-(sentence, head) sums of a block's per-row values");
  module.def("write_sums", &write_sums, "per-(sentence, head) sums of what a causal layer's heads write");
}

// Decode attention straight from the paged KV cache, for CPUs.
//
// Each decoding sequence has one query token; it attends to the first
// `lengths[s]` tokens of its cache, found through its block table. In pure
// PyTorch that needs the blocks gathered into a contiguous batch first (a
// copy of every key and value, every layer, every step) and then a second
// pass to attend. Here each (sequence, KV head) pair reads its keys and values
// once, in place, for all the query heads that share that KV head.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <vector>

// DIM > 0 fixes the head dimension at compile time, so the inner loops unroll; 0 reads it at run time.
template <typename scalar_t, int64_t DIM>
static void decode(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& lengths, torch::Tensor& out, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t sequences = query.size(0), heads = query.size(1), dim = DIM > 0 ? DIM : query.size(2);
  const int64_t kv_heads = key_cache.size(0), blocks = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = heads / kv_heads, width = block_tables.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* keys = key_cache.data_ptr<scalar_t>();
  const scalar_t* values = value_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();

  at::parallel_for(0, sequences * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores, accumulator(group * dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t s = pair / kv_heads, h = pair % kv_heads, length = lens[s];
      const int64_t* table = tables + s * width;
      const scalar_t* q_group = q + (s * heads + h * group) * dim;
      scores.assign(group * length, acc_t(0));
      for (int64_t t = 0; t < length; ++t) {
        const scalar_t* k = keys + ((h * blocks + table[t / block_size]) * block_size + t % block_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < dim; ++i) dot += acc_t(q_group[g * dim + i]) * acc_t(k[i]);
          scores[g * length + t] = dot * acc_t(scale);
        }
      }
      std::vector<acc_t> totals(group);
      for (int64_t g = 0; g < group; ++g) {
        acc_t* row = scores.data() + g * length;
        const acc_t peak = *std::max_element(row, row + length);
        acc_t total = 0;
        for (int64_t t = 0; t < length; ++t) total += (row[t] = std::exp(row[t] - peak));
        totals[g] = total;
      }
      std::fill(accumulator.begin(), accumulator.end(), acc_t(0));
      for (int64_t t = 0; t < length; ++t) {
        const scalar_t* v = values + ((h * blocks + table[t / block_size]) * block_size + t % block_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const acc_t weight = scores[g * length + t];
          acc_t* acc = accumulator.data() + g * dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) acc[i] += weight * acc_t(v[i]);
        }
      }
      scalar_t* out_group = o + (s * heads + h * group) * dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i) out_group[g * dim + i] = scalar_t(accumulator[g * dim + i] / totals[g]);
    }
  });
}

// query [sequences, heads, dim]; caches [kv_heads, blocks, block_size, dim];
// block_tables [sequences, max blocks] (int64); lengths [sequences] (int64).
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor lengths, double scale) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64, "int64 tables");
  auto out = torch::empty_like(query);
  const auto tables = block_tables.contiguous(), lens = lengths.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    switch (query.size(2)) {
      case 32: decode<scalar_t, 32>(query, key_cache, value_cache, tables, lens, out, scale); break;
      case 64: decode<scalar_t, 64>(query, key_cache, value_cache, tables, lens, out, scale); break;
      case 128: decode<scalar_t, 128>(query, key_cache, value_cache, tables, lens, out, scale); break;
      default: decode<scalar_t, 0>(query, key_cache, value_cache, tables, lens, out, scale);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache"); }

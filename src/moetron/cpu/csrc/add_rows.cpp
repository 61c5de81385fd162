// out[index[r]] += src[r] for every row r, in the order of r: index_add_ along dim 0 of CPU float32 rows, one thread.
//
// Why: the MoE combine (`moe/dispatch.py`: WeightedIndexAdd, GatherRows' backward) adds [R, D] rows into [T, D]
// with index_add_, which ATen runs as a scatter-add split over the columns; at T = 768, D = 128 that is ~60 µs at one
// thread and 0.7–1 ms at two with OMP_WAIT_POLICY=PASSIVE (the threads' wake-ups cost more than the adds:
// benchmarks/RESULTS.md, issue 28). The same IEEE adds in the same order per destination row (r ascending), so the
// same bits as index_add_ at any thread count.
//
// Shape legend: R source rows, T destination rows, D columns.

#include "kernels.h"

#include <ATen/cpu/vec/vec.h>

namespace moetron_cpu {

void add_rows(Tensor& out, const Tensor& index, const Tensor& src) {
  TORCH_CHECK(out.dim() == 2 && src.dim() == 2 && out.size(1) == src.size(1) && out.device().is_cpu() &&
                  src.device().is_cpu() && out.scalar_type() == at::kFloat && src.scalar_type() == at::kFloat &&
                  out.is_contiguous() && src.is_contiguous() && out.has_storage() && src.has_storage() &&
                  !out.key_set().has(c10::DispatchKey::Python) && !src.key_set().has(c10::DispatchKey::Python),
              "add_rows: out [T, D] and src [R, D] must be contiguous CPU float32 tensors");
  TORCH_CHECK(index.dim() == 1 && index.size(0) == src.size(0) && index.device().is_cpu() &&
                  index.scalar_type() == at::kLong && index.is_contiguous() && index.has_storage(),
              "add_rows: index must be a contiguous CPU int64 vector of ", src.size(0), " rows");
  using Vec = at::vec::Vectorized<float>;
  const int64_t R = src.size(0), T = out.size(0), D = src.size(1);
  const int64_t* row = index.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < T, "add_rows: index ", row[r], " of row ", r, " is outside ", T, " rows");
  float* target = out.mutable_data_ptr<float>();
  const float* source = src.const_data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    float* o = target + row[r] * D;
    const float* s = source + r * D;
    int64_t j = 0;
    for (; j + Vec::size() <= D; j += Vec::size()) (Vec::loadu(o + j) + Vec::loadu(s + j)).store(o + j);
    for (; j < D; ++j) o[j] += s[j];
  }
}

}  // namespace moetron_cpu

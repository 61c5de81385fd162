// The column of each row's maximum, the FIRST one on ties, a NaN counting as the largest value (its first
// occurrence): what `x.max(dim=1).indices` and `torch.argmax(x, dim=1)` return on CPU.
// The router's top-1 pick, T rows of E scores. ATen's indexed reductions carry (value, index) pairs through a
// generic scalar reduction (0.8 ms at T = 8192, E = 64 here); this takes each row's maximum with vector max, then
// finds its first column (the row is in L1 by then). Integers out, so it either equals ATen's answer or is wrong; the
// tests compare it with both on ties, NaN, ±0 and ±inf.

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

#include <cmath>

namespace moetron_cpu {

using Vec = at::vec::Vectorized<float>;

Tensor first_max_column(const Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu() && x_in.has_storage() &&
                  !x_in.key_set().has(c10::DispatchKey::Python),
              "first_max_column: a plain 2-D CPU float32 tensor (no tensor subclass)");
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(cols > 0, "first_max_column: no columns");
  Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.const_data_ptr<float>();
  int64_t* index = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1 << 12, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * cols;
      // The row's maximum, NaN-propagating (Vectorized::maximum), then its first column: either an equal value
      // (-0.0 and +0.0 compare equal, as they tie in ATen) or, for a NaN maximum, the first NaN.
      float best = row[0];
      int64_t c = 0;
      if (cols >= Vec::size()) {
        Vec best_vec = Vec::loadu(row);
        for (c = Vec::size(); c + Vec::size() <= cols; c += Vec::size()) {
          best_vec = at::vec::maximum(best_vec, Vec::loadu(row + c));
        }
        best = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best_vec);
      }
      for (; c < cols; ++c) best = (std::isnan(best) || std::isnan(row[c])) ? NAN : std::max(best, row[c]);
      int64_t column = 0;
      if (std::isnan(best)) {
        while (!std::isnan(row[column])) ++column;
      } else {
        while (row[column] != best) ++column;
      }
      index[r] = column;
    }
  });
  return out;
}

}  // namespace moetron_cpu

// The fused LM head's per-chunk softmax (`moetron/model/fused_cross_entropy.py`): one exp per logit, two passes
// over each row, where ATen's log_softmax, the label gather and exp_ make four passes and two exps per logit.
//
// For each row x of a chunk of fp32 logits [M, V], with its label l, m = max(x) and s = Σ exp(x − m):
//   label_logp = x[l] − m − log(s)                       log_softmax's value at the label (up to the sum's order)
//   the row, in place: exp(x − m) − s·[v == l]           = s · (softmax − one-hot), the logits' gradient times s
//   sums = s                                             the caller folds 1/s into the row factor it already
//                                                        applies to the [M, C] side of the gradient GEMMs
// so no pass over the [M, V] chunk divides by s. A row (V = 50304: 200 KB) stays in L2 from its max pass to its exp
// pass. The exp is ATen's vector exp_u20 (what ATen's own softmax kernels run: 2.3x faster than the 1-ULP Sleef exp
// that exp_ runs, 19.3 → 8.3 ms per 384 × 50304 chunk on one AVX2 core; ≤ 2 ULP), the scalar tail std::exp.
//
// Shape legend: M rows (tokens of one chunk), V vocabulary.

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>

namespace moetron_cpu {
namespace {

using Vec = at::vec::Vectorized<float>;

}  // namespace

float max_nan(float a, float b) { return (std::isnan(a) || a > b) ? a : b; }

float row_max(const float* row, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (V >= Vec::size()) {
    Vec lanes = Vec::loadu(row);
    for (j = Vec::size(); j + Vec::size() <= V; j += Vec::size()) lanes = at::vec::maximum(lanes, Vec::loadu(row + j));
    float values[Vec::size()];
    lanes.store(values);
    for (const float v : values) m = max_nan(m, v);
  }
  for (; j < V; ++j) m = max_nan(m, row[j]);
  return m;
}

namespace {

// Overwrites row with exp(row − m) and returns their sum (two vector accumulators, then the scalar tail).
template <bool kFast>
float exp_and_sum(float* row, int64_t V, float m) {
  const auto exp = [](const Vec& v) { return kFast ? v.exp_u20() : v.exp(); };
  const Vec shift(m);
  Vec sum0(0.0f), sum1(0.0f);
  int64_t j = 0;
  for (; j + 2 * Vec::size() <= V; j += 2 * Vec::size()) {
    const Vec e0 = exp(Vec::loadu(row + j) - shift), e1 = exp(Vec::loadu(row + j + Vec::size()) - shift);
    e0.store(row + j);
    e1.store(row + j + Vec::size());
    sum0 = sum0 + e0;
    sum1 = sum1 + e1;
  }
  for (; j + Vec::size() <= V; j += Vec::size()) {
    const Vec e = exp(Vec::loadu(row + j) - shift);
    e.store(row + j);
    sum0 = sum0 + e;
  }
  float lanes[Vec::size()];
  (sum0 + sum1).store(lanes);
  float s = 0.0f;
  for (const float v : lanes) s += v;
  for (; j < V; ++j) {
    row[j] = std::exp(row[j] - m);
    s += row[j];
  }
  return s;
}

}  // namespace

float exp_shifted_and_sum(float* row, int64_t V, float m) {
  // a finite max: every x − m is in [−inf, 0], where exp_u20 is within 2 ULP (it flushes below −87 to 0); NaN or
  // inf logits: the exact exp, so that they reach the loss and the gradients as exp_ would carry them
  return std::isfinite(m) ? exp_and_sum<true>(row, V, m) : exp_and_sum<false>(row, V, m);
}

namespace {

// One row, in place: the row becomes s·(softmax − one-hot); writes the label's log-probability and s.
void softmax_gradient_row(float* row, int64_t V, int64_t label, float* label_logp, float* sum) {
  const float m = row_max(row, V);
  const float x_label = row[label];
  const float s = exp_shifted_and_sum(row, V, m);
  row[label] -= s;
  *sum = s;
  *label_logp = x_label - m - std::log(s);
}

}  // namespace

std::tuple<Tensor, Tensor> softmax_gradient_rows(Tensor& logits, const Tensor& labels) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.has_storage() && !logits.key_set().has(c10::DispatchKey::Python) && logits.is_contiguous(),
              "softmax_gradient_rows: logits must be a contiguous 2-D CPU float32 tensor (no tensor subclass)");
  const int64_t M = logits.size(0), V = logits.size(1);
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == M && labels.device().is_cpu() &&
                  labels.scalar_type() == at::kLong && labels.has_storage() &&
                  !labels.key_set().has(c10::DispatchKey::Python) && labels.is_contiguous(),
              "softmax_gradient_rows: labels must be a contiguous CPU int64 tensor of ", M, " rows");
  TORCH_CHECK(V > 0, "softmax_gradient_rows: no vocabulary");
  const int64_t* label = labels.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)  // every write below stays inside the row
    TORCH_CHECK(label[r] >= 0 && label[r] < V, "softmax_gradient_rows: label ", label[r], " of row ", r,
                " is outside the vocabulary of ", V);
  Tensor label_logp = at::empty({M}, logits.options()), sums = at::empty({M}, logits.options());
  float* data = logits.mutable_data_ptr<float>();
  float* logp = label_logp.mutable_data_ptr<float>();
  float* sum = sums.mutable_data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) softmax_gradient_row(data + r * V, V, label[r], logp + r, sum + r);
  });
  return {label_logp, sums};
}

}  // namespace moetron_cpu

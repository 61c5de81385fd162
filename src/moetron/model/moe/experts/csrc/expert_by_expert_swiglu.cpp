// moetron's CPU SwiGLU experts, expert by expert, in C++ (loaded by `compiled_kernel.py`).
//
// The same per-expert at::mm calls as the Python loop in `cpu_kernels.py`, and the same element-wise values, with
// the element-wise work fused into one pass per expert in each direction:
//   forward   h = silu(a) * b                      (ATen: silu, then mul: two passes, one more [n, F] buffer)
//   backward  db = silu(a) * dh, da = silu'(a)·(dh * b)   (ATen: mul_, mul_, silu_backward: three passes)
// and without the Python interpreter between the ~17 calls per expert. silu is recomputed in the backward from
// the one exp it needs anyway, so the forward saves a, b and h only (one [n, F] activation less per expert).
//
// Bitwise ATen's values: the vector code is ATen's own silu / silu_backward expressions on ATen's Vectorized<float>
// (compiled for the CPU capability ATen dispatches to here, so the same Sleef exp), over the same chunks that
// TensorIterator's parallel_for gives (GRAIN_SIZE), two vectors per step and the scalar expression for the tail,
// as ATen's vectorized_loop does. The products (s * b, s * dh, dh * b) are single IEEE multiplies either way.
// `compiled_kernel.py` checks this against the Python loop on every load and falls back to it if a bit differs.
//
// Shape legend: N rows sorted by expert (rows past the sum of counts are not computed), E experts, D hidden,
// F ffn size per expert; n the rows of one expert.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();  // ATen's vectorized_loop: two vectors per iteration

// Runs fn(begin, end) over [0, n) in TensorIterator's parallel chunks, so that the scalar tails fall on the
// same elements as in ATen's own kernels at any thread count.
template <typename Fn>
void for_each_chunk(int64_t n, const Fn& fn) {
  at::parallel_for(0, n, at::internal::GRAIN_SIZE, fn);
}

// h = silu(a) * b, silu(x) = x / (1 + exp(-x)) (ATen's silu_kernel).
void silu_times(const float* a, const float* b, float* h, int64_t n) {
  for_each_chunk(n, [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    const float *pa = a + begin, *pb = b + begin;
    float* ph = h + begin;
    const int64_t len = end - begin;
    int64_t i = 0;
    for (; i <= len - kStep; i += kStep) {
      for (int64_t j = i; j < i + kStep; j += Vec::size()) {
        const Vec x = Vec::loadu(pa + j);
        (x / (one + x.neg().exp()) * Vec::loadu(pb + j)).store(ph + j);
      }
    }
    for (; i < len; ++i) {
      const float x = pa[i];
      ph[i] = x / (1.0f + std::exp(-x)) * pb[i];
    }
  });
}

// In: a, b, dh (the gradient of h). Out, in place: db = silu(a) * dh over b, da = silu_backward(dh * b, a) over dh
// (ATen's silu_backward_kernel: dy * sigmoid * (1 + x * (1 - sigmoid)), sigmoid = 1 / (1 + exp(-x))).
void swiglu_gradients(const float* a, float* b_then_db, float* dh_then_da, int64_t n) {
  for_each_chunk(n, [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    const float* pa = a + begin;
    float *pb = b_then_db + begin, *pd = dh_then_da + begin;
    const int64_t len = end - begin;
    int64_t i = 0;
    for (; i <= len - kStep; i += kStep) {
      for (int64_t j = i; j < i + kStep; j += Vec::size()) {
        const Vec x = Vec::loadu(pa + j), dh = Vec::loadu(pd + j);
        const Vec denominator = one + x.neg().exp();
        const Vec sigmoid = one / denominator;
        const Vec dy = dh * Vec::loadu(pb + j);
        (x / denominator * dh).store(pb + j);
        (dy * sigmoid * (one + x * (one - sigmoid))).store(pd + j);
      }
    }
    for (; i < len; ++i) {
      const float x = pa[i], dh = pd[i];
      const float denominator = 1.0f + std::exp(-x);
      const float sigmoid = 1.0f / denominator;
      const float dy = dh * pb[i];
      pb[i] = x / denominator * dh;
      pd[i] = dy * sigmoid * (1.0f + x * (1.0f - sigmoid));
    }
  });
}

using Activations = std::tuple<Tensor, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>>;

// (y, a, b, h per expert): y[row of expert e] = (silu(x_e·w1_e) * (x_e·w3_e))·w2_e; rows past the counts are 0.
Activations forward(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                    const std::vector<int64_t>& counts) {
  const int64_t num_rows = x.size(0);
  Tensor y = at::empty({num_rows, w2.size(2)}, x.options());
  std::vector<Tensor> a_list, b_list, h_list;
  a_list.reserve(counts.size());
  b_list.reserve(counts.size());
  h_list.reserve(counts.size());
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t n = counts[e];
    const Tensor x_e = x.narrow(0, row, n);
    Tensor a = at::mm(x_e, w1.select(0, e)), b = at::mm(x_e, w3.select(0, e));
    Tensor h = at::empty_like(a);
    silu_times(a.const_data_ptr<float>(), b.const_data_ptr<float>(), h.mutable_data_ptr<float>(), a.numel());
    Tensor y_e = y.narrow(0, row, n);
    at::mm_out(y_e, h, w2.select(0, e));
    a_list.push_back(std::move(a));
    b_list.push_back(std::move(b));
    h_list.push_back(std::move(h));
    row += n;
  }
  y.narrow(0, row, num_rows - row).zero_();
  return {y, a_list, b_list, h_list};
}

// Writes the gradients asked for (grad_x: the input's, zero past the counts; w*_grad: the weights') and returns
// (da, db) per expert when `keep` (zero bubble's second pass reuses them), else empty lists. `da_kept`/`db_kept`
// from an earlier pass replace a and b (which that pass consumed); h is needed only for the weight gradients.
std::tuple<std::vector<Tensor>, std::vector<Tensor>> backward(
    const Tensor& grad, const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
    const std::vector<int64_t>& counts, const std::vector<Tensor>& a_list, const std::vector<Tensor>& b_list,
    const std::vector<Tensor>& h_list, const std::vector<Tensor>& da_kept, const std::vector<Tensor>& db_kept,
    std::optional<Tensor> grad_x, std::optional<Tensor> w1_grad, std::optional<Tensor> w3_grad,
    std::optional<Tensor> w2_grad, bool keep) {
  const bool weights = w1_grad.has_value();
  std::vector<Tensor> da_out, db_out;
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t n = counts[e];
    const Tensor g_e = grad.narrow(0, row, n), x_e = x.narrow(0, row, n);
    if (weights) {
      Tensor w2_grad_e = w2_grad->select(0, e);
      at::mm_out(w2_grad_e, h_list[e].t(), g_e);
    }
    Tensor da, db;
    if (da_kept.empty()) {
      da = at::mm(g_e, w2.select(0, e).t());  // dh, then da in place
      db = b_list[e];                          // b, then db in place: b is dead after this
      swiglu_gradients(a_list[e].const_data_ptr<float>(), db.mutable_data_ptr<float>(), da.mutable_data_ptr<float>(),
                       da.numel());
    } else {
      da = da_kept[e];
      db = db_kept[e];
    }
    if (weights) {
      const Tensor x_t = x_e.t();
      Tensor w1_grad_e = w1_grad->select(0, e), w3_grad_e = w3_grad->select(0, e);
      at::mm_out(w1_grad_e, x_t, da);
      at::mm_out(w3_grad_e, x_t, db);
    }
    if (grad_x.has_value()) {
      Tensor grad_x_e = grad_x->narrow(0, row, n);
      at::mm_out(grad_x_e, da, w1.select(0, e).t()).add_(at::mm(db, w3.select(0, e).t()));
    }
    if (keep) {
      da_out.push_back(std::move(da));
      db_out.push_back(std::move(db));
    }
    row += n;
  }
  if (grad_x.has_value()) grad_x->narrow(0, row, grad_x->size(0) - row).zero_();
  return {da_out, db_out};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Only tensors and vectors are touched after the arguments are converted: the GIL goes while it runs.
  m.def("forward", &forward, py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, py::call_guard<py::gil_scoped_release>());
}

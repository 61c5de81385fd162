// moetron's CPU SwiGLU experts, expert by expert, in C++ (loaded by `compiled_kernels.py`).
//
// The same per-expert GEMMs as the Python loop in `cpu_kernels.py` (the very BLAS calls at::mm makes: `gemm_into`,
// without ATen's dispatch, views and output allocation around each of the ~10 per expert), and the same element-wise
// values, with the element-wise work fused into one pass per expert in each direction:
//   forward   d = 1 + exp(-a), h = a / d * b = silu(a) * b   (ATen: silu, then mul: two passes, one more buffer)
//   backward  db = a / d * dh, da = (dh * b)·silu'(a)          (ATen: mul_, mul_, silu_backward: three passes)
// and without the Python interpreter between the calls. The forward saves a, b and silu's denominator d (not h, which
// goes through one reused buffer), so the backward needs no exp: silu(a) = a / d and sigmoid(a) = 1 / d are what
// ATen's silu and silu_backward compute from the same denominator, and h = a / d * b is recomputed (two IEEE ops)
// for the weight gradient.
//
// Bitwise ATen's values: the vector code is ATen's own silu / silu_backward expressions on ATen's Vectorized<float>
// (compiled for the CPU capability ATen dispatches to here, so the same Sleef exp), over the same chunks that
// TensorIterator's parallel_for gives (GRAIN_SIZE), two vectors per step and the scalar expression for the tail,
// as ATen's vectorized_loop does. The products (s * b, s * dh, dh * b) are single IEEE multiplies either way.
// `cpu_kernels.compiled_engine` checks this against the Python loop in every process and falls back to it if a bit
// differs.
//
// Token order (`tokens`, dropless top-1): x, y and their gradients stay in the tokens' order and sorted row r is token
// tokens[r] (a permutation); each expert's rows are gathered into a buffer of its own before its GEMMs and its
// outputs scattered back after them, so the dispatcher's two [N, D] permutations and the combine's two are not made.
// The buffers have the layout a slice of a sorted [N, D] tensor has (row stride D), so the GEMM calls are the same.
//
// Shape legend: N rows sorted by expert (rows past the sum of counts are not computed), E experts, D hidden,
// F ffn size per expert; n the rows of one expert.

#include "kernels.h"

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace moetron_cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();  // ATen's vectorized_loop: two vectors per iteration

// Runs fn(begin, end) over [0, n) in TensorIterator's parallel chunks, so that the scalar tails fall on the
// same elements as in ATen's own kernels at any thread count.
template <typename Fn>
void for_each_chunk(int64_t n, const Fn& fn) {
  at::parallel_for(0, n, at::internal::GRAIN_SIZE, fn);
}

// d = 1 + exp(-a) and h = a / d * b: silu(x) = x / (1 + exp(-x)) as ATen's silu_kernel computes it, times b.
// `h` may be null (only d wanted).
void silu_denominator_and_product(const float* a, const float* b, float* d, float* h, int64_t n) {
  for_each_chunk(n, [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    const float *pa = a + begin, *pb = b + begin;
    float *pd = d + begin, *ph = h ? h + begin : nullptr;
    const int64_t len = end - begin;
    int64_t i = 0;
    for (; i <= len - kStep; i += kStep) {
      for (int64_t j = i; j < i + kStep; j += Vec::size()) {
        const Vec x = Vec::loadu(pa + j);
        const Vec denominator = one + x.neg().exp();
        denominator.store(pd + j);
        if (ph) (x / denominator * Vec::loadu(pb + j)).store(ph + j);
      }
    }
    for (; i < len; ++i) {
      const float x = pa[i];
      pd[i] = 1.0f + std::exp(-x);
      if (ph) ph[i] = x / pd[i] * pb[i];
    }
  });
}

// h = a / d * b (d from `silu_denominator_and_product`: the forward's h, bit for bit).
void silu_product(const float* a, const float* d, const float* b, float* h, int64_t n) {
  for_each_chunk(n, [&](int64_t begin, int64_t end) {
    const float *pa = a + begin, *pd = d + begin, *pb = b + begin;
    float* ph = h + begin;
    const int64_t len = end - begin;
    int64_t i = 0;
    for (; i <= len - kStep; i += kStep) {
      for (int64_t j = i; j < i + kStep; j += Vec::size())
        (Vec::loadu(pa + j) / Vec::loadu(pd + j) * Vec::loadu(pb + j)).store(ph + j);
    }
    for (; i < len; ++i) ph[i] = pa[i] / pd[i] * pb[i];
  });
}

// In: a, d = 1 + exp(-a), b, dh (the gradient of h). Out, in place: db = silu(a) * dh over b, da = silu_backward(dh *
// b, a) over dh (ATen's silu_backward_kernel: dy * sigmoid * (1 + x * (1 - sigmoid)), sigmoid = 1 / (1 + exp(-x)),
// here 1 / d).
void swiglu_gradients(const float* a, const float* d, float* b_then_db, float* dh_then_da, int64_t n) {
  for_each_chunk(n, [&](int64_t begin, int64_t end) {
    const Vec one(1.0f);
    const float *pa = a + begin, *pden = d + begin;
    float *pb = b_then_db + begin, *pd = dh_then_da + begin;
    const int64_t len = end - begin;
    int64_t i = 0;
    for (; i <= len - kStep; i += kStep) {
      for (int64_t j = i; j < i + kStep; j += Vec::size()) {
        const Vec x = Vec::loadu(pa + j), dh = Vec::loadu(pd + j);
        const Vec denominator = Vec::loadu(pden + j);
        const Vec sigmoid = one / denominator;
        const Vec dy = dh * Vec::loadu(pb + j);
        (x / denominator * dh).store(pb + j);
        (dy * sigmoid * (one + x * (one - sigmoid))).store(pd + j);
      }
    }
    for (; i < len; ++i) {
      const float x = pa[i], dh = pd[i];
      const float denominator = pden[i];
      const float sigmoid = 1.0f / denominator;
      const float dy = dh * pb[i];
      pb[i] = x / denominator * dh;
      pd[i] = dy * sigmoid * (1.0f + x * (1.0f - sigmoid));
    }
  });
}


// The BLAS torch links (MKL here), which ATen's cpublas::gemm calls for float.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

// Every operand, output and gradient is contiguous (`cpu_kernels.swiglu_engine` hands this engine contiguous
// tensors only; a gradient is made contiguous here), or a transpose of a contiguous matrix.
// A matrix view: element (i, j) at data[i * s0 + j * s1].
struct Matrix {
  const float* data;
  int64_t rows, cols, s0, s1;
  Matrix t() const { return {data, cols, rows, s1, s0}; }
};

Matrix matrix(const Tensor& t) { return {t.const_data_ptr<float>(), t.size(0), t.size(1), t.stride(0), t.stride(1)}; }
Matrix rows_of(const Tensor& t, int64_t row, int64_t n) {
  return {t.const_data_ptr<float>() + row * t.stride(0), n, t.size(1), t.stride(0), t.stride(1)};
}
Matrix expert(const Tensor& w, int64_t e) {
  return {w.const_data_ptr<float>() + e * w.stride(0), w.size(1), w.size(2), w.stride(1), w.stride(2)};
}
float* expert_out(Tensor& w, int64_t e) { return w.mutable_data_ptr<float>() + e * w.stride(0); }

// c [rows, cols] (element (i, j) at c[i * c_s0 + j * c_s1]) = a · b, by the BLAS call at::mm makes for these
// strides: addmm_impl_cpu_'s layout choice (a result with unit row stride is computed as it is, one with unit column
// stride as cᵀ = bᵀ · aᵀ; each operand transposed or not by its strides; lda/ldb/ldc from them), cpublas'
// normalize_last_dims, then sgemm_. The same call, so the same bits (checked on every load).
void gemm_into(float* c, int64_t c_s0, int64_t c_s1, Matrix m1, Matrix m2) {
  int64_t m = m1.rows, k = m1.cols, n = m2.cols;
  if (m == 0 || n == 0) return;
  if (k == 0) {  // at::mm zero-fills: [m, 0] x [0, n]
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * c_s0 + j * c_s1] = 0.0f;
    return;
  }
  bool tc;
  if (c_s0 == 1 && (n == 1 || c_s1 >= std::max<int64_t>(1, m))) {
    tc = false;
  } else {
    TORCH_CHECK(c_s1 == 1 && (m == 1 || c_s0 >= std::max<int64_t>(1, n)), "gemm_into: unsupported output strides");
    std::swap(m1, m2);
    std::swap(m, n);
    tc = true;
  }
  auto stride = [](const Matrix& x, int i) { return i == 0 ? x.s0 : x.s1; };
  const int row = tc ? 1 : 0, col = tc ? 0 : 1;
  bool ta, tb;
  if (stride(m1, row) == 1 && stride(m1, col) >= std::max<int64_t>(1, m)) {
    ta = false;
  } else {
    TORCH_CHECK(stride(m1, col) == 1 && stride(m1, row) >= std::max<int64_t>(1, k), "gemm_into: unsupported strides");
    ta = true;
  }
  if (stride(m2, row) == 1 && stride(m2, col) >= std::max<int64_t>(1, k)) {
    tb = false;
  } else {
    TORCH_CHECK(stride(m2, col) == 1 && stride(m2, row) >= std::max<int64_t>(1, n), "gemm_into: unsupported strides");
    tb = true;
  }
  int64_t lda = stride(m1, ta == tc ? 1 : 0), ldb = stride(m2, tb == tc ? 1 : 0), ldc = tc ? c_s0 : c_s1;
  if (n == 1) ldc = m;  // cpublas::normalize_last_dims
  if (ta) { if (m == 1) lda = k; } else if (k == 1) lda = m;
  if (tb) { if (k == 1) ldb = n; } else if (n == 1) ldb = k;
  const char transa = ta ? 't' : 'n', transb = tb ? 't' : 'n';
  const int im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
  const float one = 1.0f, zero = 0.0f;
  sgemm_(&transa, &transb, &im, &in, &ik, &one, m1.data, &ilda, m2.data, &ildb, &zero, c, &ildc);
}

// c: rows with unit column stride and row stride ld (a fresh tensor, or rows of one)
void gemm_into(float* c, int64_t ld, const Matrix& a, const Matrix& b) { gemm_into(c, ld, 1, a, b); }

// c += d: ATen's add_ (one IEEE add per element, so the same sums in any order)
void add_into(float* c, const float* d, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(c + i) + Vec::loadu(d + i)).store(c + i);
  for (; i < n; ++i) c[i] += d[i];
}

// dst[i] = src[index[i]] for n rows of `width` floats (dst packed, src of row stride `width`), and the reverse.
// Split over threads as ATen's index_select splits its rows (whole rows, GRAIN_SIZE elements at least per chunk).
void gather_rows(float* dst, const float* src, const int64_t* index, int64_t n, int64_t width) {
  at::parallel_for(0, n, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, width)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i)
                       std::memcpy(dst + i * width, src + index[i] * width, width * sizeof(float));
                   });
}
void scatter_rows(float* dst, const float* src, const int64_t* index, int64_t n, int64_t width) {
  at::parallel_for(0, n, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, width)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i)
                       std::memcpy(dst + index[i] * width, src + i * width, width * sizeof(float));
                   });
}

// Every pointer below is computed from these shapes: check them all, so that a caller's mistake is an error and
// never a write past a buffer. Plain CPU float32 tensors only: a tensor subclass (DTensor, FakeTensor, ...) has no
// data of its own to point at.
void check_plain(const Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.has_storage() &&
                  !t.key_set().has(c10::DispatchKey::Python) && t.sizes() == shape && t.is_contiguous(),
              "moetron CPU SwiGLU kernel: ", name, " must be a contiguous CPU float32 tensor of shape ", shape,
              ", got ", t.sizes());
}

int64_t checked_rows(const std::vector<int64_t>& counts, const Tensor& x, const Tensor& w1, const Tensor& w3,
                     const Tensor& w2) {
  TORCH_CHECK(w1.dim() == 3 && x.dim() == 2, "moetron CPU SwiGLU kernel: x [N, D] and weights [E, D, F]");
  const int64_t E = w1.size(0), D = w1.size(1), F = w1.size(2);
  check_plain(x, "x", {x.size(0), D});
  check_plain(w1, "w1", {E, D, F});
  check_plain(w3, "w3", {E, D, F});
  check_plain(w2, "w2", {E, F, D});
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == E, "moetron CPU SwiGLU kernel: ", counts.size(),
              " counts for ", E, " experts");
  int64_t rows = 0;
  for (const int64_t n : counts) {
    TORCH_CHECK(n >= 0, "moetron CPU SwiGLU kernel: a negative count");
    rows += n;
  }
  TORCH_CHECK(rows <= x.size(0), "moetron CPU SwiGLU kernel: counts sum to ", rows, " rows, x has ", x.size(0));
  return rows;
}

// The token of every sorted row, or nullptr without token order. Checked whole (int64, one per row of x, the counts
// covering them all, each row exactly once), so every gather and scatter stays inside x and writes each row once.
const int64_t* checked_tokens(const std::optional<Tensor>& tokens, int64_t num_rows, int64_t counted) {
  if (!tokens.has_value()) return nullptr;
  const Tensor& t = *tokens;
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kLong && t.has_storage() &&
                  !t.key_set().has(c10::DispatchKey::Python) && t.dim() == 1 && t.size(0) == num_rows &&
                  t.is_contiguous(),
              "moetron CPU SwiGLU kernel: tokens must be a contiguous CPU int64 tensor of ", num_rows, " rows");
  TORCH_CHECK(counted == num_rows, "moetron CPU SwiGLU kernel: in token order the counts must cover every row (",
              counted, " of ", num_rows, ")");
  const int64_t* index = t.const_data_ptr<int64_t>();
  std::vector<bool> seen(num_rows, false);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t token = index[r];
    TORCH_CHECK(token >= 0 && token < num_rows && !seen[token], "moetron CPU SwiGLU kernel: tokens is not a "
                "permutation of 0..", num_rows - 1, " (row ", r, " names ", token, ")");
    seen[token] = true;
  }
  return index;
}

int64_t max_count(const std::vector<int64_t>& counts) {
  int64_t most = 0;
  for (const int64_t n : counts) most = std::max(most, n);
  return most;
}

// The first sorted row of every expert.
std::vector<int64_t> first_rows(const std::vector<int64_t>& counts) {
  std::vector<int64_t> first(counts.size(), 0);
  for (size_t e = 1; e < counts.size(); ++e) first[e] = first[e - 1] + counts[e - 1];
  return first;
}

// Workers that run whole experts: every intra-op thread (1 inside another parallel region).
int64_t expert_workers() { return at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads()); }

// body(e, worker) for every expert: on this thread with one worker; with more, one worker per thread of the team,
// each taking the next expert (the largest first) until none is left. Inside the parallel region ATen's element-wise
// helpers run one chunk and MKL one thread, so an expert's values are the one-thread values whichever worker runs it,
// and the experts write disjoint rows and weight slices. Why not every thread in each of an expert's GEMMs: at a few
// hundred rows per expert, MKL's threading costs more than it saves (benchmarks/RESULTS.md, issue 28: at two threads
// the E = 8 layer took twice the CPU time of one thread, and longer in wall time as well).
template <typename Body>
void for_each_expert(const std::vector<int64_t>& counts, int64_t workers, const Body& body) {
  const int64_t E = static_cast<int64_t>(counts.size());
  if (workers <= 1) {
    for (int64_t e = 0; e < E; ++e) body(e, 0);
    return;
  }
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    const at::NoGradGuard no_grad;  // grad mode is thread-local: the team's other threads start with it on
    for (int64_t worker = begin; worker < end; ++worker)
      for (int64_t i = next++; i < E; i = next++) body(order[i], worker);
  });
}

}  // namespace

// (y, a, b, d per expert): y[row of expert e] = (silu(x_e·w1_e) * (x_e·w3_e))·w2_e; rows past the counts are 0;
// d = 1 + exp(-a), silu's denominator.
// With `tokens`, x and y are in token order (see the top of this file).
Activations swiglu_forward(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                           const std::vector<int64_t>& counts, const std::optional<Tensor>& tokens) {
  const int64_t counted = checked_rows(counts, x, w1, w3, w2);
  const int64_t num_rows = x.size(0);
  const int64_t* token = checked_tokens(tokens, num_rows, counted);
  Tensor y = at::empty({num_rows, w2.size(2)}, x.options());
  const int64_t E = static_cast<int64_t>(counts.size()), F = w1.size(2), D = w2.size(2);
  std::vector<Tensor> a_list(E), b_list(E), d_list(E);
  for (int64_t e = 0; e < E; ++e) {
    a_list[e] = at::empty({counts[e], F}, x.options());
    b_list[e] = at::empty({counts[e], F}, x.options());
    d_list[e] = at::empty({counts[e], F}, x.options());
  }
  const std::vector<int64_t> first = first_rows(counts);
  const int64_t workers = expert_workers();
  const int64_t buffer_rows = token ? max_count(counts) : 0;  // one expert's rows of x, then of y
  // per worker: one expert's rows of x and y (token order), and its h, dead after its last GEMM
  std::vector<Tensor> x_buffers, y_buffers, h_buffers;
  for (int64_t w = 0; w < workers; ++w) {
    x_buffers.push_back(at::empty({buffer_rows, D}, x.options()));
    y_buffers.push_back(at::empty({buffer_rows, D}, x.options()));
    h_buffers.push_back(at::empty({max_count(counts), F}, x.options()));
  }
  for_each_expert(counts, workers, [&](int64_t e, int64_t worker) {
    const int64_t n = counts[e], row = first[e];
    const Tensor &x_buffer = x_buffers[worker], &y_buffer = y_buffers[worker], &h_buffer = h_buffers[worker];
    if (token) gather_rows(x_buffer.mutable_data_ptr<float>(), x.const_data_ptr<float>(), token + row, n, D);
    const Matrix x_e = token ? rows_of(x_buffer, 0, n) : rows_of(x, row, n);
    const Tensor &a = a_list[e], &b = b_list[e], &d = d_list[e];
    gemm_into(a.mutable_data_ptr<float>(), F, x_e, expert(w1, e));
    gemm_into(b.mutable_data_ptr<float>(), F, x_e, expert(w3, e));
    silu_denominator_and_product(a.const_data_ptr<float>(), b.const_data_ptr<float>(), d.mutable_data_ptr<float>(),
                                 h_buffer.mutable_data_ptr<float>(), a.numel());
    float* y_e = token ? y_buffer.mutable_data_ptr<float>() : y.mutable_data_ptr<float>() + row * D;
    gemm_into(y_e, D, rows_of(h_buffer, 0, n), expert(w2, e));
    if (token) scatter_rows(y.mutable_data_ptr<float>(), y_e, token + row, n, D);
  });
  const int64_t row = E ? first[E - 1] + counts[E - 1] : 0;
  y.narrow(0, row, num_rows - row).zero_();
  return {y, a_list, b_list, d_list};
}

// Writes the gradients asked for (grad_x: the input's, zero past the counts; w*_grad: the weights') and returns
// (da, db, h) per expert when `keep` (the other pass of a zero-bubble split reuses them; h only where this pass leaves
// the weight gradients to that one), else empty lists. The first pass reads a, b and d (b becomes db in place); the
// second reads what the first kept instead.
Gradients swiglu_backward(
    const Tensor& grad_in, const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
    const std::vector<int64_t>& counts, const std::vector<Tensor>& a_list, const std::vector<Tensor>& b_list,
    const std::vector<Tensor>& d_list, const std::vector<Tensor>& da_kept, const std::vector<Tensor>& db_kept,
    const std::vector<Tensor>& h_kept, std::optional<Tensor> grad_x, std::optional<Tensor> w1_grad,
    std::optional<Tensor> w3_grad, std::optional<Tensor> w2_grad, bool keep, const std::optional<Tensor>& tokens) {
  const int64_t counted = checked_rows(counts, x, w1, w3, w2);
  const int64_t* token = checked_tokens(tokens, x.size(0), counted);
  const Tensor grad = grad_in.contiguous();  // an expanded (stride 0) gradient: at::mm would copy it the same way
  const bool weights = w1_grad.has_value();
  const int64_t E = w1.size(0), F = w1.size(2), D = w1.size(1), N = x.size(0);
  check_plain(grad, "grad", {N, D});
  if (grad_x.has_value()) check_plain(*grad_x, "grad_x", {N, D});
  TORCH_CHECK(weights == w3_grad.has_value() && weights == w2_grad.has_value(), "moetron CPU SwiGLU kernel: all "
              "three weight gradients or none");
  if (weights) {
    check_plain(*w1_grad, "w1_grad", {E, D, F});
    check_plain(*w3_grad, "w3_grad", {E, D, F});
    check_plain(*w2_grad, "w2_grad", {E, F, D});
  }
  const bool stashed = !da_kept.empty();
  const auto every_expert = [E](const std::vector<Tensor>& list) { return static_cast<int64_t>(list.size()) == E; };
  TORCH_CHECK(stashed ? every_expert(da_kept) && every_expert(db_kept) && (!weights || every_expert(h_kept))
                      : every_expert(a_list) && every_expert(b_list) && every_expert(d_list),
              "moetron CPU SwiGLU kernel: the activations (or their kept gradients) of every expert");
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t> rows_F = {counts[e], F};
    if (stashed) {
      check_plain(da_kept[e], "da", rows_F);
      check_plain(db_kept[e], "db", rows_F);
      if (weights) check_plain(h_kept[e], "h", rows_F);
    } else {
      check_plain(a_list[e], "a", rows_F);
      check_plain(b_list[e], "b", rows_F);
      check_plain(d_list[e], "d", rows_F);
    }
  }
  // The weight pass comes after this one: it needs h, which b (about to become db) cannot give it then.
  const bool keep_h = keep && !weights && !stashed;
  std::vector<Tensor> da_out(keep ? E : 0), db_out(keep ? E : 0), h_out(keep_h ? E : 0);
  const std::vector<int64_t> first = first_rows(counts);
  const int64_t workers = expert_workers();
  // Per worker: db · w3ᵀ of one expert (added to its rows of grad_x), one expert's h, and in token order its rows of
  // grad, of x (for the weight gradients) and of grad_x, gathered and scattered.
  const int64_t most = max_count(counts), buffer_rows = token ? most : 0;
  std::vector<Tensor> scratches, h_buffers, g_buffers, x_buffers, gx_buffers;
  for (int64_t w = 0; w < workers; ++w) {
    scratches.push_back(at::empty({grad_x.has_value() ? most : 0, D}, x.options()));
    h_buffers.push_back(at::empty({weights && !stashed ? most : 0, F}, x.options()));
    g_buffers.push_back(at::empty({buffer_rows, D}, x.options()));
    x_buffers.push_back(at::empty({buffer_rows, D}, x.options()));
    gx_buffers.push_back(at::empty({buffer_rows, D}, x.options()));
  }
  for_each_expert(counts, workers, [&](int64_t e, int64_t worker) {
    const int64_t n = counts[e], row = first[e];
    const Tensor &g_buffer = g_buffers[worker], &x_buffer = x_buffers[worker], &gx_buffer = gx_buffers[worker];
    if (token) {
      if (weights || !stashed)  // the second pass of a split backward (the input's, da and db kept) reads no grad
        gather_rows(g_buffer.mutable_data_ptr<float>(), grad.const_data_ptr<float>(), token + row, n, D);
      if (weights) gather_rows(x_buffer.mutable_data_ptr<float>(), x.const_data_ptr<float>(), token + row, n, D);
    }
    const Matrix g_e = token ? rows_of(g_buffer, 0, n) : rows_of(grad, row, n);
    const Matrix x_e = token ? rows_of(x_buffer, 0, n) : rows_of(x, row, n);
    Tensor h;  // h = a / d * b: the forward's, recomputed for dW2 now or kept for the weight pass
    if (!stashed && (weights || keep_h)) {
      h = keep_h ? at::empty({n, F}, x.options()) : h_buffers[worker].narrow(0, 0, n);
      silu_product(a_list[e].const_data_ptr<float>(), d_list[e].const_data_ptr<float>(),
                   b_list[e].const_data_ptr<float>(), h.mutable_data_ptr<float>(), n * F);
    } else if (stashed && weights) {
      h = h_kept[e];
    }
    if (weights) gemm_into(expert_out(*w2_grad, e), D, matrix(h).t(), g_e);
    Tensor da, db;
    if (!stashed) {
      da = at::empty({n, F}, x.options());  // dh, then da in place
      gemm_into(da.mutable_data_ptr<float>(), F, g_e, expert(w2, e).t());
      db = b_list[e];                          // b, then db in place: b is dead after this
      swiglu_gradients(a_list[e].const_data_ptr<float>(), d_list[e].const_data_ptr<float>(),
                       db.mutable_data_ptr<float>(), da.mutable_data_ptr<float>(), da.numel());
    } else {
      da = da_kept[e];
      db = db_kept[e];
    }
    if (weights) {
      gemm_into(expert_out(*w1_grad, e), F, x_e.t(), matrix(da));
      gemm_into(expert_out(*w3_grad, e), F, x_e.t(), matrix(db));
    }
    if (grad_x.has_value()) {
      float* gx = token ? gx_buffer.mutable_data_ptr<float>() : grad_x->mutable_data_ptr<float>() + row * D;
      gemm_into(gx, D, matrix(da), expert(w1, e).t());
      float* scratch = scratches[worker].mutable_data_ptr<float>();
      gemm_into(scratch, D, matrix(db), expert(w3, e).t());
      add_into(gx, scratch, n * D);
      if (token) scatter_rows(grad_x->mutable_data_ptr<float>(), gx, token + row, n, D);
    }
    if (keep) {
      da_out[e] = std::move(da);
      db_out[e] = std::move(db);
      if (keep_h) h_out[e] = std::move(h);
    }
  });
  const int64_t row = E ? first[E - 1] + counts[E - 1] : 0;
  if (grad_x.has_value()) grad_x->narrow(0, row, grad_x->size(0) - row).zero_();
  return {da_out, db_out, h_out};
}

}  // namespace moetron_cpu

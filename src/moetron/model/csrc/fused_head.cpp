// The fused LM head's fp32 CPU forward (`moetron/model/fused_cross_entropy.py`): for every chunk of rows, the
// logits GEMM, the one-exp softmax (softmax_gradient_rows.cpp), the input-gradient GEMM and the weight-gradient
// GEMM, the threads sharing the work out in rounds of W chunks: in each round every thread first runs a chunk of
// its own — logits, softmax, input gradient, one-thread BLAS calls included — and then writes its W-th of the
// vocabulary in the weight gradient (dW_VC's rows, or dW_CV's columns: the caller's layout) from the round's chunks.
//
// Why not one chunk at a time with every thread in each GEMM (the Python loop's way, MKL's threading): the chunk's
// GEMMs are M = 256 rows against V = 50304 columns, and MKL splits them so that at two threads the three GEMMs cost
// 1.2–1.5× the process CPU time they take at one thread (the logits GEMM up to 2×: benchmarks/fused_head.py,
// RESULTS.md); a thread running a whole chunk keeps one thread's efficiency, and the softmax between the GEMMs
// needs no parallel region. The weight gradient by vocabulary: one gradient for all the threads, each
// chunk's product added in chunk order — no per-thread parts to sum afterwards (at two threads that sum cost as
// much CPU again as writing dW back as [V, C]). The price is one [M, V] chunk buffer per thread
// (`fused_cross_entropy.cpu_head_workers` caps it).
//
// Per chunk, with G = s·(softmax − one-hot) in place of the logits (s = Σ exp, per row) and the row factor
// f = weight · grad_scale / s — the same ATen calls, in the same order, as the Python loop, so one worker computes
// the Python loop's bits:
//   loss   −= Σ_rows weight · label_logp            (chunk by chunk, in chunk order, after all workers are done)
//   dx_MC   = f ⊙ (G · W)
//   dW_VC  += Gᵀ · (f ⊙ x_MC)  or  dW_CV += (f ⊙ x_MC)ᵀ · G     (the first chunk writes it: no zero-fill)
// Round r runs chunks r·W … r·W + W − 1 of the n chunks of `rows` rows (the last may be shorter); the dW sums are
// in chunk order whatever W is.
//
// Shape legend: N rows (tokens), C hidden size, V vocabulary, M rows of one chunk, W workers (threads).

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <functional>

namespace moetron_cpu {
namespace {

bool plain_cpu(const Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.has_storage() &&
         !t.key_set().has(c10::DispatchKey::Python) && t.is_contiguous();
}

}  // namespace

Tensor fused_head_forward(const Tensor& x, const Tensor& w, const Tensor& labels, const Tensor& weights,
                          double grad_scale, int64_t rows, const std::vector<Tensor>& logits_buffers,
                          const std::optional<Tensor>& grad_x, const std::optional<Tensor>& weight_grad,
                          bool weight_grad_rows) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && plain_cpu(x, at::kFloat) &&
                  plain_cpu(w, at::kFloat),
              "fused_head_forward: x [N, C] and w [V, C] must be contiguous CPU float32 tensors");
  const int64_t N = x.size(0), C = x.size(1), V = w.size(0);
  const int64_t workers = static_cast<int64_t>(logits_buffers.size());
  TORCH_CHECK(V > 0 && rows > 0 && workers > 0, "fused_head_forward: no vocabulary, rows or workers");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == N && plain_cpu(labels, at::kLong) && weights.dim() == 1 &&
                  weights.size(0) == N && plain_cpu(weights, at::kFloat),
              "fused_head_forward: labels (int64) and weights (float32) must be contiguous CPU vectors of ", N,
              " rows");
  for (const Tensor& buffer : logits_buffers)
    TORCH_CHECK(plain_cpu(buffer, at::kFloat) && buffer.dim() == 2 && buffer.size(0) >= std::min(rows, N) &&
                    buffer.size(1) == V,
                "fused_head_forward: every logits buffer must be a contiguous float32 [", std::min(rows, N), ", ",
                V, "]");
  const bool needs_dw = weight_grad.has_value();
  if (needs_dw) {
    const int64_t dw_rows = weight_grad_rows ? V : C, dw_columns = weight_grad_rows ? C : V;
    TORCH_CHECK(plain_cpu(*weight_grad, at::kFloat) && weight_grad->dim() == 2 && weight_grad->size(0) == dw_rows &&
                    weight_grad->size(1) == dw_columns,
                "fused_head_forward: the weight gradient must be a contiguous float32 [", dw_rows, ", ", dw_columns,
                "]");
  }
  if (grad_x)
    TORCH_CHECK(plain_cpu(*grad_x, at::kFloat) && grad_x->sizes() == x.sizes(),
                "fused_head_forward: grad_x must be a contiguous float32 [", N, ", ", C, "]");
  const int64_t* label = labels.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r)  // every write of the softmax stays inside its row
    TORCH_CHECK(label[r] >= 0 && label[r] < V, "fused_head_forward: label ", label[r], " of row ", r,
                " is outside the vocabulary of ", V);

  const int64_t chunks = (N + rows - 1) / rows;
  Tensor label_logp = at::empty({N}, x.options()), sums = at::empty({N}, x.options());
  std::vector<float> chunk_loss(chunks, 0.0f);
  std::vector<Tensor> scaled_x(chunks);  // f ⊙ x_MC per chunk, the weight gradient's left operand
  float* logp = label_logp.mutable_data_ptr<float>();
  float* sum = sums.mutable_data_ptr<float>();
  const Tensor w_t = w.t();
  if (needs_dw && chunks == 0) weight_grad->zero_();

  // Phase 1 of a round: worker w's chunk (round · W + w) — logits, softmax, loss, dx; its G stays in the buffer.
  const auto softmax_and_dx = [&](int64_t chunk, int64_t worker) {
    const int64_t start = chunk * rows, end = std::min(N, start + rows), M = end - start;
    const Tensor x_MC = x.slice(0, start, end);
    Tensor logits_MV = logits_buffers[worker].slice(0, 0, M);
    at::mm_out(logits_MV, x_MC, w_t);
    float* data = logits_MV.mutable_data_ptr<float>();
    for (int64_t r = 0; r < M; ++r)
      softmax_gradient_row(data + r * V, V, label[start + r], logp + start + r, sum + start + r);
    const Tensor weight_M1 = weights.slice(0, start, end).unsqueeze(1);
    chunk_loss[chunk] = (label_logp.slice(0, start, end).unsqueeze(1) * weight_M1).sum().item<float>();
    if (!grad_x && !needs_dw) return;
    const Tensor scaled_M1 = grad_scale != 1.0 ? weight_M1 * grad_scale : weight_M1;
    const Tensor factor_M1 = scaled_M1 / sums.slice(0, start, end).unsqueeze(1);
    if (grad_x) {
      Tensor dx_MC = grad_x->slice(0, start, end);
      at::mm_out(dx_MC, logits_MV, w);
      dx_MC.mul_(factor_M1);
    }
    if (needs_dw) scaled_x[chunk] = x_MC * factor_M1;
  };
  // Phase 2 of a round: worker w's share [w·V / W, (w + 1)·V / W) of the vocabulary in dW (dW_VC's rows or dW_CV's
  // columns), over the round's chunks in chunk order.
  const auto weight_grad_share = [&](int64_t round, int64_t worker) {
    const int64_t v0 = worker * V / workers, v1 = (worker + 1) * V / workers;
    Tensor dw_share = weight_grad->slice(weight_grad_rows ? 0 : 1, v0, v1);
    for (int64_t chunk = round * workers; chunk < std::min(chunks, (round + 1) * workers); ++chunk) {
      const int64_t M = std::min(N, (chunk + 1) * rows) - chunk * rows;
      const Tensor g_MV = logits_buffers[chunk - round * workers].slice(0, 0, M).slice(1, v0, v1);
      // dW_VC += Gᵀ · (f ⊙ x_MC), or dW_CV += (f ⊙ x_MC)ᵀ · G
      const Tensor left = weight_grad_rows ? g_MV.t() : scaled_x[chunk].t();
      const Tensor right = weight_grad_rows ? scaled_x[chunk] : g_MV;
      if (chunk == 0)
        at::mm_out(dw_share, left, right);
      else
        dw_share.addmm_(left, right);
    }
  };
  // One worker: the calling thread, its BLAS calls threaded as usual. More: one worker per thread of the team, and
  // inside the parallel region ATen's and MKL's calls run on that thread alone.
  const auto on_workers = [&](int64_t count, const std::function<void(int64_t)>& work) {
    if (count == 1) {
      work(0);
      return;
    }
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      const at::NoGradGuard no_grad;  // grad mode is thread-local: the team's other threads start with it on
      for (int64_t worker = begin; worker < end; ++worker) work(worker);
    });
  };
  const at::NoGradGuard no_grad;
  for (int64_t round = 0; round * workers < chunks; ++round) {
    // a short last round still runs in the team, so that every chunk's BLAS calls run on one thread
    on_workers(workers, [&](int64_t worker) {
      if (round * workers + worker < chunks) softmax_and_dx(round * workers + worker, worker);
    });
    if (needs_dw) on_workers(workers, [&](int64_t worker) { weight_grad_share(round, worker); });
  }
  float loss = 0.0f;
  for (const float part : chunk_loss) loss -= part;
  return at::full({}, loss, x.options());
}

void transpose_scaled(const Tensor& dw_CV, const Tensor& ratio, Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && plain_cpu(out, at::kFloat), "transpose_scaled: out must be a contiguous float32 [V, C]");
  const int64_t V = out.size(0), C = out.size(1);
  TORCH_CHECK(plain_cpu(dw_CV, at::kFloat) && dw_CV.dim() == 2 && dw_CV.size(0) == C && dw_CV.size(1) == V,
              "transpose_scaled: the gradient must be a contiguous float32 [", C, ", ", V, "]");
  TORCH_CHECK(ratio.numel() == 1 && ratio.device().is_cpu(), "transpose_scaled: ratio must be one CPU value");
  const float factor = ratio.to(at::kFloat).item<float>();
  const float* source = dw_CV.const_data_ptr<float>();
  float* target = out.mutable_data_ptr<float>();
  // Tiles of 64 columns of dW_CV (64 rows of out): dW_CV is read along its rows, out is written in [64, C] tiles
  // that stay in cache until they are complete.
  constexpr int64_t kTile = 64;
  at::parallel_for(0, (V + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t v0 = tile * kTile, v1 = std::min(V, v0 + kTile);
      for (int64_t c = 0; c < C; ++c)
        for (int64_t v = v0; v < v1; ++v) target[v * C + c] = source[c * V + v] * factor;
    }
  });
}

}  // namespace moetron_cpu

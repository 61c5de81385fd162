// The fused LM head's fp32 CPU forward (`moetron/model/fused_cross_entropy.py`): for every chunk of rows, the
// logits GEMM, the one-exp softmax, the input-gradient GEMM and the weight-gradient GEMM, the threads sharing the
// work out in rounds of W chunks: in each round every thread first runs a chunk of its own — logits, softmax, input
// gradient, one-thread BLAS calls included — and then writes its W-th of the vocabulary in the weight gradient
// (dW_VC's rows, or dW_CV's columns: the caller's layout) from the round's chunks.
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
// Why blocks of the vocabulary in a chunk: a chunk's logits are 77 MB at M = 384, and logits GEMM → max → exp → dx
// GEMM over the whole chunk takes them through memory four times; two threads doing so at once cost 7% more CPU
// in their GEMMs than with a 2048-column block (3 MB) kept in cache from its GEMM to its dx product (the kernel:
// 0.96× the head's CPU at two threads, 0.99× at one; benchmarks/RESULTS.md, issue 28 session 42). The softmax of
// a block is taken against the row's running max (the online softmax of flash attention): when a later block
// raises the max, the sum and dx's accumulator shrink by exp(old − new) first; dW, whose GEMM needs the final
// max and sum, reads the exps back per block with exp(block's max − row's max) folded into its [M, C] operand.
//
// Per chunk, with E = exp(logits − m) (m the row's max, s = Σ E per row) in place of the logits and the row factor
// f = weight · grad_scale / s:
//   loss   −= Σ_rows weight · (logit[label] − m − log s)     (chunk by chunk, in chunk order, after the workers)
//   dx_MC   = f ⊙ (E · W) − weight · grad_scale · W[label]
//   dW_VC  += Eᵀ · (f ⊙ x_MC)  or  dW_CV += (f ⊙ x_MC)ᵀ · E   (the first chunk writes it: no zero-fill),
//   then dW[label] −= weight · grad_scale · x_row, row by row
// — (softmax − one-hot) times the row's weight, its label term apart. Round r runs chunks r·W … r·W + W − 1 of the
// n chunks of `rows` rows (the last may be shorter); the dW sums are in chunk order whatever W is, so every thread
// count computes the same bits (the Python loop, one GEMM per chunk, agrees to fp32 rounding).
//
// Shape legend: N rows (tokens), C hidden size, V vocabulary, M rows of one chunk, W workers (threads).

#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace moetron_cpu {
namespace {

// Columns of the vocabulary per block: a block's logits (M × 2048 × 4 bytes, 3 MB at M = 384) stay in cache from
// their GEMM through their max, exp and dx's partial product.
constexpr int64_t kVocabBlock = 2048;

// One chunk's rows, from its softmax (phase 1) to its share of dW (phase 2).
struct ChunkRows {
  std::vector<float> max, sum;  // per row: the max logit m and s = Σ exp(logit − m)
  std::vector<float> shift;     // [blocks × M]: the running max a block's exps were taken against
  std::vector<float> scale;     // weight · grad_scale
  std::vector<float> factor;    // scale / s
};

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

  const int64_t chunks = (N + rows - 1) / rows, blocks = (V + kVocabBlock - 1) / kVocabBlock;
  Tensor label_logp = at::empty({N}, x.options());
  std::vector<float> chunk_loss(chunks, 0.0f);
  std::vector<ChunkRows> chunk_rows(chunks);
  float* logp = label_logp.mutable_data_ptr<float>();
  const float* x_data = x.const_data_ptr<float>();
  const float* w_data = w.const_data_ptr<float>();
  const float* weight = weights.const_data_ptr<float>();
  if (needs_dw && chunks == 0) weight_grad->zero_();

  // Phase 1 of a round: worker w's chunk (round · W + w), block by block of the vocabulary — logits, their online
  // max and sum, exp, dx's partial product — then the loss and the row factors; its exps stay in the buffer.
  const auto softmax_and_dx = [&](int64_t chunk, int64_t worker) {
    const int64_t start = chunk * rows, end = std::min(N, start + rows), M = end - start;
    const Tensor x_MC = x.slice(0, start, end);
    Tensor logits_MV = logits_buffers[worker].slice(0, 0, M);
    float* data = logits_MV.mutable_data_ptr<float>();
    ChunkRows& state = chunk_rows[chunk];
    state.max.assign(M, -std::numeric_limits<float>::infinity());
    state.sum.assign(M, 0.0f);
    state.shift.resize(blocks * M);
    std::vector<float> label_logit(M);
    Tensor acc_MC = grad_x ? grad_x->slice(0, start, end) : Tensor();  // Σ_blocks exp(block − max) · W_block
    float* acc = grad_x ? acc_MC.mutable_data_ptr<float>() : nullptr;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t v0 = b * kVocabBlock, v1 = std::min(V, v0 + kVocabBlock);
      Tensor block_MV = logits_MV.slice(1, v0, v1);
      const Tensor w_BC = w.slice(0, v0, v1);
      at::mm_out(block_MV, x_MC, w_BC.t());
      for (int64_t r = 0; r < M; ++r) {
        float* row = data + r * V + v0;
        const int64_t l = label[start + r];
        if (l >= v0 && l < v1) label_logit[r] = row[l - v0];
        const float previous = state.max[r], m = max_nan(previous, row_max(row, v1 - v0));
        if (b > 0 && m > previous) {  // a larger max: what was summed against the old one shrinks by exp(old − new)
          const float shrink = std::exp(previous - m);
          state.sum[r] *= shrink;
          if (acc)
            for (int64_t c = 0; c < C; ++c) acc[r * C + c] *= shrink;
        }
        state.max[r] = m;
        if (m == -std::numeric_limits<float>::infinity())  // nothing but −inf so far: exps of 0 once a max is found
          std::fill(row, row + (v1 - v0), 0.0f);
        else
          state.sum[r] += exp_shifted_and_sum(row, v1 - v0, m);
        state.shift[b * M + r] = m;
      }
      if (!acc) continue;
      if (b == 0)
        at::mm_out(acc_MC, block_MV, w_BC);
      else
        acc_MC.addmm_(block_MV, w_BC);
    }
    state.scale.resize(M);
    state.factor.resize(M);
    for (int64_t r = 0; r < M; ++r) {
      logp[start + r] = label_logit[r] - state.max[r] - std::log(state.sum[r]);
      state.scale[r] = weight[start + r] * static_cast<float>(grad_scale);
      state.factor[r] = state.scale[r] / state.sum[r];
    }
    const Tensor weight_M1 = weights.slice(0, start, end).unsqueeze(1);
    chunk_loss[chunk] = (label_logp.slice(0, start, end).unsqueeze(1) * weight_M1).sum().item<float>();
    if (!acc) return;
    // dx = f ⊙ (Σ exp · W − s · W[label]) = f ⊙ acc − weight · grad_scale · W[label]
    for (int64_t r = 0; r < M; ++r) {
      const float* w_label = w_data + label[start + r] * C;
      for (int64_t c = 0; c < C; ++c) acc[r * C + c] = acc[r * C + c] * state.factor[r] - state.scale[r] * w_label[c];
    }
  };
  // Phase 2 of a round: worker w's share [w·V / W, (w + 1)·V / W) of the vocabulary in dW (dW_VC's rows or dW_CV's
  // columns), over the round's chunks in chunk order: per vocabulary block, its exps times x scaled by the row factor
  // and by exp(the block's max − the row's), then each row's label term, −weight · grad_scale · x_row.
  const auto weight_grad_share = [&](int64_t round, int64_t worker) {
    const int64_t s0 = worker * V / workers, s1 = (worker + 1) * V / workers;
    float* dw = weight_grad->mutable_data_ptr<float>();
    for (int64_t chunk = round * workers; chunk < std::min(chunks, (round + 1) * workers); ++chunk) {
      const int64_t start = chunk * rows, M = std::min(N, start + rows) - start;
      const ChunkRows& state = chunk_rows[chunk];
      const Tensor g_MV = logits_buffers[chunk - round * workers].slice(0, 0, M);
      Tensor scaled_MC = at::empty({M, C}, x.options());
      float* scaled = scaled_MC.mutable_data_ptr<float>();
      for (int64_t b = s0 / kVocabBlock; b * kVocabBlock < s1; ++b) {
        const int64_t v0 = std::max(s0, b * kVocabBlock), v1 = std::min(s1, (b + 1) * kVocabBlock);
        for (int64_t r = 0; r < M; ++r) {
          const float f = state.factor[r] * std::exp(state.shift[b * M + r] - state.max[r]);
          for (int64_t c = 0; c < C; ++c) scaled[r * C + c] = x_data[(start + r) * C + c] * f;
        }
        const Tensor g_MB = g_MV.slice(1, v0, v1);
        Tensor dw_part = weight_grad->slice(weight_grad_rows ? 0 : 1, v0, v1);
        const Tensor left = weight_grad_rows ? g_MB.t() : scaled_MC.t();
        const Tensor right = weight_grad_rows ? scaled_MC : g_MB;
        if (chunk == 0)
          at::mm_out(dw_part, left, right);
        else
          dw_part.addmm_(left, right);
      }
      for (int64_t r = 0; r < M; ++r) {
        const int64_t l = label[start + r];
        if (l < s0 || l >= s1) continue;
        const float* x_row = x_data + (start + r) * C;
        for (int64_t c = 0; c < C; ++c) {
          float& target = weight_grad_rows ? dw[l * C + c] : dw[c * V + l];
          target -= state.scale[r] * x_row[c];
        }
      }
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

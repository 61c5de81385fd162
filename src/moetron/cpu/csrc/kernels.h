// moetron's CPU kernels, one extension module (`module.cpp`), built by `compiled_kernels.py`.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace moetron_cpu {

using at::Tensor;
using Activations = std::tuple<Tensor, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>>;
using Gradients = std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>>;

// expert_by_expert_swiglu.cpp
Activations swiglu_forward(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                           const std::vector<int64_t>& counts, const std::optional<Tensor>& tokens);
Gradients swiglu_backward(const Tensor& grad_in, const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                          const std::vector<int64_t>& counts, const std::vector<Tensor>& a_list,
                          const std::vector<Tensor>& b_list, const std::vector<Tensor>& d_list,
                          const std::vector<Tensor>& da_kept, const std::vector<Tensor>& db_kept,
                          const std::vector<Tensor>& h_kept, std::optional<Tensor> grad_x,
                          std::optional<Tensor> w1_grad, std::optional<Tensor> w3_grad, std::optional<Tensor> w2_grad,
                          bool keep, const std::optional<Tensor>& tokens);

// first_max_column.cpp
Tensor first_max_column(const Tensor& x);

// softmax_gradient_rows.cpp
std::tuple<Tensor, Tensor> softmax_gradient_rows(Tensor& logits, const Tensor& labels);
// Its row-wise parts, which the fused head's blocks use too: the larger of two values (a NaN winning, as ATen's max
// reductions), a row's max (NaN-propagating), and the row overwritten with exp(row − m), returning its sum (exp_u20
// for a finite m, else the exact exp).
float max_nan(float a, float b);
float row_max(const float* row, int64_t V);
float exp_shifted_and_sum(float* row, int64_t V, float m);

// fused_head.cpp
Tensor fused_head_forward(const Tensor& x, const Tensor& w, const Tensor& labels, const Tensor& weights,
                          double grad_scale, int64_t rows, const std::vector<Tensor>& logits_buffers,
                          const std::optional<Tensor>& grad_x, const std::optional<Tensor>& weight_grad,
                          bool weight_grad_rows);
void transpose_scaled(const Tensor& dw_CV, const Tensor& ratio, Tensor& out);

// add_rows.cpp
void add_rows(Tensor& out, const Tensor& index, const Tensor& src);

}  // namespace moetron_cpu

// Batch norm in training mode on float32 channels-last maps, with the ReLU that follows it, as two CPU kernels
// (forward; the gradients of x, gamma and beta). Built on the machine at first use (imagenet_tpu/cpu/native.py).
//
// Batch norm is bound by memory on CPUs: these kernels do in fewer passes over the map what TensorFlow's kernels
// (and oneDNN's) do with the ReLU as separate ops:
// - forward: the statistics in one pass (sums of x - x[0] and of its square, per channel: the shift by the
//   first row keeps the variance from cancelling when a channel's mean is far from 0), then y = max(x a + b, 0);
// - backward: the ReLU's mask is recomputed from x (x a + b > 0, the same expression as the forward pass, so
//   exactly the mask of y), so neither y nor the ReLU's gradient is read or written: one pass for the two
//   sums (of g and of g (x - mean)), one for dx.
// Each pass splits the rows into one contiguous range per thread of the op's pool; partial sums are added in
// float over blocks of kBlock rows and in double across blocks and threads.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace imagenet_tpu {

REGISTER_OP("ImagenetTpuBatchNorm")
    .Input("x: float")
    .Input("gamma: float")
    .Input("beta: float")
    .Output("y: float")
    .Output("mean: float")
    .Output("variance: float")
    .Attr("epsilon: float")
    .Attr("relu: bool")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->input(1));
      c->set_output(2, c->input(1));
      return absl::OkStatus();
    });

REGISTER_OP("ImagenetTpuBatchNormGrad")
    .Input("dy: float")
    .Input("x: float")
    .Input("gamma: float")
    .Input("beta: float")
    .Input("mean: float")
    .Input("variance: float")
    .Output("dx: float")
    .Output("dgamma: float")
    .Output("dbeta: float")
    .Attr("epsilon: float")
    .Attr("relu: bool")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(2));
      c->set_output(2, c->input(2));
      return absl::OkStatus();
    });

namespace {

constexpr int64_t kBlock = 64;

// x a + b, one rounding: the forward pass's output and the backward pass's ReLU mask are the same expression,
// so the mask recomputed from x is exactly y > 0.
inline float Affine(float x, float a, float b) { return std::fma(x, a, b); }

// The per-channel a and b of y = x a + b, from the statistics as the forward pass returns them (float), so that
// both passes compute them alike.
void AffineOf(int64_t channels, const float* gamma, const float* beta, const float* mean, const float* variance,
              float epsilon, float* scale, float* offset) {
  for (int64_t c = 0; c < channels; ++c) {
    scale[c] = gamma[c] / std::sqrt(variance[c] + epsilon);
    offset[c] = beta[c] - mean[c] * scale[c];
  }
}

// Per-channel sums over rows [first, end) of two functions of the row, into double partials:
// terms(row, a, b) adds each channel's two terms to float a[c], b[c].
template <typename Terms>
void SumRows(int64_t first, int64_t end, int64_t channels, double* sum_a, double* sum_b, const Terms& terms) {
  std::vector<float> a(channels), b(channels);
  for (int64_t block = first; block < end; block += kBlock) {
    std::fill(a.begin(), a.end(), 0.f);
    std::fill(b.begin(), b.end(), 0.f);
    const int64_t block_end = std::min(end, block + kBlock);
    for (int64_t row = block; row < block_end; ++row) terms(row, a.data(), b.data());
    for (int64_t c = 0; c < channels; ++c) {
      sum_a[c] += a[c];
      sum_b[c] += b[c];
    }
  }
}

// Sets an error on `context` unless x has a channel axis and inputs [first_vector, first_vector + vectors) are
// vectors of its channels.
void CheckInputs(OpKernelContext* context, const Tensor& x, int first_vector, int vectors) {
  OP_REQUIRES(context, x.dims() >= 1, errors::InvalidArgument("x must have a channel axis"));
  const int64_t channels = x.dim_size(x.dims() - 1);
  for (int i = first_vector; i < first_vector + vectors; ++i) {
    const Tensor& vector = context->input(i);
    OP_REQUIRES(context, vector.dims() == 1 && vector.dim_size(0) == channels,
                errors::InvalidArgument("input ", i, " must have shape [", channels, "], not ",
                                        vector.shape().DebugString()));
  }
}

}  // namespace

class BatchNormOp : public OpKernel {
 public:
  explicit BatchNormOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(context, context->GetAttr("relu", &relu_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x_tensor = context->input(0);
    CheckInputs(context, x_tensor, 1, 2);
    if (!context->status().ok()) return;
    const int64_t channels = x_tensor.dim_size(x_tensor.dims() - 1);
    const int64_t rows = channels == 0 ? 0 : x_tensor.NumElements() / channels;
    Tensor *y_tensor, *mean_tensor, *variance_tensor;
    OP_REQUIRES_OK(context, context->allocate_output(0, x_tensor.shape(), &y_tensor));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({channels}), &mean_tensor));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({channels}), &variance_tensor));
    float* mean = mean_tensor->flat<float>().data();
    float* variance = variance_tensor->flat<float>().data();
    if (rows == 0) {  // as TensorFlow's fused kernel: statistics of no rows are NaN
      std::fill(mean, mean + channels, std::numeric_limits<float>::quiet_NaN());
      std::fill(variance, variance + channels, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    const float* __restrict x = x_tensor.flat<float>().data();
    const float* gamma = context->input(1).flat<float>().data();
    const float* beta = context->input(2).flat<float>().data();

    const int shards = NumShards(context, rows);
    std::vector<double> sums(2 * shards * channels, 0.0);
    const std::vector<float> shift(x, x + channels);
    ForShards(context, shards, rows, [&](int64_t shard, int64_t first, int64_t end) {
      const float* __restrict s = shift.data();
      SumRows(first, end, channels, &sums[2 * shard * channels], &sums[(2 * shard + 1) * channels],
              [&](int64_t row, float* __restrict a, float* __restrict b) {
                const float* __restrict in = x + row * channels;
                for (int64_t c = 0; c < channels; ++c) {
                  const float centred = in[c] - s[c];
                  a[c] += centred;
                  b[c] += centred * centred;
                }
              });
    });
    std::vector<float> scale(channels), offset(channels);
    for (int64_t c = 0; c < channels; ++c) {
      double sum = 0.0, squares = 0.0;
      for (int shard = 0; shard < shards; ++shard) {
        sum += sums[2 * shard * channels + c];
        squares += sums[(2 * shard + 1) * channels + c];
      }
      const double centred_mean = sum / rows;
      mean[c] = static_cast<float>(centred_mean + shift[c]);
      variance[c] = static_cast<float>(std::max(0.0, squares / rows - centred_mean * centred_mean));
    }
    AffineOf(channels, gamma, beta, mean, variance, epsilon_, scale.data(), offset.data());

    float* __restrict y = y_tensor->flat<float>().data();
    const bool relu = relu_;
    ForShards(context, shards, rows, [&](int64_t, int64_t first, int64_t end) {
      const float* __restrict a = scale.data();
      const float* __restrict b = offset.data();
      for (int64_t row = first; row < end; ++row) {
        const float* __restrict in = x + row * channels;
        float* __restrict out = y + row * channels;
        if (relu) {
          for (int64_t c = 0; c < channels; ++c) out[c] = std::max(Affine(in[c], a[c], b[c]), 0.f);
        } else {
          for (int64_t c = 0; c < channels; ++c) out[c] = Affine(in[c], a[c], b[c]);
        }
      }
    });
  }

 private:
  float epsilon_;
  bool relu_;
};

class BatchNormGradOp : public OpKernel {
 public:
  explicit BatchNormGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(context, context->GetAttr("relu", &relu_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& dy_tensor = context->input(0);
    const Tensor& x_tensor = context->input(1);
    OP_REQUIRES(context, dy_tensor.shape() == x_tensor.shape(),
                errors::InvalidArgument("dy and x must have one shape: ", dy_tensor.shape().DebugString(),
                                        " and ", x_tensor.shape().DebugString()));
    CheckInputs(context, x_tensor, 2, 4);
    if (!context->status().ok()) return;
    const int64_t channels = x_tensor.dim_size(x_tensor.dims() - 1);
    const int64_t rows = channels == 0 ? 0 : x_tensor.NumElements() / channels;
    Tensor *dx_tensor, *dgamma_tensor, *dbeta_tensor;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({0}, 0, x_tensor.shape(), &dx_tensor));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({channels}), &dgamma_tensor));
    OP_REQUIRES_OK(context, context->allocate_output(2, TensorShape({channels}), &dbeta_tensor));
    float* dgamma = dgamma_tensor->flat<float>().data();
    float* dbeta = dbeta_tensor->flat<float>().data();
    if (rows == 0) {
      std::fill(dgamma, dgamma + channels, 0.f);
      std::fill(dbeta, dbeta + channels, 0.f);
      return;
    }
    const float* dy = dy_tensor.flat<float>().data();
    const float* __restrict x = x_tensor.flat<float>().data();
    const float* gamma = context->input(2).flat<float>().data();
    const float* beta = context->input(3).flat<float>().data();
    const float* mean = context->input(4).flat<float>().data();
    const float* variance = context->input(5).flat<float>().data();

    std::vector<float> scale(channels), offset(channels), inverse_std(channels);
    AffineOf(channels, gamma, beta, mean, variance, epsilon_, scale.data(), offset.data());
    for (int64_t c = 0; c < channels; ++c) inverse_std[c] = 1.f / std::sqrt(variance[c] + epsilon_);
    const int shards = NumShards(context, rows);
    const bool relu = relu_;
    std::vector<double> sums(2 * shards * channels, 0.0);
    ForShards(context, shards, rows, [&](int64_t shard, int64_t first, int64_t end) {
      const float* __restrict a = scale.data();
      const float* __restrict b = offset.data();
      const float* __restrict m = mean;
      double* sum_g = &sums[2 * shard * channels];
      double* sum_gx = &sums[(2 * shard + 1) * channels];
      if (relu) {
        SumRows(first, end, channels, sum_g, sum_gx, [&](int64_t row, float* __restrict sg, float* __restrict sgx) {
          const float* __restrict in = x + row * channels;
          const float* __restrict grad = dy + row * channels;
          for (int64_t c = 0; c < channels; ++c) {
            const float g = Affine(in[c], a[c], b[c]) > 0.f ? grad[c] : 0.f;
            sg[c] += g;
            sgx[c] += g * (in[c] - m[c]);
          }
        });
      } else {
        SumRows(first, end, channels, sum_g, sum_gx, [&](int64_t row, float* __restrict sg, float* __restrict sgx) {
          const float* __restrict in = x + row * channels;
          const float* __restrict grad = dy + row * channels;
          for (int64_t c = 0; c < channels; ++c) {
            sg[c] += grad[c];
            sgx[c] += grad[c] * (in[c] - m[c]);
          }
        });
      }
    });
    // dx = a (g - sum g / n - xhat sum(g xhat) / n) = a g - (x k + k0), with xhat = (x - mean) / std.
    std::vector<float> k(channels), k0(channels);
    for (int64_t c = 0; c < channels; ++c) {
      double sum_g = 0.0, sum_gx = 0.0;
      for (int shard = 0; shard < shards; ++shard) {
        sum_g += sums[2 * shard * channels + c];
        sum_gx += sums[(2 * shard + 1) * channels + c];
      }
      dbeta[c] = static_cast<float>(sum_g);
      dgamma[c] = static_cast<float>(sum_gx * inverse_std[c]);
      const double per_x = static_cast<double>(scale[c]) * inverse_std[c] * inverse_std[c] * sum_gx / rows;
      k[c] = static_cast<float>(per_x);
      k0[c] = static_cast<float>(static_cast<double>(scale[c]) * sum_g / rows - mean[c] * per_x);
    }
    float* __restrict dx = dx_tensor->flat<float>().data();
    ForShards(context, shards, rows, [&](int64_t, int64_t first, int64_t end) {
      const float* __restrict a = scale.data();
      const float* __restrict b = offset.data();
      const float* __restrict q = k.data();
      const float* __restrict q0 = k0.data();
      for (int64_t row = first; row < end; ++row) {
        // dx may be dy's buffer (forwarded): each element is read before it is written, at the same index.
        const float* __restrict in = x + row * channels;
        const float* grad = dy + row * channels;
        float* out = dx + row * channels;
        if (relu) {
#pragma GCC ivdep
          for (int64_t c = 0; c < channels; ++c) {
            const float g = Affine(in[c], a[c], b[c]) > 0.f ? grad[c] : 0.f;
            out[c] = g * a[c] - (in[c] * q[c] + q0[c]);
          }
        } else {
#pragma GCC ivdep
          for (int64_t c = 0; c < channels; ++c) out[c] = grad[c] * a[c] - (in[c] * q[c] + q0[c]);
        }
      }
    });
  }

 private:
  float epsilon_;
  bool relu_;
};

REGISTER_KERNEL_BUILDER(Name("ImagenetTpuBatchNorm").Device(::tensorflow::DEVICE_CPU), BatchNormOp);
REGISTER_KERNEL_BUILDER(Name("ImagenetTpuBatchNormGrad").Device(::tensorflow::DEVICE_CPU), BatchNormGradOp);

}  // namespace imagenet_tpu

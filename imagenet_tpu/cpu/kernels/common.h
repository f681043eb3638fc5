// What our CPU kernels share (batch_norm.cc, winograd.cc): TensorFlow's names and the split of a kernel's work
// into one contiguous range per thread of the op's pool.
#ifndef IMAGENET_TPU_CPU_KERNELS_COMMON_H_
#define IMAGENET_TPU_CPU_KERNELS_COMMON_H_

#include <algorithm>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace imagenet_tpu {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;
namespace shape_inference = ::tensorflow::shape_inference;

// One range per thread of the op's pool, at most one per item.
inline int NumShards(OpKernelContext* context, int64_t items) {
  const int threads = context->device()->tensorflow_cpu_worker_threads()->num_threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
}

// fn(shard, first, end) for `shards` contiguous ranges of [0, items), on the op's thread pool.
template <typename Fn>
void ForShards(OpKernelContext* context, int shards, int64_t items, const Fn& fn) {
  auto* pool = context->device()->tensorflow_cpu_worker_threads()->workers;
  pool->TransformRangeConcurrently(1, shards, [&](int64_t first, int64_t end) {
    for (int64_t shard = first; shard < end; ++shard) {
      fn(shard, items * shard / shards, items * (shard + 1) / shards);
    }
  });
}

// fn(first, end) for NumShards ranges of [0, items).
template <typename Fn>
void ForRanges(OpKernelContext* context, int64_t items, const Fn& fn) {
  ForShards(context, NumShards(context, items), items, [&](int64_t, int64_t first, int64_t end) { fn(first, end); });
}

}  // namespace imagenet_tpu

#endif  // IMAGENET_TPU_CPU_KERNELS_COMMON_H_

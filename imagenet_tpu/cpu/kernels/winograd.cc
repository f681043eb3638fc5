// The transforms of Winograd's minimal filtering algorithm F(2x2, 3x3) (Lavin and Gray, "Fast Algorithms for
// Convolutional Neural Networks", CVPR 2016) on float32 channels-last maps, for 3x3 stride-1 SAME convolutions:
// each 2x2 block of outputs is computed from the 4x4 tile of inputs around it with 16 products in place of 36.
// Built on the machine at first use with batch_norm.cc (imagenet_tpu/cpu/native.py).
//
// The map [N, H, W, C] is cut into tiles of 2x2 outputs, T = N ceil(H / 2) ceil(W / 2) of them; tile (n, a, b)
// reads input rows 2a - 1 ... 2a + 2 and columns 2b - 1 ... 2b + 2 (zero outside the map, as SAME pads). With
// Bt = [[1,0,-1,0],[0,1,1,0],[0,-1,1,0],[0,1,0,-1]], At = [[1,1,1,0],[0,1,-1,-1]] and
// G = [[1,0,0],[1/2,1/2,1/2],[1/2,-1/2,1/2],[0,0,1]]:
// - ImagenetTpuWinogradInput: x [N, H, W, C] -> v [16, T, C], v[4i + j, t] = (Bt d B)[i, j] for the tile's d;
// - ImagenetTpuWinogradFilter: w [3, 3, C, F] -> u [16, C, F], u[4i + j] = (G w Gt)[i, j];
// - ImagenetTpuWinogradOutput: m [16, T, F] -> y [N, H, W, F], each tile's 2x2 outputs At m A (those in the map),
//   where m[k] = v[k] u[k] are 16 matrix products (TensorFlow's batched product, convolution.py);
// and the adjoints, from which the gradients are made:
// - ImagenetTpuWinogradOutputGrad: dy [N, H, W, F] -> dm [16, T, F], A dy At;
// - ImagenetTpuWinogradInputGrad: dv [16, T, C] -> dx [N, H, W, C], B dv Bt added into each tile's pixels;
// - ImagenetTpuWinogradFilterGrad: du [16, C, F] -> dw [3, 3, C, F], Gt du G.
// Each kernel splits its tiles (InputGrad: its images, whose tiles overlap; the filter kernels: its C F columns)
// into one contiguous range per thread of the op's pool; the loops over channels are the vectorised inner loops.

#include <algorithm>
#include <vector>

#include "common.h"

namespace imagenet_tpu {

namespace {

int64_t Tiles(int64_t size) { return (size + 1) / 2; }

// The tiles' matrix [16, T, C] of a map [N, H, W, C].
absl::Status TilesShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle map;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &map));
  shape_inference::DimensionHandle rows = c->UnknownDim();
  if (c->ValueKnown(c->Dim(map, 0)) && c->ValueKnown(c->Dim(map, 1)) && c->ValueKnown(c->Dim(map, 2))) {
    rows = c->MakeDim(c->Value(c->Dim(map, 0)) * Tiles(c->Value(c->Dim(map, 1))) * Tiles(c->Value(c->Dim(map, 2))));
  }
  c->set_output(0, c->MakeShape({c->MakeDim(16), rows, c->Dim(map, 3)}));
  return absl::OkStatus();
}

// The map [N, height, width, C] of a tiles' matrix [16, T, C].
absl::Status MapShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle tiles;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &tiles));
  int64_t height, width;
  TF_RETURN_IF_ERROR(c->GetAttr("height", &height));
  TF_RETURN_IF_ERROR(c->GetAttr("width", &width));
  shape_inference::DimensionHandle images = c->UnknownDim();
  if (c->ValueKnown(c->Dim(tiles, 1))) images = c->MakeDim(c->Value(c->Dim(tiles, 1)) / (Tiles(height) * Tiles(width)));
  c->set_output(0, c->MakeShape({images, c->MakeDim(height), c->MakeDim(width), c->Dim(tiles, 2)}));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("ImagenetTpuWinogradInput").Input("x: float").Output("v: float").SetShapeFn(TilesShape);
REGISTER_OP("ImagenetTpuWinogradOutputGrad").Input("dy: float").Output("dm: float").SetShapeFn(TilesShape);
REGISTER_OP("ImagenetTpuWinogradFilter")
    .Input("w: float")
    .Output("u: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &w));
      c->set_output(0, c->MakeShape({c->MakeDim(16), c->Dim(w, 2), c->Dim(w, 3)}));
      return absl::OkStatus();
    });
REGISTER_OP("ImagenetTpuWinogradFilterGrad")
    .Input("du: float")
    .Output("dw: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle du;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &du));
      c->set_output(0, c->MakeShape({c->MakeDim(3), c->MakeDim(3), c->Dim(du, 1), c->Dim(du, 2)}));
      return absl::OkStatus();
    });
REGISTER_OP("ImagenetTpuWinogradOutput")
    .Input("m: float")
    .Output("y: float")
    .Attr("height: int >= 1")
    .Attr("width: int >= 1")
    .SetShapeFn(MapShape);
REGISTER_OP("ImagenetTpuWinogradInputGrad")
    .Input("dv: float")
    .Output("dx: float")
    .Attr("height: int >= 1")
    .Attr("width: int >= 1")
    .SetShapeFn(MapShape);

namespace {

// A map [N, H, W, C] and its tiles' matrix [16, T, C].
struct Geometry {
  int64_t images, height, width, channels, tile_rows, tile_columns;
  int64_t tiles() const { return images * tile_rows * tile_columns; }
  // The pixel (row, column) of image n, or null outside the map.
  template <typename T>
  T* Pixel(T* map, int64_t n, int64_t row, int64_t column) const {
    if (row < 0 || row >= height || column < 0 || column >= width) return nullptr;
    return map + ((n * height + row) * width + column) * channels;
  }
};

Geometry OfMap(const Tensor& map) {
  Geometry g{map.dim_size(0), map.dim_size(1), map.dim_size(2), map.dim_size(3), 0, 0};
  g.tile_rows = Tiles(g.height);
  g.tile_columns = Tiles(g.width);
  return g;
}

// Calls fn(t, n, a, b) for tiles [first, end), t = (n tile_rows + a) tile_columns + b.
template <typename Fn>
void ForTiles(const Geometry& g, int64_t first, int64_t end, const Fn& fn) {
  for (int64_t t = first; t < end; ++t) {
    const int64_t b = t % g.tile_columns, a = (t / g.tile_columns) % g.tile_rows;
    fn(t, t / (g.tile_columns * g.tile_rows), a, b);
  }
}

bool CheckMap(OpKernelContext* context, const Tensor& map) {
  if (map.dims() == 4) return true;
  context->CtxFailure(errors::InvalidArgument("expected a map [N, H, W, C], got ", map.shape().DebugString()));
  return false;
}

// The geometry of a tiles' matrix [16, T, C] for maps of height x width, or an error.
bool CheckTiles(OpKernelContext* context, const Tensor& tiles, int64_t height, int64_t width, Geometry* g) {
  if (tiles.dims() != 3 || tiles.dim_size(0) != 16) {
    context->CtxFailure(errors::InvalidArgument("expected tiles [16, T, C], got ", tiles.shape().DebugString()));
    return false;
  }
  const int64_t per_image = Tiles(height) * Tiles(width);
  if (tiles.dim_size(1) % per_image != 0) {
    context->CtxFailure(
        errors::InvalidArgument(tiles.dim_size(1), " tiles are not whole images of ", height, "x", width));
    return false;
  }
  *g = Geometry{tiles.dim_size(1) / per_image, height, width, tiles.dim_size(2), Tiles(height), Tiles(width)};
  return true;
}

}  // namespace

// A kernel from a map [N, H, W, C] (input 0) to its tiles' matrix [16, T, C] (output 0): for each tile (n, a, b),
// the pixels of the kSize x kSize block from row 2a + offset and column 2b + offset (zeros outside the map) as p[],
// the tile's 16 rows of the matrix as o[], and transform(p, o, c) for each channel c.
template <int kSize, typename Transform>
void MapToTiles(OpKernelContext* context, int offset, const Transform& transform) {
  const Tensor& map_tensor = context->input(0);
  if (!CheckMap(context, map_tensor)) return;
  const Geometry g = OfMap(map_tensor);
  Tensor* tiles_tensor;
  OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({16, g.tiles(), g.channels}), &tiles_tensor));
  const float* map = map_tensor.flat<float>().data();
  float* tiles = tiles_tensor->flat<float>().data();
  const int64_t C = g.channels, T = g.tiles();
  const std::vector<float> zeros(C, 0.f);
  ForRanges(context, T, [&](int64_t first, int64_t end) {
    ForTiles(g, first, end, [&](int64_t t, int64_t n, int64_t a, int64_t b) {
      const float* p[kSize * kSize];
      for (int i = 0; i < kSize; ++i) {
        for (int j = 0; j < kSize; ++j) {
          const float* pixel = g.Pixel(map, n, 2 * a + offset + i, 2 * b + offset + j);
          p[kSize * i + j] = pixel ? pixel : zeros.data();
        }
      }
      float* o[16];
      for (int k = 0; k < 16; ++k) o[k] = tiles + (k * T + t) * C;
#pragma GCC ivdep
      for (int64_t c = 0; c < C; ++c) transform(p, o, c);
    });
  });
}

class WinogradInputOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* context) override {
    // The 4x4 pixels of each tile, from one row and column before its outputs: Bt d B.
    MapToTiles<4>(context, -1, [](const float* const* p, float* const* o, int64_t c) {
      float r[16];  // Bt d: rows
      for (int j = 0; j < 4; ++j) {
        r[j] = p[j][c] - p[8 + j][c];
        r[4 + j] = p[4 + j][c] + p[8 + j][c];
        r[8 + j] = p[8 + j][c] - p[4 + j][c];
        r[12 + j] = p[4 + j][c] - p[12 + j][c];
      }
      for (int i = 0; i < 4; ++i) {  // (Bt d) B: columns
        o[4 * i][c] = r[4 * i] - r[4 * i + 2];
        o[4 * i + 1][c] = r[4 * i + 1] + r[4 * i + 2];
        o[4 * i + 2][c] = r[4 * i + 2] - r[4 * i + 1];
        o[4 * i + 3][c] = r[4 * i + 1] - r[4 * i + 3];
      }
    });
  }
};

class WinogradOutputGradOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* context) override {
    // The 2x2 outputs of each tile: A dy At.
    MapToTiles<2>(context, 0, [](const float* const* p, float* const* o, int64_t c) {
      float r[8];  // A dy: rows 0..3 of 2 columns
      for (int j = 0; j < 2; ++j) {
        r[j] = p[j][c];
        r[2 + j] = p[j][c] + p[2 + j][c];
        r[4 + j] = p[j][c] - p[2 + j][c];
        r[6 + j] = -p[2 + j][c];
      }
      for (int i = 0; i < 4; ++i) {  // (A dy) At: columns
        o[4 * i][c] = r[2 * i];
        o[4 * i + 1][c] = r[2 * i] + r[2 * i + 1];
        o[4 * i + 2][c] = r[2 * i] - r[2 * i + 1];
        o[4 * i + 3][c] = -r[2 * i + 1];
      }
    });
  }
};

// A kernel from a tiles' matrix [16, T, C] to maps of the height and width its attributes give.
class MapOfTilesOp : public OpKernel {
 public:
  explicit MapOfTilesOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("height", &height_));
    OP_REQUIRES_OK(context, context->GetAttr("width", &width_));
  }

 protected:
  // Checks input 0, allocates output 0 and gives the geometry and both buffers; false after an error.
  bool Start(OpKernelContext* context, Geometry* g, const float** tiles, float** map) {
    const Tensor& tiles_tensor = context->input(0);
    if (!CheckTiles(context, tiles_tensor, height_, width_, g)) return false;
    Tensor* map_tensor;
    const absl::Status status =
        context->allocate_output(0, TensorShape({g->images, g->height, g->width, g->channels}), &map_tensor);
    if (!status.ok()) {
      context->CtxFailure(status);
      return false;
    }
    *tiles = tiles_tensor.flat<float>().data();
    *map = map_tensor->flat<float>().data();
    return true;
  }

  int64_t height_, width_;
};

class WinogradOutputOp : public MapOfTilesOp {
 public:
  using MapOfTilesOp::MapOfTilesOp;

  void Compute(OpKernelContext* context) override {
    Geometry g;
    const float* m;
    float* y;
    if (!Start(context, &g, &m, &y)) return;
    const int64_t C = g.channels, T = g.tiles();
    ForRanges(context, T, [&](int64_t first, int64_t end) {
      std::vector<float> discard(C);  // where outputs outside the map go (the last tiles of odd sizes)
      ForTiles(g, first, end, [&](int64_t t, int64_t n, int64_t a, int64_t b) {
        const float* p[16];
        for (int k = 0; k < 16; ++k) p[k] = m + (k * T + t) * C;
        float* o[4];
        for (int i = 0; i < 2; ++i) {
          for (int j = 0; j < 2; ++j) {
            float* pixel = g.Pixel(y, n, 2 * a + i, 2 * b + j);
            o[2 * i + j] = pixel ? pixel : discard.data();
          }
        }
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          float r[8];  // At m: 2 rows of 4 columns
          for (int j = 0; j < 4; ++j) {
            r[j] = p[j][c] + p[4 + j][c] + p[8 + j][c];
            r[4 + j] = p[4 + j][c] - p[8 + j][c] - p[12 + j][c];
          }
          for (int i = 0; i < 2; ++i) {  // (At m) A
            o[2 * i][c] = r[4 * i] + r[4 * i + 1] + r[4 * i + 2];
            o[2 * i + 1][c] = r[4 * i + 1] - r[4 * i + 2] - r[4 * i + 3];
          }
        }
      });
    });
  }
};

class WinogradInputGradOp : public MapOfTilesOp {
 public:
  using MapOfTilesOp::MapOfTilesOp;

  void Compute(OpKernelContext* context) override {
    Geometry g;
    const float* dv;
    float* dx;
    if (!Start(context, &g, &dv, &dx)) return;
    const int64_t C = g.channels, T = g.tiles(), image = g.height * g.width * C;
    // Tiles overlap by two rows and columns: each range of images adds its tiles into its own pixels, in order.
    ForRanges(context, g.images, [&](int64_t first, int64_t end) {
      std::fill(dx + first * image, dx + end * image, 0.f);
      std::vector<float> discard(C);  // where the adjoint of the zeros outside the map goes
      ForTiles(g, first * g.tile_rows * g.tile_columns, end * g.tile_rows * g.tile_columns,
               [&](int64_t t, int64_t n, int64_t a, int64_t b) {
        const float* p[16];
        for (int k = 0; k < 16; ++k) p[k] = dv + (k * T + t) * C;
        float* o[16];
        for (int i = 0; i < 4; ++i) {
          for (int j = 0; j < 4; ++j) {
            float* pixel = g.Pixel(dx, n, 2 * a - 1 + i, 2 * b - 1 + j);
            o[4 * i + j] = pixel ? pixel : discard.data();
          }
        }
#pragma GCC ivdep
        for (int64_t c = 0; c < C; ++c) {
          float r[16];  // B dv: rows
          for (int j = 0; j < 4; ++j) {
            r[j] = p[j][c];
            r[4 + j] = p[4 + j][c] - p[8 + j][c] + p[12 + j][c];
            r[8 + j] = p[4 + j][c] + p[8 + j][c] - p[j][c];
            r[12 + j] = -p[12 + j][c];
          }
          for (int i = 0; i < 4; ++i) {  // (B dv) Bt: columns, added into the pixels
            o[4 * i][c] += r[4 * i];
            o[4 * i + 1][c] += r[4 * i + 1] - r[4 * i + 2] + r[4 * i + 3];
            o[4 * i + 2][c] += r[4 * i + 1] + r[4 * i + 2] - r[4 * i];
            o[4 * i + 3][c] += -r[4 * i + 3];
          }
        }
      });
    });
  }
};

// The filter kernels: transform(p, o, e) for each column e of `size`, from kIn planes of `in` to kOut of `out`
// (plane k of a buffer starts at k size).
template <int kIn, int kOut, typename Transform>
void ForPlanes(OpKernelContext* context, const float* in, float* out, int64_t size, const Transform& transform) {
  ForRanges(context, size, [&](int64_t first, int64_t end) {
    const float* p[kIn];
    float* o[kOut];
    for (int k = 0; k < kIn; ++k) p[k] = in + k * size;
    for (int k = 0; k < kOut; ++k) o[k] = out + k * size;
#pragma GCC ivdep
    for (int64_t e = first; e < end; ++e) transform(p, o, e);
  });
}

class WinogradFilterOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* context) override {
    const Tensor& w_tensor = context->input(0);
    OP_REQUIRES(context, w_tensor.dims() == 4 && w_tensor.dim_size(0) == 3 && w_tensor.dim_size(1) == 3,
                errors::InvalidArgument("expected a filter [3, 3, C, F], got ", w_tensor.shape().DebugString()));
    Tensor* u_tensor;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({16, w_tensor.dim_size(2), w_tensor.dim_size(3)}), &u_tensor));
    ForPlanes<9, 16>(context, w_tensor.flat<float>().data(), u_tensor->flat<float>().data(),
                     w_tensor.dim_size(2) * w_tensor.dim_size(3),
                     [](const float* const* p, float* const* o, int64_t e) {
      float r[12];
      for (int j = 0; j < 3; ++j) {  // G w: rows
        r[j] = p[j][e];
        r[3 + j] = 0.5f * (p[j][e] + p[3 + j][e] + p[6 + j][e]);
        r[6 + j] = 0.5f * (p[j][e] - p[3 + j][e] + p[6 + j][e]);
        r[9 + j] = p[6 + j][e];
      }
      for (int i = 0; i < 4; ++i) {  // (G w) Gt: columns
        o[4 * i][e] = r[3 * i];
        o[4 * i + 1][e] = 0.5f * (r[3 * i] + r[3 * i + 1] + r[3 * i + 2]);
        o[4 * i + 2][e] = 0.5f * (r[3 * i] - r[3 * i + 1] + r[3 * i + 2]);
        o[4 * i + 3][e] = r[3 * i + 2];
      }
    });
  }
};

class WinogradFilterGradOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* context) override {
    const Tensor& du_tensor = context->input(0);
    OP_REQUIRES(context, du_tensor.dims() == 3 && du_tensor.dim_size(0) == 16,
                errors::InvalidArgument("expected [16, C, F], got ", du_tensor.shape().DebugString()));
    Tensor* dw_tensor;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({3, 3, du_tensor.dim_size(1), du_tensor.dim_size(2)}), &dw_tensor));
    ForPlanes<16, 9>(context, du_tensor.flat<float>().data(), dw_tensor->flat<float>().data(),
                     du_tensor.dim_size(1) * du_tensor.dim_size(2),
                     [](const float* const* p, float* const* o, int64_t e) {
      float r[12];
      for (int j = 0; j < 4; ++j) {  // Gt du: rows
        r[j] = p[j][e] + 0.5f * (p[4 + j][e] + p[8 + j][e]);
        r[4 + j] = 0.5f * (p[4 + j][e] - p[8 + j][e]);
        r[8 + j] = 0.5f * (p[4 + j][e] + p[8 + j][e]) + p[12 + j][e];
      }
      for (int i = 0; i < 3; ++i) {  // (Gt du) G: columns
        o[3 * i][e] = r[4 * i] + 0.5f * (r[4 * i + 1] + r[4 * i + 2]);
        o[3 * i + 1][e] = 0.5f * (r[4 * i + 1] - r[4 * i + 2]);
        o[3 * i + 2][e] = 0.5f * (r[4 * i + 1] + r[4 * i + 2]) + r[4 * i + 3];
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("ImagenetTpuWinogradFilter").Device(::tensorflow::DEVICE_CPU), WinogradFilterOp);
REGISTER_KERNEL_BUILDER(Name("ImagenetTpuWinogradFilterGrad").Device(::tensorflow::DEVICE_CPU),
                        WinogradFilterGradOp);
REGISTER_KERNEL_BUILDER(Name("ImagenetTpuWinogradInput").Device(::tensorflow::DEVICE_CPU), WinogradInputOp);
REGISTER_KERNEL_BUILDER(Name("ImagenetTpuWinogradOutputGrad").Device(::tensorflow::DEVICE_CPU), WinogradOutputGradOp);
REGISTER_KERNEL_BUILDER(Name("ImagenetTpuWinogradOutput").Device(::tensorflow::DEVICE_CPU), WinogradOutputOp);
REGISTER_KERNEL_BUILDER(Name("ImagenetTpuWinogradInputGrad").Device(::tensorflow::DEVICE_CPU), WinogradInputGradOp);

}  // namespace imagenet_tpu

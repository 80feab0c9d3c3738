// Runs the fused layer kernels (coordinator/sim/kernels/conv_pool.cpp) on inputs read from a file and
// writes their outputs, for tests/test_kernels.py: built for aarch64 and run under qemu-user, its
// outputs are compared with the x86 builds'. float32 only.
//   in:  int64 N, B, H, W, K, Cin, O; float x_all[N*Cin*H*W]; int64 rows[K*B]; float w[K*O*Cin*25],
//        bias[K*O], gy[B*Hp*Wp*K*O]; int64 H2, W2, O2; float h[B*H2*W2*K*6], w2[K*O2*150], b2[K*O2],
//        gy2[K*B*O2*Hp2*Wp2]
//   out: y, arg (uint8), gw, gb of the first layer; y2, arg2 (uint8), gh, gw2, gb2 of the second; then the same
//        again in the client-major layouts (layout = 1: the same buffers read as [K, B, ...] tensors); then y, arg
//        of the first layer's forward with the samples in the lanes (`forward_lanes`, client-major)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

extern "C" {
int64_t dropfl_split_size_f32(int64_t, int64_t, int64_t, int64_t);
void dropfl_split_images_f32(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float*);
void dropfl_conv_pool_fwd_f32(const float*, const int64_t*, const float*, const float*, float*, uint8_t*, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
void dropfl_conv_pool_fwd_lanes_f32(const float*, const int64_t*, const float*, const float*, float*, uint8_t*,
                                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
void dropfl_conv_pool_bwd_f32(const float*, const int64_t*, const float*, const uint8_t*, float*, float*, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
int dropfl_conv2_pool_fwd_f32(const float*, const float*, const float*, float*, uint8_t*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
int dropfl_conv2_pool_bwd_f32(const float*, const float*, const float*, const uint8_t*, float*, float*, float*,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
}

template <typename T>
std::vector<T> take(FILE* f, int64_t n) {
  std::vector<T> v(n);
  if (std::fread(v.data(), sizeof(T), n, f) != static_cast<size_t>(n)) throw 1;
  return v;
}

template <typename T>
void put(FILE* f, const std::vector<T>& v) { std::fwrite(v.data(), sizeof(T), v.size(), f); }

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  if (!in || !out) return 2;
  const auto d = take<int64_t>(in, 7);
  const int64_t N = d[0], B = d[1], H = d[2], W = d[3], K = d[4], Cin = d[5], O = d[6];
  const int64_t Hp = (H - 4) / 2, Wp = (W - 4) / 2;
  const auto x = take<float>(in, N * Cin * H * W);
  const auto rows = take<int64_t>(in, K * B);
  const auto w = take<float>(in, K * O * Cin * 25), bias = take<float>(in, K * O);
  const auto gy = take<float>(in, B * Hp * Wp * K * O);
  const auto d2 = take<int64_t>(in, 3);
  const int64_t H2 = d2[0], W2 = d2[1], O2 = d2[2], Hp2 = (H2 - 4) / 2, Wp2 = (W2 - 4) / 2;
  const auto h = take<float>(in, B * H2 * W2 * K * 6);
  const auto w2 = take<float>(in, K * O2 * 150), b2 = take<float>(in, K * O2);
  const auto gy2 = take<float>(in, K * B * O2 * Hp2 * Wp2);

  // the first layer reads the images split into even and odd columns (its padded width is the target's)
  std::vector<float> xs(N * dropfl_split_size_f32(H, W, Cin, 5));
  dropfl_split_images_f32(x.data(), N, H, W, Cin, 5, xs.data());
  // the client-major backward reads a row's last vector whole: 64 bytes of slack after gy, arg and gh
  std::vector<float> gyp(gy.size() + 16);
  std::copy(gy.begin(), gy.end(), gyp.begin());
  for (int64_t layout = 0; layout < 2; ++layout) {
    std::vector<float> y(B * Hp * Wp * K * O), gw(w.size()), gb(bias.size());
    std::vector<uint8_t> arg(K * B * O * Hp * Wp + 64);
    dropfl_conv_pool_fwd_f32(xs.data(), rows.data(), w.data(), bias.data(), y.data(), arg.data(), B, H, W, K, Cin, O,
                             5, 5, layout);
    dropfl_conv_pool_bwd_f32(xs.data(), rows.data(), gyp.data(), arg.data(), gw.data(), gb.data(), B, H, W, K, Cin, O,
                             5, 5, layout);
    arg.resize(arg.size() - 64);
    std::vector<float> y2(K * B * O2 * Hp2 * Wp2), gh(h.size() + 16), gw2(w2.size()), gb2(b2.size());
    std::vector<uint8_t> arg2(y2.size());
    if (dropfl_conv2_pool_fwd_f32(h.data(), w2.data(), b2.data(), y2.data(), arg2.data(), B, H2, W2, K, 6, O2, 5, 5,
                                  layout) ||
        dropfl_conv2_pool_bwd_f32(h.data(), w2.data(), gy2.data(), arg2.data(), gh.data(), gw2.data(), gb2.data(), B,
                                  H2, W2, K, 6, O2, 5, 5, layout))
      return 3;
    gh.resize(h.size());
    put(out, y); put(out, arg); put(out, gw); put(out, gb);
    put(out, y2); put(out, arg2); put(out, gh); put(out, gw2); put(out, gb2);
  }
  std::vector<float> y(B * Hp * Wp * K * O);
  std::vector<uint8_t> arg(K * B * O * Hp * Wp);
  dropfl_conv_pool_fwd_lanes_f32(xs.data(), rows.data(), w.data(), bias.data(), y.data(), arg.data(), B, H, W, K, Cin,
                                 O, 5, 5);
  put(out, y); put(out, arg);
  std::fclose(out);
  return 0;
}

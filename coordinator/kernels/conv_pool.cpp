// Fused first layer of the LeNets for the batched engine, K clients at once:
//     y = relu(max_pool2d(conv2d(x_k, w_k, b_k), 2))  for every client k,
// the forward and the weight/bias gradients (the first layer needs no input gradient).
// See docs/engine.md, "The fused first layer".
//
// Written by hand because no library has it: with one input channel per group, mkldnn runs the grouped
// conv1 as a depthwise-like convolution at ~20 GFLOP/s, and the max-pool backward then zero-fills
// and scatters a gradient the size of conv1's whole output (3.3 MB per 15-client step) that the
// weight gradient reads back. Fused, the conv output never leaves registers, and the backward only
// visits the pooled positions.
//
// Arguments (all contiguous):
//   x_all [N, Cin, H, W]  every client's preloaded images; rows [K, B] int64 picks the step's samples:
//                         client k's b-th input is x_all[rows[k, b]]
//   w     [K*O, Cin, R, S], bias [K*O]   the grouped conv's parameters (client k: channels k*O..k*O+O-1)
//   y     [B, Hp, Wp, K*O]   output, channels-last (what the next grouped conv reads fastest);
//                            Hp = (H-R+1)/2, Wp = (W-S+1)/2 (floor, as max_pool2d)
//   arg   [K, B, O, Hp, Wp]  uint8, saved for the backward: which conv output of the 2x2 window is
//                            the maximum (0..3, row-major), or 4 where relu passes no gradient
// Semantics, element for element as PyTorch's CPU kernels: the window's FIRST maximum in row-major
// order (a later value wins only if greater, or NaN), relu(NaN) = NaN, a gradient only where > 0.
// Only the order in which each output's R*S*Cin products are summed differs from mkldnn (ulp-level).
//
// Vectorised over the output columns j of one pooled row (GCC/Clang vector extensions, no
// intrinsics: the same source builds for AVX-512, AVX2 or NEON). An image's columns are first split
// into even and odd ones, so that the conv output at column 2j+c, tap q, reads the contiguous run
// (even or odd part)[j + (c+q)/2 ...]: every inner step is one vector load and O FMAs.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
struct V {
  typedef T type __attribute__((vector_size(64)));
  static constexpr int L = 64 / sizeof(T);  // lanes: 16 floats, 8 doubles
};

struct Shape {
  int64_t B, H, W, K, Cin, O, R, S;
  int64_t Hp, Wp, C, taps;
  int64_t chunks, PW;  // column chunks of L lanes per pooled row; padded width of a split half-row
};

template <typename T>
Shape make_shape(int64_t B, int64_t H, int64_t W, int64_t K, int64_t Cin, int64_t O, int64_t R, int64_t S) {
  constexpr int L = V<T>::L;
  Shape s{B, H, W, K, Cin, O, R, S, (H - R + 1) / 2, (W - S + 1) / 2, K * O, Cin * R * S, 0, 0};
  s.chunks = (s.Wp + L - 1) / L;
  s.PW = s.chunks * L + S / 2 + 1;  // the furthest read: j0 + L - 1 + (1 + S - 1) / 2
  return s;
}

// One image [Cin, H, W] → split[(ci*H + y)*2 + parity][m] = img[ci, y, 2m + parity], zero-padded to PW.
template <typename T>
void split_columns(const T* img, const Shape& s, T* split) {
  const int64_t ne = (s.W + 1) / 2, no = s.W / 2;  // even and odd columns
  for (int64_t cy = 0; cy < s.Cin * s.H; ++cy) {
    const T* src = img + cy * s.W;
    T* even = split + cy * 2 * s.PW;
    T* odd = even + s.PW;
    for (int64_t m = 0; m < ne; ++m) even[m] = src[2 * m];
    for (int64_t m = 0; m < no; ++m) odd[m] = src[2 * m + 1];
    for (int64_t m = ne; m < s.PW; ++m) even[m] = T(0);
    for (int64_t m = no; m < s.PW; ++m) odd[m] = T(0);
  }
}

// The 4 window inputs of tap (ci, r, q) at pooled row i, columns from j0: window position p = 2a + c
// is the conv output at (2i + a, 2j + c), whose tap reads column 2j + c + q.
template <typename T>
inline const T* tap_input(const T* split, const Shape& s, int64_t ci, int64_t i, int64_t r, int64_t q, int a, int c,
                          int64_t j0) {
  const int64_t y = 2 * i + a + r, col = c + q;
  return split + ((ci * s.H + y) * 2 + (col & 1)) * s.PW + j0 + (col >> 1);
}

template <typename T>
inline typename V<T>::type loadu(const T* p) {
  typename V<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// OB output channels per register block (4*OB accumulators + 4 inputs must fit the vector registers).
template <typename T, int OB>
void forward(const T* x_all, const int64_t* rows, const T* w, const T* bias, T* y, uint8_t* arg, const Shape& s) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  std::vector<T> split(s.Cin * s.H * 2 * s.PW);
  const int64_t img = s.Cin * s.H * s.W;
  for (int64_t b = 0; b < s.B; ++b) {    // sample-major: y[b] (all clients' channels) stays in cache
    for (int64_t k = 0; k < s.K; ++k) {
      split_columns(x_all + rows[k * s.B + b] * img, s, split.data());
      for (int64_t i = 0; i < s.Hp; ++i) {
        for (int64_t ch = 0; ch < s.chunks; ++ch) {
         const int64_t j0 = ch * L, nj = s.Wp - j0 < L ? s.Wp - j0 : L;
         for (int64_t o0 = 0; o0 < s.O; o0 += OB) {
          const T* wk = w + (k * s.O + o0) * s.taps;
          vec acc[4][OB];  // [window position][output channel of the block]
          for (int o = 0; o < OB; ++o)
            for (int p = 0; p < 4; ++p) acc[p][o] = vec{} + bias[k * s.O + o0 + o];
          for (int64_t ci = 0; ci < s.Cin; ++ci)
            for (int64_t r = 0; r < s.R; ++r)
              for (int64_t q = 0; q < s.S; ++q) {
                const vec x00 = loadu(tap_input(split.data(), s, ci, i, r, q, 0, 0, j0));
                const vec x01 = loadu(tap_input(split.data(), s, ci, i, r, q, 0, 1, j0));
                const vec x10 = loadu(tap_input(split.data(), s, ci, i, r, q, 1, 0, j0));
                const vec x11 = loadu(tap_input(split.data(), s, ci, i, r, q, 1, 1, j0));
                const T* wt = wk + (ci * s.R + r) * s.S + q;
                for (int o = 0; o < OB; ++o) {
                  const T wv = wt[o * s.taps];
                  acc[0][o] += x00 * wv;
                  acc[1][o] += x01 * wv;
                  acc[2][o] += x10 * wv;
                  acc[3][o] += x11 * wv;
                }
              }
          for (int ob = 0; ob < OB; ++ob) {
            const int64_t o = o0 + ob;
            vec m = acc[0][ob];
            auto a = m < m;  // all lanes 0 (false), of the comparison's integer vector type
            for (int p = 1; p < 4; ++p) {
              const vec v = acc[p][ob];
              const auto wins = (v > m) | (v != v);  // PyTorch: a later value wins if greater, or NaN
              m = wins ? v : m;
              a = wins ? p : a;
            }
            const auto pass = m > 0;
            const vec out = (pass | (m != m)) ? m : vec{};  // relu; relu(NaN) = NaN
            a = pass ? a : 4;
            uint8_t* ao = arg + (((k * s.B + b) * s.O + o) * s.Hp + i) * s.Wp + j0;
            T* yo = y + ((b * s.Hp + i) * s.Wp + j0) * s.C + k * s.O + o;
            for (int64_t l = 0; l < nj; ++l) {
              yo[l * s.C] = out[l];
              ao[l] = static_cast<uint8_t>(a[l]);
            }
          }
         }
        }
      }
    }
  }
}

template <typename T, int OB>
void backward(const T* x_all, const int64_t* rows, const T* gy, const uint8_t* arg, T* gw, T* gb, const Shape& s) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  std::vector<T> split(s.Cin * s.H * 2 * s.PW);
  // every client's weight and bias gradient, [k][o][tap] and [k][o], by lane (the columns j)
  std::vector<vec> acc_all(s.K * s.O * s.taps), db_all(s.K * s.O);
  const int64_t img = s.Cin * s.H * s.W;
  for (int64_t b = 0; b < s.B; ++b) {    // sample-major: gy[b] (all clients' channels) stays in cache
    for (int64_t k = 0; k < s.K; ++k) {
      vec* acc = acc_all.data() + k * s.O * s.taps;
      vec* db = db_all.data() + k * s.O;
      split_columns(x_all + rows[k * s.B + b] * img, s, split.data());
      for (int64_t i = 0; i < s.Hp; ++i) {
        for (int64_t ch = 0; ch < s.chunks; ++ch) {
          const int64_t j0 = ch * L, nj = s.Wp - j0 < L ? s.Wp - j0 : L;
          for (int64_t o0 = 0; o0 < s.O; o0 += OB) {
            vec g[4][OB];  // the output gradient routed to each window position (0 elsewhere)
            bool any = false;
            for (int ob = 0; ob < OB; ++ob) {
              const int64_t o = o0 + ob;
              const uint8_t* ao = arg + (((k * s.B + b) * s.O + o) * s.Hp + i) * s.Wp + j0;
              const T* go = gy + ((b * s.Hp + i) * s.Wp + j0) * s.C + k * s.O + o;
              vec gv{};
              auto av = gv < gv;
              for (int64_t l = 0; l < nj; ++l) {
                av[l] = ao[l];
                gv[l] = ao[l] < 4 ? go[l * s.C] : T(0);
                any |= ao[l] < 4;
              }
              db[o] += gv;
              for (int p = 0; p < 4; ++p) g[p][ob] = av == p ? gv : vec{};
            }
            if (!any) continue;
            for (int64_t ci = 0; ci < s.Cin; ++ci)
              for (int64_t r = 0; r < s.R; ++r)
                for (int64_t q = 0; q < s.S; ++q) {
                  const vec x00 = loadu(tap_input(split.data(), s, ci, i, r, q, 0, 0, j0));
                  const vec x01 = loadu(tap_input(split.data(), s, ci, i, r, q, 0, 1, j0));
                  const vec x10 = loadu(tap_input(split.data(), s, ci, i, r, q, 1, 0, j0));
                  const vec x11 = loadu(tap_input(split.data(), s, ci, i, r, q, 1, 1, j0));
                  vec* d = acc + o0 * s.taps + (ci * s.R + r) * s.S + q;
                  for (int ob = 0; ob < OB; ++ob)
                    d[ob * s.taps] += g[0][ob] * x00 + g[1][ob] * x01 + g[2][ob] * x10 + g[3][ob] * x11;
                }
          }
        }
      }
    }
  }
  for (int64_t ko = 0; ko < s.K * s.O; ++ko) {  // sum each accumulator's lanes
    for (int64_t t = 0; t < s.taps; ++t) {
      T sum = 0;
      for (int l = 0; l < L; ++l) sum += acc_all[ko * s.taps + t][l];
      gw[ko * s.taps + t] = sum;
    }
    T sum = 0;
    for (int l = 0; l < L; ++l) sum += db_all[ko][l];
    gb[ko] = sum;
  }
}

// Calls f(std::integral_constant<int, OB>) with the widest register block OB that divides O:
// 6 (mimic-cnn, cifar-lenet), 5 (fdms-cnn's 10), ... 1.
template <typename F>
void with_block(int64_t O, F f) {
  if (O % 6 == 0) f(std::integral_constant<int, 6>{});
  else if (O % 5 == 0) f(std::integral_constant<int, 5>{});
  else if (O % 4 == 0) f(std::integral_constant<int, 4>{});
  else if (O % 3 == 0) f(std::integral_constant<int, 3>{});
  else if (O % 2 == 0) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

}  // namespace

extern "C" {

int dropfl_conv_pool_abi() { return 1; }

#define DROPFL_ENTRY(T, suffix)                                                                              \
  void dropfl_conv_pool_fwd_##suffix(const T* x_all, const int64_t* rows, const T* w, const T* bias, T* y,  \
                                     uint8_t* arg, int64_t B, int64_t H, int64_t W, int64_t K, int64_t Cin, \
                                     int64_t O, int64_t R, int64_t S) {                                    \
    const Shape s = make_shape<T>(B, H, W, K, Cin, O, R, S);                                               \
    with_block(O, [&](auto ob) { forward<T, decltype(ob)::value>(x_all, rows, w, bias, y, arg, s); });     \
  }                                                                                                        \
  void dropfl_conv_pool_bwd_##suffix(const T* x_all, const int64_t* rows, const T* gy, const uint8_t* arg, \
                                     T* gw, T* gb, int64_t B, int64_t H, int64_t W, int64_t K, int64_t Cin, \
                                     int64_t O, int64_t R, int64_t S) {                                    \
    const Shape s = make_shape<T>(B, H, W, K, Cin, O, R, S);                                               \
    with_block(O, [&](auto ob) { backward<T, decltype(ob)::value>(x_all, rows, gy, arg, gw, gb, s); });    \
  }

DROPFL_ENTRY(float, f32)
DROPFL_ENTRY(double, f64)

}  // extern "C"

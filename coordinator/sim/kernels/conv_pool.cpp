// Fused layers of the LeNets for the batched engine, K clients at once:
//     y = relu(max_pool2d(conv2d(x_k, w_k, b_k), 2))  for every client k.
// First layer (on the images): forward and weight/bias gradients (the images need no gradient).
// Second layer (on the first layer's output, further below): forward and all gradients.
// See docs/engine.md, "The fused layers".
//
// Written by hand because no library has them: with one input channel per group, mkldnn runs the
// grouped conv1 as a depthwise-like convolution at ~20 GFLOP/s, and the max-pool backward then
// zero-fills and scatters a gradient the size of conv1's whole output (3.3 MB per 15-client step)
// that the weight gradient reads back; conv2's dense backward does 4x the work a max-pooled
// gradient needs. Fused, conv outputs never leave registers, and the backwards only visit the
// outputs that carry a gradient.
//
// ---- First layer -------------------------------------------------------------------------------
// Arguments (all contiguous):
//   xs    [N, Cin, H, 2, PW]  every client's preloaded images, split into even and odd columns once
//                         (`dropfl_split_images`, below); rows [K, B] int64 picks the step's samples:
//                         client k's b-th input is image rows[k, b]
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
// intrinsics: the same source builds for AVX-512, AVX2, SSE2 or NEON). An image's columns are split
// into even and odd ones, so that the conv output at column 2j+c, tap q, reads the contiguous run
// (even or odd part)[j + (c+q)/2 ...]: every inner step is one vector load and O FMAs. The split is
// done once per image when the engine loads the data (it was done twice per image and step, ~5 % of
// a step; its padded width PW depends on the vector width, so the split belongs to one variant).
//
// Portability. The vector width VB is the target's (64 bytes with AVX-512, 32 with AVX2, 16 otherwise:
// SSE2, NEON) and the register blocks are sized for its register file (REGS). Neither changes the
// order in which any output or gradient element is summed: every lane is one output column, channel
// or patch element, and the first layer's weight gradient, the one sum across lanes, is accumulated
// in a fixed 64-byte lane layout (LOGICAL) whatever VB is. So all variants compute the same bits where
// the compiler contracts a*b+c into the same FMAs (AVX-512 and AVX2 do; x86's generic build has no FMA
// and rounds each product: ulp-level differences, as any other BLAS).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int VB = 64;
#elif defined(__AVX__)
constexpr int VB = 32;
#else
constexpr int VB = 16;  // SSE2, NEON (aarch64's baseline), or scalar code the compiler splits
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int REGS = 32;  // vector registers
#else
constexpr int REGS = 16;
#endif
constexpr int LOGICAL = 64;  // the lane layout of the first layer's weight gradient sums, for every VB
constexpr int G = LOGICAL / VB;  // target vectors per logical one

template <typename T>
struct V {
  typedef T type __attribute__((vector_size(VB)));
  static constexpr int L = VB / sizeof(T);  // lanes: 16 floats, 8 doubles with AVX-512
};

struct Shape {
  int64_t B, H, W, K, Cin, O, R, S;
  int64_t Hp, Wp, C, taps;
  int64_t chunks, PW;  // column chunks of L lanes per pooled row; padded width of a split half-row
  bool cm = false;     // client-major layouts (the step by hand): y [K, B, Hp, Wp, O], gy [K, B, O, Hp, Wp]
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

// Elements of one split image: [Cin][H][2][PW].
inline int64_t split_size(const Shape& s) { return s.Cin * s.H * 2 * s.PW; }

template <typename T>
inline typename V<T>::type loadu(const T* p) {
  typename V<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The 4 window inputs of tap (ci, r, q) at pooled row i, columns j0..j0+L-1: window position p = 2a + c
// is the conv output at (2i + a, 2j + c), whose tap reads column 2j + c + q of row 2i + a + r, i.e.
// [j + (c+q)/2] of that row's even (c+q even) or odd half.
template <typename T>
inline void window_inputs(const T* split, const Shape& s, int64_t ci, int64_t i, int64_t r, int64_t q, int64_t j0,
                          typename V<T>::type x[4]) {
  for (int p = 0; p < 4; ++p) {
    const int64_t y = 2 * i + p / 2 + r, col = p % 2 + q;
    x[p] = loadu(split + ((ci * s.H + y) * 2 + (col & 1)) * s.PW + j0 + (col >> 1));
  }
}


// Max-pool of a window's 4 conv outputs (row-major positions 0..3) and relu, per lane: out = relu(max)
// and the returned position of the maximum, or 4 where relu passes no gradient (max <= 0 or NaN).
// As PyTorch's CPU kernels: a later value wins only if greater, or NaN; relu(NaN) = NaN.
template <typename T>
inline auto pool_relu(typename V<T>::type v0, typename V<T>::type v1, typename V<T>::type v2,
                      typename V<T>::type v3, typename V<T>::type& out) {
  typedef typename V<T>::type vec;
  const vec c[4] = {v0, v1, v2, v3};
  vec m = c[0];
  auto a = m < m;  // all lanes 0 (false), of the comparison's integer vector type
  for (int p = 1; p < 4; ++p) {
    const auto wins = (c[p] > m) | (c[p] != c[p]);
    m = wins ? c[p] : m;
    a = wins ? p : a;
  }
  const auto pass = m > 0;
  out = (pass | (m != m)) ? m : vec{};
  return pass ? a : 4;
}

// L window indices a[0..L) as the lanes of the integer vector IV. In two steps, through 16 bits: GCC 12 compiles
// a direct uint8 → int32 __builtin_convertvector of 16 lanes into ~60 scalar instructions, the two steps into
// four zero-extensions. (Outside the kernels' templates: there GCC refuses a conversion between two
// dependent vector types.)
template <int L>
struct Indices {
  typedef uint8_t bytes __attribute__((vector_size(L)));
  typedef uint16_t halves __attribute__((vector_size(2 * L)));
};
template <typename IV, int L>
inline IV widen(const uint8_t* a) {
  typename Indices<L>::bytes a8;
  std::memcpy(&a8, a, sizeof(a8));
  const typename Indices<L>::halves a16 = __builtin_convertvector(a8, typename Indices<L>::halves);
  return __builtin_convertvector(a16, IV);
}

// The lanes of an integer vector (values 0..255) as L bytes: `widen`'s inverse. With AVX-512 one conversion (one
// vpmovdb/vpmovqb; the two steps below compiled to ~10 instructions there, 8 % of the first layer's forward), else
// in the same two steps as `widen` (fewer instructions than GCC 12's direct conversion with AVX2 or SSE2).
template <int L, typename IV>
inline typename Indices<L>::bytes narrow(IV a) {
#if defined(__AVX512F__)
  return __builtin_convertvector(a, typename Indices<L>::bytes);
#else
  const typename Indices<L>::halves a16 = __builtin_convertvector(a, typename Indices<L>::halves);
  return __builtin_convertvector(a16, typename Indices<L>::bytes);
#endif
}

// Stores the first n (1..L) lanes of the vector v at p: whole when n = L, else in pieces of L/2, L/4, ... 1
// lanes by n's bits (each piece shuffled to the front first), so that nothing past p[n) is written and no lane
// goes through memory: lane by lane, the values were spilled as a vector and read back as scalars, which the
// CPU does not forward from the vector store (~10 % of the first layer's forward stalled on those reads).
template <int P, typename E, typename VEC, typename IV>
inline void store_pieces(E* p, const VEC& v, int64_t n, const IV& lane, int64_t off) {
  if constexpr (P >= 1) {   // one piece of P lanes, a fixed size: one store
    if (n & P) {
      typedef std::remove_reference_t<decltype(lane[0])> index;
      const VEC u = off ? __builtin_shuffle(v, lane + static_cast<index>(off)) : v;
      std::memcpy(p + off, &u, P * sizeof(E));
      off += P;
    }
    store_pieces<P / 2>(p, v, n, lane, off);
  }
}

template <typename E, typename VEC, typename IV>
inline void store_first(E* p, const VEC& v, int64_t n, const IV& lane) {
  constexpr int L = sizeof(VEC) / sizeof(E);
  if (n >= L)
    std::memcpy(p, &v, sizeof(v));
  else
    store_pieces<L / 2>(p, v, n, lane, 0);
}

// Whether any of the n (<= 16) window indices at a[0..n) routes a gradient (is not 4). The indices are 0..4, so
// index ^ 4 is 0 exactly where none is routed: 8-byte words, the bytes past n masked off. Reads whole words
// (up to 7 bytes past a[n)): the client-major window indices carry 64 bytes of slack (`_padded`). A lane-by-lane
// test of the routed mask compiled to ~40 extractions and ORs.
inline bool any_routed(const uint8_t* a, int64_t n) {
  uint64_t bits = 0;
  for (int64_t w = 0; w * 8 < n; ++w) {
    uint64_t v;
    std::memcpy(&v, a + 8 * w, 8);
    const int64_t m = n - 8 * w;
    const uint64_t first_m = m >= 8 ? ~0ull
                             : __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? (1ull << (8 * m)) - 1
                                                                         : ~0ull << (8 * (8 - m));
    bits |= (v ^ 0x0404040404040404ull) & first_m;
  }
  return bits != 0;
}

// The first layer's accumulators of a window's 4 conv outputs x OB channels, each starting at its channel's bias: the
// start of every output's sum in both forwards (`forward`, `forward_lanes`), which add the taps in the same order.
template <typename T, int OB>
inline void bias_acc(typename V<T>::type acc[4][OB], const T* bias) {
  for (int o = 0; o < OB; ++o)
    for (int p = 0; p < 4; ++p) acc[p][o] = typename V<T>::type{} + bias[o];
}

// OB output channels per register block (4*OB accumulators + 4 inputs must fit the vector registers:
// `with_block`).
template <typename T, int OB>
void forward(const T* xs, const int64_t* rows, const T* w, const T* bias, T* y, uint8_t* arg, const Shape& s) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  typedef decltype(vec{} < vec{}) ivec;
  typedef typename Indices<L>::bytes bytes;
  const int64_t img = split_size(s);
  ivec lane;
  bytes lane8;
  for (int l = 0; l < L; ++l) lane[l] = l, lane8[l] = l;
  // Client-major with all channels in one block (the LeNets with 32 vector registers): a pooled row's chunk of
  // y is nj·O contiguous values, [column][channel], written as whole vectors, interleaved from the O channel
  // vectors by shuffles: vector t of the chunk is out[0] shuffled by pick[t][0], then out[o] shuffled into it by
  // pick[t][o] (lane l of vector t holds element m = t·L + l: channel m % O, column m / O).
  const bool whole = s.cm && OB == s.O;
  ivec pick[OB][OB];
  for (int t = 0; t < OB; ++t)
    for (int o = 0; o < OB; ++o)
      for (int l = 0; l < L; ++l) {
        const int m = t * L + l, j = m / OB;
        pick[t][o][l] = m % OB == o ? (o ? L : 0) + j : (o ? l : 0);
      }
  for (int64_t b = 0; b < s.B; ++b) {    // sample-major: y[b] (all clients' channels) stays in cache
    for (int64_t k = 0; k < s.K; ++k) {
      const T* split = xs + rows[k * s.B + b] * img;
      for (int64_t i = 0; i < s.Hp; ++i) {
        for (int64_t ch = 0; ch < s.chunks; ++ch) {
         const int64_t j0 = ch * L, nj = s.Wp - j0 < L ? s.Wp - j0 : L;
         vec outs[OB];
         // A row's partial last vector is stored whole where its lanes past the row fall on the next pooled row
         // (of the same map, or of the same client and sample), which this kernel writes later: the values stay as
         // they were, in one store instead of pieces
         const bool spill = i + 1 < s.Hp && L - nj <= s.Wp;
         for (int64_t o0 = 0; o0 < s.O; o0 += OB) {
          const T* wk = w + (k * s.O + o0) * s.taps;
          vec acc[4][OB];  // [window position][output channel of the block]
          bias_acc<T, OB>(acc, bias + k * s.O + o0);
          for (int64_t ci = 0; ci < s.Cin; ++ci)
            for (int64_t r = 0; r < s.R; ++r)
              for (int64_t q = 0; q < s.S; ++q) {
                vec x[4];
                window_inputs(split, s, ci, i, r, q, j0, x);
                const T* wt = wk + (ci * s.R + r) * s.S + q;
                for (int o = 0; o < OB; ++o)
                  for (int p = 0; p < 4; ++p) acc[p][o] += x[p] * wt[o * s.taps];
              }
          for (int ob = 0; ob < OB; ++ob) {
            const int64_t o = o0 + ob;
            vec& out = outs[ob];
            const auto a = pool_relu<T>(acc[0][ob], acc[1][ob], acc[2][ob], acc[3][ob], out);
            uint8_t* ar = arg + (((k * s.B + b) * s.O + o) * s.Hp + i) * s.Wp + j0;
            const bytes a8 = narrow<L>(a);
            if (spill) std::memcpy(ar, &a8, sizeof(a8));
            else store_first(ar, a8, nj, lane8);
            if (whole) continue;
            T* yo = s.cm ? y + (((k * s.B + b) * s.Hp + i) * s.Wp + j0) * s.O + o
                         : y + ((b * s.Hp + i) * s.Wp + j0) * s.C + k * s.O + o;
            const int64_t ys = s.cm ? s.O : s.C;
            for (int64_t l = 0; l < nj; ++l) yo[l * ys] = out[l];
          }
         }
         if (whole) {
           T* yr = y + (((k * s.B + b) * s.Hp + i) * s.Wp + j0) * OB;
           for (int64_t t = 0; t * L < nj * OB; ++t) {
             vec u = __builtin_shuffle(outs[0], pick[t][0]);
             for (int o = 1; o < OB; ++o) u = __builtin_shuffle(u, outs[o], pick[t][o]);
             if (spill && L <= s.Wp * OB) std::memcpy(yr + t * L, &u, sizeof(u));
             else store_first(yr + t * L, u, nj * OB - t * L, lane);
           }
         }
        }
      }
    }
  }
}

template <typename T, int OB>
void backward(const T* xs, const int64_t* rows, const T* gy, const uint8_t* arg, T* gw, T* gb, const Shape& s) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  // every client's weight and bias gradient, [k][o][tap][slot] and [k][o][slot], by lane: column j is
  // logical lane j % (LOGICAL / sizeof(T)), i.e. slot (j / L) % G, lane j % L (one slot when VB = LOGICAL)
  std::vector<vec> acc_all(s.K * s.O * s.taps * G), db_all(s.K * s.O * G);
  const int64_t img = split_size(s);
  typedef decltype(vec{} < vec{}) ivec;                          // the comparisons' integer lanes
  typedef std::remove_reference_t<decltype(ivec{}[0])> ilane;     // int32 for floats, int64 for doubles
  ivec lane;
  for (int l = 0; l < L; ++l) lane[l] = l;
  for (int64_t b = 0; b < s.B; ++b) {    // sample-major: gy[b] (all clients' channels) stays in cache
    for (int64_t k = 0; k < s.K; ++k) {
      const T* split = xs + rows[k * s.B + b] * img;
      for (int64_t i = 0; i < s.Hp; ++i) {
        for (int64_t ch = 0; ch < s.chunks; ++ch) {
          const int64_t j0 = ch * L, nj = s.Wp - j0 < L ? s.Wp - j0 : L;
          vec* acc = acc_all.data() + k * s.O * s.taps * G + ch % G;  // + (o * taps + tap) * G
          vec* db = db_all.data() + k * s.O * G + ch % G;              // + o * G
          for (int64_t o0 = 0; o0 < s.O; o0 += OB) {
            vec g[4][OB];  // the output gradient routed to each window position (0 elsewhere)
            bool any = false;
            for (int ob = 0; ob < OB; ++ob) {
              const int64_t o = o0 + ob;
              const uint8_t* ao = arg + (((k * s.B + b) * s.O + o) * s.Hp + i) * s.Wp + j0;
              vec gv{};
              auto av = gv < gv;
              if (s.cm) {  // the row's gradients and window indices as whole vectors (the caller pads both
                           // buffers by a vector: lanes past the row are read, then masked)
                const T* go = gy + (((k * s.B + b) * s.O + o) * s.Hp + i) * s.Wp + j0;
                av = widen<ivec, L>(ao);
                av = lane < ilane(nj) ? av : 4;
                const auto routed = av < 4;
                gv = routed ? loadu(go) : vec{};
                any |= any_routed(ao, nj);
              } else {
                const T* go = gy + ((b * s.Hp + i) * s.Wp + j0) * s.C + k * s.O + o;
                for (int64_t l = 0; l < nj; ++l) {
                  av[l] = ao[l];
                  gv[l] = ao[l] < 4 ? go[l * s.C] : T(0);
                  any |= ao[l] < 4;
                }
              }
              db[o * G] += gv;
              for (int p = 0; p < 4; ++p) g[p][ob] = av == p ? gv : vec{};
            }
            if (!any) continue;
            for (int64_t ci = 0; ci < s.Cin; ++ci)
              for (int64_t r = 0; r < s.R; ++r)
                for (int64_t q = 0; q < s.S; ++q) {
                  vec x[4];
                  window_inputs(split, s, ci, i, r, q, j0, x);
                  vec* d = acc + (o0 * s.taps + (ci * s.R + r) * s.S + q) * G;
                  for (int ob = 0; ob < OB; ++ob)
                    d[ob * s.taps * G] += g[0][ob] * x[0] + g[1][ob] * x[1] + g[2][ob] * x[2] + g[3][ob] * x[3];
                }
          }
        }
      }
    }
  }
  for (int64_t ko = 0; ko < s.K * s.O; ++ko) {  // sum each accumulator's logical lanes, in order
    for (int64_t t = 0; t < s.taps; ++t) {
      T sum = 0;
      for (int m = 0; m < G * L; ++m) sum += acc_all[(ko * s.taps + t) * G + m / L][m % L];
      gw[ko * s.taps + t] = sum;
    }
    T sum = 0;
    for (int m = 0; m < G * L; ++m) sum += db_all[ko * G + m / L][m % L];
    gb[ko] = sum;
  }
}

// ---- First layer, forward, with a client's samples in the lanes (the step by hand's client-major layouts) ----------
// The same sums as `forward` in the same order (the bias, then every tap ci, r, q as one multiply-add on each of the
// window's 4 conv outputs) and the same max-pool and relu, so the same bits; but lane l of every vector is sample
// b0 + l of a client's batch instead of one pooled column. Every lane carries work (a LeNet's 12 pooled columns
// filled 12 of AVX-512's 16 float lanes) and every input is one aligned vector load (the column form's loads started
// at every float offset, most of them split across two cache lines). The price is three transposes per group of L
// samples, done in registers L×L at a time: the samples' split images (as `forward` reads them, so that the backward
// finds them in cache) into xt [split value][lane], and the pooled values and
// window indices, staged as [element][lane], out to y [K, B, Hp, Wp, O] and arg [K, B, O, Hp, Wp] (the layouts
// the second layer and `backward` read). Lanes past the batch compute on a copy of lane 0's image and are not stored.

// L values of E as one vector (a class template: GCC ignores vector_size on a function template's dependent typedef).
template <typename E, int L>
struct Lanes_of {
  typedef E type __attribute__((vector_size(L * sizeof(E))));
};

// Transposes L×L values in registers: v[r][c] → v[c][r]. log2(L) rounds, every index compile-time (the vectors
// stay in registers); the round of distance D swaps, in every 2D × 2D block, the D × D block above the diagonal
// with the one below it: one two-vector shuffle per row.
template <typename VEC, int L, int D = L / 2>
inline void transpose_block(VEC v[L]) {
  if constexpr (D >= 1) {
    typedef std::remove_reference_t<decltype(VEC{} < VEC{})> IV;   // the shuffles' index vector
    IV lo, hi;
    for (int l = 0; l < L; ++l) {
      lo[l] = (l & D) ? L + l - D : l;   // upper row r: its own left half of the block, then row r+D's
      hi[l] = (l & D) ? L + l : l + D;   // lower row r+D: row r's right half, then its own right half
    }
#pragma GCC unroll 16
    for (int r = 0; r < L; ++r)
      if (!(r & D)) {
        const VEC a = v[r], b = v[r + D];
        v[r] = __builtin_shuffle(a, b, lo);
        v[r + D] = __builtin_shuffle(a, b, hi);
      }
    transpose_block<VEC, L, D / 2>(v);
  }
}

// dst[l * ld + m] = src[m][l] for m < M, l < n: an [M][L] staging buffer out to n rows of a row-major matrix.
template <typename E, int L>
void transpose_out(const E* src, int64_t M, E* dst, int64_t ld, int64_t n) {
  typedef typename Lanes_of<E, L>::type vec;
  int64_t m = 0;
  for (; m + L <= M; m += L) {
    vec v[L];
    std::memcpy(v, src + m * L, sizeof(v));
    transpose_block<vec, L>(v);
    for (int64_t l = 0; l < n; ++l) std::memcpy(dst + l * ld + m, &v[l], sizeof(vec));
  }
  for (; m < M; ++m)
    for (int64_t l = 0; l < n; ++l) dst[l * ld + m] = src[m * L + l];
}

// dst[m][l] = img[l][m] for m < M: L images (rows of M values) into an [M][L] buffer.
template <typename E, int L>
void transpose_in(const E* const img[L], int64_t M, E* dst) {
  typedef typename Lanes_of<E, L>::type vec;
  int64_t m = 0;
  for (; m + L <= M; m += L) {
    vec v[L];
    for (int l = 0; l < L; ++l) std::memcpy(&v[l], img[l] + m, sizeof(vec));
    transpose_block<vec, L>(v);
    std::memcpy(dst + m * L, v, sizeof(v));
  }
  for (; m < M; ++m)
    for (int l = 0; l < L; ++l) dst[m * L + l] = img[l][m];
}

// xs, rows, w, bias as `forward` (the split images: the backward then finds the step's images in cache); y [K, B,
// Hp, Wp, O] and arg [K, B, O, Hp, Wp] as `forward`'s client-major layouts. RS: the kernel's size when it is RS × RS,
// known at compile time (the taps' loops unrolled: the LeNets' 5 × 5), or 0.
template <typename T, int OB, int RS>
void forward_lanes(const T* xs, const int64_t* rows, const T* w, const T* bias, T* y, uint8_t* arg, const Shape& s) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  typedef typename Indices<L>::bytes bytes;
  const int64_t pix = split_size(s), plane = s.Hp * s.Wp, my = plane * s.O;   // pix: a split image's values
  const int64_t R = RS ? RS : s.R, S = RS ? RS : s.S;
  // staging buffers, every value written before it is read: kept by the thread from call to call (the step by hand
  // calls this once per client and step: allocating and zeroing them each time was ~3 % of this kernel)
  static thread_local std::vector<vec> xt, yt;
  static thread_local std::vector<bytes> at;
  if (xt.size() < size_t(pix)) xt.resize(pix);
  if (yt.size() < size_t(my)) yt.resize(my);
  if (at.size() < size_t(my)) at.resize(my);
  for (int64_t k = 0; k < s.K; ++k) {
    for (int64_t b0 = 0; b0 < s.B; b0 += L) {
      const int64_t nb = s.B - b0 < L ? s.B - b0 : L;
      const T* img[L];
      for (int l = 0; l < L; ++l) img[l] = xs + rows[k * s.B + b0 + (l < nb ? l : 0)] * pix;
      transpose_in<T, L>(img, pix, reinterpret_cast<T*>(xt.data()));
      for (int64_t i = 0; i < s.Hp; ++i)
        for (int64_t j = 0; j < s.Wp; ++j)
          for (int64_t o0 = 0; o0 < s.O; o0 += OB) {
            const T* wk = w + (k * s.O + o0) * s.taps;
            vec acc[4][OB];  // [window position][output channel of the block]
            bias_acc<T, OB>(acc, bias + k * s.O + o0);   // then the taps in `forward`'s order
            for (int64_t ci = 0; ci < s.Cin; ++ci)
              for (int64_t r = 0; r < R; ++r)
                for (int64_t q = 0; q < S; ++q) {
                  // window position p = 2a + c: the conv output at (2i + a, 2j + c), whose tap reads row 2i+a+r,
                  // column 2j+c+q: in the split image, [j + (c+q)/2] of that row's even or odd half (`window_inputs`)
                  const vec* x0 = xt.data() + (ci * s.H + 2 * i + r) * 2 * s.PW + j;
                  const vec* h0 = x0 + (q & 1) * s.PW + (q >> 1);              // c = 0: column q
                  const vec* h1 = x0 + ((q + 1) & 1) * s.PW + ((q + 1) >> 1);  // c = 1: column q + 1
                  const vec xv[4] = {h0[0], h1[0], h0[2 * s.PW], h1[2 * s.PW]};
                  const T* wt = wk + (ci * R + r) * S + q;
                  for (int o = 0; o < OB; ++o)
                    for (int p = 0; p < 4; ++p) acc[p][o] += xv[p] * wt[o * s.taps];
                }
            for (int ob = 0; ob < OB; ++ob) {
              const int64_t o = o0 + ob;
              const auto a = pool_relu<T>(acc[0][ob], acc[1][ob], acc[2][ob], acc[3][ob], yt[(i * s.Wp + j) * s.O + o]);
              at[(o * s.Hp + i) * s.Wp + j] = narrow<L>(a);
            }
          }
      transpose_out<T, L>(reinterpret_cast<const T*>(yt.data()), my, y + (k * s.B + b0) * my, my, nb);
      transpose_out<uint8_t, L>(reinterpret_cast<const uint8_t*>(at.data()), my, arg + (k * s.B + b0) * my, my, nb);
    }
  }
}

// Calls f(std::integral_constant<int, OB>) with the widest register block OB that divides O:
// 6 (mimic-cnn, cifar-lenet), 5 (fdms-cnn's 10), ... 1; at most 2 with 16 vector registers.
template <typename F>
void with_block(int64_t O, F f) {
  if (REGS < 32) {
    if (O % 2 == 0) f(std::integral_constant<int, 2>{});
    else f(std::integral_constant<int, 1>{});
  } else if (O % 6 == 0) f(std::integral_constant<int, 6>{});
  else if (O % 5 == 0) f(std::integral_constant<int, 5>{});
  else if (O % 4 == 0) f(std::integral_constant<int, 4>{});
  else if (O % 3 == 0) f(std::integral_constant<int, 3>{});
  else if (O % 2 == 0) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}


// ---- The LeNets' second layer: relu(max_pool2d(conv2d(h, w, b, groups=K), 2)) on activations ----------------
//
//   h    [B, H, W, K*CIN]    the first layer's output (channels-last: client k owns channels k*CIN..)
//   w    [K*O, CIN, R, S], bias [K*O]
//   y    [K, B, O, Hp, Wp]   output in row layout: y[k, b] is client k's `flatten(1)` of its pooled map,
//                            what the fully connected layers read
//   arg  [K, B, Hp, Wp, O]   uint8 window index, 4 where relu passes no gradient (as above); a window's O indices
//                            are contiguous: the backward reads them as one vector
// Backward: gh [B, H, W, K*CIN] (every element written), gw, gb. Only 1 of the 4 conv outputs of a
// window receives a gradient, so the backward visits routed outputs only: 1/4 of the dense
// convolution backward's multiply-adds, for the input gradient and the weight gradient alike.
//
// Compiled for the LeNets' shape (CIN = 6, 5x5, O <= 2 logical vectors: 32 floats, 16 doubles); other
// shapes use the torch ops.
// Forward: vectorised over the output channels o, JB pooled columns at once (4 window positions x JB
// columns x OV vectors of accumulators, JB sized to the register file). Backward, per conv output
// position (column-major, so that
// consecutive read-modify-writes of the input gradient hit exactly the addresses just written):
// the routed outputs' g * w patches are summed in registers, then added to the gradient once.
// A patch row is S*CIN contiguous values of the client's input (gathered per sample into a padded
// buffer xk[y][x*CIN + ci]), RV vectors; RB patch rows at a time (RB*RV accumulators in registers).

constexpr int CIN2 = 6, R2 = 5, S2 = 5;

// pooled columns per forward block: 4*JB*OV accumulators in half the vector registers
constexpr int jb_for(int OV) { return REGS / 2 / (4 * OV) > 1 ? REGS / 2 / (4 * OV) : 1; }
constexpr int JB_MAX = jb_for(1);

struct Inner {
  int64_t B, H, W, K, O, Hp, Wp, C;
  int64_t nJB, XS;  // column blocks of JB_MAX; padded row stride of xk (elements)
  bool cm = false;  // client-major layouts (the step by hand): h [K, B, H, W, CIN], gh [K, B, CIN, H, W]
};

template <typename T>
constexpr int row_vectors() { return (S2 * CIN2 + V<T>::L - 1) / V<T>::L; }

template <typename T>
Inner make_inner(int64_t B, int64_t H, int64_t W, int64_t K, int64_t O) {
  Inner s{B, H, W, K, O, (H - R2 + 1) / 2, (W - S2 + 1) / 2, K * CIN2, 0, 0};
  s.nJB = (s.Wp + JB_MAX - 1) / JB_MAX;
  const int64_t cols = W > 2 * s.nJB * JB_MAX + S2 ? W : 2 * s.nJB * JB_MAX + S2;  // forward reads up to here
  s.XS = cols * CIN2 + row_vectors<T>() * V<T>::L;                        // + a patch row's overrun
  return s;
}

// Client k's input of sample b into xk[y * XS + x * CIN + ci]. Only x < W is written: the padding past it is
// zero from the buffer's allocation (std::vector<T>(n) value-initialises) and never written (a memset of the
// whole buffer per sample was ~2 % of a step).
template <typename T>
void gather_client(const T* h, const Inner& s, int64_t b, int64_t k, T* xk) {
  if (s.cm) {  // a row of client k's sample b is W * CIN contiguous values
    for (int64_t y = 0; y < s.H; ++y)
      std::memcpy(xk + y * s.XS, h + ((k * s.B + b) * s.H + y) * s.W * CIN2, sizeof(T) * s.W * CIN2);
    return;
  }
  for (int64_t y = 0; y < s.H; ++y)
    for (int64_t x = 0; x < s.W; ++x) {
      const T* src = h + ((b * s.H + y) * s.W + x) * s.C + k * CIN2;
      for (int ci = 0; ci < CIN2; ++ci) xk[y * s.XS + x * CIN2 + ci] = src[ci];
    }
}

template <typename T, int OV>
void inner_forward(const T* h, const T* w, const T* bias, T* y, uint8_t* arg, const Inner& s) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L, taps = CIN2 * R2 * S2, JB = jb_for(OV);
  const int64_t nJB = (s.Wp + JB - 1) / JB;  // within the buffer: JB divides JB_MAX
  const int64_t plane = s.Hp * s.Wp;
  std::vector<T> xk(s.H * s.XS);
  std::vector<vec> wt(taps * OV);  // wt[(r*S + q)*CIN + ci][v]: lanes = output channels (0-padded)
  for (int64_t k = 0; k < s.K; ++k) {
    T* wl = reinterpret_cast<T*>(wt.data());   // tap t = (r * S + q) * CIN + ci, lane l: w[l][ci][r][q]
    for (int64_t l = 0; l < OV * L; ++l) {
      if (l >= s.O) {
        for (int t = 0; t < taps; ++t) wl[t * OV * L + l] = T(0);
        continue;
      }
      const T* src = w + (k * s.O + l) * taps;
      for (int ci = 0; ci < CIN2; ++ci)
        for (int r = 0; r < R2; ++r)
          for (int q = 0; q < S2; ++q) wl[((r * S2 + q) * CIN2 + ci) * OV * L + l] = src[(ci * R2 + r) * S2 + q];
    }
    vec b0[OV] = {};
    for (int v = 0; v < OV; ++v)
      for (int l = 0; l < L; ++l) b0[v][l] = v * L + l < s.O ? bias[k * s.O + v * L + l] : T(0);
    for (int64_t b = 0; b < s.B; ++b) {
      gather_client(h, s, b, k, xk.data());
      T* yk = y + (k * s.B + b) * s.O * plane;
      uint8_t* ak = arg + (k * s.B + b) * s.O * plane;
      for (int64_t i = 0; i < s.Hp; ++i)
        for (int64_t jb = 0; jb < nJB; ++jb) {
          vec acc[JB][4][OV];
          for (int jj = 0; jj < JB; ++jj)
            for (int p = 0; p < 4; ++p)
              for (int v = 0; v < OV; ++v) acc[jj][p][v] = b0[v];
          const T* x0 = xk.data() + 2 * i * s.XS + 2 * jb * JB * CIN2;
          for (int r = 0; r < R2; ++r)
            for (int t = 0; t < S2 * CIN2; ++t) {  // t = q*CIN + ci: contiguous in a row of xk
              const vec* wv = wt.data() + (r * S2 * CIN2 + t) * OV;
              for (int jj = 0; jj < JB; ++jj)
                for (int p = 0; p < 4; ++p) {  // conv output (2i + p/2, 2j + p%2)
                  const T xv = x0[(p / 2 + r) * s.XS + (2 * jj + p % 2) * CIN2 + t];
                  for (int v = 0; v < OV; ++v) acc[jj][p][v] += xv * wv[v];
                }
            }
          for (int jj = 0; jj < JB && jb * JB + jj < s.Wp; ++jj) {
            const int64_t j = jb * JB + jj;
            for (int v = 0; v < OV; ++v) {
              vec m;
              const auto a = pool_relu<T>(acc[jj][0][v], acc[jj][1][v], acc[jj][2][v], acc[jj][3][v], m);
              for (int l = 0; l < L && v * L + l < s.O; ++l) yk[(v * L + l) * plane + i * s.Wp + j] = m[l];
              uint8_t* aw = ak + (i * s.Wp + j) * s.O + v * L;   // the window's indices: contiguous
              if ((v + 1) * L <= s.O) {
                const auto a8 = narrow<L>(a);
                std::memcpy(aw, &a8, L);
              } else {
                for (int l = 0; v * L + l < s.O; ++l) aw[l] = static_cast<uint8_t>(a[l]);
              }
            }
          }
        }
    }
  }
}

// Which of a window's n (<= 32) output channels are routed to each window position p = 0..3: bit o of bits[p] is
// set where a[o] == p. The indices compared 16 at a time as one vector, each comparison's 0/1 bytes packed into bits
// by a multiply (8 bytes at a time: byte i's bit lands on bit 56 + i).
inline void routed_bits(const uint8_t* a, int64_t n, uint32_t bits[4]) {
  typedef uint8_t b16 __attribute__((vector_size(16)));
  for (int p = 0; p < 4; ++p) bits[p] = 0;
  for (int64_t o0 = 0; o0 < n; o0 += 16) {
    b16 v;
    if (n - o0 >= 16) {
      std::memcpy(&v, a + o0, 16);
    } else {
      v = b16{} + 4;   // channels past n: routed nowhere
      std::memcpy(&v, a + o0, n - o0);
    }
    for (int p = 0; p < 4; ++p) {
      const b16 hit = (v == static_cast<uint8_t>(p)) & 1;
      uint64_t w[2];
      std::memcpy(w, &hit, 16);
      uint32_t m = 0;
      for (int h = 0; h < 2; ++h) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        m |= static_cast<uint32_t>((w[h] * 0x0102040810204080ull) >> 56) << (8 * h);
#else
        for (int i = 0; i < 8; ++i) m |= static_cast<uint32_t>(hit[8 * h + i]) << (8 * h + i);
#endif
      }
      bits[p] |= m << o0;
    }
  }
}

template <typename T>
void inner_backward(const T* h, const T* w, const T* gy, const uint8_t* arg, T* gh, T* gw, T* gb, const Inner& s) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L, RV = row_vectors<T>(), RW = RV * L, taps = CIN2 * R2 * S2;
  // patch rows per block: RB*RV accumulators in half the registers (all 5 rows with AVX-512 floats)
  constexpr int RB = REGS / 2 / RV >= R2 ? R2 : REGS / 2 / RV >= 1 ? REGS / 2 / RV : 1;
  const int64_t plane = s.Hp * s.Wp;
  std::vector<T> xk(s.H * s.XS), dxk(s.H * s.XS), db(s.O);
  std::vector<vec> wrow(s.O * R2 * RV), dw(s.O * R2 * RV);  // [o][r][v]: lanes = (q, ci), 0-padded
  std::vector<uint32_t> routed(plane * 4);  // [window][position]: the output channels routed there, bit o
  for (int64_t k = 0; k < s.K; ++k) {
    T* wl = reinterpret_cast<T*>(wrow.data());   // lane l = q * CIN + ci of row r: w[o][ci][r][q]
    for (int64_t o = 0; o < s.O; ++o)
      for (int r = 0; r < R2; ++r) {
        T* dst = wl + (o * R2 + r) * RW;
        const T* src = w + (k * s.O + o) * taps + r * S2;
        for (int q = 0; q < S2; ++q)
          for (int ci = 0; ci < CIN2; ++ci) dst[q * CIN2 + ci] = src[ci * R2 * S2 + q];
        for (int l = S2 * CIN2; l < RW; ++l) dst[l] = T(0);
      }
    for (auto& v : dw) v = vec{};
    for (auto& v : db) v = T(0);
    for (int64_t b = 0; b < s.B; ++b) {
      gather_client(h, s, b, k, xk.data());
      std::memset(dxk.data(), 0, sizeof(T) * s.H * s.XS);
      const T* gk = gy + (k * s.B + b) * s.O * plane;
      const uint8_t* ak = arg + (k * s.B + b) * s.O * plane;
      // Per window and position, the output channels routed there, as bits: the window's indices compared as
      // one vector (a per-output branch on the saved position mispredicted ~1 time in 3; appending each output
      // to its position's list without branches was ~10 % of this backward, its counters a chain through memory)
      for (int64_t at = 0; at < plane; ++at) routed_bits(ak + at * s.O, s.O, routed.data() + at * 4);
      for (int64_t x0 = 0; x0 < 2 * s.Wp; ++x0)
        for (int64_t y0 = 0; y0 < 2 * s.Hp; ++y0) {  // conv output (y0, x0): window (y0/2, x0/2), position p
          const int64_t at = (y0 / 2) * s.Wp + x0 / 2, p = (y0 % 2) * 2 + x0 % 2;
          const uint32_t os = routed[at * 4 + p];
          if (os == 0) continue;
          const T* xb = xk.data() + y0 * s.XS + x0 * CIN2;
          T* db0 = dxk.data() + y0 * s.XS + x0 * CIN2;
          // rows r0..r0+NR-1 (NR a compile-time count); each element's sum runs over t in the same order
          auto rows = [&](int r0, auto nr_c) {
            constexpr int NR = decltype(nr_c)::value;
            vec acc[NR][RV] = {};
            for (uint32_t m = os; m; m &= m - 1) {   // the routed channels in increasing order
              const int64_t o = __builtin_ctz(m);
              const T g = gk[o * plane + at];
              if (r0 == 0) db[o] += g;
              const vec* wr = wrow.data() + (o * R2 + r0) * RV;
              vec* dwr = dw.data() + (o * R2 + r0) * RV;
              for (int r = 0; r < NR; ++r)
                for (int v = 0; v < RV; ++v) {
                  acc[r][v] += g * wr[r * RV + v];                                // lanes past S*CIN: + g*0
                  dwr[r * RV + v] += g * loadu(xb + (r0 + r) * s.XS + v * L);     // lanes past S*CIN: discarded
                }
            }
            for (int r = 0; r < NR; ++r)
              for (int v = 0; v < RV; ++v) {
                const vec d = loadu(db0 + (r0 + r) * s.XS + v * L) + acc[r][v];
                std::memcpy(db0 + (r0 + r) * s.XS + v * L, &d, sizeof(d));
              }
          };
          int r0 = 0;
          for (; r0 + RB <= R2; r0 += RB) rows(r0, std::integral_constant<int, RB>{});
          if (r0 < R2) rows(r0, std::integral_constant<int, R2 % RB == 0 ? 1 : R2 % RB>{});
        }
      if (s.cm) {
        for (int ci = 0; ci < CIN2; ++ci)
          for (int64_t yy = 0; yy < s.H; ++yy) {
            T* dst = gh + (((k * s.B + b) * CIN2 + ci) * s.H + yy) * s.W;
            for (int64_t x = 0; x < s.W; ++x) dst[x] = dxk[yy * s.XS + x * CIN2 + ci];
          }
      } else {
        for (int64_t yy = 0; yy < s.H; ++yy)
          for (int64_t x = 0; x < s.W; ++x) {
            T* dst = gh + ((b * s.H + yy) * s.W + x) * s.C + k * CIN2;
            for (int ci = 0; ci < CIN2; ++ci) dst[ci] = dxk[yy * s.XS + x * CIN2 + ci];
          }
      }
    }
    const T* dl = reinterpret_cast<const T*>(dw.data());
    for (int64_t o = 0; o < s.O; ++o) {
      for (int r = 0; r < R2; ++r) {
        const T* src = dl + (o * R2 + r) * RW;
        T* dst = gw + (k * s.O + o) * taps + r * S2;
        for (int q = 0; q < S2; ++q)
          for (int ci = 0; ci < CIN2; ++ci) dst[ci * R2 * S2 + q] = src[q * CIN2 + ci];
      }
      gb[k * s.O + o] = db[o];
    }
  }
}

// ---- The SGD step of FedProx and SCAFFOLD clients, fused --------------------------------------------------------
//
// The engine's update of one parameter stack p [K, n] (client k's row k*n..) from its gradient g [K, n], torch's
// ops one element at a time, in torch's order and rounding:
//     g + mu_k * (p - a)      FedProx (a: the anchor, w_global's row: a + k * a_stride; mu: [K], or none)
//     ... + c                 SCAFFOLD (the correction c [K, n], or none)
//     p = fma(g', -lr, p)     p.add_(g', alpha=-lr): ATen's vectorised add computes other * alpha + self as one fma
// `terms` [K] (or none: every client gets the terms given): bit 1 adds client k's FedProx term, bit 2 its
// correction. A lockstep sweep merges plain, FedProx and SCAFFOLD clients of one lr into one computation and
// gives each client the terms its own run's computation adds (coordinator/sim/lockstep.py).
// Torch's ops stream the whole stack through memory four times, with a temporary each (the stacks of a
// 20-client step are ~3.5 MB, past L2): ~1.5 ms of a 20-client FedProx step of ~8.6 ms, and 11 % of all samples
// of a uniform Table 3 worker (py-spy); fused, 0.37 ms (the plain step's update: 0.27 ms). Each product and sum
// is rounded on its own as in torch: no contraction here (fp-contract=off below), the one fma is explicit. The
// engine checks these bits against torch's ops at run time before using it (`kernels.sgd_update_exact`), so a
// torch whose add differs is never silently replaced.

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T, bool PROX, bool CORR>
void sgd_row(T* __restrict pk, const T* __restrict gk, const T* __restrict ak, T m, const T* __restrict ck, T neg_lr,
             int64_t n) {
  for (int64_t e = 0; e < n; ++e) {
    T gv = gk[e];
    if (PROX) {
      const T d = pk[e] - ak[e];
      const T md = m * d;
      gv = gv + md;
    }
    if (CORR) gv = gv + ck[e];
    pk[e] = std::fma(gv, neg_lr, pk[e]);  // fmaf for float: one instruction with FMA hardware
  }
}
#pragma GCC pop_options

template <typename T>
void sgd_update_any(T* p, const T* g, const T* a, int64_t a_stride, const T* mu, const T* c, const uint8_t* terms,
                    T neg_lr, int64_t K, int64_t n) {
  for (int64_t k = 0; k < K; ++k) {
    const bool prox = mu && (!terms || (terms[k] & 1)), corr = c && (!terms || (terms[k] & 2));
    T* pk = p + k * n;
    const T* gk = g + k * n;
    const T* ak = prox ? a + k * a_stride : nullptr;
    const T* ck = corr ? c + k * n : nullptr;
    const T m = prox ? mu[k] : T(0);
    auto run = [&](auto pr, auto co) {
      sgd_row<T, decltype(pr)::value, decltype(co)::value>(pk, gk, ak, m, ck, neg_lr, n);
    };
    using Y = std::true_type;
    using N = std::false_type;
    if (prox && corr) run(Y{}, Y{});
    else if (prox) run(Y{}, N{});
    else if (corr) run(N{}, Y{});
    else run(N{}, N{});
  }
}


// ---- A fully connected weight's gradient and its SGD step in one pass (the LeNet step by hand, plain SGD) --------
//
// For K clients: w[k] ← w[k] − lr·(x[k]ᵀ·g[k]); x [K, B, in] (the layer's input), g [K, B, out] (its output's
// gradient), w [K, in, out] (the engine holds linear weights transposed). The arithmetic of the torch ops it
// replaces, `w.add_(x.transpose(1, 2).bmm(g), alpha=-lr)`: each gradient element is one FMA chain over the batch
// rows in order from 0 (what MKL's sgemm computes for these small matrices on the CPUs measured), then one
// fma(gradient, −lr, w) (ATen's add with alpha). The gradient never goes to memory. On a 15-client mimic-cnn step
// the bmm wrote fc1's gradient (1.8 MB) and add_ read it back with the weights, past L2: 150 + 132 µs. The engine
// compares the bits with the torch ops' for every shape it meets, once per process, and uses this only where they
// agree (`kernels.fc_sgd_exact`): a torch, MKL or CPU that sums in another order keeps the torch ops.
// Vectorised over the output columns; where `out` is not a multiple of the vector, the last vector overlaps the
// previous one and leaves the overlapped lanes as they are (each weight is updated once). Measured alone, 15 clients
// × batch 16, µs (torch ops → this): fc1 256→120 291 → 167, fc2 120→84 64 → 59.
template <typename T>
inline void storeu(T* p, typename V<T>::type v) {
  std::memcpy(p, &v, sizeof(v));
}

constexpr int DW_MB = 4;                     // rows of w per register block
constexpr int DW_NB = REGS == 32 ? 4 : 2;    // vectors of columns per register block

template <typename T>
using Lanes = decltype(typename V<T>::type{} < typename V<T>::type{});   // the comparisons' integer vector

// The lane numbers 0..L-1 as the comparisons' integer vector (`store_first`'s shuffles, masks by lane).
template <typename T>
inline Lanes<T> lane_numbers() {
  Lanes<T> lane{};
  for (int l = 0; l < V<T>::L; ++l) lane[l] = l;
  return lane;
}

// Output columns in vectors: vector j covers columns [n0(j), n0(j) + L). Where Fout >= L the last vector overlaps
// the one before it (it starts at Fout - L: the overlapping lanes compute the same values again); where Fout < L
// there is one vector of Fout lanes.
inline int64_t col_start(int64_t j, int64_t L, int64_t Fout) { return Fout >= L ? std::min(j * L, Fout - L) : 0; }

template <typename T, int MB, int NB>
void dw_block(const T* x, const T* g, T* w, int64_t B, int64_t Fin, int64_t Fout, int64_t i0, int64_t v0, T neg_lr,
              const Lanes<T>& lane) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  typedef std::remove_reference_t<decltype(lane[0])> ilane;
  int64_t n0[NB];
  Lanes<T> keep[NB];   // lanes a previous vector already covers (the overlapping last vector of a row)
  for (int j = 0; j < NB; ++j) {
    n0[j] = col_start(v0 + j, L, Fout);
    keep[j] = lane < static_cast<ilane>((v0 + j) * L - n0[j]);
  }
  // every block of MB rows in one call, from i0 (a call per block: its set-up, and the accumulators through the
  // stack, for B = 16 FMAs each)
  for (; i0 + MB <= Fin; i0 += MB) {
    vec acc[MB][NB];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = vec{};
    for (int64_t b = 0; b < B; ++b) {
      vec gv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) gv[j] = loadu(g + b * Fout + n0[j]);
      const T* xb = x + b * Fin + i0;
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[i][j] += gv[j] * xb[i];   // one FMA (contracted)
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        T* p = w + (i0 + i) * Fout + n0[j];
        const vec old = loadu(p);
        const vec upd = acc[i][j] * neg_lr + old;   // fma(gradient, −lr, w)
        storeu(p, keep[j] ? old : upd);
      }
  }
}

// Rows i0.. of one client's update: blocks of MB rows, then the rest in blocks of MB/2, MB/4, ... 1.
template <typename T, int MB, int NB>
void dw_rows(const T* x, const T* g, T* w, int64_t B, int64_t Fin, int64_t Fout, int64_t i0, int64_t v0, T neg_lr,
             const Lanes<T>& lane) {
  if constexpr (MB >= 1) {
    dw_block<T, MB, NB>(x, g, w, B, Fin, Fout, i0, v0, neg_lr, lane);
    dw_rows<T, MB / 2, NB>(x, g, w, B, Fin, Fout, i0 + (Fin - i0) / MB * MB, v0, neg_lr, lane);
  }
}

// Columns: blocks of NB vectors, then the rest in blocks of NB/2, ... 1 (each over all the rows).
template <typename T, int NB>
void dw_cols(const T* x, const T* g, T* w, int64_t B, int64_t Fin, int64_t Fout, int64_t v0, int64_t nvec, T neg_lr,
             const Lanes<T>& lane) {
  if constexpr (NB >= 1) {
    for (; v0 + NB <= nvec; v0 += NB) dw_rows<T, DW_MB, NB>(x, g, w, B, Fin, Fout, 0, v0, neg_lr, lane);
    dw_cols<T, NB / 2>(x, g, w, B, Fin, Fout, v0, nvec, neg_lr, lane);
  }
}

// Returns -1 (and does nothing) where `out` is narrower than a vector: the caller keeps the torch ops (mimic-cnn's
// last layer, 10 outputs, is ~3 % of the fully connected weights; padding it cost more than the torch ops).
template <typename T>
int fc_sgd(const T* x, const T* g, T* w, int64_t K, int64_t B, int64_t Fin, int64_t Fout, T neg_lr) {
  constexpr int L = V<T>::L;
  if (Fout < L) return -1;
  const Lanes<T> lane = lane_numbers<T>();
  for (int64_t k = 0; k < K; ++k)
    dw_cols<T, DW_NB>(x + k * B * Fin, g + k * B * Fout, w + k * Fin * Fout, B, Fin, Fout, 0, (Fout + L - 1) / L,
                      neg_lr, lane);
  return 0;
}

// ---- The fully connected layers of the LeNet step by hand, with MKL's bits -------------------------------------------
// x [K, B, Fin], w [K, Fin, Fout] (the engine's transposed weight), bias [K, Fout], y/g [K, B, Fout], all contiguous.
// Each output and gradient is summed in the order the torch ops it replaces sum it on this machine (found by testing
// candidate orders against their results, as for `fc_sgd`): baddbmm's y = (Σ_i x·w as one FMA chain over i from 0)
// + bias; bmm's g·wᵀ, one FMA chain over the outputs from 0; the bias gradient g.sum(1), ATen's reduction over the
// batch rows (`column_sum`). That order is the libraries' behaviour, not their contract, so
// the engine compares these kernels with the torch ops once per shape (`kernels.fc_layer_exact`) and runs the torch ops
// wherever the bits differ.

// Σ_b row(b) as ATen's sum over the batch rows of a [B, Fout] gradient adds each column (measured against g.sum(1)
// for 1..64 rows), for one column (U = T) or a vector of columns (U = a vector, the same order in every lane). The
// columns in whole blocks of its vectorised kernel (`cascade`: 4 vectors of its ISA's width) are summed in row order
// from 0 in a cascade of 4 levels of 2^max(4, ⌈log2 B⌉/4) rows each; the rest in four sums over every fourth row
// (the rows past the last whole four into the first), then added from 0.
template <typename U, typename F>
U column_sum(int64_t B, bool cascade, F row) {
  if (cascade) {
    int64_t lp = 0;
    while ((int64_t(1) << lp) < B) ++lp;   // ⌈log2 B⌉
    lp = std::max<int64_t>(4, lp / 4);
    const int64_t step = int64_t(1) << lp, mask = step - 1;
    U acc[4] = {U{}, U{}, U{}, U{}};
    int64_t i = 0;
    while (i + step <= B) {
      for (int64_t j = 0; j < step; ++j, ++i) acc[0] += row(i);
      for (int j = 1; j < 4; ++j) {
        acc[j] += acc[j - 1];
        acc[j - 1] = U{};
        if (i & (mask << (j * lp))) break;
      }
    }
    for (; i < B; ++i) acc[0] += row(i);
    for (int j = 1; j < 4; ++j) acc[0] += acc[j];
    return acc[0];
  }
  U a[4] = {U{}, U{}, U{}, U{}};
  int64_t i = 0;
  for (; i + 4 <= B; i += 4)
    for (int j = 0; j < 4; ++j) a[j] += row(i + j);
  for (; i < B; ++i) a[0] += row(i);
  return U{} + a[0] + a[1] + a[2] + a[3];
}

// Loads the first n (< L) lanes of a vector, the rest zero: rows narrower than a vector (mimic-cnn's fc3; they are
// stored back with `store_first`).
template <typename T>
inline typename V<T>::type load_first(const T* p, int64_t n) {
  typename V<T>::type v{};
  std::memcpy(&v, p, n * sizeof(T));
  return v;
}



// forward blocks: FC_MB rows x FC_NB vectors of columns (8 x 2 measured fastest of 2x8 .. 16x1 for mimic-cnn's fc1)
constexpr int FC_MB = REGS >= 32 ? 8 : 4, FC_NB = 2;
constexpr int64_t FC_KMAX = 384;   // the longest row MKL's sgemm sums in one chain here (measured: 384 yes, 385 no)
constexpr int GX_ROWS = 8;   // rows of w per input-gradient block (`fc_bwd_sgd`; 8 measured best of 6 .. 16)

// y[m][cols of vectors v0..v0+NB) for rows m0..m0+MB of one client.
template <typename T, int MB, int NB, bool NARROW>
void fc_fwd_block(const T* x, const T* w, const T* bias, T* y, int64_t Fin, int64_t Fout, int64_t m0, int64_t v0,
                  bool relu) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  typedef std::remove_reference_t<decltype(Lanes<T>{}[0])> ilane;
  const int64_t ws = NARROW ? L : Fout;   // NARROW: w's rows and the bias padded to L lanes
  const Lanes<T> lane = lane_numbers<T>();
  int64_t n0[NB];
  Lanes<T> keep[NB];   // lanes the vector before already covers (a row's overlapping last vector; none if NARROW)
  for (int j = 0; j < NB; ++j) {
    n0[j] = col_start(v0 + j, L, Fout);
    keep[j] = lane < static_cast<ilane>((v0 + j) * L - n0[j]);
  }
  // MKL sums a long row in balanced blocks of at most FC_KMAX (400 inputs: 2 x 200), each an FMA chain from 0
  // added to the output in turn (the bias first); the output holds the sum between blocks
  const int64_t nblocks = (Fin + FC_KMAX - 1) / FC_KMAX, kb = (Fin + nblocks - 1) / nblocks;
  for (int64_t i0 = 0; i0 < Fin; i0 += kb) {
    const int64_t i1 = std::min(Fin, i0 + kb);
    vec acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = vec{};
    for (int64_t i = i0; i < i1; ++i) {
      vec wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = loadu(w + i * ws + n0[j]);
      for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] += x[(m0 + m) * Fin + i] * wv[j];   // one FMA (contracted)
    }
    for (int j = 0; j < NB; ++j) {
      const vec bv = loadu(bias + n0[j]);
      for (int m = 0; m < MB; ++m) {
        T* yp = y + (m0 + m) * Fout + n0[j];
        const vec old = i0 == 0 ? bv : NARROW ? load_first(yp, Fout) : loadu(yp);
        vec out = acc[m][j] + old;
        if (relu && i1 == Fin) out = out < 0 ? vec{} : out;   // torch.relu: NaN and -0 stay
        // in several blocks, the lanes an earlier vector covers keep what it stored (y holds partial sums: computed
        // again they would add a block twice); in one block they are computed again, the same values
        if (!NARROW && nblocks > 1) out = keep[j] ? loadu(yp) : out;
        if (NARROW) store_first(yp, out, Fout, lane);
        else storeu(yp, out);
      }
    }
  }
}

template <typename T, int MB, int NB, bool NARROW = false>
void fc_fwd_rows(const T* x, const T* w, const T* bias, T* y, int64_t B, int64_t Fin, int64_t Fout, int64_t m0,
                 int64_t v0, bool relu) {
  if constexpr (MB >= 1) {
    for (; m0 + MB <= B; m0 += MB) fc_fwd_block<T, MB, NB, NARROW>(x, w, bias, y, Fin, Fout, m0, v0, relu);
    fc_fwd_rows<T, MB / 2, NB, NARROW>(x, w, bias, y, B, Fin, Fout, m0, v0, relu);
  }
}

// Columns: blocks of NB vectors (FC_MB·4/NB rows at a time), then the rest in blocks of NB/2, ... 1.
template <typename T, int NB>
void fc_fwd_cols(const T* x, const T* w, const T* bias, T* y, int64_t B, int64_t Fin, int64_t Fout, int64_t v0,
                 int64_t nvec, bool relu) {
  if constexpr (NB >= 1) {
    for (; v0 + NB <= nvec; v0 += NB) fc_fwd_rows<T, FC_MB * FC_NB / NB, NB>(x, w, bias, y, B, Fin, Fout, 0, v0, relu);
    fc_fwd_cols<T, NB / 2>(x, w, bias, y, B, Fin, Fout, v0, nvec, relu);
  }
}

template <typename T>
void fc_fwd(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t B, int64_t Fin, int64_t Fout, bool relu) {
  constexpr int L = V<T>::L;
  const int64_t nvec = (Fout + L - 1) / L;
  std::vector<T> wpad(Fout < L ? (Fin + 1) * L : 0);   // zeros past Fout
  for (int64_t k = 0; k < K; ++k) {
    const T* xk = x + k * B * Fin;
    const T* wk = w + k * Fin * Fout;
    const T* bk = bias + k * Fout;
    T* yk = y + k * B * Fout;
    if (Fout < L) {   // one vector of Fout lanes: the weight's rows and the bias copied padded to L first
      for (int64_t i = 0; i < Fin; ++i) std::memcpy(wpad.data() + i * L, wk + i * Fout, Fout * sizeof(T));
      std::memcpy(wpad.data() + Fin * L, bk, Fout * sizeof(T));
      fc_fwd_rows<T, 2 * FC_MB, 1, true>(xk, wpad.data(), wpad.data() + Fin * L, yk, B, Fin, Fout, 0, 0, relu);
      continue;
    }
    fc_fwd_cols<T, FC_NB>(xk, wk, bk, yk, B, Fin, Fout, 0, nvec, relu);
  }
}

// gxT[v][i][lanes] = Σ_o w[i][o]·gT[v][o][lanes] (one FMA chain over o from 0) for rows i0..i0+IB of one client and
// NV vectors v of batch lanes: the input gradient g·wᵀ with the batch rows in the lanes (w's rows are contiguous in o).
template <typename T, int IB, int NV>
void fc_gx_block(const T* gT, const T* w, T* gxT, int64_t Fin, int64_t Fout, int64_t i0) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  vec acc[IB][NV];
  for (int i = 0; i < IB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vec{};
  for (int64_t o = 0; o < Fout; ++o) {
    vec gv[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&gv[v], gT + (v * Fout + o) * L, sizeof(vec));
    // unrolled here: GCC's loop interchange otherwise swaps the loops over o and i and keeps the accumulators in
    // memory (a load and a store per FMA: this loop ran at half speed)
#pragma GCC unroll 32
    for (int i = 0; i < IB; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] += w[(i0 + i) * Fout + o] * gv[v];   // one FMA (contracted)
  }
  for (int i = 0; i < IB; ++i)
    for (int v = 0; v < NV; ++v) std::memcpy(gxT + (v * Fin + i0 + i) * L, &acc[i][v], sizeof(vec));
}

template <typename T, int IB, int NV>
void fc_gx_rows(const T* gT, const T* w, T* gxT, int64_t Fin, int64_t Fout, int64_t i0) {
  if constexpr (IB >= 1) {
    for (; i0 + IB <= Fin; i0 += IB) fc_gx_block<T, IB, NV>(gT, w, gxT, Fin, Fout, i0);
    fc_gx_rows<T, IB / 2, NV>(gT, w, gxT, Fin, Fout, i0);
  }
}

// One layer's backward and plain SGD step, client by client: the input gradient gx = g·wᵀ (then relu's
// threshold_backward where r, the layer's relu'd input, is given; gx may be null: no input gradient), then the
// bias gradient and the weight gradient with their steps, b ← fma(Σ_b g, −lr, b) and w ← fma(xᵀ·g, −lr, w) (the
// weight is read for gx first). Returns -1 (and does nothing) for a batch of more than 8 vectors of lanes.
template <typename T>
int fc_bwd_sgd(const T* x, const T* g, T* w, T* bias, const T* r, T* gx, int64_t K, int64_t B, int64_t Fin,
               int64_t Fout, T neg_lr, int64_t sum_block) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  const int64_t NV = (B + L - 1) / L;   // vectors of batch lanes
  if (NV > 8 || sum_block < 1) return -1;
  const int64_t seq_cols = Fout / sum_block * sum_block;
  std::vector<T> gT(NV * Fout * L), gxT(NV * Fin * L);
  std::vector<T> gb(Fout);
  std::vector<vec> gnarrow(Fout < L ? B : 0);
  const Lanes<T> lane = lane_numbers<T>();
  for (int64_t k = 0; k < K; ++k) {
    const T* xk = x + k * B * Fin;
    const T* gk = g + k * B * Fout;
    T* wk = w + k * Fin * Fout;
    if (gx != nullptr) {
      // gT [v][o][lane]: the gradient's rows in the lanes (lanes past the batch: row 0 again, not stored)
      for (int64_t v = 0; v < NV; ++v) {
        const T* rows[L];
        for (int l = 0; l < L; ++l) rows[l] = gk + (v * L + l < B ? v * L + l : 0) * Fout;
        transpose_in<T, L>(rows, Fout, gT.data() + v * Fout * L);
      }
      // IB rows of w x NV vectors of accumulators: at most GX_ROWS rows (each row's broadcasts need its own address
      // register: with 24 rows GCC spilled them and reloaded one per FMA) and 3/4 of the vector registers
      constexpr int ACC = REGS * 3 / 4;
      const T* gTp = gT.data();
      T* gxTp = gxT.data();
      switch (NV) {
        case 1: fc_gx_rows<T, std::min(GX_ROWS, ACC), 1>(gTp, wk, gxTp, Fin, Fout, 0); break;
        case 2: fc_gx_rows<T, std::min(GX_ROWS, ACC / 2), 2>(gTp, wk, gxTp, Fin, Fout, 0); break;
        case 3: fc_gx_rows<T, ACC / 3, 3>(gTp, wk, gxTp, Fin, Fout, 0); break;
        case 4: fc_gx_rows<T, ACC / 4, 4>(gTp, wk, gxTp, Fin, Fout, 0); break;
        case 5: fc_gx_rows<T, ACC / 5, 5>(gTp, wk, gxTp, Fin, Fout, 0); break;
        case 6: fc_gx_rows<T, ACC / 6, 6>(gTp, wk, gxTp, Fin, Fout, 0); break;
        case 7: fc_gx_rows<T, ACC / 7, 7>(gTp, wk, gxTp, Fin, Fout, 0); break;
        default: fc_gx_rows<T, ACC / 8, 8>(gTp, wk, gxTp, Fin, Fout, 0); break;
      }
      T* gxk = gx + k * B * Fin;
      for (int64_t v = 0; v < NV; ++v)   // back to rows: gx [b][i]
        transpose_out<T, L>(gxT.data() + v * Fin * L, Fin, gxk + v * L * Fin, Fin, std::min<int64_t>(L, B - v * L));
      if (r != nullptr) {   // threshold_backward(gx, r, 0): 0 where r <= 0
        const T* rk = r + k * B * Fin;
        for (int64_t e = 0; e < B * Fin; ++e) gxk[e] = rk[e] <= 0 ? T(0) : gxk[e];
      }
    }
    // the bias gradient in ATen's order (`column_sum`), a vector of columns at a time (`seq_cols` is a multiple of
    // the lanes wherever it is not 0: whole blocks of 4 vectors of AVX2 or AVX-512), then its step
    int64_t o = 0;
    for (; o + L <= Fout; o += L) {
      const vec sum = column_sum<vec>(B, o < seq_cols, [&](int64_t b) { return loadu(gk + b * Fout + o); });
      std::memcpy(gb.data() + o, &sum, sizeof(vec));
    }
    for (; o < Fout; ++o) gb[o] = column_sum<T>(B, o < seq_cols, [&](int64_t b) { return gk[b * Fout + o]; });
    T* bk = bias + k * Fout;
    for (int64_t o = 0; o < Fout; ++o) bk[o] = std::fma(gb[o], neg_lr, bk[o]);
    // the weight's gradient and step
    if (Fout >= L) {
      dw_cols<T, DW_NB>(xk, gk, wk, B, Fin, Fout, 0, (Fout + L - 1) / L, neg_lr, lane);
    } else {   // narrower than a vector: the gradient's rows as vectors of Fout lanes, 8 rows of w at a time
      for (int64_t b = 0; b < B; ++b) gnarrow[b] = load_first(gk + b * Fout, Fout);
      int64_t i0 = 0;
      for (; i0 + 8 <= Fin; i0 += 8) {
        vec acc[8] = {};
        for (int64_t b = 0; b < B; ++b)
          for (int i = 0; i < 8; ++i) acc[i] += xk[b * Fin + i0 + i] * gnarrow[b];
        for (int i = 0; i < 8; ++i) {
          const vec old = load_first(wk + (i0 + i) * Fout, Fout);
          store_first(wk + (i0 + i) * Fout, vec(acc[i] * neg_lr + old), Fout, lane);   // fma(gradient, −lr, w)
        }
      }
      for (; i0 < Fin; ++i0) {
        vec acc{};
        for (int64_t b = 0; b < B; ++b) acc += xk[b * Fin + i0] * gnarrow[b];
        const vec old = load_first(wk + i0 * Fout, Fout);
        store_first(wk + i0 * Fout, vec(acc * neg_lr + old), Fout, lane);
      }
    }
  }
  return 0;
}

// ---- The LeNet step by hand's loss: log_softmax, nll_loss (reduction none) and their backward, ATen's bits --------
// For rows of D <= L logits (one partial vector), as ATen's vectorised kernels compute them (`_vec_log_softmax_lastdim`
// and its backward, for a row shorter than a vector): the row's maximum and the sum of exp(x − max) folded lane by
// lane from lane 0, log of the sum, lsm = (x − max) − log(sum); ce = −lsm[target]; the gradient z = −dloss at the
// target (nll_loss_backward), 0 elsewhere, then z − exp(lsm)·Σz as one fma. exp and log are the very SLEEF functions
// ATen calls (`vexp`, `vlog`: function pointers into libtorch_cpu, passed by the caller). The engine compares this
// with the torch ops once per process (`kernels.loss_exact`) and keeps them wherever the bits differ.
template <typename T>
using vfun = typename V<T>::type (*)(typename V<T>::type);

// ATen's vec::maximum of two lanes: the larger (the second where equal), a NaN (all bits set) where either is one.
template <typename T>
inline T aten_max(T a, T b) {
  if (a != a || b != b) {
    T nan;
    std::memset(&nan, 0xff, sizeof(T));
    return nan;
  }
  return a > b ? a : b;
}

template <typename T>
int log_softmax_nll(const T* x, const int64_t* target, const T* dloss, T* ce, T* gi, int64_t R, int64_t D,
                    vfun<T> vexp, vfun<T> vlog) {
  typedef typename V<T>::type vec;
  constexpr int L = V<T>::L;
  if (D > L || D < 1) return -1;
  for (int64_t r = 0; r < R; ++r) {
    const T* row = x + r * D;
    vec xv{};
    std::memcpy(&xv, row, D * sizeof(T));
    T mx = xv[0];
    for (int64_t c = 1; c < D; ++c) mx = aten_max(mx, xv[c]);
    const vec e = vexp(xv - mx);
    T sum = e[0];
    for (int64_t c = 1; c < D; ++c) sum = sum + e[c];
    const T logsum = vlog(vec{} + sum)[0];
    vec lsm = (xv - mx) - logsum;
    const int64_t t = target[r];
    if (t < 0 || t >= D) return -2;
    ce[r] = -lsm[t];
    vec z{};
    z[t] = -dloss[r];
    T zsum = z[0];
    for (int64_t c = 1; c < D; ++c) zsum = zsum + z[c];
    for (int64_t c = D; c < L; ++c) lsm[c] = 0;
    const vec el = vexp(lsm);
    vec out;
    for (int l = 0; l < L; ++l) out[l] = std::fma(-el[l], zsum, z[l]);
    std::memcpy(gi + r * D, &out, D * sizeof(T));
  }
  return 0;
}

// ---- Dispatch shared by the entry points and `lenet_run` --------------------------------------------------------

// The first layer's forward with the samples in the lanes, its taps' loops unrolled for 5 × 5 kernels.
template <typename T>
void forward_lanes_any(const T* xs, const int64_t* rows, const T* w, const T* bias, T* y, uint8_t* arg,
                       const Shape& s) {
  with_block(s.O, [&](auto ob) {
    if (s.R == 5 && s.S == 5) forward_lanes<T, decltype(ob)::value, 5>(xs, rows, w, bias, y, arg, s);
    else forward_lanes<T, decltype(ob)::value, 0>(xs, rows, w, bias, y, arg, s);
  });
}

// Whether the second layer's kernels take this shape (the LeNets': CIN = 6, 5 × 5, O <= 2 logical vectors).
template <typename T>
bool inner_fits(int64_t Cin, int64_t R, int64_t S, int64_t O) {
  return Cin == CIN2 && R == R2 && S == S2 && O <= 2 * LOGICAL / int64_t(sizeof(T));
}

// The second layer's forward with O output channels in as few vectors as hold them.
template <typename T>
void inner_forward_any(const T* h, const T* w, const T* bias, T* y, uint8_t* arg, const Inner& s) {
  const int64_t L = V<T>::L;
  if (s.O <= L) inner_forward<T, 1>(h, w, bias, y, arg, s);
  else if (s.O <= 2 * L) inner_forward<T, 2>(h, w, bias, y, arg, s);
  else if (s.O <= 4 * L) inner_forward<T, 4>(h, w, bias, y, arg, s);
  else inner_forward<T, 8>(h, w, bias, y, arg, s);
}

// ---- The LeNet step by hand, client by client (plain SGD, float32) ---------------------------------------------
// The calls above for one client after another instead of one layer after another for all K clients: the first
// layer's forward, the second's, every fully connected layer's forward (`fc_fwd`), the loss (`log_softmax_nll`),
// every fully connected layer's backward with its steps (`fc_bwd_sgd`, from the last), the second layer's backward,
// the first's. Layer after layer, a 15-client mimic-cnn step's operands (the clients' fully connected weights alone
// are 2.4 MB) passed through L2 and back several times; one client's (~0.4 MB) stay there from its forward to its
// backward. The same functions on the same operands (each client's computation is its own), so the same bits.
// The conv layers' steps stay with the caller (their gradients go to gw1, gb1, gw2, gb2).

// The fully connected layers: NL (<= 4) layers, relu between them, none after the last. w[l] [K, fin, fout] (the
// engine's transposed weight), bias[l] [K, fout], out[l] [K, B, fout] (relu'd but the last), gin[l] [K, B, fin]
// (layer l's input gradient, relu's threshold applied for l > 0); dims[2l], dims[2l + 1] = fin, fout; blocks[l]
// the bias gradient's `sum_block`; glog [K, B, classes] (the logits' gradient).
struct FcHead {
  int64_t NL;
  float* w[4];
  float* bias[4];
  float* out[4];
  float* gin[4];
  int64_t dims[8];
  int64_t blocks[4];
  float* glog;
  double neg_lr;
  void* vexp;
  void* vlog;
};

// Every check first (nothing is written if one fails): -1 a shape the kernels refuse, -2 a target out of range.
int fc_head_check(const FcHead& h, const int64_t* target, int64_t K, int64_t B) {
  constexpr int L = V<float>::L;
  if (h.NL < 1 || h.NL > 4) return -1;
  const int64_t D = h.dims[2 * h.NL - 1];
  if (D > L || D < 1 || (B + L - 1) / L > 8) return -1;
  for (int64_t l = 0; l < h.NL; ++l)
    if (h.blocks[l] < 1 || (l && h.dims[2 * l] != h.dims[2 * l - 1])) return -1;
  for (int64_t r = 0; r < K * B; ++r)
    if (target[r] < 0 || target[r] >= D) return -2;
  return 0;
}

// Where a step's time goes (`LeNetStep::prof`, for benchmarks/step_profile.py): seconds per part, added up.
enum Part { CONV1_FWD, CONV2_FWD, FC_FWD, LOSS, FC_BWD, CONV2_BWD, CONV1_BWD, CONV_STEPS, PARTS };

struct Laps {
  double* acc;   // [PARTS], or null: nothing timed
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void lap(Part part) {
    if (acc == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    acc[part] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

// Client k's forward, loss and backward with steps; x0 [K, B, in] the first layer's input, ce [K·B] each row's loss.
void fc_head_client(const FcHead& h, const float* x0, const int64_t* target, const float* dloss, float* ce, int64_t k,
                    int64_t B, Laps& laps) {
  const int64_t NL = h.NL, D = h.dims[2 * NL - 1];
  const auto vexp = reinterpret_cast<vfun<float>>(h.vexp), vlog = reinterpret_cast<vfun<float>>(h.vlog);
  for (int64_t l = 0; l < NL; ++l) {
    const int64_t fin = h.dims[2 * l], fout = h.dims[2 * l + 1];
    const float* x = l ? h.out[l - 1] + k * B * fin : x0 + k * B * fin;
    fc_fwd<float>(x, h.w[l] + k * fin * fout, h.bias[l] + k * fout, h.out[l] + k * B * fout, 1, B, fin, fout,
                  l + 1 < NL);
  }
  laps.lap(FC_FWD);
  float* g = h.glog + k * B * D;
  log_softmax_nll<float>(h.out[NL - 1] + k * B * D, target + k * B, dloss + k * B, ce + k * B, g, B, D, vexp,
                         vlog);
  laps.lap(LOSS);
  for (int64_t l = NL - 1; l >= 0; --l) {
    const int64_t fin = h.dims[2 * l], fout = h.dims[2 * l + 1];
    const float* x = l ? h.out[l - 1] + k * B * fin : x0 + k * B * fin;
    float* gx = h.gin[l] + k * B * fin;
    fc_bwd_sgd<float>(x, g, h.w[l] + k * fin * fout, h.bias[l] + k * fout, l ? x : nullptr, gx, 1, B, fin, fout,
                      static_cast<float>(h.neg_lr), h.blocks[l]);
    g = gx;
  }
  laps.lap(FC_BWD);
}

// The whole step's operands (the LeNets: two fused layers, then the fully connected ones), all client-major as the
// step by hand's calls take them: xs the split images; w1 [K, O1, Cin, R, S], b1 [K, O1]; y1 [K, B, Hp, Wp, O1],
// arg1 and gh [K, B, O1, Hp, Wp] (padded); w2 [K, O2, O1, 5, 5], b2 [K, O2]; y2 [K, B, O2·Hp2·Wp2] (the head's input),
// arg2 [K, B, Hp2, Wp2, O2]; gw1, gb1, gw2, gb2 the conv layers' gradients (the parameters' shapes); the head's
// gin[0] is y2's gradient. lanes: the first layer's forward with a client's samples in the lanes (`forward_lanes`),
// else the column form. conv_steps: each conv parameter's plain SGD step too, right after its client's backward
// (`sgd_row`, p.add_(g, alpha=-lr)'s bits where `sgd_update_exact`), else the caller's. prof: null, or [PARTS]
// seconds to add each part's time to (`Part`).
struct LeNetStep {
  const float* xs;
  float* w1;
  float* b1;
  float* y1;
  uint8_t* arg1;
  float* gh;
  float* gw1;
  float* gb1;
  float* w2;
  float* b2;
  float* y2;
  uint8_t* arg2;
  float* gw2;
  float* gb2;
  int64_t B, H, W, Cin, O1, R, S, O2, lanes, conv_steps;
  double* prof;
  FcHead fc;
};

// The first layer's and the second layer's shapes of one client's step.
inline Shape lenet_shape1(const LeNetStep& a) {
  Shape s = make_shape<float>(a.B, a.H, a.W, 1, a.Cin, a.O1, a.R, a.S);
  s.cm = true;
  return s;
}

inline Inner lenet_shape2(const LeNetStep& a) {
  const Shape s1 = lenet_shape1(a);
  Inner s = make_inner<float>(a.B, s1.Hp, s1.Wp, 1, a.O2);
  s.cm = true;
  return s;
}

// A step of K clients' checks: -1 a shape the kernels refuse, -2 a target out of range.
int lenet_check(const LeNetStep& a, const int64_t* target, int64_t K) {
  const Inner s2 = lenet_shape2(a);
  if (!inner_fits<float>(a.O1, R2, S2, a.O2) || a.O2 < 1 || a.fc.dims[0] != a.O2 * s2.Hp * s2.Wp) return -1;
  return fc_head_check(a.fc, target, K, a.B);
}

// A step of K clients, after `lenet_check`.
void lenet_run(const LeNetStep& a, const int64_t* rows, const int64_t* target, const float* dloss, float* ce,
               int64_t K) {
  typedef float T;
  const Shape s1 = lenet_shape1(a);
  const Inner s2 = lenet_shape2(a);
  const int64_t hw2 = s2.Hp * s2.Wp;
  const int64_t taps1 = a.Cin * a.R * a.S, taps2 = CIN2 * R2 * S2, plane1 = s1.Hp * s1.Wp;
  Laps laps{a.prof};
  for (int64_t k = 0; k < K; ++k) {
    const int64_t* rk = rows + k * a.B;
    T* w1 = a.w1 + k * a.O1 * taps1;
    T* b1 = a.b1 + k * a.O1;
    T* y1 = a.y1 + k * a.B * plane1 * a.O1;
    uint8_t* arg1 = a.arg1 + k * a.B * a.O1 * plane1;
    T* gh = a.gh + k * a.B * a.O1 * plane1;
    T* w2 = a.w2 + k * a.O2 * taps2;
    T* y2 = a.y2 + k * a.B * a.O2 * hw2;
    uint8_t* arg2 = a.arg2 + k * a.B * a.O2 * hw2;
    if (a.lanes) forward_lanes_any<T>(a.xs, rk, w1, b1, y1, arg1, s1);
    else with_block(a.O1, [&](auto ob) { forward<T, decltype(ob)::value>(a.xs, rk, w1, b1, y1, arg1, s1); });
    laps.lap(CONV1_FWD);
    T* b2 = a.b2 + k * a.O2;
    inner_forward_any<T>(y1, w2, b2, y2, arg2, s2);
    laps.lap(CONV2_FWD);
    fc_head_client(a.fc, a.y2, target, dloss, ce, k, a.B, laps);
    T* gw2 = a.gw2 + k * a.O2 * taps2;
    T* gb2 = a.gb2 + k * a.O2;
    inner_backward<T>(y1, w2, a.fc.gin[0] + k * a.B * a.O2 * hw2, arg2, gh, gw2, gb2, s2);
    laps.lap(CONV2_BWD);
    T* gw1 = a.gw1 + k * a.O1 * taps1;
    T* gb1 = a.gb1 + k * a.O1;
    with_block(a.O1, [&](auto ob) { backward<T, decltype(ob)::value>(a.xs, rk, gh, arg1, gw1, gb1, s1); });
    laps.lap(CONV1_BWD);
    if (a.conv_steps) {
      const T neg_lr = static_cast<T>(a.fc.neg_lr);
      sgd_row<T, false, false>(w2, gw2, nullptr, T(0), nullptr, neg_lr, a.O2 * taps2);
      sgd_row<T, false, false>(b2, gb2, nullptr, T(0), nullptr, neg_lr, a.O2);
      sgd_row<T, false, false>(w1, gw1, nullptr, T(0), nullptr, neg_lr, a.O1 * taps1);
      sgd_row<T, false, false>(b1, gb1, nullptr, T(0), nullptr, neg_lr, a.O1);
      laps.lap(CONV_STEPS);
    }
  }
}

}  // namespace

extern "C" {

#define DROPFL_ENTRY(T, suffix)                                                                              \
  int64_t dropfl_split_size_##suffix(int64_t H, int64_t W, int64_t Cin, int64_t S) {                         \
    return split_size(make_shape<T>(0, H, W, 0, Cin, 0, 0, S));                                            \
  }                                                                                                        \
  void dropfl_split_images_##suffix(const T* x, int64_t n, int64_t H, int64_t W, int64_t Cin, int64_t S,    \
                                    T* out) {                                                              \
    const Shape s = make_shape<T>(0, H, W, 0, Cin, 0, 0, S);                                               \
    for (int64_t i = 0; i < n; ++i) split_columns(x + i * Cin * H * W, s, out + i * split_size(s));        \
  }                                                                                                        \
  void dropfl_conv_pool_fwd_##suffix(const T* xs, const int64_t* rows, const T* w, const T* bias, T* y,  \
                                     uint8_t* arg, int64_t B, int64_t H, int64_t W, int64_t K, int64_t Cin, \
                                     int64_t O, int64_t R, int64_t S, int64_t layout) {                    \
    Shape s = make_shape<T>(B, H, W, K, Cin, O, R, S);                                                     \
    s.cm = layout != 0;                                                                                    \
    with_block(O, [&](auto ob) { forward<T, decltype(ob)::value>(xs, rows, w, bias, y, arg, s); });     \
  }                                                                                                        \
  void dropfl_conv_pool_fwd_lanes_##suffix(const T* xs, const int64_t* rows, const T* w, const T* bias, T* y,  \
                                           uint8_t* arg, int64_t B, int64_t H, int64_t W, int64_t K,         \
                                           int64_t Cin, int64_t O, int64_t R, int64_t S) {                  \
    Shape s = make_shape<T>(B, H, W, K, Cin, O, R, S);                                                     \
    s.cm = true;                                                                                           \
    forward_lanes_any<T>(xs, rows, w, bias, y, arg, s);                                                    \
  }                                                                                                        \
  void dropfl_conv_pool_bwd_##suffix(const T* xs, const int64_t* rows, const T* gy, const uint8_t* arg, \
                                     T* gw, T* gb, int64_t B, int64_t H, int64_t W, int64_t K, int64_t Cin, \
                                     int64_t O, int64_t R, int64_t S, int64_t layout) {                    \
    Shape s = make_shape<T>(B, H, W, K, Cin, O, R, S);                                                     \
    s.cm = layout != 0;                                                                                    \
    with_block(O, [&](auto ob) { backward<T, decltype(ob)::value>(xs, rows, gy, arg, gw, gb, s); });    \
  }

// The second layer's entry points take the LeNets' shape only (CIN = 6, 5x5 kernels, O <= 2 logical vectors):
// they return -1 and do nothing for any other, and the caller uses the torch ops.
#define DROPFL_INNER(T, suffix)                                                                              \
  int dropfl_conv2_pool_fwd_##suffix(const T* h, const T* w, const T* bias, T* y, uint8_t* arg, int64_t B,   \
                                     int64_t H, int64_t W, int64_t K, int64_t Cin, int64_t O, int64_t R,     \
                                     int64_t S, int64_t layout) {                                          \
    if (!inner_fits<T>(Cin, R, S, O)) return -1;                                                           \
    Inner s = make_inner<T>(B, H, W, K, O);                                                                \
    s.cm = layout != 0;                                                                                    \
    inner_forward_any<T>(h, w, bias, y, arg, s);                                                           \
    return 0;                                                                                              \
  }                                                                                                        \
  int dropfl_conv2_pool_bwd_##suffix(const T* h, const T* w, const T* gy, const uint8_t* arg, T* gh, T* gw,  \
                                     T* gb, int64_t B, int64_t H, int64_t W, int64_t K, int64_t Cin,       \
                                     int64_t O, int64_t R, int64_t S, int64_t layout) {                    \
    if (!inner_fits<T>(Cin, R, S, O)) return -1;                                                           \
    Inner s = make_inner<T>(B, H, W, K, O);                                                                \
    s.cm = layout != 0;                                                                                    \
    inner_backward<T>(h, w, gy, arg, gh, gw, gb, s);                                                       \
    return 0;                                                                                              \
  }

#define DROPFL_UPDATE(T, suffix)                                                                             \
  void dropfl_sgd_update_##suffix(T* p, const T* g, const T* a, int64_t a_stride, const T* mu, const T* c,   \
                                  const uint8_t* terms, double neg_lr, int64_t K, int64_t n) {             \
    sgd_update_any<T>(p, g, a, a_stride, mu, c, terms, static_cast<T>(neg_lr), K, n);                     \
  }


#define DROPFL_FC(T, suffix)                                                                                 \
  int dropfl_fc_sgd_##suffix(const T* x, const T* g, T* w, int64_t K, int64_t B, int64_t Fin, int64_t Fout,    \
                             double neg_lr) {                                                              \
    return fc_sgd<T>(x, g, w, K, B, Fin, Fout, static_cast<T>(neg_lr));                                    \
  }                                                                                                        \
  void dropfl_fc_fwd_##suffix(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t B, int64_t Fin,   \
                              int64_t Fout, int64_t relu) {                                                \
    fc_fwd<T>(x, w, bias, y, K, B, Fin, Fout, relu != 0);                                                  \
  }                                                                                                        \
  int dropfl_fc_bwd_sgd_##suffix(const T* x, const T* g, T* w, T* bias, const T* r, T* gx, int64_t K,         \
                                 int64_t B, int64_t Fin, int64_t Fout, double neg_lr, int64_t sum_block) { \
    return fc_bwd_sgd<T>(x, g, w, bias, r, gx, K, B, Fin, Fout, static_cast<T>(neg_lr), sum_block);        \
  }

// float32 only (the engine's float64 runs keep the torch ops); exp and log: ATen's SLEEF functions for this
// variant's vector width. -1: rows longer than a vector; -2: a target out of range (nothing written past it).
int dropfl_log_softmax_nll_f32(const float* x, const int64_t* target, const float* dloss, float* ce, float* gi,
                               int64_t R, int64_t D, void* vexp, void* vlog) {
  return log_softmax_nll<float>(x, target, dloss, ce, gi, R, D, reinterpret_cast<vfun<float>>(vexp),
                                reinterpret_cast<vfun<float>>(vlog));
}

// float32 only, as the loss. `fc_head`: the fully connected layers' part of `lenet_run` for K clients, x0 [K, B, in].
int dropfl_fc_head_f32(const FcHead* h, const float* x0, const int64_t* target, const float* dloss, float* ce,
                       int64_t K, int64_t B) {
  if (const int status = fc_head_check(*h, target, K, B)) return status;
  Laps laps{nullptr};
  for (int64_t k = 0; k < K; ++k) fc_head_client(*h, x0, target, dloss, ce, k, B, laps);
  return 0;
}

int dropfl_lenet_step_f32(const LeNetStep* a, const int64_t* rows, const int64_t* target, const float* dloss,
                          float* ce, int64_t K) {
  if (const int status = lenet_check(*a, target, K)) return status;
  lenet_run(*a, rows, target, dloss, ce, K);
  return 0;
}

// S steps in one call, conv_steps on: rows, target [S, KA, B] int64, dloss, ce [S, KA, B]; step j trains the first
// ks[j] (<= KA) clients on row j of each table. Every step's checks first (nothing written if one fails).
int dropfl_lenet_steps_f32(const LeNetStep* a, const int64_t* rows, const int64_t* target, const float* dloss,
                           float* ce, const int64_t* ks, int64_t S, int64_t KA) {
  if (!a->conv_steps) return -1;
  const int64_t n = KA * a->B;
  for (int64_t j = 0; j < S; ++j) {
    if (ks[j] < 0 || ks[j] > KA) return -1;
    if (const int status = lenet_check(*a, target + j * n, ks[j])) return status;
  }
  for (int64_t j = 0; j < S; ++j) lenet_run(*a, rows + j * n, target + j * n, dloss + j * n, ce + j * n, ks[j]);
  return 0;
}

DROPFL_ENTRY(float, f32)
DROPFL_ENTRY(double, f64)
DROPFL_FC(float, f32)
DROPFL_FC(double, f64)
DROPFL_INNER(float, f32)
DROPFL_INNER(double, f64)
DROPFL_UPDATE(float, f32)
DROPFL_UPDATE(double, f64)

}  // extern "C"

// ---- BatchNorm on channels-last activations (training) ------------------------------------------------
// Per-client mode's channels-last copy of a BatchNorm model (coordinator/sim/channels_last.py). x, y, g, dx are
// [M, C] rows: a channels-last [N, C, H, W] batch is M = N*H*W rows of C channels. Torch's own channels-last
// kernel sums each channel's M values one after the other in float32 (far less precise than its NCHW kernel's
// cascade); here every sum is in double, so the statistics and gradients are as close to float64 as the NCHW
// kernel's. Where C divides 64, the rows are read as chunks of 64 values (64 / C rows) with one double
// accumulator per lane, folded per channel at the end in a fixed order: the loops vectorise whatever C is, and
// the bits do not depend on anything but the data. Otherwise row by row (C lanes). Each loop over chunks has a copy
// written at the constant width BN_LANES, which the compiler vectorises better (the same bits; at ResNet-8's shapes
// forward up to 1.35x, backward 1.16-1.59x: benchmarks/bn_kernels.py, results/bn_kernels.md).
namespace {

constexpr int64_t BN_LANES = 64;

// out[c] = sum over rows of x (shift == nullptr) or of (x - shift[c])^2, in double
void bn_col_sums(const float* __restrict x, int64_t M, int64_t C, const double* __restrict shift,
                 double* __restrict out) {
  const int64_t W = BN_LANES % C == 0 ? BN_LANES : C, R = W / C, chunks = M / R;
  std::vector<double> acc(W, 0.0), sh(W, 0.0);
  if (shift) for (int64_t j = 0; j < W; ++j) sh[j] = shift[j % C];
  double* __restrict a = acc.data();
  const double* __restrict s = sh.data();
  if (W == BN_LANES) {   // the loop below with a width the compiler knows (see above)
    for (int64_t i = 0; i < chunks; ++i) {
      const float* r = x + i * BN_LANES;
      if (shift) { for (int64_t j = 0; j < BN_LANES; ++j) { const double d = (double)r[j] - s[j]; a[j] += d * d; } }
      else { for (int64_t j = 0; j < BN_LANES; ++j) a[j] += (double)r[j]; }
    }
  } else {
    for (int64_t i = 0; i < chunks; ++i) {
      const float* r = x + i * W;
      if (shift) { for (int64_t j = 0; j < W; ++j) { const double d = (double)r[j] - s[j]; a[j] += d * d; } }
      else { for (int64_t j = 0; j < W; ++j) a[j] += (double)r[j]; }
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    double t = 0.0;
    for (int64_t k = 0; k < R; ++k) t += a[k * C + c];
    for (int64_t m = chunks * R; m < M; ++m) {   // the rows after the last whole chunk
      const double v = (double)x[m * C + c] - (shift ? shift[c] : 0.0);
      t += shift ? v * v : v;
    }
    out[c] = t;
  }
}

// sg[c] = sum of g, sgx[c] = sum of g * (x - mean[c]), in double
void bn_dot_sums(const float* __restrict g, const float* __restrict x, int64_t M, int64_t C,
                 const double* __restrict mean, double* __restrict sg, double* __restrict sgx) {
  const int64_t W = BN_LANES % C == 0 ? BN_LANES : C, R = W / C, chunks = M / R;
  std::vector<double> acc(2 * W, 0.0), mu(W);
  for (int64_t j = 0; j < W; ++j) mu[j] = mean[j % C];
  double* __restrict a = acc.data();
  double* __restrict b = acc.data() + W;
  const double* __restrict u = mu.data();
  if (W == BN_LANES) {   // the loop below with a width the compiler knows
    for (int64_t i = 0; i < chunks; ++i) {
      const float* r = x + i * BN_LANES;
      const float* q = g + i * BN_LANES;
      for (int64_t j = 0; j < BN_LANES; ++j) { const double gv = q[j]; a[j] += gv; b[j] += gv * ((double)r[j] - u[j]); }
    }
  } else {
    for (int64_t i = 0; i < chunks; ++i) {
      const float* r = x + i * W;
      const float* q = g + i * W;
      for (int64_t j = 0; j < W; ++j) { const double gv = q[j]; a[j] += gv; b[j] += gv * ((double)r[j] - u[j]); }
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    double t = 0.0, tx = 0.0;
    for (int64_t k = 0; k < R; ++k) { t += a[k * C + c]; tx += b[k * C + c]; }
    for (int64_t m = chunks * R; m < M; ++m) {
      const double gv = g[m * C + c];
      t += gv;
      tx += gv * ((double)x[m * C + c] - mean[c]);
    }
    sg[c] = t;
    sgx[c] = tx;
  }
}

// out = g * k0 + ((x - k1) * k2 + k3) per channel (g == nullptr: without the first term), in float
void bn_affine(const float* __restrict x, const float* __restrict g, int64_t M, int64_t C, const float* k0,
               const float* k1, const float* k2, const float* k3, float* __restrict out) {
  const int64_t W = BN_LANES % C == 0 ? BN_LANES : C, total = M * C;
  std::vector<float> e(4 * W);
  for (int64_t j = 0; j < W; ++j) {
    e[j] = g ? k0[j % C] : 0.f; e[W + j] = k1[j % C]; e[2 * W + j] = k2[j % C]; e[3 * W + j] = k3[j % C];
  }
  const float* __restrict e0 = e.data();
  const float* __restrict e1 = e0 + W;
  const float* __restrict e2 = e0 + 2 * W;
  const float* __restrict e3 = e0 + 3 * W;
  int64_t i = 0;
  if (W == BN_LANES) {
    for (; i + BN_LANES <= total; i += BN_LANES) {
      const float* r = x + i;
      float* o = out + i;
      if (g) { const float* q = g + i; for (int64_t j = 0; j < BN_LANES; ++j) o[j] = q[j] * e0[j] + ((r[j] - e1[j]) * e2[j] + e3[j]); }
      else { for (int64_t j = 0; j < BN_LANES; ++j) o[j] = (r[j] - e1[j]) * e2[j] + e3[j]; }
    }
  }
  for (; i + W <= total; i += W) {
    const float* r = x + i;
    float* o = out + i;
    if (g) { const float* q = g + i; for (int64_t j = 0; j < W; ++j) o[j] = q[j] * e0[j] + ((r[j] - e1[j]) * e2[j] + e3[j]); }
    else { for (int64_t j = 0; j < W; ++j) o[j] = (r[j] - e1[j]) * e2[j] + e3[j]; }
  }
  for (; i < total; ++i) {   // a last chunk of fewer than W values (whole rows: W is a multiple of C)
    const int64_t j = i % W;
    out[i] = (g ? g[i] * e0[j] : 0.f) + ((x[i] - e1[j]) * e2[j] + e3[j]);
  }
}

}  // namespace

extern "C" {

// Forward: y = (x - mean) * (invstd * w) + b. stats [3, C] double out: mean, var (biased), invstd =
// 1 / sqrt(var + eps). w, b may be null (affine=False). Where running_mean is not null, the running statistics
// are updated as torch's kernel updates them, rounded once from double: r = factor * stat + (1 - factor) * r, the
// variance unbiased (var * M / (M - 1)).
void dropfl_bn_cl_fwd_f32(const float* x, const float* w, const float* b, float* y, double* stats,
                          float* running_mean, float* running_var, int64_t M, int64_t C, double eps,
                          double factor) {
  double* mean = stats;
  double* var = stats + C;
  double* invstd = stats + 2 * C;
  bn_col_sums(x, M, C, nullptr, mean);
  for (int64_t c = 0; c < C; ++c) mean[c] /= (double)M;
  bn_col_sums(x, M, C, mean, var);
  std::vector<float> k1(C), k2(C), k3(C);
  for (int64_t c = 0; c < C; ++c) {
    var[c] /= (double)M;
    invstd[c] = 1.0 / std::sqrt(var[c] + eps);
    k1[c] = (float)mean[c];
    k2[c] = (float)(invstd[c] * (w ? (double)w[c] : 1.0));
    k3[c] = b ? b[c] : 0.f;
    if (running_mean) {
      running_mean[c] = (float)(factor * mean[c] + (1.0 - factor) * (double)running_mean[c]);
      running_var[c] = (float)(factor * var[c] * ((double)M / (double)(M - 1)) + (1.0 - factor) * (double)running_var[c]);
    }
  }
  bn_affine(x, nullptr, M, C, nullptr, k1.data(), k2.data(), k3.data(), y);
}

// Backward, from the forward's stats: sg = sum g, sgx = sum g * (x - mean), in double; db = sg and dw = sgx *
// invstd where not null (float); dx = w * invstd * (g - sg / M - (x - mean) * invstd^2 * sgx / M) where not null.
void dropfl_bn_cl_bwd_f32(const float* g, const float* x, const float* w, const double* stats, float* dx,
                          float* dw, float* db, int64_t M, int64_t C) {
  const double* mean = stats;
  const double* invstd = stats + 2 * C;
  std::vector<double> sg(C), sgx(C);
  bn_dot_sums(g, x, M, C, mean, sg.data(), sgx.data());
  for (int64_t c = 0; c < C; ++c) {
    if (dw) dw[c] = (float)(sgx[c] * invstd[c]);
    if (db) db[c] = (float)sg[c];
  }
  if (!dx) return;
  std::vector<float> k0(C), k1(C), k2(C), k3(C);
  for (int64_t c = 0; c < C; ++c) {
    const double is = invstd[c], a = is * (w ? (double)w[c] : 1.0);
    k0[c] = (float)a;
    k1[c] = (float)mean[c];
    k2[c] = (float)(-a * is * is * sgx[c] / (double)M);
    k3[c] = (float)(-a * sg[c] / (double)M);
  }
  bn_affine(x, g, M, C, k0.data(), k1.data(), k2.data(), k3.data(), dx);
}

}  // extern "C"

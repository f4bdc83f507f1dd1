// Scalar reference twins of the ops in ops.h: sequential loops in the obvious order, no BLAS, no
// threads, templated on the element type so the tests can run them in fp64 against finite
// differences and the model can compose them in double as its oracle (model_ref.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "offload/model/ops.h"
#include "offload/model/qkv_layout.h"

namespace ucp::offload::ops::ref {

template <typename T>
void EncoderForward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t B,
                    int64_t Tn, int64_t C) {
  // out[B,T,C], tokens[B,T], wte[V,C], wpe[maxT,C]
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tn; ++t) {
      T* o = out + (b * Tn + t) * C;
      const T* e = wte + static_cast<int64_t>(tokens[b * Tn + t]) * C;
      for (int64_t c = 0; c < C; ++c) o[c] = e[c] + (wpe ? wpe[t * C + c] : T(0));
    }
  }
}

template <typename T>
void EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B, int64_t Tn,
                     int64_t C) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tn; ++t) {
      const T* d = dout + (b * Tn + t) * C;
      T* dw = dwte + static_cast<int64_t>(tokens[b * Tn + t]) * C;
      for (int64_t c = 0; c < C; ++c) {
        dw[c] += d[c];
        if (dwpe) dwpe[t * C + c] += d[c];
      }
    }
  }
}

template <typename T>
void LayerNormForward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                      int64_t N, int64_t C, T eps) {
  // out[N,C], mean[N], rstd[N], inp[N,C], weight[C], bias[C]
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    T m = 0;
    for (int64_t c = 0; c < C; ++c) m += x[c];
    m = m / C;
    T v = 0;
    for (int64_t c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v = v / C;
    const T s = T(1) / std::sqrt(v + eps);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

template <typename T>
void LayerNormBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                       const T* mean, const T* rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    const T* d = dout + n * C;
    // Two reductions: mean(dnorm) and mean(dnorm * norm), dnorm = dout * weight.
    T dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int64_t c = 0; c < C; ++c) {
      const T norm = (x[c] - mean[n]) * rstd[n];
      const T dnorm = weight[c] * d[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = dnorm_mean / C;
    dnorm_norm_mean = dnorm_norm_mean / C;
    for (int64_t c = 0; c < C; ++c) {
      const T norm = (x[c] - mean[n]) * rstd[n];
      const T dnorm = weight[c] * d[c];
      dbias[c] += d[c];
      dweight[c] += norm * d[c];
      dinp[n * C + c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[n];
    }
  }
}

template <typename T>
void RmsNormForward(T* out, T* rstd, const T* inp, const T* weight, int64_t N, int64_t C, T eps) {
  // out[N,C], rstd[N], inp[N,C], weight[C]
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    T ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[c] * x[c];
    ms = ms / C;
    const T s = T(1) / std::sqrt(ms + eps);
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = x[c] * s * weight[c];
    rstd[n] = s;
  }
}

template <typename T>
void RmsNormBackward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                     const T* rstd, int64_t N, int64_t C) {
  // dx_j = rstd (dnorm_j - norm_j mean(dnorm * norm)), norm = x rstd, dnorm = dout * weight.
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    const T* d = dout + n * C;
    T dnorm_norm_mean = 0;
    for (int64_t c = 0; c < C; ++c) dnorm_norm_mean += weight[c] * d[c] * (x[c] * rstd[n]);
    dnorm_norm_mean = dnorm_norm_mean / C;
    for (int64_t c = 0; c < C; ++c) {
      const T norm = x[c] * rstd[n];
      dweight[c] += norm * d[c];
      dinp[n * C + c] += (weight[c] * d[c] - norm * dnorm_norm_mean) * rstd[n];
    }
  }
}

template <typename T>
void MatmulForward(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int64_t C,
                   int64_t OC) {
  // out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC]
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < OC; ++o) {
      T acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += inp[n * C + c] * weight[o * C + c];
      out[n * OC + o] = acc + (bias ? bias[o] : T(0));
    }
  }
}

template <typename T>
void MatmulBackward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                    int64_t N, int64_t C, int64_t OC) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < OC; ++o) {
      const T d = dout[n * OC + o];
      if (dbias) dbias[o] += d;
      for (int64_t c = 0; c < C; ++c) {
        if (dinp) dinp[n * C + c] += d * weight[o * C + c];
        dweight[o * C + c] += d * inp[n * C + c];
      }
    }
  }
}

template <typename T>
void AttentionForward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t NH, int64_t KV,
                      int64_t hd) {
  // qkv[B,T,(NH+2KV)*hd] -> out[B,T,NH*hd], lse[B,NH,T]
  const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  std::vector<T> p(Tn);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / L.hpg;
      for (int64_t t = 0; t < Tn; ++t) {
        const T* q = qkv + (b * Tn + t) * L.row + L.Q(h);
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j <= t; ++j) {
          const T* k = qkv + (b * Tn + j) * L.row + L.K(g);
          T s = 0;
          for (int64_t i = 0; i < hd; ++i) s += q[i] * k[i];
          p[j] = s * scale;
          m = std::max(m, p[j]);
        }
        T sum = 0;
        for (int64_t j = 0; j <= t; ++j) {
          p[j] = std::exp(p[j] - m);
          sum += p[j];
        }
        const T inv = T(1) / sum;
        T* o = out + (b * Tn + t) * NH * hd + h * hd;
        for (int64_t i = 0; i < hd; ++i) o[i] = 0;
        for (int64_t j = 0; j <= t; ++j) {
          const T* v = qkv + (b * Tn + j) * L.row + L.V(g);
          for (int64_t i = 0; i < hd; ++i) o[i] += (p[j] * inv) * v[i];
        }
        lse[(b * NH + h) * Tn + t] = m + std::log(sum);
      }
    }
  }
}

template <typename T>
void AttentionBackward(T* dqkv, const T* dout, const T* qkv, const T* lse, int64_t B, int64_t Tn,
                       int64_t NH, int64_t KV, int64_t hd) {
  // p_j = exp(s_j - lse), dp_j = dout . v_j, ds_j = p_j (dp_j - sum_j p_j dp_j);
  // dq += scale sum_j ds_j k_j, dk_j += scale ds_j q, dv_j += p_j dout.
  const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  std::vector<T> p(Tn), dp(Tn);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / L.hpg;
      for (int64_t t = 0; t < Tn; ++t) {
        const T* q = qkv + (b * Tn + t) * L.row + L.Q(h);
        const T* d = dout + (b * Tn + t) * NH * hd + h * hd;
        const T l = lse[(b * NH + h) * Tn + t];
        T dsum = 0;
        for (int64_t j = 0; j <= t; ++j) {
          const T* k = qkv + (b * Tn + j) * L.row + L.K(g);
          const T* v = qkv + (b * Tn + j) * L.row + L.V(g);
          T s = 0, dpj = 0;
          for (int64_t i = 0; i < hd; ++i) s += q[i] * k[i];
          for (int64_t i = 0; i < hd; ++i) dpj += d[i] * v[i];
          p[j] = std::exp(s * scale - l);
          dp[j] = dpj;
          dsum += p[j] * dpj;
        }
        T* dq = dqkv + (b * Tn + t) * L.row + L.Q(h);
        for (int64_t j = 0; j <= t; ++j) {
          const T ds = p[j] * (dp[j] - dsum) * scale;
          const T* k = qkv + (b * Tn + j) * L.row + L.K(g);
          T* dk = dqkv + (b * Tn + j) * L.row + L.K(g);
          T* dv = dqkv + (b * Tn + j) * L.row + L.V(g);
          for (int64_t i = 0; i < hd; ++i) {
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
            dv[i] += p[j] * d[i];
          }
        }
      }
    }
  }
}

template <typename T>
void RopeTables(T* cos_table, T* sin_table, int64_t Tn, int64_t hd, double theta) {
  // cos/sin[T, hd/2]; inv_freq_i = theta^(-2i/hd), angle = p * inv_freq_i, all in double.
  const int64_t half = hd / 2;
  for (int64_t p = 0; p < Tn; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / hd);
      const double angle = static_cast<double>(p) * inv_freq;
      cos_table[p * half + i] = static_cast<T>(std::cos(angle));
      sin_table[p * half + i] = static_cast<T>(std::sin(angle));
    }
  }
}

namespace {
// Rotates every q and k head of qkv[B,T,row] by +angle (sign = 1) or -angle (sign = -1).
template <typename T>
void Rotate(T* qkv, const T* cos_table, const T* sin_table, int64_t B, int64_t Tn, int64_t NH,
            int64_t KV, int64_t hd, T sign) {
  const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
  const int64_t half = hd / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tn; ++t) {
      for (int64_t g = 0; g < KV; ++g) {
        // The group's q heads and its k head are the first hpg + 1 heads of the group.
        for (int64_t h = 0; h < L.hpg + 1; ++h) {
          T* x = qkv + (b * Tn + t) * L.row + g * (L.hpg + 2) * hd + h * hd;
          for (int64_t i = 0; i < half; ++i) {
            const T c = cos_table[t * half + i], s = sign * sin_table[t * half + i];
            const T x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
          }
        }
      }
    }
  }
}
}  // namespace

template <typename T>
void RopeForward(T* qkv, const T* cos_table, const T* sin_table, int64_t B, int64_t Tn, int64_t NH,
                 int64_t KV, int64_t hd) {
  Rotate(qkv, cos_table, sin_table, B, Tn, NH, KV, hd, T(1));
}

template <typename T>
void RopeBackward(T* dqkv, const T* cos_table, const T* sin_table, int64_t B, int64_t Tn,
                  int64_t NH, int64_t KV, int64_t hd) {
  Rotate(dqkv, cos_table, sin_table, B, Tn, NH, KV, hd, T(-1));
}

template <typename T>
void GeluForward(T* out, const T* inp, int64_t n) {
  const T k = std::sqrt(T(2) / T(M_PI));
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + std::tanh(k * (x + T(0.044715) * x * x * x)));
  }
}

template <typename T>
void GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n) {
  const T k = std::sqrt(T(2) / T(M_PI));
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T th = std::tanh(k * (x + T(0.044715) * x * x * x));
    // d/dx tanh(u) = (1 - tanh^2) u'; written with tanh, not cosh, so large |x| cannot overflow.
    const T grad = T(0.5) * (T(1) + th) +
                   T(0.5) * x * (T(1) - th * th) * k * (T(1) + T(3) * T(0.044715) * x * x);
    dinp[i] += grad * dout[i];
  }
}

template <typename T>
void SwigluForward(T* out, const T* inp, int64_t N, int64_t F) {
  // inp[N,2F] = [gate | up], out[N,F]
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const T g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f];
      out[n * F + f] = g / (T(1) + std::exp(-g)) * u;
    }
  }
}

template <typename T>
void SwigluBackward(T* dinp, const T* inp, const T* dout, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) {
      const T g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f];
      const T sig = T(1) / (T(1) + std::exp(-g));
      const T d = dout[n * F + f];
      dinp[n * 2 * F + f] += d * u * sig * (T(1) + g * (T(1) - sig));
      dinp[n * 2 * F + F + f] += d * g * sig;
    }
  }
}

template <typename T>
void ResidualForward(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void ResidualBackward(T* da, T* db, const T* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

template <typename T>
double ClassifierForwardBackward(T* dx, T* dw, T* logits, const T* x, const T* w,
                                 const int32_t* targets, int64_t N, int64_t C, int64_t V,
                                 T grad_scale) {
  // logits[N,V] = x[N,C] @ w[:V,C]^T; loss_n = log(sum_v exp(l_v - m)) + m - l_target.
  MatmulForward<T>(logits, x, w, nullptr, N, C, V);
  double loss = 0;
  for (int64_t n = 0; n < N; ++n) {
    T* l = logits + n * V;
    const int32_t target = targets[n];
    if (target < 0) {
      for (int64_t v = 0; v < V; ++v) l[v] = 0;
      continue;
    }
    T m = l[0];
    for (int64_t v = 1; v < V; ++v) m = std::max(m, l[v]);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += static_cast<double>(std::exp(l[v] - m));
    loss += std::log(sum) + static_cast<double>(m) - static_cast<double>(l[target]);
    // dlogits = grad_scale * (softmax - onehot), in place.
    for (int64_t v = 0; v < V; ++v) {
      const T prob = static_cast<T>(static_cast<double>(std::exp(l[v] - m)) / sum);
      l[v] = grad_scale * (prob - (v == target ? T(1) : T(0)));
    }
  }
  if (dx != nullptr) MatmulBackward<T>(dx, dw, nullptr, logits, x, w, N, C, V);
  return loss;
}

#define UCP_OPS_REF_INSTANTIATE(T)                                                                 \
  template void EncoderForward<T>(T*, const int32_t*, const T*, const T*, int64_t, int64_t,        \
                                  int64_t);                                                        \
  template void EncoderBackward<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t, int64_t);   \
  template void LayerNormForward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t,    \
                                    T);                                                            \
  template void LayerNormBackward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, \
                                     int64_t, int64_t);                                            \
  template void RmsNormForward<T>(T*, T*, const T*, const T*, int64_t, int64_t, T);                \
  template void RmsNormBackward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t,        \
                                   int64_t);                                                       \
  template void MatmulForward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t);     \
  template void MatmulBackward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t,      \
                                  int64_t);                                                        \
  template void AttentionForward<T>(T*, T*, const T*, int64_t, int64_t, int64_t, int64_t,          \
                                    int64_t);                                                      \
  template void AttentionBackward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t,  \
                                     int64_t, int64_t);                                            \
  template void RopeTables<T>(T*, T*, int64_t, int64_t, double);                                   \
  template void RopeForward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t,         \
                               int64_t);                                                           \
  template void RopeBackward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t,        \
                                int64_t);                                                          \
  template void GeluForward<T>(T*, const T*, int64_t);                                             \
  template void GeluBackward<T>(T*, const T*, const T*, int64_t);                                  \
  template void SwigluForward<T>(T*, const T*, int64_t, int64_t);                                  \
  template void SwigluBackward<T>(T*, const T*, const T*, int64_t, int64_t);                       \
  template void ResidualForward<T>(T*, const T*, const T*, int64_t);                               \
  template void ResidualBackward<T>(T*, T*, const T*, int64_t);                                    \
  template double ClassifierForwardBackward<T>(T*, T*, T*, const T*, const T*, const int32_t*,     \
                                               int64_t, int64_t, int64_t, T);

UCP_OPS_REF_INSTANTIATE(float)
UCP_OPS_REF_INSTANTIATE(double)
#undef UCP_OPS_REF_INSTANTIATE

}  // namespace ucp::offload::ops::ref

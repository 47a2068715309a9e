// Rotary position embedding. NORMAL mode rotates adjacent pairs (2i, 2i+1) of each head,
// NEOX mode rotates (i, i + n_dims/2); dims past n_dims pass through.
// theta_i = pos * freq_scale * freq_base^(-2i / n_dims) / freq_factors[i] (factors optional); YaRN
// (ext_factor != 0) mixes the unscaled angle back in along a ramp over the pairs [corr_low, corr_high]
// and scales cos / sin by attn_factor * (1 + 0.1 ln(1 / freq_scale)); without it they are scaled by
// attn_factor.
//
// The cos / sin of a position are computed once per thread and kept (every layer's q and k rope
// of a decode asks for the same positions): the table holds exactly the values the formula gives.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/kernels/common.h"

namespace pyfast {

namespace {

// Everything an angle table depends on besides the position.
struct RopeKey {
  float base = 0, fscale = 0, ext = 0, attn = 1, lo = 0, hi = 0;
  int n_dims = 0;
  std::vector<float> ff;  // freq factors (empty: none)

  bool operator==(const RopeKey& o) const {
    return base == o.base && fscale == o.fscale && ext == o.ext && attn == o.attn && lo == o.lo && hi == o.hi &&
           n_dims == o.n_dims && ff == o.ff;
  }
};

struct RopeTable {
  RopeKey key;
  std::vector<float> cs, sn;  // [pos][n_dims / 2]
  std::vector<uint8_t> have;  // [pos]
};

constexpr int64_t kMaxCachedPos = 1 << 16;  // positions past this are computed each time

// YaRN's ramp: 1 below pair lo, 0 above pair hi, linear between.
double yarn_ramp(double lo, double hi, int i) {
  const double y = (i - lo) / std::max(0.001, hi - lo);
  return 1.0 - std::min(1.0, std::max(0.0, y));
}

void rope_angles(float pv, const RopeKey& k, float* cs, float* sn) {
  const int half = k.n_dims / 2;
  double mscale = k.attn;
  if (k.ext != 0.0f) mscale *= 1.0 + 0.1 * std::log(1.0 / k.fscale);
  for (int i = 0; i < half; ++i) {
    const double inv = std::pow((double)k.base, -2.0 * i / k.n_dims) / (k.ff.empty() ? 1.0 : (double)k.ff[i]);
    double theta = (double)pv * k.fscale * inv;
    if (k.ext != 0.0f) {
      const double mix = yarn_ramp(k.lo, k.hi, i) * k.ext;
      theta = theta * (1.0 - mix) + (double)pv * inv * mix;
    }
    cs[i] = (float)(std::cos(theta) * mscale);
    sn[i] = (float)(std::sin(theta) * mscale);
  }
}

// This thread's table for a key (made on first use; the 8 most recent are kept).
RopeTable& table_for(const RopeKey& key) {
  thread_local std::vector<RopeTable> tables;
  for (auto& e : tables)
    if (e.key == key) return e;
  if (tables.size() >= 8) tables.erase(tables.begin());
  tables.emplace_back();
  tables.back().key = key;
  return tables.back();
}

// cos / sin of position pos (the table's when it is cached, else computed into the scratch).
void angles(int32_t pos, RopeTable& t, const float*& cs, const float*& sn, float* scs, float* ssn) {
  const int half = t.key.n_dims / 2;
  if (pos < 0 || pos >= kMaxCachedPos) {
    rope_angles((float)pos, t.key, scs, ssn);
    cs = scs;
    sn = ssn;
    return;
  }
  if ((int64_t)t.have.size() <= pos) {
    const size_t n = (size_t)pos + 1 > 2 * t.have.size() ? (size_t)pos + 1 : 2 * t.have.size();
    t.have.resize(n, 0);
    t.cs.resize(n * half);
    t.sn.resize(n * half);
  }
  float* c = t.cs.data() + (size_t)pos * half;
  float* s = t.sn.data() + (size_t)pos * half;
  if (!t.have[pos]) {
    rope_angles((float)pos, t.key, c, s);
    t.have[pos] = 1;
  }
  cs = c;
  sn = s;
}

}  // namespace

void cpu_rope(const ComputeParams& p, Node& dst, const Node* const* src) {
  const Node* x = src[0];
  const Node* pos = src[1];
  const Shape& sx = x->shape;
  const int64_t T = sx.dims[0], H = sx.dims[1], D = sx.dims[2];
  const int n_dims = dst.params.i[0];
  const int mode = dst.params.i[1];
  const int half = n_dims / 2;
  const int64_t es = sx.strides[2] / 4;
  int64_t t0, t1;
  split_range(T, p.ith, p.nth, t0, t1);
  if (t0 >= t1) return;
  thread_local RopeKey key;
  key.base = dst.params.f[0];
  key.fscale = dst.params.f[1];
  key.ext = dst.params.f[2];
  key.attn = dst.params.f[3];
  key.lo = dst.params.f[4];
  key.hi = dst.params.f[5];
  key.n_dims = n_dims;
  key.ff.clear();
  if (dst.n_src > 2) {
    const Node* f = src[2];
    for (int i = 0; i < half; ++i) key.ff.push_back(*reinterpret_cast<const float*>(f->data + i * f->shape.strides[0]));
  }
  RopeTable& table = table_for(key);
  float scs[512], ssn[512];  // n_dims/2 <= 512 (head dims above 1024 are not supported)
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t pv = *reinterpret_cast<const int32_t*>(pos->data + t * pos->shape.strides[0]);
    const float *cs, *sn;
    angles(pv, table, cs, sn, scs, ssn);
    for (int64_t h = 0; h < H; ++h) {
      const float* in = reinterpret_cast<const float*>(x->data + t * sx.strides[0] + h * sx.strides[1]);
      float* out = reinterpret_cast<float*>(dst.data) + (t * H + h) * D;
      if (mode == ROPE_NEOX) {
        for (int i = 0; i < half; ++i) {
          const float a = in[i * es], b = in[(i + half) * es];
          out[i] = a * cs[i] - b * sn[i];
          out[i + half] = a * sn[i] + b * cs[i];
        }
      } else {
        for (int i = 0; i < half; ++i) {
          const float a = in[2 * i * es], b = in[(2 * i + 1) * es];
          out[2 * i] = a * cs[i] - b * sn[i];
          out[2 * i + 1] = a * sn[i] + b * cs[i];
        }
      }
      for (int64_t i = n_dims; i < D; ++i) out[i] = in[i * es];
    }
  }
}

}  // namespace pyfast

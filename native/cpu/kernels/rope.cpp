// Rotary position embedding. NORMAL mode rotates adjacent pairs (2i, 2i+1) of each head,
// NEOX mode rotates (i, i + n_dims/2); dims past n_dims pass through.
// theta_i = pos * freq_scale * freq_base^(-2i / n_dims).
//
// The cos / sin of a position are computed once per thread and kept (every layer's q and k rope
// of a decode asks for the same positions): the table holds exactly the values the formula gives.
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/kernels/common.h"

namespace pyfast {

namespace {

struct RopeTable {
  float base = 0, fscale = 0;
  int n_dims = 0;
  std::vector<float> cs, sn;  // [pos][n_dims / 2]
  std::vector<uint8_t> have;  // [pos]
};

constexpr int64_t kMaxCachedPos = 1 << 16;  // positions past this are computed each time

void rope_angles(float pv, float base, float fscale, int n_dims, float* cs, float* sn) {
  const int half = n_dims / 2;
  for (int i = 0; i < half; ++i) {
    const double theta = (double)pv * fscale * std::pow((double)base, -2.0 * i / n_dims);
    cs[i] = (float)std::cos(theta);
    sn[i] = (float)std::sin(theta);
  }
}

// cos / sin of position pos (the table's when it is cached, else computed into the scratch).
void angles(int32_t pos, float base, float fscale, int n_dims, const float*& cs, const float*& sn, float* scs,
            float* ssn) {
  thread_local std::vector<RopeTable> tables;
  const int half = n_dims / 2;
  if (pos < 0 || pos >= kMaxCachedPos) {
    rope_angles((float)pos, base, fscale, n_dims, scs, ssn);
    cs = scs;
    sn = ssn;
    return;
  }
  RopeTable* t = nullptr;
  for (auto& e : tables)
    if (e.base == base && e.fscale == fscale && e.n_dims == n_dims) t = &e;
  if (!t) {
    if (tables.size() >= 8) tables.erase(tables.begin());
    tables.emplace_back();
    t = &tables.back();
    t->base = base;
    t->fscale = fscale;
    t->n_dims = n_dims;
  }
  if ((int64_t)t->have.size() <= pos) {
    const size_t n = (size_t)pos + 1 > 2 * t->have.size() ? (size_t)pos + 1 : 2 * t->have.size();
    t->have.resize(n, 0);
    t->cs.resize(n * half);
    t->sn.resize(n * half);
  }
  float* c = t->cs.data() + (size_t)pos * half;
  float* s = t->sn.data() + (size_t)pos * half;
  if (!t->have[pos]) {
    rope_angles((float)pos, base, fscale, n_dims, c, s);
    t->have[pos] = 1;
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
  const float base = dst.params.f[0], fscale = dst.params.f[1];
  const int half = n_dims / 2;
  const int64_t es = sx.strides[2] / 4;
  float scs[512], ssn[512];  // n_dims/2 <= 512 (head dims above 1024 are not supported)
  int64_t t0, t1;
  split_range(T, p.ith, p.nth, t0, t1);
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t pv = *reinterpret_cast<const int32_t*>(pos->data + t * pos->shape.strides[0]);
    const float *cs, *sn;
    angles(pv, base, fscale, n_dims, cs, sn, scs, ssn);
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

#version 450
// Rotary embedding of x[T, H, D] by pos[T]: ip[0] n_dims, ip[1] mode (0 normal: pairs (2i, 2i+1),
// 2 neox: (i, i + n_dims/2)); fp[0] freq_base, fp[1] freq_scale. Dims past n_dims pass through.
// One thread per (token, head, pair or pass-through element).
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  const uint D = uint(ne(1, 0)), H = uint(ne(1, 1)), T = uint(ne(1, 2));
  const uint n_dims = uint(P.ip[0].x);
  const uint half_ = n_dims / 2u;
  const uint per = half_ + (D - n_dims);  // work items per (t, h)
  const uint i = gid_linear() * 256u + gl_LocalInvocationID.x;
  if (i >= T * H * per) return;
  const uint k = i % per, h = (i / per) % H, t = i / (per * H);
  const uint xin = tofs(1) + t * nb(1, 2) + h * nb(1, 1);
  const uint out_ = tofs(0) + 4u * ((t * H + h) * D);
  if (k >= half_) {  // pass-through
    const uint d = n_dims + (k - half_);
    wrf32(0, out_ + 4u * d, rdf32(1, xin + d * nb(1, 0)));
    return;
  }
  const float p = float(int(rd32(2, tofs(2) + t * nb(2, 0))));
  const float theta = p * P.fp[0].y * pow(P.fp[0].x, -2.0 * float(k) / float(n_dims));
  const float cs = cos(theta), sn = sin(theta);
  uint a, b;
  if (P.ip[0].y == 2) { a = k; b = k + half_; }
  else { a = 2u * k; b = 2u * k + 1u; }
  const float x0 = rdf32(1, xin + a * nb(1, 0)), x1 = rdf32(1, xin + b * nb(1, 0));
  wrf32(0, out_ + 4u * a, x0 * cs - x1 * sn);
  wrf32(0, out_ + 4u * b, x0 * sn + x1 * cs);
}

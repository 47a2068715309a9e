// The sampler chain after penalties, for one row of logits: top-k -> min-p -> top-p ->
// temperature -> softmax over the kept tokens -> draw. It is the native twin of
// pyfast/sampling.py's `_candidates` + `_draw` (top-k active case) and follows it step by step in
// float64, so that Python per generated token is one call (tests/unit/test_sampling.py checks the
// two agree on random rows).
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "pyfast/cpu.h"

namespace pyfast {

int64_t cpu_sample_candidates(const float* x, int64_t n, int64_t k, double top_p, double min_p, double temp,
                              int32_t* ids, double* probs) {
  if (!(k > 0 && k < n)) throw std::invalid_argument("sample: top_k must be in [1, n_vocab)");
  if (!(temp > 0.0)) throw std::invalid_argument("sample: temperature must be > 0");
  k = cpu_topk_row(x, n, k, ids);  // best first; ties toward the lower id
  std::vector<double> v((size_t)k);
  for (int64_t i = 0; i < k; ++i) v[(size_t)i] = (double)x[ids[i]];
  const double m = v[0];
  if (!std::isfinite(m)) throw std::invalid_argument("sample: logits have no finite maximum (all -inf, +inf or NaN)");

  // min-p keeps a prefix of the sorted candidates (equal values fall on the same side)
  int64_t kept = k;
  if (min_p > 0.0) {
    const double thr = m + std::log(min_p);
    kept = 0;
    while (kept < k && v[(size_t)kept] >= thr) ++kept;
  }
  // top-p: the smallest prefix whose mass, normalized over all k top-k survivors, reaches top_p
  if (top_p < 1.0) {
    double z = 0.0;
    for (int64_t i = 0; i < k; ++i) z += std::exp(v[(size_t)i] - m);
    double cum = 0.0;
    for (int64_t i = 0; i < kept; ++i) {
      cum += std::exp(v[(size_t)i] - m);
      if (cum / z >= top_p) {
        kept = i + 1;
        break;
      }
    }
  }
  double s = 0.0;
  for (int64_t i = 0; i < kept; ++i) s += (probs[i] = std::exp((v[(size_t)i] - m) / temp));
  for (int64_t i = 0; i < kept; ++i) probs[i] /= s;
  return kept;
}

int64_t cpu_sample_draw(const double* probs, int64_t n, double u) {
  // first index whose running sum exceeds u * total (never a zero-weight entry)
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += probs[i];
  const double t = u * total;
  double c = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    c += probs[i];
    if (c > t) return i;
  }
  return n - 1;
}

}  // namespace pyfast

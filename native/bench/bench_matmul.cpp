// Matmul kernel benchmark: GB/s of weight reading at M = 1 (generation) and GFLOP/s at M = 512
// (prompt processing) for each weight dtype, SmolLM2-135M shapes (plus K = 768 shapes, since the
// K-quants need K % 256 == 0; a shape whose K does not fit a type's block is skipped), 1 and 2
// threads.
//
//   bench_matmul [--isa scalar|avx2|avx512|neon] [--threads 1,2] [--cold] [--cold-mib 512] [--min-time 0.3]
//                [--dtypes Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K,F16,BF16,F32] [--m 1,512]
//                [--no-avxvnni] [--no-dotprod] [--packed] [--shapes KxN,KxN,...]
//
// Calls are timed in batches inside one ThreadPool::run with a barrier after each call (as a
// plan replays ops), so thread wake-up cost is not counted per call.
// "hot": one weight matrix, reused every call (L2/L3 resident when it fits).
// --cold: additionally cycles through enough copies of the weight (>= 512 MiB) that every call
//         streams it from DRAM, like generation over a whole model (every M: small M are
//         speculative-decoding verify batches).
// --cold-mib N: the copies total N MiB instead (implies --cold). A model's decode sits between
//         hot and DRAM: on a 2-core VM with a shared 480 MiB L3, 17-row calls ran within 3-8% of
//         hot at 64 MiB and about as slowly as at 512 MiB at 128 MiB. SmolLM2-135M Q4_1 holds
//         98 MB of weights; at --cold-mib 100 or 115 a 1-row call read 44-49 GB/s at 2 threads,
//         half the time of a DRAM-cold one.
// --shapes: these K->N shapes instead of the built-in ones (e.g. a 1B model's 2048x2048,2048x8192,8192x2048).
// --packed: Q4_0 / Q4_1 / Q8_0 weights in the packed x16 layout the model loader uses (quant.h).
// For several-row decodes use e.g. --m 1,2,4,8,16,17; the us/call of M rows over that of M = 1
// is what a verify batch costs relative to a plain decode step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/quant/quant.h"
#include "pyfast/cpu.h"
#include "pyfast/threadpool.h"

using namespace pyfast;

namespace {

struct Shape2 { int64_t K, N; const char* what; };

size_t row_bytes(DType t, int64_t n) { return dtype_row_size(t, n); }

const char* tname(DType t) { return dtype_name(t); }

bool parse_dtype(const std::string& s, DType& t) {
  const DType all[] = {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q5_0,
                       DType::Q5_1, DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K};
  for (DType d : all)
    if (s == dtype_name(d)) { t = d; return true; }
  return false;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) if (!item.empty()) out.push_back(item);
  return out;
}

struct AlignedBuf {
  uint8_t* p = nullptr;
  explicit AlignedBuf(size_t n) {
    if (posix_memalign((void**)&p, 64, n ? n : 64) != 0) std::abort();
  }
  ~AlignedBuf() { std::free(p); }
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  CpuIsa isa = cpu_best_isa();
  std::vector<int> threads = {1, 2};
  std::vector<int64_t> Ms = {1, 512};
  bool cold = false, packed = false;
  int64_t cold_mib = 512;
  double min_time = 0.3;
  std::vector<Shape2> shapes = {{576, 1536, "576->1536 (ffn up)"}, {1536, 576, "1536->576 (ffn down)"},
                                {576, 49152, "576->49152 (lm_head)"}, {768, 2048, "768->2048"},
                                {768, 49152, "768->49152"}};
  std::vector<std::string> shape_names;
  std::vector<DType> dtypes = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K,
                               DType::Q5_K, DType::Q6_K, DType::F16, DType::BF16, DType::F32};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--isa") {
      const std::string s = v;
      isa = s == "scalar" ? CpuIsa::scalar : s == "avx2" ? CpuIsa::avx2 : s == "avx512" ? CpuIsa::avx512
          : s == "neon" ? CpuIsa::neon : isa;
      ++i;
    } else if (a == "--threads") {
      threads.clear();
      for (auto& t : split(v)) threads.push_back(std::atoi(t.c_str()));
      ++i;
    } else if (a == "--m") {
      Ms.clear();
      for (auto& t : split(v)) Ms.push_back(std::atoll(t.c_str()));
      ++i;
    } else if (a == "--dtypes") {
      dtypes.clear();
      for (auto& t : split(v)) {
        DType d;
        if (parse_dtype(t, d)) dtypes.push_back(d);
      }
      ++i;
    } else if (a == "--cold") {
      cold = true;
    } else if (a == "--cold-mib") {
      cold = true;
      cold_mib = std::atoll(v);
      if (cold_mib < 1) {
        std::fprintf(stderr, "--cold-mib: need a size in MiB >= 1, got %s\n", v);
        return 2;
      }
      ++i;
    } else if (a == "--shapes") {
      shapes.clear();
      shape_names = split(v);
      for (const std::string& t : shape_names) {
        const size_t x = t.find('x');
        const int64_t K = x == std::string::npos ? 0 : std::atoll(t.substr(0, x).c_str());
        const int64_t N = x == std::string::npos ? 0 : std::atoll(t.substr(x + 1).c_str());
        if (K < 1 || N < 1) {
          std::fprintf(stderr, "--shapes: need KxN with K, N >= 1, got '%s'\n", t.c_str());
          return 2;
        }
      }
      for (const std::string& t : shape_names) {
        const size_t x = t.find('x');
        shapes.push_back({std::atoll(t.substr(0, x).c_str()), std::atoll(t.substr(x + 1).c_str()), t.c_str()});
      }
      ++i;
    } else if (a == "--packed") {
      packed = true;
    } else if (a == "--no-avxvnni") {
      mm::avx2_use_vnni(false);  // avx2 path: plain maddubs instead of AVX-VNNI
    } else if (a == "--no-dotprod") {
      mm::neon_use_dotprod(false);  // neon path: vmull_s8 / vpadalq_s16 instead of sdot
    } else if (a == "--min-time") {
      min_time = std::atof(v);
      ++i;
    } else {
      std::fprintf(stderr, "usage: %s [--isa I] [--threads 1,2] [--m 1,512] [--dtypes ...] [--cold] [--cold-mib N] [--min-time s] [--no-avxvnni] [--no-dotprod] [--packed] [--shapes KxN,...]\n", argv[0]);
      return 2;
    }
  }
  set_cpu_isa(isa);  // throws if unavailable
  std::printf("isa=%s%s  (GB/s = weight bytes / time; GFLOP/s = 2*M*N*K / time; best of runs >= %.2fs)\n",
              cpu_isa_name(isa), isa == CpuIsa::avx2 ? (mm::avx2_uses_vnni() ? "+avxvnni" : " (no avxvnni)")
                                 : isa == CpuIsa::neon ? (mm::neon_uses_dotprod() ? "+dotprod" : " (no dotprod)") : "",
              min_time);
  std::printf("%-5s %-22s %5s %3s %6s %10s %9s %9s\n", "dtype", "shape (K->N)", "M", "thr", "mode", "us/call", "GB/s", "GFLOP/s");

  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);

  for (DType wt : dtypes) {
    for (const Shape2& sh : shapes) {
      const int64_t K = sh.K, N = sh.N;
      if (K % dtype_block_size(wt) != 0) continue;
      const size_t wbytes = row_bytes(wt, K) * (size_t)N;
      // weights (one reference copy, replicated for cold runs)
      AlignedBuf w0(wbytes);
      {
        std::vector<float> row((size_t)K);
        for (int64_t n = 0; n < N; ++n) {
          for (float& v : row) v = nd(rng) * 0.05f;
          quantize_row_ref(wt, row.data(), w0.p + row_bytes(wt, K) * (size_t)n, K);
        }
      }
      const bool pk = packed && packable(wt) && N % 16 == 0;
      if (pk) {
        std::vector<uint8_t> tmp(w0.p, w0.p + wbytes);
        pack_x16(wt, tmp.data(), w0.p, N, K);
      }
      int ncopies = 1;
      std::unique_ptr<AlignedBuf> wc;
      if (cold) {
        ncopies = (int)std::max<size_t>(2, ((size_t)cold_mib << 20) / wbytes + 1);
        wc.reset(new AlignedBuf(wbytes * (size_t)ncopies));
        for (int c = 0; c < ncopies; ++c) std::memcpy(wc->p + wbytes * (size_t)c, w0.p, wbytes);
      }
      for (int64_t M : Ms) {
        AlignedBuf xb((size_t)(M * K) * 4), yb((size_t)(M * N) * 4);  // 64-byte aligned, like the arena
        float* x = reinterpret_cast<float*>(xb.p);
        float* y = reinterpret_cast<float*>(yb.p);
        for (int64_t i = 0; i < M * K; ++i) x[i] = nd(rng);
        Node xn, wn, yn;
        xn.dtype = DType::F32;
        xn.shape.ndim = 2;
        xn.shape.dims = {M, K, 0, 0};
        xn.shape.strides = {K * 4, 4, 0, 0};
        xn.data = (uint8_t*)x;
        wn.dtype = wt;
        wn.packed = pk;
        wn.shape.ndim = 2;
        wn.shape.dims = {N, K, 0, 0};
        wn.shape.strides = {(int64_t)row_bytes(wt, K), wt == DType::F32 ? 4 : 2, 0, 0};
        yn.dtype = DType::F32;
        yn.shape.ndim = 2;
        yn.shape.dims = {M, N, 0, 0};
        yn.shape.strides = {N * 4, 4, 0, 0};
        yn.data = (uint8_t*)y;
        for (int nth : threads) {
          ThreadPool pool(nth);
          const Node* src[2] = {&xn, &wn};
          const size_t ws = cpu_matmul_work_size(yn, src, nth);
          AlignedBuf wd(ws + 64);
          for (int mode = 0; mode < (cold ? 2 : 1); ++mode) {
            // One pool.run executes `inner` back-to-back calls separated by barriers, as a plan
            // replays its ops; the per-call time is the run's time / inner.
            auto batch = [&](int inner, int first_copy) {
              pool.run([&](int ith) {
                Node wl = wn;  // per-thread copy: the weight pointer changes per call in cold mode
                const Node* s2[2] = {&xn, &wl};
                ComputeParams p;
                p.ith = ith;
                p.nth = nth;
                p.wdata = wd.p;
                p.wsize = ws;
                p.pool = &pool;
                p.isa = isa;
                for (int r = 0; r < inner; ++r) {
                  wl.data = mode == 1 ? wc->p + wbytes * (size_t)((first_copy + r) % ncopies) : w0.p;
                  cpu_matmul(p, yn, s2);
                  p.barrier();
                }
              });
            };
            const double flops = 2.0 * (double)M * N * K;
            int inner = (int)std::max(1.0, std::min(1000.0, 2e-3 / std::max(flops / 50e9, (double)wbytes / 20e9)));
            batch(1, 0);  // warm up
            double best = 1e30, t_total = 0;
            int reps = 0, copy = 0;
            while (t_total < min_time || reps < 3) {
              const double t0 = now();
              batch(inner, copy);
              const double dt = now() - t0;
              copy = (copy + inner) % ncopies;
              best = std::min(best, dt / inner);
              t_total += dt;
              ++reps;
              if (reps > 100000) break;
            }
            const double gbs = (double)wbytes / best / 1e9;
            const double gflops = 2.0 * (double)M * N * K / best / 1e9;
            std::printf("%-5s %-22s %5lld %3d %6s %10.1f %9.2f %9.1f%s\n", tname(wt), sh.what, (long long)M, nth,
                        mode ? "cold" : "hot", best * 1e6, gbs, gflops, pk ? "  packed" : "");
            std::fflush(stdout);
          }
        }
      }
    }
  }
  return 0;
}

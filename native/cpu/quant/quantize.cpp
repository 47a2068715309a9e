// Whole-tensor quantization for `pyfast quantize`: rows split over plain std::threads (each row
// is quantized on its own, so the bytes do not depend on the thread count).
#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu/quant/quant.h"

namespace pyfast {

void quantize_rows(DType t, const float* src, void* dst, int64_t nrows, int64_t ncols, int n_threads) {
  if (!quant_supported(t)) throw std::invalid_argument(std::string("[quantize] unsupported dtype ") + dtype_name(t));
  if (nrows < 0 || ncols <= 0) throw std::invalid_argument("[quantize] bad shape");
  if (ncols % dtype_block_size(t) != 0)
    throw std::invalid_argument("[quantize] row length " + std::to_string(ncols) + " is not a multiple of " +
                                dtype_name(t) + "'s block size " + std::to_string(dtype_block_size(t)));
  const size_t rb = dtype_row_size(t, ncols);
  uint8_t* out = static_cast<uint8_t*>(dst);
  auto work = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row_fit(t, src + r * ncols, out + (size_t)r * rb, ncols);
  };
  // Enough rows per thread that starting one is worth it (~64K elements).
  const int64_t min_rows = std::max<int64_t>(1, 65536 / ncols);
  int nth = std::max(1, n_threads);
  nth = (int)std::min<int64_t>(nth, (nrows + min_rows - 1) / min_rows);
  if (nth <= 1) {
    work(0, nrows);
    return;
  }
  std::vector<std::thread> th;
  std::vector<std::exception_ptr> err((size_t)nth);
  for (int i = 0; i < nth; ++i) {
    int64_t r0, r1;
    split_range(nrows, i, nth, r0, r1);
    th.emplace_back([&, i, r0, r1] {
      try {
        work(r0, r1);
      } catch (...) {
        err[(size_t)i] = std::current_exception();
      }
    });
  }
  for (auto& x : th) x.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

}  // namespace pyfast

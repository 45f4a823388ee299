// The OpenMP team size of the calling thread, kept as torch set it, and the split of a product's outputs over that
// team, for every kernel of this extension.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace prunewatch {

// torch sizes a thread's OpenMP team lazily, once per thread, from the count last set on *any* thread. The
// once-per-thread flag lives in an inline function, so this library has its own copy: its first parallel_for on a
// thread would size the team again and replace the count the thread was given (a batcher's stepper set to two
// threads fell to one once its requests' threads had been set to one, halving its speed). Done here first, and
// the thread's own count put back (which, as torch.set_num_threads does, also makes it the last count set).
// Inline in a header: one flag per thread for the whole library, whichever of its kernels runs first.
inline void keep_thread_count() {
  thread_local bool kept = false;
  if (kept) return;
  kept = true;
  const int threads = at::get_num_threads();  // libtorch's count for this thread
  at::internal::lazy_init_num_threads();  // this library's copy of the lazy sizing
  if (at::get_num_threads() != threads) at::set_num_threads(threads);
}

// body(c0, c1) over `chunks` output chunks of a product reading `weights` weights: split among at most `threads`
// threads (<= 0: torch's intra-op count) in contiguous ranges, each thread taking whole chunks, or run on the calling
// thread when the weights are too few to pay for waking a second one (a parallel region waits for its slowest thread).
// Every product that splits its outputs over threads (fp32_dense.cpp, int4_dense.cpp, int8_dense.cpp) goes through
// here, so they take the same decision for the same layer.
constexpr int64_t kMinWeightsPerThread = 1 << 16;

template <typename Body>
void over_output_chunks(int64_t chunks, int64_t weights, int64_t threads, const Body& body) {
  const int64_t pool = std::max<int64_t>(1, at::get_num_threads());
  const int64_t num_threads = threads > 0 ? std::min(threads, pool) : pool;
  if (num_threads == 1 || weights < kMinWeightsPerThread * 2) {
    body(0, chunks);
  } else {
    at::parallel_for(0, chunks, (chunks + num_threads - 1) / num_threads, body);
  }
}

}  // namespace prunewatch

// The OpenMP team size of the calling thread, kept as torch set it, for every kernel of this extension.
#pragma once

#include <ATen/Parallel.h>

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

}  // namespace prunewatch

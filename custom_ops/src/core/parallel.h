// Work split on onnxruntime's intra-op thread pool (KernelContext::ParallelFor).
//
// Determinism: every task writes its own disjoint part of the output and computes it in a fixed
// order, so results do not depend on how many threads run the tasks or which thread runs which.
// Reductions across tasks are never done in completion order: the caller reduces afterwards in
// index order. A task's scratch buffers: workspace.h's Scratch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "ort_api.h"

namespace moe_onnx {

// Runs fn(i) for i in [0, n) on the intra-op pool; the first exception a task throws is rethrown.
template <class Fn>
void parallel_for(const Ort::KernelContext& ctx, size_t n, Fn&& fn) {
  if (n == 0) return;
  if (n == 1) {
    fn(size_t{0});
    return;
  }
  struct State {
    Fn* fn;
    std::exception_ptr error;
    std::mutex mutex;
  } state{&fn, nullptr, {}};
  auto trampoline = [](void* data, size_t i) {
    auto* s = static_cast<State*>(data);
    try {
      (*s->fn)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(s->mutex);
      if (!s->error) s->error = std::current_exception();
    }
  };
  ctx.ParallelFor(trampoline, n, 0, &state);
  if (state.error) std::rethrow_exception(state.error);
}

// Runs fn(t) for t in [0, threads) on threads of its own, fn(0) on the caller's, where the intra-op pool
// is not at hand (a kernel's constructor, the test hooks); the first exception a thread throws is
// rethrown once all have ended.
template <class Fn>
void on_own_threads(int64_t threads, Fn&& fn) {
  std::exception_ptr error;
  std::mutex mutex;
  const auto run = [&](int64_t t) {
    try {
      fn(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> others;
  for (int64_t t = 1; t < threads; ++t) others.emplace_back(run, t);
  run(0);
  for (std::thread& other : others) other.join();
  if (error) std::rethrow_exception(error);
}

// Splits [0, n) into about `parts` chunks of at least `min_chunk`; returns the chunk count and size.
inline size_t chunk_count(size_t n, size_t min_chunk, size_t parts, size_t* chunk) {
  if (n == 0) {
    *chunk = 1;
    return 0;
  }
  size_t c = (n + parts - 1) / parts;
  if (c < min_chunk) c = min_chunk;
  *chunk = c;
  return (n + c - 1) / c;
}

// Runs fn(begin, end) over about 64 chunks of [0, n), each at least `min_chunk` long, on the intra-op pool.
template <class Fn>
void parallel_chunks(const Ort::KernelContext& ctx, int64_t n, size_t min_chunk, Fn&& fn) {
  size_t chunk = 1;
  const size_t n_chunks = chunk_count(n > 0 ? static_cast<size_t>(n) : 0, min_chunk, 64, &chunk);
  parallel_for(ctx, n_chunks, [&](size_t c) {
    fn(static_cast<int64_t>(c * chunk), std::min<int64_t>(n, static_cast<int64_t>((c + 1) * chunk)));
  });
}

}  // namespace moe_onnx

// The kernels' worker threads: one team per process (usable_cpus() threads, the calling thread
// among them) that runs a region's body on every thread, with barriers and work-sharing loops.
//
// Why not OpenMP: libgomp keeps a team per calling thread, and MindSpore calls the kernels from
// more than one thread (the main thread and its actor threads), so two teams live on two cores;
// once libgomp's threads outnumber the CPUs it stops spinning and sleeps in the kernel at every
// barrier. A decode step's 30 fused layers at batch 1 took 11-13 ms that way against 5.5-6 ms with
// one team (measured on the 2-core Xeon, the same weights called through ctypes).
//
// Workers spin on the next region for SPIN_US after one ends (a step's layers follow each other
// tens of microseconds apart), then sleep on a futex, so an idle agent costs no CPU.
#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>

#include "usable_cpus.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace team {

constexpr int64_t SPIN_US = 300;
constexpr int SPINS_BEFORE_YIELD = 1 << 12;  // then a waiting thread yields its core at each check
constexpr int LOOP_COUNTERS = 4;             // dynamic loops in flight: one, its successor's reset
constexpr int MAX_THREADS = 256;             // a team's threads at most (one claim word each a loop)

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waits until done() holds: spinning, then yielding the core (a preempted team mate needs it).
template <class Done>
inline void wait_until(Done done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < SPINS_BEFORE_YIELD) relax();
    else sched_yield();
  }
}

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words are plain 32-bit words");

inline void futex_wait(std::atomic<uint32_t> &word, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t> &word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Denormal floats flushed to zero, in and out, while one lives on this thread (the thread's previous
// mode back after). Attention weighs values by probabilities down to exp(-87): their products
// are denormal, and each denormal result costs a microcode assist of ~100 cycles on x86 cores.
// The 30 layers of a 16-row decode step at context 128, over keys whose scores spread widely, took
// 63 ms instead of 28 (the 2-core Xeon). A denormal is below 1.2e-38: nothing beside the sums it joins.
// Elsewhere (Arm cores handle denormals at full speed) it does nothing.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | FTZ_DAZ); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
#else
  FlushDenormals() {}
#endif
  FlushDenormals(const FlushDenormals &) = delete;
  FlushDenormals &operator=(const FlushDenormals &) = delete;

#if defined(__SSE__)
 private:
  static constexpr unsigned FTZ_DAZ = 0x8040;  // MXCSR: flush-to-zero (bit 15), denormals-are-zero (6)
  unsigned saved_;
#endif
};

class Team;

// One thread's view of a running region.
class Region {
 public:
  Region(Team &team, int id) : team_(team), id_(id) {}
  int id() const { return id_; }
  int size() const;
  // Every thread of the team waits here for the others.
  void barrier();
  // body(i) for i in [0, n), a barrier at the end. Each thread owns a contiguous share and takes
  // it in chunks of `chunk` (>= 1) from its front; a thread done with its own takes chunks from the
  // back of the others' (what a preempted team mate has not claimed yet is done for it). A share
  // holds fewer than 2^32 items (its claim counts are 32-bit).
  template <class Body>
  void for_dynamic(int64_t n, int64_t chunk, Body body);
  // body(i) for i in [0, n), split in one contiguous share per thread; a barrier at the end.
  template <class Body>
  void for_static(int64_t n, Body body);

 private:
  Team &team_;
  int id_;
  int loop_ = 0;  // dynamic loops this thread has entered: every thread enters the same ones
};

class Team {
 public:
  // The process's team (made on first use; made again in a forked child, which has no workers).
  static Team &instance() {
    static std::atomic<Team *> current{nullptr};
    static std::mutex making;
    Team *team = current.load(std::memory_order_acquire);
    if (team != nullptr && team->pid_ == getpid()) return *team;
    std::lock_guard<std::mutex> lock(making);
    team = current.load(std::memory_order_acquire);
    if (team == nullptr || team->pid_ != getpid()) {
      team = new Team(usable_cpus());  // never freed: workers outlive static destructors
      current.store(team, std::memory_order_release);
    }
    return *team;
  }

  int size() const { return size_; }

  // body(Region &) on every thread of the team, this one as thread 0; returns when all have
  // finished. Callers on other threads meanwhile wait their turn.
  template <class Body>
  void run(Body &&body) {
    using Callable = std::remove_reference_t<Body>;
    std::lock_guard<std::mutex> lock(running_);
    const FlushDenormals flush;  // this thread's; the workers' is set for good (work())
    for (auto &loop : claimed_)
      for (int id = 0; id < size_; ++id) loop[id].taken.store(0, std::memory_order_relaxed);
    Region region(*this, 0);
    if (size_ == 1) {
      body(region);
      return;
    }
    body_ = const_cast<void *>(static_cast<const void *>(&body));
    invoke_ = [](void *b, Region &r) { (*static_cast<Callable *>(b))(r); };
    finished_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(generation_);
    body(region);
    wait_until([&] { return finished_.load(std::memory_order_acquire) == size_ - 1; });
  }

 private:
  friend class Region;

  explicit Team(int size) : size_(size < MAX_THREADS ? size : MAX_THREADS), pid_(getpid()) {
    for (int id = 1; id < size_; ++id) std::thread([this, id] { work(id); }).detach();
  }

  void work(int id) {
    const FlushDenormals flush;
    uint32_t seen = 0;  // not the current generation: the first region may have begun before this thread
    for (;;) {
      await_region(seen);
      seen = generation_.load(std::memory_order_acquire);
      Region region(*this, id);
      invoke_(body_, region);
      finished_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  // Returns once the generation has moved past `seen`: spinning for SPIN_US, then asleep.
  void await_region(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
    for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
      relax();
      if (spins % 256 != 255 || std::chrono::steady_clock::now() < until) continue;
      // The waker bumps the generation, then looks for sleepers; a sleeper counts itself, then
      // looks at the generation again (and the futex compares it once more): one of them sees the other.
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      while (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(generation_, seen);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void barrier() {
    const uint32_t phase = barrier_phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      barrier_phase_.fetch_add(1, std::memory_order_release);
      return;
    }
    wait_until([&] { return barrier_phase_.load(std::memory_order_acquire) != phase; });
  }

  const int size_;
  const pid_t pid_;
  std::mutex running_;
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> finished_{0};
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> barrier_phase_{0};
  // Per dynamic loop and thread share: items taken from its front (low 32 bits) and back (high 32).
  struct alignas(64) Claimed {
    std::atomic<uint64_t> taken{0};
  };
  Claimed claimed_[LOOP_COUNTERS][MAX_THREADS];
  void *body_ = nullptr;
  void (*invoke_)(void *, Region &) = nullptr;
};

inline int Region::size() const { return team_.size_; }

inline void Region::barrier() {
  if (team_.size_ > 1) team_.barrier();
}

// Takes up to `chunk` items of share [lo, hi) whose claims are `claimed`, from its front or its
// back; false once none is left. One word holds both ends' counts, so the owner (front) and a
// thief (back) never take the same item.
inline bool claim(std::atomic<uint64_t> &claimed, int64_t lo, int64_t hi, int64_t chunk, bool front,
                  int64_t &first, int64_t &last) {
  uint64_t seen = claimed.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t from = lo + static_cast<int64_t>(seen & 0xffffffffu);
    const int64_t to = hi - static_cast<int64_t>(seen >> 32);
    if (from >= to) return false;
    const int64_t take = chunk < to - from ? chunk : to - from;
    first = front ? from : to - take;
    last = first + take;
    const uint64_t next = seen + (front ? static_cast<uint64_t>(take) : static_cast<uint64_t>(take) << 32);
    if (claimed.compare_exchange_weak(seen, next, std::memory_order_relaxed)) return true;
  }
}

template <class Body>
inline void Region::for_dynamic(int64_t n, int64_t chunk, Body body) {
  // Loop k claims from slot k % LOOP_COUNTERS, which loop k - 1's end barrier found at zero; the
  // slot loop k + 1 will use is zeroed here, where no thread can be inside loop k + 1 yet.
  // Contiguous shares: a thread's weights stream from memory as one run (its prefetches ahead land
  // in its own share), not as chunks interleaved with its mate's (tools.model_bench on the 2-core
  // EPYC, decode at context 128: batch 1 9.1 -> 7.7 ms, batch 16 39.1 -> 36.0, batch 32 73.6 -> 63.9).
  const int size = team_.size_;
  auto &claimed = team_.claimed_[loop_ % LOOP_COUNTERS];
  auto &following = team_.claimed_[(loop_ + 1) % LOOP_COUNTERS];
  ++loop_;
  const auto share = [&](int id, int64_t &lo, int64_t &hi) {
    lo = n * id / size;
    hi = n * (id + 1) / size;
  };
  int64_t lo, hi, first, last;
  share(id_, lo, hi);
  while (claim(claimed[id_].taken, lo, hi, chunk, true, first, last))
    for (int64_t i = first; i < last; ++i) body(i);
  for (int step = 1; step < size; ++step) {
    const int victim = (id_ + step) % size;
    share(victim, lo, hi);
    while (claim(claimed[victim].taken, lo, hi, chunk, false, first, last))
      for (int64_t i = first; i < last; ++i) body(i);
  }
  if (id_ == 0)
    for (int id = 0; id < size; ++id) following[id].taken.store(0, std::memory_order_relaxed);
  barrier();
}

template <class Body>
inline void Region::for_static(int64_t n, Body body) {
  const int64_t share = (n + team_.size_ - 1) / team_.size_;
  const int64_t first = id_ * share, last = first + share < n ? first + share : n;
  for (int64_t i = first; i < last; ++i) body(i);
  barrier();
}

}  // namespace team

// The CPUs this process may run on (its affinity), which is what the kernels' thread team is sized by:
// not OMP_NUM_THREADS (importing MindSpore sets it to 1, and spawned agents inherit that).
#pragma once

#include <sched.h>

inline int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

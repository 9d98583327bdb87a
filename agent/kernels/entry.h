// The ops' C entry points, the only symbols a kernels library exports: it is built with hidden
// visibility, so each library (one per kernel target, several in one test process) keeps its own
// statics. Exported, an inline function's static (a thread-local tile buffer, the thread team) is a
// GNU unique symbol shared by every library loaded: an AVX-512 library then took the AVX2 one's
// buffer of half-width vectors and faulted on its aligned stores.
#pragma once

#define KERNEL_ENTRY extern "C" __attribute__((visibility("default")))

// The kernels' C entry points (agent/kernels/*.cc) called by name from another process: the test of
// the Arm builds (tests/unit/agent/test_arm_kernels.py) cross-compiles this file with the kernels'
// sources for AArch64 and runs it under qemu-aarch64, sending the calls the x86 tests make through
// ctypes (tests/support/kernel_calls.py) over stdin and reading the arrays back from stdout.
//
// A call: a line "<function> <arrays>", then per array (the inputs, the output last) a line
// "<ndim> <dim>... <bytes>" and its bytes. The answer: a line "<return code>", then every array's
// bytes after the call (the output, and the caches a fused layer writes in place). EOF ends it.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define ENTRY(name) \
  extern "C" int name(int, void **, int *, int64_t **, const char **, void *, void *);
ENTRY(DecodeAttention)
ENTRY(RmsNorm)
ENTRY(SwiGlu)
ENTRY(Rope)
ENTRY(FusedStack)
ENTRY(FusedStackI8)
ENTRY(MoeFfn)
ENTRY(MoeFfnI8)
ENTRY(SkinnyMatMul)
ENTRY(SkinnyMatMulAdd)
ENTRY(SkinnyMatMulFormat)
ENTRY(SkinnyMatMulFormatI8)
ENTRY(MatrixRows)
#undef ENTRY

using Entry = int (*)(int, void **, int *, int64_t **, const char **, void *, void *);

struct Named {
  const char *name;
  Entry entry;
};

#define NAMED(name) {#name, name}
const Named ENTRIES[] = {
    NAMED(DecodeAttention), NAMED(RmsNorm),    NAMED(SwiGlu),          NAMED(Rope),
    NAMED(FusedStack),      NAMED(FusedStackI8), NAMED(MoeFfn),        NAMED(MoeFfnI8),
    NAMED(SkinnyMatMul),    NAMED(SkinnyMatMulAdd), NAMED(SkinnyMatMulFormat), NAMED(SkinnyMatMulFormatI8),
    NAMED(MatrixRows),
};
#undef NAMED

// An array of the call: its shape and its bytes, 64-byte aligned as numpy's large arrays are.
struct Array {
  std::vector<int64_t> shape;
  size_t bytes = 0;
  void *data = nullptr;
};

[[noreturn]] void fail(const char *what) {
  std::fprintf(stderr, "kernel_cases: %s\n", what);
  std::exit(2);
}

bool read_array(Array &a) {
  int ndim = 0;
  if (std::scanf("%d", &ndim) != 1 || ndim < 0 || ndim > 8) return false;
  a.shape.resize(ndim);
  for (auto &dim : a.shape)
    if (std::scanf("%lld", reinterpret_cast<long long *>(&dim)) != 1) return false;
  unsigned long long bytes = 0;
  if (std::scanf("%llu", &bytes) != 1 || std::getchar() != '\n') return false;
  a.bytes = bytes;
  a.data = std::aligned_alloc(64, (a.bytes + 63) / 64 * 64 + 64);
  return a.data != nullptr && std::fread(a.data, 1, a.bytes, stdin) == a.bytes;
}

int main() {
  char name[64];
  int count = 0;
  while (std::scanf("%63s %d", name, &count) == 2) {
    Entry entry = nullptr;
    for (const Named &named : ENTRIES)
      if (std::strcmp(named.name, name) == 0) entry = named.entry;
    if (entry == nullptr) fail("unknown entry point");
    std::vector<Array> arrays(count);
    for (Array &a : arrays)
      if (!read_array(a)) fail("malformed array");
    std::vector<void *> params;
    std::vector<int> ndims;
    std::vector<int64_t *> shapes;
    for (Array &a : arrays) {
      params.push_back(a.data);
      ndims.push_back(static_cast<int>(a.shape.size()));
      shapes.push_back(a.shape.data());
    }
    const int code = entry(count, params.data(), ndims.data(), shapes.data(), nullptr, nullptr, nullptr);
    std::printf("%d\n", code);
    for (Array &a : arrays) {
      std::fwrite(a.data, 1, a.bytes, stdout);
      std::free(a.data);
    }
    std::fflush(stdout);
  }
  return 0;
}

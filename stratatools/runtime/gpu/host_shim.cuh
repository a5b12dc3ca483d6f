// Makes decoders.cuh compile as host C++17 (tests/test_gpu_kernels_host.py).
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __restrict__
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }

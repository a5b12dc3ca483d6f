// Makes decoders.cuh compile as host C++17 (tests/test_gpu_kernels_host.py).
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __restrict__
#ifndef STRATA_HOST_BITCASTS  // (also in host_kernel_shim.cuh; whichever shim comes first defines them)
#define STRATA_HOST_BITCASTS
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
#endif

// Makes qsa_step.cu compile as host C++17 (tests/test_gpu_qsa_host.py): one thread per block (threadIdx.x = 0,
// blockDim.x = 1), blocks run one after another (the test's driver sets blockIdx/gridDim), shared memory is static.
#define QSA_HOST 1
#include <cmath>
#include <cstring>
struct QsaDim3 { unsigned x, y, z; };
static QsaDim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __syncthreads()
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
static inline int atomicAdd(int* a, int v) { int o = *a; *a += v; return o; }

// Part of stratatools (stratatools/runtime/gpu). Loaded at run time by kernels.py / decode.py and compiled with
// NVRTC (cupy.RawModule); tests/test_gpu_kernels_host.py compiles the decoders as host C++.
// Integer types shared by every CUDA source of the runtime.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

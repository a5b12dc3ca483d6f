// Part of stratatools (stratatools/runtime/gpu): programmatic dependent launch (sm_90, PTX griddepcontrol), shared by
// the kernels of the batch-1 decode step and those of the prefill and the batched step (qmm.cu, prefill.cu,
// gdn_prep.cu, attn_batch.cu), which include it with #include "pdl.cuh" (kernels.py's cuda_unit() puts the text in
// place). launch.py launches these kernels with the launch attribute
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION while a step is captured into a CUDA graph: a kernel may then
// start while the kernel before it on the stream still runs, so each of them begins with PDL_ENTRY():
//   pdl_wait()    griddepcontrol.wait: returns once every grid this one depends on has finished and its writes are
//                 visible (at once for a kernel launched without the attribute). Nothing before it may read what an
//                 earlier kernel writes or write what an earlier kernel reads; only constant inputs (the weights) may
//                 be loaded before it.
//   pdl_trigger() griddepcontrol.launch_dependents: the next kernel on the stream may be scheduled once every block
//                 of this one has passed here (it then waits in its own pdl_wait()).
// Host builds and device code below sm_90: both are no-ops (the kernels run one after another).
#ifndef STRATA_PDL_CUH
#define STRATA_PDL_CUH
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define PDL_ENTRY() \
    do {            \
        pdl_wait(); \
        pdl_trigger(); \
    } while (0)
#endif

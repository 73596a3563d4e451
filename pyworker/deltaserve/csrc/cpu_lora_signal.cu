// Sync-free invocation of the CPU LoRA helpers (CaraServe §4.2): the launching thread never waits.
//
// deltaserve_cpu_lora_send: on `stream`, copy x's rows (device) into pinned, mapped host memory, then
// write `seq` into each helper's SEQ word (mapped host memory). The stream runs its work in order, so
// a helper that sees the new SEQ also sees the copied rows; the host only queued two operations.
//
// deltaserve_cpu_lora_wait: on `stream`, one warp spins until each helper's DONE word (mapped host
// memory) equals `seq`, or `max_cycles` pass (then it sets *failed = 1 and returns: the stream is
// never stuck, and the worker reads `failed` when it finishes the step, recomputing on the normal
// path). Work queued after it (the result's copy in, the add) runs after the helpers' writes.
//
// Words are int64 `stride` apart (one control row per helper: helpers/protocol.py). The words live in
// host memory registered as mapped (cudaHostRegisterMapped); the entry points take their host
// addresses and translate them with cudaHostGetDevicePointer, since a kernel may use the host
// address itself only where cudaDevAttrCanUseHostPointerForRegisteredMem holds (not on every
// virtualised host). `failed_dev` is device memory. Entry points return a cudaError_t.

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__global__ void signal_kernel(volatile int64_t* seq_dev, int n, int stride, int64_t seq) {
    int i = threadIdx.x;
    __threadfence_system();  // the copy before us in the stream is visible to the host first
    if (i < n) seq_dev[static_cast<int64_t>(i) * stride] = seq;
    __threadfence_system();
}

__global__ void wait_kernel(const volatile int64_t* done_dev, int n, int stride, int64_t seq, long long max_cycles,
                            int32_t* failed_dev) {
    int i = threadIdx.x;
    if (i >= n) return;
    long long start = clock64();
    while (done_dev[static_cast<int64_t>(i) * stride] != seq) {
        if (clock64() - start > max_cycles) {
            atomicExch(failed_dev, 1);
            return;
        }
    }
    __threadfence_system();  // the helper's results, written before DONE, are read after us
}

}  // namespace

extern "C" {

int deltaserve_cpu_lora_send(void* dst_host, const void* src_dev, size_t nbytes, int64_t* seq_host, int n, int stride,
                             int64_t seq, cudaStream_t stream) {
    if (n < 1 || n > 1024 || stride < 1) return static_cast<int>(cudaErrorInvalidValue);
    int64_t* seq_dev = nullptr;
    cudaError_t err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&seq_dev), seq_host, 0);
    if (err != cudaSuccess) return static_cast<int>(err);
    err = cudaMemcpyAsync(dst_host, src_dev, nbytes, cudaMemcpyDeviceToHost, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    signal_kernel<<<1, ((n + 31) / 32) * 32, 0, stream>>>(seq_dev, n, stride, seq);
    return static_cast<int>(cudaGetLastError());
}

int deltaserve_cpu_lora_wait(const int64_t* done_host, int n, int stride, int64_t seq, long long max_cycles,
                             int32_t* failed_dev, cudaStream_t stream) {
    if (n < 1 || n > 1024 || stride < 1) return static_cast<int>(cudaErrorInvalidValue);
    int64_t* done_dev = nullptr;
    cudaError_t err =
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&done_dev), const_cast<int64_t*>(done_host), 0);
    if (err != cudaSuccess) return static_cast<int>(err);
    wait_kernel<<<1, ((n + 31) / 32) * 32, 0, stream>>>(done_dev, n, stride, seq, max_cycles, failed_dev);
    return static_cast<int>(cudaGetLastError());
}

const char* deltaserve_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"

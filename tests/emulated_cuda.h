// The CUDA our kernels use, on a CPU (tests/emulated_cuda.py): each thread of a block is a std::thread, the grid's
// blocks run one after the other (so a __shared__ array, made static, is the running block's), __syncthreads is
// a barrier of the block's threads, and the warp collectives (mma.sync m16n8k16 on bf16, the shuffles) trade
// their operands through per-warp slots between barriers of the warp's 32 threads.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

using std::max;
using std::min;

struct Dim {
  int x = 0, y = 0, z = 0;
};
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float f) {  // round to nearest even, as __float2bfloat16
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t rounding = 0x7fff + ((u >> 16) & 1);
    bits = uint16_t((u + rounding) >> 16);
  }
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __device__
#define __forceinline__ inline
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
#define __syncthreads() block_barrier->arrive_and_wait()
inline int lane_id() { return threadIdx.x & 31; }
inline int warp_id() { return threadIdx.x >> 5; }
inline void warp_sync() { warp_barriers[warp_id()]->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_sync(); }

// Shuffles: every lane of the warp takes part (our kernels call them with the full mask).
uint64_t shuffle_slots[32][32];
template <typename U>
U shuffle_from(U v, int source_lane) {
  int w = warp_id(), l = lane_id();
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(U));
  shuffle_slots[w][l] = bits;
  warp_sync();
  uint64_t got = shuffle_slots[w][source_lane & 31];
  warp_sync();
  U r;
  std::memcpy(&r, &got, sizeof(U));
  return r;
}
template <typename U>
U __shfl_xor_sync(unsigned, U v, int o) { return shuffle_from(v, lane_id() ^ o); }
template <typename U>
U __shfl_up_sync(unsigned, U v, int o) { return shuffle_from(v, lane_id() >= o ? lane_id() - o : lane_id()); }
template <typename U>
U __shfl_sync(unsigned, U v, int source) { return shuffle_from(v, source); }

// The lanes of the warp whose v equals this lane's, as a bit mask.
template <typename U>
unsigned __match_any_sync(unsigned, U v) {
  int w = warp_id(), l = lane_id();
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(U));
  shuffle_slots[w][l] = bits;
  warp_sync();
  unsigned mask = 0;
  for (int lane = 0; lane < 32; ++lane) mask |= unsigned(shuffle_slots[w][lane] == bits) << lane;
  warp_sync();
  return mask;
}
inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <typename U, typename V>
U atomicAdd(U* p, V v) {  // CUDA's overloads convert the value to the address's type
  return std::atomic_ref<U>(*p).fetch_add(U(v));
}

unsigned mma_a[32][32][4], mma_b[32][32][2];
inline float half_of(unsigned word, int hi) {
  bf16 h;
  h.bits = uint16_t(hi ? word >> 16 : word & 0xffff);
  return float(h);
}
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0..d3}, {a0..a3}, {b0, b1}, {d0..d3}: D += A (16 x 16)
// B (16 x 8), each lane's registers holding the fragments as the PTX ISA lays them out for 16-bit inputs.
inline void mma_emul(float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2,
                     unsigned a3, unsigned b0, unsigned b1) {
  int w = warp_id(), l = lane_id();
  const unsigned a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
  float* d[4] = {&d0, &d1, &d2, &d3};
  for (int q = 0; q < 4; ++q) mma_a[w][l][q] = a[q];
  for (int q = 0; q < 2; ++q) mma_b[w][l][q] = b[q];
  warp_sync();
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    int g = lane >> 2, t = lane & 3;
    const unsigned* fa = mma_a[w][lane];
    A[g][2 * t] = half_of(fa[0], 0), A[g][2 * t + 1] = half_of(fa[0], 1);
    A[g + 8][2 * t] = half_of(fa[1], 0), A[g + 8][2 * t + 1] = half_of(fa[1], 1);
    A[g][2 * t + 8] = half_of(fa[2], 0), A[g][2 * t + 9] = half_of(fa[2], 1);
    A[g + 8][2 * t + 8] = half_of(fa[3], 0), A[g + 8][2 * t + 9] = half_of(fa[3], 1);
    const unsigned* fb = mma_b[w][lane];
    B[2 * t][g] = half_of(fb[0], 0), B[2 * t + 1][g] = half_of(fb[0], 1);
    B[2 * t + 8][g] = half_of(fb[1], 0), B[2 * t + 9][g] = half_of(fb[1], 1);
  }
  int g = l >> 2, t = l & 3;
  int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int q = 0; q < 4; ++q) {
    float s = 0;
    for (int k = 0; k < 16; ++k) s += A[rows[q]][k] * B[k][cols[q]];
    *d[q] += s;
  }
  warp_sync();
}

// Reads an input file (int32 ndim, int32 shape..., the values) into ndim, shape and a buffer.
inline std::vector<char> read_input(const char* path, int* shape, int* ndim, size_t item) {
  FILE* f = fopen(path, "rb");
  size_t size = 1;
  if (!f || fread(ndim, 4, 1, f) != 1) exit(2);
  for (int d = 0; d < *ndim; ++d) {
    if (fread(&shape[d], 4, 1, f) != 1) exit(2);
    size *= shape[d];
  }
  std::vector<char> data(size * item + 16);
  if (fread(data.data(), item, size, f) != size) exit(2);
  fclose(f);
  return data;
}

// Runs kernel() on grid x blocks of block threads, the blocks one after the other.
template <typename F>
void launch(int gx, int gy, int block, F kernel) {
  std::barrier<> barrier(block);
  block_barrier = &barrier;
  blockDim = {block, 1, 1}, gridDim = {gx, gy, 1};
  for (int w = 0; w < (block + 31) / 32; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
  std::vector<std::thread> threads;
  for (int tid = 0; tid < block; ++tid)
    threads.emplace_back([&, tid] {
      threadIdx.x = tid;
      for (int by = 0; by < gy; ++by)
        for (int bx = 0; bx < gx; ++bx) {
          blockIdx.x = bx, blockIdx.y = by;
          kernel();
          barrier.arrive_and_wait();  // the next block's shared arrays are this one's
        }
    });
  for (auto& t : threads) t.join();
}

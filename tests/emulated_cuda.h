// The CUDA our kernels use, on a CPU (tests/emulated_cuda.py): each thread of a block is a std::thread, the grid's
// blocks run one after the other (so a __shared__ array, made static, is the running block's), __syncthreads is
// a barrier of the block's threads, and the warp collectives (mma.sync m16n8k16 on bf16, __shfl_xor_sync) trade
// their operands through per-warp slots between barriers of the warp's 32 threads. Blocks of 128 threads.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstddef>
#include <thread>
#include <vector>
#include <cstdio>
#include <cstdlib>

struct Dim { int x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    uint32_t rounding = 0x7fff + ((u >> 16) & 1);
    bits = uint16_t((u + rounding) >> 16);
  }
  explicit operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __device__
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

std::barrier<>* block_barrier;
std::barrier<>* warp_barriers[4];
#define __syncthreads() block_barrier->arrive_and_wait()
inline int lane_id() { return threadIdx.x & 31; }
inline int warp_id() { return threadIdx.x >> 5; }

float shfl_slots[4][32];
inline float __shfl_xor_sync(unsigned, float v, int o) {
  int w = warp_id(), l = lane_id();
  shfl_slots[w][l] = v;
  warp_barriers[w]->arrive_and_wait();
  float r = shfl_slots[w][l ^ o];
  warp_barriers[w]->arrive_and_wait();
  return r;
}

unsigned mma_a[4][32][4], mma_b[4][32][2];
inline float half_of(unsigned word, int hi) { bf16 h; h.bits = uint16_t(hi ? word >> 16 : word & 0xffff); return float(h); }
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0..d3}, {a0..a3}, {b0, b1}, {d0..d3}: D += A (16 x 16)
// B (16 x 8), each lane's registers holding the fragments as the PTX ISA lays them out for 16-bit inputs.
inline void mma_emul(float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2,
                     unsigned a3, unsigned b0, unsigned b1) {
  int w = warp_id(), l = lane_id();
  const unsigned a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
  float* d[4] = {&d0, &d1, &d2, &d3};
  for (int q = 0; q < 4; ++q) mma_a[w][l][q] = a[q];
  for (int q = 0; q < 2; ++q) mma_b[w][l][q] = b[q];
  warp_barriers[w]->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    int g = lane >> 2, t = lane & 3;
    const unsigned* fa = mma_a[w][lane];
    A[g][2*t] = half_of(fa[0], 0); A[g][2*t+1] = half_of(fa[0], 1);
    A[g+8][2*t] = half_of(fa[1], 0); A[g+8][2*t+1] = half_of(fa[1], 1);
    A[g][2*t+8] = half_of(fa[2], 0); A[g][2*t+9] = half_of(fa[2], 1);
    A[g+8][2*t+8] = half_of(fa[3], 0); A[g+8][2*t+9] = half_of(fa[3], 1);
    const unsigned* fb = mma_b[w][lane];
    B[2*t][g] = half_of(fb[0], 0); B[2*t+1][g] = half_of(fb[0], 1);
    B[2*t+8][g] = half_of(fb[1], 0); B[2*t+9][g] = half_of(fb[1], 1);
  }
  int g = l >> 2, t = l & 3;
  int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2*t, 2*t+1, 2*t, 2*t+1};
  for (int q = 0; q < 4; ++q) {
    float s = 0;
    for (int k = 0; k < 16; ++k) s += A[rows[q]][k] * B[k][cols[q]];
    *d[q] += s;
  }
  warp_barriers[w]->arrive_and_wait();
}

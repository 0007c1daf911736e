// dos GPU kernels: fused AdamW over flat subgroup buffers, the 16-bit casts,
// and the fused non-finite check + sum of squares for global clipping.
//
// Semantics are adam/'s (package doc there): the same IEEE fp32 operations
// in the same order, each rounded (the __f*_rn intrinsics, which nvcc never
// contracts into FMAs, and the build passes -fmad=false too), so a GPU step
// equals the CPU step bit for bit; only which NaN a NaN result carries may
// differ. Denormals are kept (no fast math). Conversions are written out in
// integer arithmetic where CUDA's intrinsics treat NaN differently from the
// CPU path (adam.F32ToBF16, F32ToF16, F16ToF32).
//
// Compiled to PTX by scripts/build-kernels.sh (nvcc -ptx -arch=compute_80
// -fmad=false); the PTX is committed beside this file, stamped with this
// file's SHA-256, and a test fails when they drift.

#include <cuda_fp16.h>
#include <stdint.h>

#define GRAD_F32 0
#define GRAD_BF16 1
#define GRAD_F16 2
#define OUT_NONE 0
#define OUT_BF16 1
#define OUT_F16 2

// flags
#define F_L2 1        // Adam's L2 weight decay: g += l2 * p
#define F_SMALLW 2    // lerp with weight < 0.5: m + w*(g-m); else g - (g-m)*(1-w)
#define F_AMSGRAD 4
#define F_MAXIMIZE 8
#define F_UNSCALE 16  // g *= unscale
#define F_CLIP 32     // g *= clip

struct Coef {
	float decay, l2, w, omw, beta2, omb2, bc2sqrt, eps, negstep, unscale, clip;
	int flags;
};

__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

__device__ __forceinline__ float f16_to_f32(uint16_t h) {
	uint32_t sign = (uint32_t)(h & 0x8000) << 16;
	uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
	if (exp == 0x1f) return __uint_as_float(man ? (sign | 0x7fc00000u | man << 13) : (sign | 0x7f800000u));
	return __half2float(__ushort_as_half(h)); // exact for finite values
}

__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
	uint32_t b = __float_as_uint(f);
	if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(b >> 16) | 0x40;
	b += 0x7fffu + ((b >> 16) & 1);
	return (uint16_t)(b >> 16);
}

__device__ __forceinline__ uint16_t f32_to_f16(float f) {
	uint32_t b = __float_as_uint(f);
	if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((b >> 16) & 0x8000) | 0x7e00 | ((b & 0x7fffffu) >> 13));
	return __half_as_ushort(__float2half_rn(f));
}

template <int GT> __device__ __forceinline__ float load_grad(const void *g, long long i) {
	if (GT == GRAD_F32) return ((const float *)g)[i];
	uint16_t h = ((const uint16_t *)g)[i];
	return GT == GRAD_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

template <int OT> __device__ __forceinline__ uint16_t to16(float f) {
	return OT == OUT_BF16 ? f32_to_bf16(f) : f32_to_f16(f);
}

// One element: adam.update after loadGrad's scaling. Returns the new p.
__device__ __forceinline__ float upd(float g, float p, float &m, float &v, float *vmax, const Coef &c) {
	if (c.flags & F_UNSCALE) g = __fmul_rn(g, c.unscale);
	if (c.flags & F_CLIP) g = __fmul_rn(g, c.clip);
	if (c.flags & F_MAXIMIZE) g = -g;
	p = __fmul_rn(p, c.decay);
	if (c.flags & F_L2) g = __fadd_rn(g, __fmul_rn(c.l2, p));
	float d = __fsub_rn(g, m);
	if (c.flags & F_SMALLW) m = __fadd_rn(m, __fmul_rn(c.w, d));
	else m = __fsub_rn(g, __fmul_rn(d, c.omw));
	v = __fadd_rn(__fmul_rn(v, c.beta2), __fmul_rn(__fmul_rn(c.omb2, g), g));
	float vd = v;
	if (c.flags & F_AMSGRAD) {
		float x = *vmax;
		if (x > vd || x != x) vd = x; // torch.maximum: NaN propagates
		*vmax = vd;
	}
	float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vd), c.bc2sqrt), c.eps);
	return __fadd_rn(p, __fdiv_rn(__fmul_rn(c.negstep, m), denom));
}

// The fused AdamW step over n elements, grid-stride, 4 elements (16-byte
// loads of p, m, v) per thread and iteration when every pointer allows it.
template <int GT, int OT>
__device__ void adamw_body(float *__restrict__ p, float *__restrict__ m, float *__restrict__ v,
                           float *__restrict__ vmax, const void *__restrict__ g, uint16_t *__restrict__ out,
                           long long n, const Coef &c) {
	long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	long long stride = (long long)gridDim.x * blockDim.x;
	uintptr_t a16 = (uintptr_t)p | (uintptr_t)m | (uintptr_t)v | (vmax ? (uintptr_t)vmax : 0) |
	                (GT == GRAD_F32 ? (uintptr_t)g : 0);
	uintptr_t a8 = (GT != GRAD_F32 ? (uintptr_t)g : 0) | (OT != OUT_NONE ? (uintptr_t)out : 0);
	long long head = 0;
	if ((a16 & 15) == 0 && (a8 & 7) == 0) {
		long long n4 = n / 4;
		head = n4 * 4;
		for (long long j = tid; j < n4; j += stride) {
			float4 P = ((float4 *)p)[j], M = ((float4 *)m)[j], V = ((float4 *)v)[j];
			float G[4];
			if (GT == GRAD_F32) {
				float4 x = ((const float4 *)g)[j];
				G[0] = x.x, G[1] = x.y, G[2] = x.z, G[3] = x.w;
			} else {
				uint2 x = ((const uint2 *)g)[j];
				uint16_t h[4] = {(uint16_t)(x.x & 0xffff), (uint16_t)(x.x >> 16), (uint16_t)(x.y & 0xffff),
				                 (uint16_t)(x.y >> 16)};
				for (int k = 0; k < 4; k++) G[k] = GT == GRAD_BF16 ? bf16_to_f32(h[k]) : f16_to_f32(h[k]);
			}
			float *vm = vmax ? vmax + 4 * j : 0;
			P.x = upd(G[0], P.x, M.x, V.x, vm, c);
			P.y = upd(G[1], P.y, M.y, V.y, vm + 1, c);
			P.z = upd(G[2], P.z, M.z, V.z, vm + 2, c);
			P.w = upd(G[3], P.w, M.w, V.w, vm + 3, c);
			((float4 *)p)[j] = P, ((float4 *)m)[j] = M, ((float4 *)v)[j] = V;
			if (OT != OUT_NONE) {
				uint2 o;
				o.x = (uint32_t)to16<OT>(P.x) | (uint32_t)to16<OT>(P.y) << 16;
				o.y = (uint32_t)to16<OT>(P.z) | (uint32_t)to16<OT>(P.w) << 16;
				((uint2 *)out)[j] = o;
			}
		}
	}
	for (long long i = head + tid; i < n; i += stride) {
		float mi = m[i], vi = v[i];
		float pi = upd(load_grad<GT>(g, i), p[i], mi, vi, vmax ? vmax + i : 0, c);
		p[i] = pi, m[i] = mi, v[i] = vi;
		if (OT != OUT_NONE) out[i] = to16<OT>(pi);
	}
}

#define COEF_PARAMS                                                                                              \
	float decay, float l2, float w, float omw, float beta2, float omb2, float bc2sqrt, float eps, float negstep, \
	    float unscale, float clip, int flags
#define COEF_INIT {decay, l2, w, omw, beta2, omb2, bc2sqrt, eps, negstep, unscale, clip, flags}

#define ADAMW(name, GT, OT)                                                                                   \
	extern "C" __global__ void __launch_bounds__(256)                                                      \
	    name(float *p, float *m, float *v, float *vmax, const void *g, uint16_t *out, long long n, COEF_PARAMS) { \
		Coef c = COEF_INIT;                                                                                   \
		adamw_body<GT, OT>(p, m, v, vmax, g, out, n, c);                                                      \
	}

ADAMW(dos_adamw_f32, GRAD_F32, OUT_NONE)
ADAMW(dos_adamw_f32_bf16, GRAD_F32, OUT_BF16)
ADAMW(dos_adamw_f32_f16, GRAD_F32, OUT_F16)
ADAMW(dos_adamw_bf16, GRAD_BF16, OUT_NONE)
ADAMW(dos_adamw_bf16_bf16, GRAD_BF16, OUT_BF16)
ADAMW(dos_adamw_bf16_f16, GRAD_BF16, OUT_F16)
ADAMW(dos_adamw_f16, GRAD_F16, OUT_NONE)
ADAMW(dos_adamw_f16_bf16, GRAD_F16, OUT_BF16)
ADAMW(dos_adamw_f16_f16, GRAD_F16, OUT_F16)

// The multi-tensor form: one launch over many tensors. tensors[t] describes
// tensor t; block b updates chunk chunks[b].y (of chunk elements) of tensor
// chunks[b].x. Every tensor has the gradient and copy dtypes of the kernel.
struct Tensor {
	float *p, *m, *v, *vmax;
	const void *g;
	uint16_t *out;
	long long n;
};

template <int GT, int OT>
__device__ void adamw_multi_body(const Tensor *__restrict__ tensors, const int2 *__restrict__ chunks, long long chunk,
                                 const Coef &c) {
	int2 tc = chunks[blockIdx.x];
	Tensor t = tensors[tc.x];
	long long lo = (long long)tc.y * chunk;
	long long n = min(chunk, t.n - lo);
	size_t gsz = GT == GRAD_F32 ? 4 : 2;
	for (long long i = threadIdx.x; i < n; i += blockDim.x) {
		long long k = lo + i;
		float mi = t.m[k], vi = t.v[k];
		float pi = upd(load_grad<GT>((const char *)t.g + lo * gsz, i), t.p[k], mi, vi, t.vmax ? t.vmax + k : 0, c);
		t.p[k] = pi, t.m[k] = mi, t.v[k] = vi;
		if (OT != OUT_NONE) t.out[k] = to16<OT>(pi);
	}
}

#define ADAMW_MULTI(name, GT, OT)                                                                 \
	extern "C" __global__ void __launch_bounds__(256)                                              \
	    name(const Tensor *tensors, const int2 *chunks, long long chunk, COEF_PARAMS) {            \
		Coef c = COEF_INIT;                                                                       \
		adamw_multi_body<GT, OT>(tensors, chunks, chunk, c);                                      \
	}

ADAMW_MULTI(dos_adamw_multi_f32, GRAD_F32, OUT_NONE)
ADAMW_MULTI(dos_adamw_multi_f32_bf16, GRAD_F32, OUT_BF16)
ADAMW_MULTI(dos_adamw_multi_f32_f16, GRAD_F32, OUT_F16)
ADAMW_MULTI(dos_adamw_multi_bf16, GRAD_BF16, OUT_NONE)
ADAMW_MULTI(dos_adamw_multi_bf16_bf16, GRAD_BF16, OUT_BF16)
ADAMW_MULTI(dos_adamw_multi_bf16_f16, GRAD_BF16, OUT_F16)
ADAMW_MULTI(dos_adamw_multi_f16, GRAD_F16, OUT_NONE)
ADAMW_MULTI(dos_adamw_multi_f16_bf16, GRAD_F16, OUT_BF16)
ADAMW_MULTI(dos_adamw_multi_f16_f16, GRAD_F16, OUT_F16)

// Casts, grid-stride.
extern "C" __global__ void dos_widen_bf16(float *dst, const uint16_t *src, long long n) {
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
		dst[i] = bf16_to_f32(src[i]);
}
extern "C" __global__ void dos_widen_f16(float *dst, const uint16_t *src, long long n) {
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
		dst[i] = f16_to_f32(src[i]);
}
extern "C" __global__ void dos_round_bf16(uint16_t *dst, const float *src, long long n) {
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
		dst[i] = f32_to_bf16(src[i]);
}
extern "C" __global__ void dos_round_f16(uint16_t *dst, const float *src, long long n) {
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
		dst[i] = f32_to_f16(src[i]);
}

// The fused non-finite check and sum of squares, in the CPU's order
// (adam.Path.GradStats), so that the sum is the same bits on either side:
// block b of chunk elements (adam.MinChunk) covers [b*chunk, (b+1)*chunk);
// within it, element i adds float64(float32(g*unscale))^2 to lane i%16, each
// lane its elements in order; the block's sum is its 16 lanes added in lane
// order, written to partial[b]; the host adds the partials in block order.
// A thread block of 256 threads takes 16 chunk blocks, one group of 16
// threads (the lanes) each. Any Inf or NaN (judged before scaling) sets
// *nonfinite to 1.
template <int GT>
__device__ void stats_body(const void *g, long long n, float unscale, long long chunk, double *partial,
                           int *nonfinite) {
	__shared__ double sh[256];
	const int lane = threadIdx.x % 16, grp = threadIdx.x / 16;
	const long long b = (long long)blockIdx.x * 16 + grp;
	const long long lo = b * chunk, hi = min(n, lo + chunk);
	double s = 0;
	bool bad = false;
	long long i = lo + lane;
	// Unrolled by 4: the loads are independent, the adds stay in order.
	for (; i + 48 < hi; i += 64) {
		float x0 = load_grad<GT>(g, i), x1 = load_grad<GT>(g, i + 16), x2 = load_grad<GT>(g, i + 32),
		      x3 = load_grad<GT>(g, i + 48);
		uint32_t e = (__float_as_uint(x0) & 0x7f800000u) == 0x7f800000u || (__float_as_uint(x1) & 0x7f800000u) == 0x7f800000u ||
		             (__float_as_uint(x2) & 0x7f800000u) == 0x7f800000u || (__float_as_uint(x3) & 0x7f800000u) == 0x7f800000u;
		if (e) bad = true;
		double y0 = (double)__fmul_rn(x0, unscale), y1 = (double)__fmul_rn(x1, unscale),
		       y2 = (double)__fmul_rn(x2, unscale), y3 = (double)__fmul_rn(x3, unscale);
		s = __dadd_rn(s, __dmul_rn(y0, y0));
		s = __dadd_rn(s, __dmul_rn(y1, y1));
		s = __dadd_rn(s, __dmul_rn(y2, y2));
		s = __dadd_rn(s, __dmul_rn(y3, y3));
	}
	for (; i < hi; i += 16) {
		float x = load_grad<GT>(g, i);
		if ((__float_as_uint(x) & 0x7f800000u) == 0x7f800000u) bad = true;
		double y = (double)__fmul_rn(x, unscale);
		s = __dadd_rn(s, __dmul_rn(y, y));
	}
	if (bad) *nonfinite = 1;
	sh[threadIdx.x] = s;
	__syncthreads();
	if (lane == 0 && lo < n) {
		double t = 0;
		for (int j = 0; j < 16; j++) t = __dadd_rn(t, sh[threadIdx.x + j]);
		partial[b] = t;
	}
}

extern "C" __global__ void __launch_bounds__(256)
    dos_grad_stats_f32(const void *g, long long n, float unscale, long long chunk, double *partial, int *nonfinite) {
	stats_body<GRAD_F32>(g, n, unscale, chunk, partial, nonfinite);
}
extern "C" __global__ void __launch_bounds__(256)
    dos_grad_stats_bf16(const void *g, long long n, float unscale, long long chunk, double *partial, int *nonfinite) {
	stats_body<GRAD_BF16>(g, n, unscale, chunk, partial, nonfinite);
}
extern "C" __global__ void __launch_bounds__(256)
    dos_grad_stats_f16(const void *g, long long n, float unscale, long long chunk, double *partial, int *nonfinite) {
	stats_body<GRAD_F16>(g, n, unscale, chunk, partial, nonfinite);
}

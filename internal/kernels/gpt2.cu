// dos GPU kernels of the GPT-2 model: everything of forward and backward
// that is not a matrix product (those run in cuBLASLt, internal/cublas).
//
// Data types follow llm.c's mixed precision, with one change: activations
// and weights are bf16, every reduction and every element-wise formula
// runs in fp32, and the residual stream and its gradient stay fp32 (as
// PyTorch's autocast keeps them: its residual adds mix an fp32 stream with
// bf16 sublayer outputs), so the model tracks PyTorch's bf16-autocast GPT-2
// closely.
//
// Every kernel is deterministic: each sum runs in a fixed order (a lane's
// strided elements, then a butterfly over the warp, then warps or chunks in
// index order); no atomics. So a step computed twice from the same weights
// and batch gives the same bits, and resuming a run reproduces it.
//
// Shapes, row-major: BT = B*T rows of the residual stream of width C; NH
// heads of size HS = C/NH; V columns of the logits (the padded vocabulary).
// Semantics: Hugging Face transformers' GPT2LMHeadModel (GPT2Block,
// GPT2Attention, NewGELUActivation, LayerNorm eps 1e-5 with the biased
// variance); the kernel split follows llm.c's train_gpt2.cu.
//
// Compiled to PTX by scripts/build-kernels.sh with adamw.cu; the PTX is
// committed beside this file and stamped with its SHA-256.

#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define LN_EPS 1e-5f
#define GELU_K 0.7978845608028654f // sqrt(2/pi)
#define GELU_C 0.044715f

__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 tobf(float x) { return __float2bfloat16_rn(x); }

// A butterfly over the warp: every lane gets the same sum, in the same
// order on every run.
__device__ __forceinline__ float warp_sum(float v) {
	for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

__device__ __forceinline__ float warp_max(float v) {
	for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

// block_sum and block_max reduce over a block of up to 1024 threads (a
// multiple of 32); every thread gets the result. buf holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float *buf) {
	int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
	v = warp_sum(v);
	__syncthreads(); // buf may still be read by an earlier reduction
	if (lane == 0) buf[warp] = v;
	__syncthreads();
	v = lane < nw ? buf[lane] : 0.0f;
	return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float *buf) {
	int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
	v = warp_max(v);
	__syncthreads();
	if (lane == 0) buf[warp] = v;
	__syncthreads();
	v = lane < nw ? buf[lane] : -INFINITY;
	return warp_max(v);
}

#define GRID_STRIDE(i, n) \
	for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long)gridDim.x * blockDim.x)

// The row a warp of a warp-per-row kernel owns, or -1.
__device__ __forceinline__ int warp_row(int n) {
	int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
	return row < n ? row : -1;
}

// A parameter read as bf16, or as fp32 when f32 is set (the optimizer's
// fp32 master weights on the device, where PyTorch's autocast reads fp32).
#define PARAM(p, f32, i) ((f32) ? ((const float *)(p))[i] : bf(((const bf16 *)(p))[i]))

// ---- embeddings ----

// out[b,t,:] = wte[tok[b,t],:] + wpe[t,:], fp32. tok [BT], wte [V, C],
// wpe [NCtx, C] with T <= NCtx; wte and wpe bf16, or fp32 with f32.
extern "C" __global__ void gpt_encoder_forward(float *__restrict__ out, const int *__restrict__ tok,
                                               const void *__restrict__ wte, const void *__restrict__ wpe,
                                               int f32, int BT, int T, int C) {
	GRID_STRIDE(i, (long)BT * C) {
		int bt = (int)(i / C), c = (int)(i % C);
		out[i] = PARAM(wte, f32, (long)tok[bt] * C + c) + PARAM(wpe, f32, (long)(bt % T) * C + c);
	}
}

// dwpe[t,c] = sum over b (ascending) of dres[b,t,c] for t < T, and 0 for
// the rows T..NCtx-1 that the batch did not use.
extern "C" __global__ void gpt_wpe_backward(bf16 *__restrict__ dwpe, const float *__restrict__ dres,
                                            int B, int T, int NCtx, int C) {
	long used = (long)T * C;
	GRID_STRIDE(i, (long)NCtx * C) {
		float s = 0.0f;
		if (i < used)
			for (int b = 0; b < B; b++) s += dres[(long)b * used + i];
		dwpe[i] = tobf(s);
	}
}

// dwte[tok,:] += the rows of dres whose token is tok, in ascending
// position. The host sorts the positions by token: segment s holds
// pos[seg[s]..seg[s+1]) (ascending), all of token segTok[s]. fp32.
extern "C" __global__ void gpt_wte_backward(float *__restrict__ dwte, const float *__restrict__ dres,
                                            const int *__restrict__ pos, const int *__restrict__ seg,
                                            const int *__restrict__ segTok, int nseg, int C) {
	for (int s = blockIdx.x; s < nseg; s += gridDim.x) {
		long tok = segTok[s];
		int p0 = seg[s], p1 = seg[s + 1];
		for (int c = threadIdx.x; c < C; c += blockDim.x) {
			float acc = dwte[tok * C + c];
			for (int p = p0; p < p1; p++) acc += dres[(long)pos[p] * C + c];
			dwte[tok * C + c] = acc;
		}
	}
}

// out = bf16(in), n elements.
extern "C" __global__ void gpt_cast_bf16(bf16 *__restrict__ out, const float *__restrict__ in, long n) {
	GRID_STRIDE(i, n) out[i] = tobf(in[i]);
}

// ---- LayerNorm ----

// One warp per row of N rows of width C. With y, first res_out = res_in +
// y (the residual add; res_out may equal res_in), then LayerNorm of
// res_out; without y, LayerNorm of res_in. out = (x - mean) * rstd * w + b
// in bf16, w and b bf16 or fp32 (f32); mean and rstd (fp32, [N]) are
// kept for backward. The variance is the biased one, computed in a second
// pass over the row.
extern "C" __global__ void gpt_layernorm_forward(bf16 *__restrict__ out, float *__restrict__ mean,
                                                 float *__restrict__ rstd, float *res_out, const float *res_in,
                                                 const bf16 *__restrict__ y, const void *__restrict__ w,
                                                 const void *__restrict__ b, int f32, int N, int C) {
	int row = warp_row(N);
	if (row < 0) return;
	int lane = threadIdx.x % 32;
	const float *x = res_in + (long)row * C;
	float s = 0.0f;
	if (y != 0) {
		const bf16 *yr = y + (long)row * C;
		float *xo = res_out + (long)row * C;
		for (int c = lane; c < C; c += 32) {
			float r = x[c] + bf(yr[c]);
			xo[c] = r;
			s += r;
		}
		x = xo; // each lane reads back only what it wrote
	} else {
		for (int c = lane; c < C; c += 32) s += x[c];
	}
	float m = warp_sum(s) / C;
	float v = 0.0f;
	for (int c = lane; c < C; c += 32) {
		float d = x[c] - m;
		v += d * d;
	}
	float rs = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
	bf16 *o = out + (long)row * C;
	for (int c = lane; c < C; c += 32) o[c] = tobf((x[c] - m) * rs * PARAM(w, f32, c) + PARAM(b, f32, c));
	if (lane == 0) {
		mean[row] = m;
		rstd[row] = rs;
	}
}

// LayerNorm backward to its input, one warp per row: with xhat = (x -
// mean) * rstd and g = dout * w, dx = (g - mean(g) - xhat * mean(g *
// xhat)) * rstd. dres = dx (accumulate 0) or dres += dx (accumulate 1);
// dres16, when not null, receives bf16(dres) for the matrix products that
// read the residual gradient; w is bf16, or fp32 with f32. The weight and
// bias gradients are gpt_colsum_partial's.
extern "C" __global__ void gpt_layernorm_backward(float *__restrict__ dres, bf16 *__restrict__ dres16,
                                                  const bf16 *__restrict__ dout, const float *__restrict__ inp,
                                                  const void *__restrict__ w, int f32, const float *__restrict__ mean,
                                                  const float *__restrict__ rstd, int accumulate, int N, int C) {
	int row = warp_row(N);
	if (row < 0) return;
	int lane = threadIdx.x % 32;
	const float *x = inp + (long)row * C;
	const bf16 *d = dout + (long)row * C;
	float m = mean[row], rs = rstd[row];
	float a = 0.0f, bsum = 0.0f;
	for (int c = lane; c < C; c += 32) {
		float xh = (x[c] - m) * rs;
		float g = bf(d[c]) * PARAM(w, f32, c);
		a += g;
		bsum += g * xh;
	}
	a = warp_sum(a) / C;
	bsum = warp_sum(bsum) / C;
	float *dr = dres + (long)row * C;
	bf16 *dr16 = dres16 != 0 ? dres16 + (long)row * C : 0;
	for (int c = lane; c < C; c += 32) {
		float xh = (x[c] - m) * rs;
		float g = bf(d[c]) * PARAM(w, f32, c);
		float dx = (g - a - xh * bsum) * rs;
		float r = accumulate ? dr[c] + dx : dx;
		dr[c] = r;
		if (dr16 != 0) dr16[c] = tobf(r);
	}
}

// ---- column sums (bias and LayerNorm parameter gradients) ----

#define CS_ROWS 8 // threadIdx.y extent of gpt_colsum_partial

// Column sums over N rows of width C in two deterministic stages. Grid
// (ceil(C/32), R), block (32, CS_ROWS): block (bx, r) sums columns
// bx*32..bx*32+31 over the rows of chunk r, [r*rows, min(N, (r+1)*rows)),
// and writes part[r][0][col] = sum dout; with inp (LayerNorm mode) also
// part[r][1][col] = sum dout * (inp - mean) * rstd. part is [R][W][C],
// W = 2 with inp, else 1.
extern "C" __global__ void gpt_colsum_partial(float *__restrict__ part, const bf16 *__restrict__ dout,
                                              const float *__restrict__ inp, const float *__restrict__ mean,
                                              const float *__restrict__ rstd, int N, int C, int rows) {
	__shared__ float sb[CS_ROWS][33], sw[CS_ROWS][33];
	int col = blockIdx.x * 32 + threadIdx.x;
	int r0 = blockIdx.y * rows, r1 = min(N, r0 + rows);
	float ab = 0.0f, aw = 0.0f;
	if (col < C) {
		for (int r = r0 + threadIdx.y; r < r1; r += CS_ROWS) {
			float d = bf(dout[(long)r * C + col]);
			ab += d;
			if (inp != 0) aw += d * ((inp[(long)r * C + col] - mean[r]) * rstd[r]);
		}
	}
	sb[threadIdx.y][threadIdx.x] = ab;
	sw[threadIdx.y][threadIdx.x] = aw;
	__syncthreads();
	if (threadIdx.y == 0 && col < C) {
		float tb = 0.0f, tw = 0.0f;
		for (int i = 0; i < CS_ROWS; i++) {
			tb += sb[i][threadIdx.x];
			tw += sw[i][threadIdx.x];
		}
		int W = inp != 0 ? 2 : 1;
		float *p = part + (long)blockIdx.y * W * C;
		p[col] = tb;
		if (inp != 0) p[C + col] = tw;
	}
}

// The second stage: db[col] = sum over r (ascending) of part[r][0][col],
// and with dw, dw[col] = sum of part[r][1][col]; written in bf16.
extern "C" __global__ void gpt_colsum_finish(bf16 *__restrict__ db, bf16 *__restrict__ dw,
                                             const float *__restrict__ part, int R, int C) {
	int W = dw != 0 ? 2 : 1;
	GRID_STRIDE(col, (long)C) {
		float sb = 0.0f, sw = 0.0f;
		for (int r = 0; r < R; r++) {
			const float *p = part + (long)r * W * C;
			sb += p[col];
			if (dw != 0) sw += p[C + col];
		}
		db[col] = tobf(sb);
		if (dw != 0) dw[col] = tobf(sw);
	}
}

// ---- GELU (tanh approximation, HF "gelu_new") ----

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), n elements.
extern "C" __global__ void gpt_gelu_forward(bf16 *__restrict__ out, const bf16 *__restrict__ inp, long n) {
	GRID_STRIDE(i, n) {
		float x = bf(inp[i]);
		float u = GELU_K * (x + GELU_C * x * x * x);
		out[i] = tobf(0.5f * x * (1.0f + tanhf(u)));
	}
}

// dinp = dout * gelu'(inp), the derivative of gpt_gelu_forward's formula.
extern "C" __global__ void gpt_gelu_backward(bf16 *__restrict__ dinp, const bf16 *__restrict__ inp,
                                             const bf16 *__restrict__ dout, long n) {
	GRID_STRIDE(i, n) {
		float x = bf(inp[i]);
		float u = GELU_K * (x + GELU_C * x * x * x);
		float th = tanhf(u);
		float du = GELU_K * (1.0f + 3.0f * GELU_C * x * x);
		float g = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
		dinp[i] = tobf(g * bf(dout[i]));
	}
}

// ---- attention ----

// Index helper: i runs over [B, NH, T, HS]; bthd_index is where element
// i sits in a [B, T, rows, HS] layout whose token rows hold rows heads of
// HS: rows = NH for [B, T, NH, HS], 3*NH for q's place in qkv [B, T, 3C]
// (add NH*HS for k's, 2*NH*HS for v's).
__device__ __forceinline__ long bthd_index(long i, int T, int NH, int HS, int rows) {
	int d = (int)(i % HS);
	long r = i / HS;
	int t = (int)(r % T);
	r /= T;
	int h = (int)(r % NH);
	long b = r / NH;
	return ((b * T + t) * rows + h) * HS + d;
}

// q, k, v [B, NH, T, HS] from qkv [B, T, 3C] (HF's split of c_attn's output).
extern "C" __global__ void gpt_permute_qkv(bf16 *__restrict__ q, bf16 *__restrict__ k, bf16 *__restrict__ v,
                                           const bf16 *__restrict__ qkv, int B, int T, int NH, int HS) {
	long hs = (long)NH * HS;
	GRID_STRIDE(i, (long)B * T * hs) {
		long s = bthd_index(i, T, NH, HS, 3 * NH);
		q[i] = qkv[s];
		k[i] = qkv[s + hs];
		v[i] = qkv[s + 2 * hs];
	}
}

// The inverse: dqkv [B, T, 3C] from dq, dk, dv [B, NH, T, HS].
extern "C" __global__ void gpt_permute_qkv_backward(bf16 *__restrict__ dqkv, const bf16 *__restrict__ dq,
                                                    const bf16 *__restrict__ dk, const bf16 *__restrict__ dv,
                                                    int B, int T, int NH, int HS) {
	long hs = (long)NH * HS;
	GRID_STRIDE(i, (long)B * T * hs) {
		long s = bthd_index(i, T, NH, HS, 3 * NH);
		dqkv[s] = dq[i];
		dqkv[s + hs] = dk[i];
		dqkv[s + 2 * hs] = dv[i];
	}
}

// out [B, T, NH, HS] = y [B, NH, T, HS] (the heads side by side again).
extern "C" __global__ void gpt_unpermute(bf16 *__restrict__ out, const bf16 *__restrict__ y, int B, int T, int NH,
                                         int HS) {
	GRID_STRIDE(i, (long)B * T * NH * HS) out[bthd_index(i, T, NH, HS, NH)] = y[i];
}

// The inverse: dy [B, NH, T, HS] from dout [B, T, NH, HS].
extern "C" __global__ void gpt_unpermute_backward(bf16 *__restrict__ dy, const bf16 *__restrict__ dout, int B,
                                                  int T, int NH, int HS) {
	GRID_STRIDE(i, (long)B * T * NH * HS) dy[i] = dout[bthd_index(i, T, NH, HS, NH)];
}

// Causal softmax, one warp per row of rows = B*NH*T rows of length T: row
// r is query t = r % T; att[j] = exp(pre[j] - max) / sum over j <= t, and 0
// for j > t. pre is fp32, already scaled by 1/sqrt(HS) (the product's
// alpha).
extern "C" __global__ void gpt_softmax_forward(bf16 *__restrict__ att, const float *__restrict__ pre, int rows,
                                               int T) {
	int row = warp_row(rows);
	if (row < 0) return;
	int lane = threadIdx.x % 32, t = row % T;
	const float *x = pre + (long)row * T;
	bf16 *y = att + (long)row * T;
	float m = -INFINITY;
	for (int j = lane; j <= t; j += 32) m = fmaxf(m, x[j]);
	m = warp_max(m);
	float s = 0.0f;
	for (int j = lane; j <= t; j += 32) s += expf(x[j] - m);
	float inv = 1.0f / warp_sum(s);
	for (int j = lane; j < T; j += 32) y[j] = tobf(j <= t ? expf(x[j] - m) * inv : 0.0f);
}

// Its backward, one warp per row: dpre[j] = att[j] (datt[j] - sum_k att[k]
// datt[k]) * scale for j <= t, 0 beyond; datt fp32, dpre bf16. scale is
// forward's 1/sqrt(HS), so dpre is the gradient of q kᵀ unscaled.
extern "C" __global__ void gpt_softmax_backward(bf16 *__restrict__ dpre, const float *__restrict__ datt,
                                                const bf16 *__restrict__ att, float scale, int rows, int T) {
	int row = warp_row(rows);
	if (row < 0) return;
	int lane = threadIdx.x % 32, t = row % T;
	const float *da = datt + (long)row * T;
	const bf16 *a = att + (long)row * T;
	bf16 *dp = dpre + (long)row * T;
	float s = 0.0f;
	for (int j = lane; j <= t; j += 32) s += bf(a[j]) * da[j];
	s = warp_sum(s);
	for (int j = lane; j < T; j += 32) dp[j] = tobf(j <= t ? bf(a[j]) * (da[j] - s) * scale : 0.0f);
}

// ---- the classifier ----

// Softmax cross-entropy over V columns, one block per row of logits [N, V]
// (bf16): loss[row] = log(sum exp(x - max)) + max - x[target], fp32. With
// dloss != 0 the row is overwritten by its gradient, (softmax(x) -
// onehot(target)) * dloss, in bf16; dloss is the weight of each row's loss
// in the total (1/N for the mean). Targets must lie in [0, V).
extern "C" __global__ void gpt_classifier(bf16 *__restrict__ logits, float *__restrict__ losses,
                                          const int *__restrict__ targets, float dloss, int V) {
	__shared__ float buf[32];
	bf16 *x = logits + (long)blockIdx.x * V;
	int tg = targets[blockIdx.x];
	float xt = bf(x[tg]); // read before any thread overwrites the row
	float m = -INFINITY;
	for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, bf(x[j]));
	m = block_max(m, buf);
	float s = 0.0f;
	for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(bf(x[j]) - m);
	s = block_sum(s, buf);
	if (threadIdx.x == 0) losses[blockIdx.x] = logf(s) + m - xt;
	if (dloss == 0.0f) return;
	float inv = 1.0f / s;
	for (int j = threadIdx.x; j < V; j += blockDim.x) {
		float p = expf(bf(x[j]) - m) * inv;
		x[j] = tobf((p - (j == tg ? 1.0f : 0.0f)) * dloss);
	}
}

// ---- flash attention (head size 64) ----
//
// Causal attention without the T×T matrices in memory (Dao, FlashAttention-2,
// 2023): a block of 4 warps takes 64 query rows of one (b, h); each warp owns
// 16 of them and walks the 64-key tiles up to the diagonal with an online
// softmax. The products run on bf16 tensor cores through mma.sync
// m16n8k16 (fp32 accumulation), whose register layout (PTX ISA, "Matrix
// Fragments for mma.m16n8k16") lets the probabilities go from the score
// accumulators straight into the next product's A operand. q, k and v are
// read in place from c_attn's output qkv [B, T, 3, NH, 64] and the output
// goes straight to [B, T, NH, 64], so no permutes run. Forward keeps the
// log-sum-exp of each row (lse [B, NH, T], in units of the scaled scores)
// for backward.
//
// Backward is deterministic (no atomics): one kernel accumulates dK and dV
// of a 64-key tile over the query tiles at or below the diagonal, another
// dQ of a 64-query tile over the key tiles, each recomputing the
// probabilities from lse. D = rowsum(dO ∘ O) comes from a small kernel
// first. T need not be a multiple of 64: rows past T are zero and masked.

#define FA_D 64       // head size
#define FA_BR 64      // rows of a tile
#define FA_LD 72      // a shared tile's row stride: 144 bytes, so fragment loads hit distinct banks
#define FA_THREADS 128

// fa_load copies rows t0..t0+63 of a [B*T, ld]-strided bf16 matrix (columns
// col..col+63 of batch b) into a 64×64 shared tile, zeros past T.
__device__ __forceinline__ void fa_load(bf16 *tile, const bf16 *src, long b, int t0, int T, long ld, long col) {
	for (int i = threadIdx.x; i < FA_BR * FA_D / 8; i += FA_THREADS) {
		int r = i / (FA_D / 8), c8 = i % (FA_D / 8);
		uint4 v = make_uint4(0, 0, 0, 0);
		int t = t0 + r;
		if (t < T) v = *(const uint4 *)(src + (b * T + t) * ld + col + 8 * c8);
		*(uint4 *)(tile + r * FA_LD + 8 * c8) = v;
	}
}

// D += A·B for one 16×8 tile, A 16×16 (4 registers of bf16 pairs), B 16×8
// (2 registers), fp32 accumulators.
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
	             "{%0,%1,%2,%3};\n"
	             : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
	             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t ld32(const bf16 *p) { return *(const uint32_t *)p; }

__device__ __forceinline__ uint32_t pack2(bf16 lo, bf16 hi) {
	return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}

__device__ __forceinline__ uint32_t packf(float lo, float hi) { return pack2(tobf(lo), tobf(hi)); }

// In the helpers below g = lane / 4 and t = lane % 4. An accumulator tile
// acc[8][4] is 16×64: element (j, i) is row g + 8*(i/2), column 8j + 2t +
// i%2. An A operand a[4][4] is 16×64: a[kc] covers columns 16kc..16kc+15.

// fa_load_a loads a warp's A operand: rows row0..row0+15 of a shared tile.
__device__ __forceinline__ void fa_load_a(uint32_t a[4][4], const bf16 *tile, int row0, int g, int t) {
	for (int kc = 0; kc < 4; kc++) {
		const bf16 *p = tile + (row0 + g) * FA_LD + 16 * kc + 2 * t;
		a[kc][0] = ld32(p);
		a[kc][1] = ld32(p + 8 * FA_LD);
		a[kc][2] = ld32(p + 8);
		a[kc][3] = ld32(p + 8 * FA_LD + 8);
	}
}

// fa_mma_abt: acc = A · tileᵀ (tile [64 n][64 k]), e.g. S = Q Kᵀ.
__device__ __forceinline__ void fa_mma_abt(float acc[8][4], const uint32_t a[4][4], const bf16 *tile, int g, int t) {
	for (int j = 0; j < 8; j++) {
		acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
		for (int kc = 0; kc < 4; kc++) {
			const bf16 *p = tile + (8 * j + g) * FA_LD + 16 * kc + 2 * t;
			mma16816(acc[j], a[kc], ld32(p), ld32(p + 8));
		}
	}
}

// fa_mma_ab: acc += A · tile (tile [64 k][64 n]), e.g. O += P V.
__device__ __forceinline__ void fa_mma_ab(float acc[8][4], const uint32_t a[4][4], const bf16 *tile, int g, int t) {
	for (int j = 0; j < 8; j++) {
		for (int kc = 0; kc < 4; kc++) {
			const bf16 *p = tile + (16 * kc + 2 * t) * FA_LD + 8 * j + g;
			mma16816(acc[j], a[kc], pack2(p[0], p[FA_LD]), pack2(p[8 * FA_LD], p[9 * FA_LD]));
		}
	}
}

// fa_acc_to_a rounds a 16×64 accumulator tile into an A operand.
__device__ __forceinline__ void fa_acc_to_a(uint32_t a[4][4], const float acc[8][4]) {
	for (int kc = 0; kc < 4; kc++) {
		a[kc][0] = packf(acc[2 * kc][0], acc[2 * kc][1]);
		a[kc][1] = packf(acc[2 * kc][2], acc[2 * kc][3]);
		a[kc][2] = packf(acc[2 * kc + 1][0], acc[2 * kc + 1][1]);
		a[kc][3] = packf(acc[2 * kc + 1][2], acc[2 * kc + 1][3]);
	}
}

// fa_store writes rows (row[r], r = 0, 1: the lane's two rows) of a 16×64
// accumulator tile times f into dst (row stride ld), skipping rows >= T.
__device__ __forceinline__ void fa_store(bf16 *dst, long ld, const int row[2], int T, const float acc[8][4], float f,
                                         int t) {
	for (int r = 0; r < 2; r++) {
		if (row[r] >= T) continue;
		bf16 *d = dst + (long)row[r] * ld + 2 * t;
		for (int j = 0; j < 8; j++) *(uint32_t *)(d + 8 * j) = packf(acc[j][2 * r] * f, acc[j][2 * r + 1] * f);
	}
}

// Forward. Grid (ceil(T/64), B*NH), 128 threads. out [B, T, NH*64] bf16,
// lse [B, NH, T] fp32, qkv [B, T, 3*NH*64] bf16.
extern "C" __global__ void __launch_bounds__(FA_THREADS)
gpt_flash_forward(bf16 *__restrict__ out, float *__restrict__ lse, const bf16 *__restrict__ qkv, int B, int T, int NH,
                  float scale) {
	__shared__ __align__(16) bf16 Qs[FA_BR * FA_LD];
	__shared__ __align__(16) bf16 Ks[FA_BR * FA_LD];
	__shared__ __align__(16) bf16 Vs[FA_BR * FA_LD];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
	int qt = blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
	long C = (long)NH * FA_D, ld = 3 * C;
	int q0 = qt * FA_BR;
	fa_load(Qs, qkv, b, q0, T, ld, (long)h * FA_D);
	__syncthreads();
	uint32_t qa[4][4];
	fa_load_a(qa, Qs, warp * 16, g, t);
	int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
	float o[8][4], s[8][4];
	for (int j = 0; j < 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
	float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
	for (int kt = 0; kt <= qt; kt++) {
		int k0 = kt * FA_BR;
		__syncthreads(); // Ks, Vs are reloaded
		fa_load(Ks, qkv, b, k0, T, ld, C + (long)h * FA_D);
		fa_load(Vs, qkv, b, k0, T, ld, 2 * C + (long)h * FA_D);
		__syncthreads();
		fa_mma_abt(s, qa, Ks, g, t); // S = Q Kᵀ
		float mx[2] = {-INFINITY, -INFINITY};
		for (int j = 0; j < 8; j++) {
			for (int i = 0; i < 4; i++) {
				int key = k0 + 8 * j + 2 * t + (i & 1), r = i >> 1;
				float v = s[j][i] * scale;
				if (key > row[r] || key >= T) v = -INFINITY;
				s[j][i] = v;
				mx[r] = fmaxf(mx[r], v);
			}
		}
		float mu[2], alpha[2], rs[2] = {0.0f, 0.0f};
		for (int r = 0; r < 2; r++) {
			mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
			mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
			float mn = fmaxf(m[r], mx[r]);
			mu[r] = mn == -INFINITY ? 0.0f : mn; // a row with nothing yet (past T)
			alpha[r] = __expf(m[r] - mu[r]);
			m[r] = mn;
		}
		for (int j = 0; j < 8; j++) {
			for (int i = 0; i < 4; i++) {
				float p = __expf(s[j][i] - mu[i >> 1]);
				s[j][i] = p;
				rs[i >> 1] += p;
				o[j][i] *= alpha[i >> 1];
			}
		}
		for (int r = 0; r < 2; r++) {
			rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
			rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
			l[r] = l[r] * alpha[r] + rs[r];
		}
		uint32_t pa[4][4];
		fa_acc_to_a(pa, s);
		fa_mma_ab(o, pa, Vs, g, t); // O += P V
	}
	float inv[2] = {1.0f / l[0], 1.0f / l[1]};
	for (int j = 0; j < 8; j++) {
		for (int i = 0; i < 4; i++) o[j][i] *= inv[i >> 1];
	}
	fa_store(out + (long)b * T * C + (long)h * FA_D, C, row, T, o, 1.0f, t);
	if (t == 0) {
		for (int r = 0; r < 2; r++)
			if (row[r] < T) lse[(long)bh * T + row[r]] = m[r] + logf(l[r]);
	}
}

// D[b, h, t] = sum over d of dout[b, t, h, d] * out[b, t, h, d], one warp per
// (b, t, h); fp32.
extern "C" __global__ void gpt_flash_backward_pre(float *__restrict__ D, const bf16 *__restrict__ out,
                                                  const bf16 *__restrict__ dout, int B, int T, int NH) {
	int row = warp_row(B * T * NH);
	if (row < 0) return;
	int lane = threadIdx.x % 32;
	int h = row % NH, bt = row / NH, b = bt / T, t = bt % T;
	long base = (long)row * FA_D;
	float s = bf(out[base + lane]) * bf(dout[base + lane]) + bf(out[base + lane + 32]) * bf(dout[base + lane + 32]);
	s = warp_sum(s);
	if (lane == 0) D[((long)b * NH + h) * T + t] = s;
}

// dK, dV. Grid (ceil(T/64), B*NH): block (kt, bh) owns keys kt*64.. and
// sums over query tiles qt >= kt; each warp owns 16 keys. dqkv [B, T,
// 3*NH*64]: its k and v parts.
extern "C" __global__ void __launch_bounds__(FA_THREADS)
gpt_flash_backward_kv(bf16 *__restrict__ dqkv, const bf16 *__restrict__ qkv, const bf16 *__restrict__ dout,
                      const float *__restrict__ lse, const float *__restrict__ D, int B, int T, int NH, float scale) {
	__shared__ __align__(16) bf16 As[FA_BR * FA_LD]; // K, then Q tiles
	__shared__ __align__(16) bf16 Bs[FA_BR * FA_LD]; // V, then dO tiles
	__shared__ float Ls[FA_BR], Ds[FA_BR];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
	int kt = blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
	long C = (long)NH * FA_D, ld = 3 * C;
	int k0 = kt * FA_BR;
	fa_load(As, qkv, b, k0, T, ld, C + (long)h * FA_D);
	fa_load(Bs, qkv, b, k0, T, ld, 2 * C + (long)h * FA_D);
	__syncthreads();
	uint32_t ka[4][4], va[4][4], pa[4][4];
	fa_load_a(ka, As, warp * 16, g, t);
	fa_load_a(va, Bs, warp * 16, g, t);
	float dk[8][4], dv[8][4], s[8][4], dp[8][4];
	for (int j = 0; j < 8; j++) {
		for (int i = 0; i < 4; i++) dk[j][i] = dv[j][i] = 0.0f;
	}
	int row[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8}; // this lane's keys
	int nq = (T + FA_BR - 1) / FA_BR;
	for (int qt = kt; qt < nq; qt++) {
		int q0 = qt * FA_BR;
		__syncthreads(); // As, Bs are reloaded
		fa_load(As, qkv, b, q0, T, ld, (long)h * FA_D);
		fa_load(Bs, dout, b, q0, T, C, (long)h * FA_D);
		for (int i = threadIdx.x; i < FA_BR; i += FA_THREADS) {
			int q = q0 + i;
			Ls[i] = q < T ? lse[(long)bh * T + q] : 0.0f;
			Ds[i] = q < T ? D[(long)bh * T + q] : 0.0f;
		}
		__syncthreads();
		fa_mma_abt(s, ka, As, g, t); // Sᵀ = K Qᵀ (16 keys × 64 queries)
		for (int j = 0; j < 8; j++) {
			for (int i = 0; i < 4; i++) {
				int c = 8 * j + 2 * t + (i & 1), q = q0 + c, key = row[i >> 1];
				bool ok = q >= key && q < T && key < T;
				s[j][i] = ok ? __expf(s[j][i] * scale - Ls[c]) : 0.0f; // Pᵀ
			}
		}
		fa_acc_to_a(pa, s);
		fa_mma_ab(dv, pa, Bs, g, t);  // dV += Pᵀ dO
		fa_mma_abt(dp, va, Bs, g, t); // dPᵀ = V dOᵀ
		for (int j = 0; j < 8; j++) {
			for (int i = 0; i < 4; i++) dp[j][i] = s[j][i] * (dp[j][i] - Ds[8 * j + 2 * t + (i & 1)]);
		}
		fa_acc_to_a(pa, dp);
		fa_mma_ab(dk, pa, As, g, t); // dK += dSᵀ Q
	}
	bf16 *base = dqkv + (long)b * T * ld + (long)h * FA_D;
	fa_store(base + C, ld, row, T, dk, scale, t);
	fa_store(base + 2 * C, ld, row, T, dv, 1.0f, t);
}

// dQ. Grid (ceil(T/64), B*NH): block (qt, bh) owns queries qt*64.. and sums
// over key tiles kt <= qt; each warp owns 16 queries. Writes dqkv's q part.
extern "C" __global__ void __launch_bounds__(FA_THREADS)
gpt_flash_backward_q(bf16 *__restrict__ dqkv, const bf16 *__restrict__ qkv, const bf16 *__restrict__ dout,
                     const float *__restrict__ lse, const float *__restrict__ D, int B, int T, int NH, float scale) {
	__shared__ __align__(16) bf16 As[FA_BR * FA_LD]; // Q, then K tiles
	__shared__ __align__(16) bf16 Bs[FA_BR * FA_LD]; // dO, then V tiles
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
	int qt = blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH;
	long C = (long)NH * FA_D, ld = 3 * C;
	int q0 = qt * FA_BR;
	fa_load(As, qkv, b, q0, T, ld, (long)h * FA_D);
	fa_load(Bs, dout, b, q0, T, C, (long)h * FA_D);
	__syncthreads();
	uint32_t qa[4][4], da[4][4], pa[4][4];
	fa_load_a(qa, As, warp * 16, g, t);
	fa_load_a(da, Bs, warp * 16, g, t);
	int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8}; // this lane's queries
	float L[2], Dq[2];
	for (int r = 0; r < 2; r++) {
		L[r] = row[r] < T ? lse[(long)bh * T + row[r]] : 0.0f;
		Dq[r] = row[r] < T ? D[(long)bh * T + row[r]] : 0.0f;
	}
	float dq[8][4], s[8][4], dp[8][4];
	for (int j = 0; j < 8; j++) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;
	for (int kt = 0; kt <= qt; kt++) {
		int k0 = kt * FA_BR;
		__syncthreads(); // As, Bs are reloaded
		fa_load(As, qkv, b, k0, T, ld, C + (long)h * FA_D);
		fa_load(Bs, qkv, b, k0, T, ld, 2 * C + (long)h * FA_D);
		__syncthreads();
		fa_mma_abt(s, qa, As, g, t); // S = Q Kᵀ
		for (int j = 0; j < 8; j++) {
			for (int i = 0; i < 4; i++) {
				int key = k0 + 8 * j + 2 * t + (i & 1), r = i >> 1;
				bool ok = key <= row[r] && key < T && row[r] < T;
				s[j][i] = ok ? __expf(s[j][i] * scale - L[r]) : 0.0f; // P
			}
		}
		fa_mma_abt(dp, da, Bs, g, t); // dP = dO Vᵀ
		for (int j = 0; j < 8; j++) {
			for (int i = 0; i < 4; i++) dp[j][i] = s[j][i] * (dp[j][i] - Dq[i >> 1]);
		}
		fa_acc_to_a(pa, dp);
		fa_mma_ab(dq, pa, As, g, t); // dQ += dS K
	}
	fa_store(dqkv + (long)b * T * ld + (long)h * FA_D, ld, row, T, dq, scale, t);
}

//go:build !noasm

#include "textflag.h"

// The element-wise AdamW core on fp32 gradients, 16 (AVX-512) or 8 (AVX2)
// lanes at a time, the same operations in the same order as the Go
// reference update() in step.go, none fused: results are bitwise equal.
//
// func updateAVX512(p, m, v, vmax, grad *float32, n int, k *[9]float32, flags int)
// func updateAVX2(p, m, v, vmax, grad *float32, n int, k *[9]float32, flags int)
//
// n is a multiple of the lane count. k holds decay, l2, w, 1-w, beta2,
// 1-beta2, sqrt(bias correction 2), eps, -step size. flags: bit 0 L2 weight
// decay, bit 1 lerp with a small weight, bit 2 amsgrad (vmax is read and
// written only then).

TEXT ·updateAVX512(SB), NOSPLIT, $0-64
	MOVQ p+0(FP), DI
	MOVQ m+8(FP), SI
	MOVQ v+16(FP), DX
	MOVQ vmax+24(FP), R9
	MOVQ grad+32(FP), BX
	MOVQ n+40(FP), CX
	MOVQ k+48(FP), R8
	MOVQ flags+56(FP), R10
	VBROADCASTSS 0(R8), Z16  // decay
	VBROADCASTSS 4(R8), Z17  // l2
	VBROADCASTSS 8(R8), Z18  // w
	VBROADCASTSS 12(R8), Z19 // 1-w
	VBROADCASTSS 16(R8), Z20 // beta2
	VBROADCASTSS 20(R8), Z21 // 1-beta2
	VBROADCASTSS 24(R8), Z22 // bc2 sqrt
	VBROADCASTSS 28(R8), Z23 // eps
	VBROADCASTSS 32(R8), Z24 // -step size
	XORQ AX, AX

loop512:
	CMPQ AX, CX
	JGE  done512
	PREFETCHT0 2048(DI)(AX*4) // software prefetch, 2048 B ahead (update_amd64.go)
	PREFETCHT0 2048(BX)(AX*4)
	PREFETCHT0 2048(SI)(AX*4)
	PREFETCHT0 2048(DX)(AX*4)
	VMOVUPS (DI)(AX*4), Z0 // p
	VMOVUPS (BX)(AX*4), Z1 // g
	VMOVUPS (SI)(AX*4), Z2 // m
	VMOVUPS (DX)(AX*4), Z3 // v
	VMULPS  Z16, Z0, Z0    // p *= decay
	BTQ     $0, R10
	JCC     nol2_512
	VMULPS  Z0, Z17, Z4    // l2*p
	VADDPS  Z4, Z1, Z1     // g += l2*p

nol2_512:
	VSUBPS Z2, Z1, Z4 // g - m
	BTQ    $1, R10
	JCC    biglerp512
	VMULPS Z4, Z18, Z4 // w*(g-m)
	VADDPS Z4, Z2, Z2  // m + w*(g-m)
	JMP    lerped512

biglerp512:
	VMULPS Z19, Z4, Z4 // (g-m)*(1-w)
	VSUBPS Z4, Z1, Z2  // g - (g-m)*(1-w)

lerped512:
	VMULPS  Z20, Z3, Z5 // v*beta2
	VMULPS  Z1, Z21, Z6 // (1-beta2)*g
	VMULPS  Z1, Z6, Z6  // *g
	VADDPS  Z6, Z5, Z3  // v
	VMOVAPS Z3, Z7
	BTQ     $2, R10
	JCC     noams512
	PREFETCHT0 2048(R9)(AX*4)
	VMOVUPS (R9)(AX*4), Z8
	VMAXPS  Z3, Z8, Z7     // vmax > v ? vmax : v
	VCMPPS  $3, Z8, Z8, K1 // vmax is NaN
	VMOVAPS Z8, K1, Z7
	VMOVUPS Z7, (R9)(AX*4)

noams512:
	VSQRTPS Z7, Z7
	VDIVPS  Z22, Z7, Z7 // sqrt(v) / bc2 sqrt
	VADDPS  Z23, Z7, Z7 // + eps
	VMULPS  Z2, Z24, Z9 // -step*m
	VDIVPS  Z7, Z9, Z9  // / denom
	VADDPS  Z9, Z0, Z0  // p + ...
	VMOVUPS Z0, (DI)(AX*4)
	VMOVUPS Z2, (SI)(AX*4)
	VMOVUPS Z3, (DX)(AX*4)
	ADDQ    $16, AX
	JMP     loop512

done512:
	VZEROUPPER
	RET

TEXT ·updateAVX2(SB), NOSPLIT, $0-64
	MOVQ p+0(FP), DI
	MOVQ m+8(FP), SI
	MOVQ v+16(FP), DX
	MOVQ vmax+24(FP), R9
	MOVQ grad+32(FP), BX
	MOVQ n+40(FP), CX
	MOVQ k+48(FP), R8
	MOVQ flags+56(FP), R10
	VBROADCASTSS 0(R8), Y7   // decay
	VBROADCASTSS 4(R8), Y8   // l2
	VBROADCASTSS 8(R8), Y9   // w
	VBROADCASTSS 12(R8), Y10 // 1-w
	VBROADCASTSS 16(R8), Y11 // beta2
	VBROADCASTSS 20(R8), Y12 // 1-beta2
	VBROADCASTSS 24(R8), Y13 // bc2 sqrt
	VBROADCASTSS 28(R8), Y14 // eps
	VBROADCASTSS 32(R8), Y15 // -step size
	XORQ AX, AX

loop256:
	CMPQ AX, CX
	JGE  done256
	PREFETCHT0 2048(DI)(AX*4) // software prefetch, 2048 B ahead (update_amd64.go)
	PREFETCHT0 2048(BX)(AX*4)
	PREFETCHT0 2048(SI)(AX*4)
	PREFETCHT0 2048(DX)(AX*4)
	VMOVUPS (DI)(AX*4), Y0 // p
	VMOVUPS (BX)(AX*4), Y1 // g
	VMOVUPS (SI)(AX*4), Y2 // m
	VMOVUPS (DX)(AX*4), Y3 // v
	VMULPS  Y7, Y0, Y0     // p *= decay
	BTQ     $0, R10
	JCC     nol2_256
	VMULPS  Y0, Y8, Y4     // l2*p
	VADDPS  Y4, Y1, Y1     // g += l2*p

nol2_256:
	VSUBPS Y2, Y1, Y4 // g - m
	BTQ    $1, R10
	JCC    biglerp256
	VMULPS Y4, Y9, Y4 // w*(g-m)
	VADDPS Y4, Y2, Y2 // m + w*(g-m)
	JMP    lerped256

biglerp256:
	VMULPS Y10, Y4, Y4 // (g-m)*(1-w)
	VSUBPS Y4, Y1, Y2  // g - (g-m)*(1-w)

lerped256:
	VMULPS  Y11, Y3, Y5 // v*beta2
	VMULPS  Y1, Y12, Y6 // (1-beta2)*g
	VMULPS  Y1, Y6, Y6  // *g
	VADDPS  Y6, Y5, Y3  // v
	VMOVAPS Y3, Y5      // v' = v
	BTQ     $2, R10
	JCC     noams256
	PREFETCHT0 2048(R9)(AX*4)
	VMOVUPS (R9)(AX*4), Y6
	VMAXPS  Y3, Y6, Y5        // vmax > v ? vmax : v
	VCMPPS  $3, Y6, Y6, Y4    // vmax is NaN
	VBLENDVPS Y4, Y6, Y5, Y5  // NaN vmax wins
	VMOVUPS Y5, (R9)(AX*4)

noams256:
	VSQRTPS Y5, Y5
	VDIVPS  Y13, Y5, Y5 // sqrt(v) / bc2 sqrt
	VADDPS  Y14, Y5, Y5 // + eps
	VMULPS  Y2, Y15, Y4 // -step*m
	VDIVPS  Y5, Y4, Y4  // / denom
	VADDPS  Y4, Y0, Y0  // p + ...
	VMOVUPS Y0, (DI)(AX*4)
	VMOVUPS Y2, (SI)(AX*4)
	VMOVUPS Y3, (DX)(AX*4)
	ADDQ    $8, AX
	JMP     loop256

done256:
	VZEROUPPER
	RET

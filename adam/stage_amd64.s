//go:build !noasm

#include "textflag.h"

// The gradient kernels: scale (the unscale, clip and maximize of a staged
// gradient) and stats (the non-finite check and the lane-ordered sum of
// squares), on 16 lanes (AVX-512F) and 8 lanes (AVX2). Both follow the Go
// references scale and stats in stage.go operation for operation.

// func scaleAVX512(x *float32, n int, a, b float32, flags int)
// x[i] *= a if flags bit 0; x[i] *= b if bit 1; x[i] = -x[i] if bit 2.
// n is a multiple of 16.
TEXT ·scaleAVX512(SB), NOSPLIT, $0-32
	MOVQ         x+0(FP), DI
	MOVQ         n+8(FP), CX
	VBROADCASTSS a+16(FP), Z1
	VBROADCASTSS b+20(FP), Z2
	MOVQ         flags+24(FP), R10
	MOVL         $0x80000000, DX
	VPBROADCASTD DX, Z3
	XORQ         AX, AX

sc512:
	CMPQ    AX, CX
	JGE     sc512done
	VMOVUPS (DI)(AX*4), Z0
	BTQ     $0, R10
	JCC     sc512b
	VMULPS  Z1, Z0, Z0

sc512b:
	BTQ    $1, R10
	JCC    sc512n
	VMULPS Z2, Z0, Z0

sc512n:
	BTQ     $2, R10
	JCC     sc512st
	VPXORD  Z3, Z0, Z0

sc512st:
	VMOVUPS Z0, (DI)(AX*4)
	ADDQ    $16, AX
	JMP     sc512

sc512done:
	VZEROUPPER
	RET

// func scaleAVX2(x *float32, n int, a, b float32, flags int)
// scaleAVX512 on 8 lanes; n is a multiple of 8.
TEXT ·scaleAVX2(SB), NOSPLIT, $0-32
	MOVQ         x+0(FP), DI
	MOVQ         n+8(FP), CX
	VBROADCASTSS a+16(FP), Y1
	VBROADCASTSS b+20(FP), Y2
	MOVQ         flags+24(FP), R10
	MOVL         $0x80000000, DX
	VMOVQ         DX, X3
	VPBROADCASTD X3, Y3
	XORQ         AX, AX

sc256:
	CMPQ    AX, CX
	JGE     sc256done
	VMOVUPS (DI)(AX*4), Y0
	BTQ     $0, R10
	JCC     sc256b
	VMULPS  Y1, Y0, Y0

sc256b:
	BTQ    $1, R10
	JCC    sc256n
	VMULPS Y2, Y0, Y0

sc256n:
	BTQ   $2, R10
	JCC   sc256st
	VPXOR Y3, Y0, Y0

sc256st:
	VMOVUPS Y0, (DI)(AX*4)
	ADDQ    $8, AX
	JMP     sc256

sc256done:
	VZEROUPPER
	RET

// func statsAVX512(acc *[16]float64, x *float32, n int, unscale float32) bool
// For each i < n (a multiple of 16): acc[i%16] += float64(x[i]*unscale)^2,
// the product rounded to fp32 first. Returns whether some x[i] is an Inf or
// a NaN (exponent all ones), judged before scaling.
TEXT ·statsAVX512(SB), NOSPLIT, $0-33
	MOVQ          acc+0(FP), DI
	MOVQ          x+8(FP), SI
	MOVQ          n+16(FP), CX
	VBROADCASTSS  unscale+24(FP), Z5
	VMOVUPD       0(DI), Z0  // lanes 0-7
	VMOVUPD       64(DI), Z1 // lanes 8-15
	MOVL          $0x7f800000, DX
	VPBROADCASTD  DX, Z6
	KXORW         K2, K2, K2
	XORQ          AX, AX

st512:
	CMPQ          AX, CX
	JGE           st512done
	PREFETCHT0    2048(SI)(AX*4)
	VMOVUPS       (SI)(AX*4), Z2
	VPANDD        Z6, Z2, Z3
	VPCMPEQD      Z6, Z3, K1 // exponent all ones
	KORW          K1, K2, K2
	VMULPS        Z5, Z2, Z2
	VCVTPS2PD     Y2, Z3
	VEXTRACTF64X4 $1, Z2, Y4
	VCVTPS2PD     Y4, Z4
	VMULPD        Z3, Z3, Z3 // exact: a 24-bit significand squared
	VMULPD        Z4, Z4, Z4
	VADDPD        Z3, Z0, Z0
	VADDPD        Z4, Z1, Z1
	ADDQ          $16, AX
	JMP           st512

st512done:
	VMOVUPD  Z0, 0(DI)
	VMOVUPD  Z1, 64(DI)
	KORTESTW K2, K2
	SETNE    ret+32(FP)
	VZEROUPPER
	RET

// func statsAVX2(acc *[16]float64, x *float32, n int, unscale float32) bool
// statsAVX512 on 8 lanes, 16 elements at a time; n is a multiple of 16.
TEXT ·statsAVX2(SB), NOSPLIT, $0-33
	MOVQ         acc+0(FP), DI
	MOVQ         x+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS unscale+24(FP), Y5
	VMOVUPD      0(DI), Y0   // lanes 0-3
	VMOVUPD      32(DI), Y1  // lanes 4-7
	VMOVUPD      64(DI), Y12 // lanes 8-11
	VMOVUPD      96(DI), Y13 // lanes 12-15
	MOVL         $0x7f800000, DX
	VMOVQ         DX, X6
	VPBROADCASTD X6, Y6
	VPXOR        Y7, Y7, Y7
	XORQ         AX, AX

st256:
	CMPQ         AX, CX
	JGE          st256done
	PREFETCHT0   2048(SI)(AX*4)
	VMOVUPS      (SI)(AX*4), Y2
	VMOVUPS      32(SI)(AX*4), Y3
	VPAND        Y6, Y2, Y4
	VPCMPEQD     Y6, Y4, Y4
	VPOR         Y4, Y7, Y7
	VPAND        Y6, Y3, Y4
	VPCMPEQD     Y6, Y4, Y4
	VPOR         Y4, Y7, Y7
	VMULPS       Y5, Y2, Y2
	VMULPS       Y5, Y3, Y3
	VCVTPS2PD    X2, Y8
	VEXTRACTF128 $1, Y2, X9
	VCVTPS2PD    X9, Y9
	VCVTPS2PD    X3, Y10
	VEXTRACTF128 $1, Y3, X11
	VCVTPS2PD    X11, Y11
	VMULPD       Y8, Y8, Y8
	VMULPD       Y9, Y9, Y9
	VMULPD       Y10, Y10, Y10
	VMULPD       Y11, Y11, Y11
	VADDPD       Y8, Y0, Y0
	VADDPD       Y9, Y1, Y1
	VADDPD       Y10, Y12, Y12
	VADDPD       Y11, Y13, Y13
	ADDQ         $16, AX
	JMP          st256

st256done:
	VMOVUPD Y0, 0(DI)
	VMOVUPD Y1, 32(DI)
	VMOVUPD Y12, 64(DI)
	VMOVUPD Y13, 96(DI)
	VPTEST  Y7, Y7
	SETNE   ret+32(FP)
	VZEROUPPER
	RET

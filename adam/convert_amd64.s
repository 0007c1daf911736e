//go:build !noasm

#include "textflag.h"

// 16-bit conversions on 16 lanes (AVX-512F), bitwise equal to BF16ToF32,
// F16ToF32, F32ToBF16 and F32ToF16 in dtype.go. n is a multiple of 16.

// func widenBF16AVX512(dst *float32, src *uint16, n int)
TEXT ·widenBF16AVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ AX, AX

wbf:
	CMPQ      AX, CX
	JGE       wbfdone
	VPMOVZXWD (SI)(AX*2), Z0
	VPSLLD    $16, Z0, Z0
	VMOVUPS   Z0, (DI)(AX*4)
	ADDQ      $16, AX
	JMP       wbf

wbfdone:
	VZEROUPPER
	RET

// func widenF16AVX512(dst *float32, src *uint16, n int)
TEXT ·widenF16AVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ AX, AX

wf:
	CMPQ      AX, CX
	JGE       wfdone
	VCVTPH2PS (SI)(AX*2), Z0
	VMOVUPS   Z0, (DI)(AX*4)
	ADDQ      $16, AX
	JMP       wf

wfdone:
	VZEROUPPER
	RET

// func roundBF16AVX512(dst *uint16, src *float32, n int)
// Round to nearest even by integer arithmetic: (x + 0x7fff + ((x >> 16) & 1)) >> 16;
// a NaN keeps its sign and top payload with the quiet bit set: (x >> 16) | 0x40.
TEXT ·roundBF16AVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVL $0x7fff, DX
	VPBROADCASTD DX, Z4
	MOVL $1, DX
	VPBROADCASTD DX, Z5
	MOVL $0x40, DX
	VPBROADCASTD DX, Z6
	XORQ AX, AX

rbf:
	CMPQ    AX, CX
	JGE     rbfdone
	VMOVUPS (SI)(AX*4), Z0
	VPSRLD  $16, Z0, Z1    // x >> 16
	VPANDD  Z5, Z1, Z2     // lsb
	VPADDD  Z4, Z0, Z3     // x + 0x7fff
	VPADDD  Z2, Z3, Z3     // + lsb
	VPSRLD  $16, Z3, Z3    // rounded
	VPORD   Z6, Z1, Z1     // NaN result
	VCMPPS  $3, Z0, Z0, K1 // x is NaN
	VMOVDQA32 Z1, K1, Z3
	VPMOVDW Z3, (DI)(AX*2)
	ADDQ    $16, AX
	JMP     rbf

rbfdone:
	VZEROUPPER
	RET

// func roundF16AVX512(dst *uint16, src *float32, n int)
TEXT ·roundF16AVX512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ AX, AX

rf:
	CMPQ      AX, CX
	JGE       rfdone
	VMOVUPS   (SI)(AX*4), Z0
	VCVTPS2PH $0, Z0, (DI)(AX*2) // round to nearest even
	ADDQ      $16, AX
	JMP       rf

rfdone:
	VZEROUPPER
	RET

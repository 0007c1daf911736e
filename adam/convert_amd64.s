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
	PREFETCHT0 2048(SI)(AX*2)
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
	PREFETCHT0 2048(SI)(AX*2)
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

// The same four conversions on 8 lanes (AVX2 and F16C); n is a multiple of 8.

// func widenBF16AVX2(dst *float32, src *uint16, n int)
TEXT ·widenBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ AX, AX

wbf2:
	CMPQ       AX, CX
	JGE        wbf2done
	PREFETCHT0 2048(SI)(AX*2)
	VPMOVZXWD  (SI)(AX*2), Y0
	VPSLLD     $16, Y0, Y0
	VMOVUPS    Y0, (DI)(AX*4)
	ADDQ       $8, AX
	JMP        wbf2

wbf2done:
	VZEROUPPER
	RET

// func widenF16AVX2(dst *float32, src *uint16, n int)
TEXT ·widenF16AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ AX, AX

wf2:
	CMPQ       AX, CX
	JGE        wf2done
	PREFETCHT0 2048(SI)(AX*2)
	VCVTPH2PS  (SI)(AX*2), Y0
	VMOVUPS    Y0, (DI)(AX*4)
	ADDQ       $8, AX
	JMP        wf2

wf2done:
	VZEROUPPER
	RET

// func roundBF16AVX2(dst *uint16, src *float32, n int)
// As roundBF16AVX512, the NaN lanes chosen by a blend, the 8 results packed
// to 16 bits by VPACKUSDW (every value fits: no saturation).
TEXT ·roundBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	MOVL         $0x7fff, DX
	VMOVQ         DX, X4
	VPBROADCASTD X4, Y4
	MOVL         $1, DX
	VMOVQ         DX, X5
	VPBROADCASTD X5, Y5
	MOVL         $0x40, DX
	VMOVQ         DX, X6
	VPBROADCASTD X6, Y6
	XORQ         AX, AX

rbf2:
	CMPQ         AX, CX
	JGE          rbf2done
	VMOVUPS      (SI)(AX*4), Y0
	VPSRLD       $16, Y0, Y1     // x >> 16
	VPAND        Y5, Y1, Y2      // lsb
	VPADDD       Y4, Y0, Y3      // x + 0x7fff
	VPADDD       Y2, Y3, Y3      // + lsb
	VPSRLD       $16, Y3, Y3     // rounded
	VPOR         Y6, Y1, Y1      // NaN result
	VCMPPS       $3, Y0, Y0, Y7  // x is NaN
	VBLENDVPS    Y7, Y1, Y3, Y3
	VEXTRACTI128 $1, Y3, X8
	VPACKUSDW    X8, X3, X3
	VMOVDQU      X3, (DI)(AX*2)
	ADDQ         $8, AX
	JMP          rbf2

rbf2done:
	VZEROUPPER
	RET

// func roundF16AVX2(dst *uint16, src *float32, n int)
TEXT ·roundF16AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ AX, AX

rf2:
	CMPQ      AX, CX
	JGE       rf2done
	VMOVUPS   (SI)(AX*4), Y0
	VCVTPS2PH $0, Y0, (DI)(AX*2) // round to nearest even
	ADDQ      $8, AX
	JMP       rf2

rf2done:
	VZEROUPPER
	RET

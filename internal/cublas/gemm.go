package cublas

import (
	"errors"
	"fmt"
	"math"
	"strings"
)

// DType is the element type of a matrix.
type DType int

const (
	BF16 DType = iota // bfloat16 (CUDA_R_16BF); the zero value
	F32               // float32 (CUDA_R_32F)
)

func (t DType) String() string {
	switch t {
	case BF16:
		return "bf16"
	case F32:
		return "f32"
	}
	return fmt.Sprintf("DType(%d)", int(t))
}

// Size is the element size in bytes.
func (t DType) Size() int64 {
	if t == F32 {
		return 4
	}
	return 2
}

// cudaDataType_t values (library_types.h).
const (
	cudaR32F  = 0  // CUDA_R_32F
	cudaR16BF = 14 // CUDA_R_16BF
)

func (t DType) cuda() uintptr {
	if t == F32 {
		return cudaR32F
	}
	return cudaR16BF
}

// Epilogue is what cuBLASLt does to the product before it stores C.
type Epilogue int

const (
	// None: C = alpha·A·B (+ C with Accumulate).
	None Epilogue = iota
	// Bias: C = alpha·A·B (+ C) + bias, bias [N] broadcast over the rows
	// (CUBLASLT_EPILOGUE_BIAS). bias has C's element type.
	Bias
	// GELUAuxBias: C = gelu(alpha·A·B (+ C) + bias), the pre-activation
	// alpha·A·B (+ C) + bias written to Aux, [M, N] with row stride N
	// (CUBLASLT_EPILOGUE_GELU_AUX_BIAS). gelu is cuBLASLt's, which the
	// tests hold to the tanh approximation 0.5·x·(1 + tanh(√(2/π)·(x +
	// 0.044715·x³))) at bf16 precision. C and Aux are bf16 and N a multiple
	// of 8 (cuBLASLt's rule for the aux leading dimension).
	GELUAuxBias
	// DGELU: C = (alpha·A·B (+ C)) · gelu'(Aux), Aux the pre-activation
	// that GELUAuxBias wrote, [M, N] with row stride N
	// (CUBLASLT_EPILOGUE_DGELU): the backward of the GELU through the
	// matmul that follows it. Same rules as GELUAuxBias.
	DGELU
)

func (e Epilogue) String() string {
	switch e {
	case None:
		return "none"
	case Bias:
		return "bias"
	case GELUAuxBias:
		return "gelu_aux_bias"
	case DGELU:
		return "dgelu"
	}
	return fmt.Sprintf("Epilogue(%d)", int(e))
}

// cublasLtEpilogue_t values (cublasLt.h).
const (
	epilogueDefault     = 1            // CUBLASLT_EPILOGUE_DEFAULT
	epilogueBias        = 4            // CUBLASLT_EPILOGUE_BIAS
	epilogueGELUAuxBias = 32 | 128 | 4 // CUBLASLT_EPILOGUE_GELU_AUX_BIAS: GELU (32) | AUX (128) | BIAS (4)
	epilogueDGELU       = 64 | 128     // CUBLASLT_EPILOGUE_DGELU
)

func (e Epilogue) cublas() uintptr {
	switch e {
	case Bias:
		return epilogueBias
	case GELUAuxBias:
		return epilogueGELUAuxBias
	case DGELU:
		return epilogueDGELU
	}
	return epilogueDefault
}

func (e Epilogue) hasBias() bool { return e == Bias || e == GELUAuxBias }
func (e Epilogue) hasAux() bool  { return e == GELUAuxBias || e == DGELU }

// GEMM is one matrix product in row-major terms: C = alpha·op(A)·op(B)
// (+ C), then the epilogue. All matrices are dense and row-major.
type GEMM struct {
	// C is [M, N]; the product's inner dimension is K.
	M, N, K int
	// A is [M, K], or [K, M] when TransA (op(A) is its transpose); B is
	// [K, N], or [N, K] when TransB.
	TransA, TransB bool
	// Batch is the number of products of a strided batch; 0 or 1: one.
	Batch int
	// StrideA, StrideB and StrideC are the elements between consecutive
	// members of a batch (ignored when Batch <= 1). A and B may be 0 (one
	// matrix for every member); C's members must not overlap.
	StrideA, StrideB, StrideC int64
	// AType is the element type of A and B (BF16 normally; F32 where
	// cuBLASLt supports it). CType is C's, BF16 or F32. The products are
	// computed in float32 (CUBLAS_COMPUTE_32F), alpha and beta are float32.
	AType, CType DType
	// Alpha scales the product; 0 means 1.
	Alpha float32
	// Accumulate adds the product to C (beta = 1); otherwise C is
	// overwritten (beta = 0) and need not hold numbers.
	Accumulate bool
	// Epilogue is what follows the product.
	Epilogue Epilogue
}

// String describes g in one line, e.g. "M=37 N=64 K=48 TransB bf16->f32
// epilogue=bias".
func (g GEMM) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "M=%d N=%d K=%d", g.M, g.N, g.K)
	if g.TransA {
		b.WriteString(" TransA")
	}
	if g.TransB {
		b.WriteString(" TransB")
	}
	if g.Batch > 1 {
		fmt.Fprintf(&b, " batch=%d strides=%d,%d,%d", g.Batch, g.StrideA, g.StrideB, g.StrideC)
	}
	fmt.Fprintf(&b, " %s->%s", g.AType, g.CType)
	if g.Alpha != 0 && g.Alpha != 1 {
		fmt.Fprintf(&b, " alpha=%g", g.Alpha)
	}
	if g.Accumulate {
		b.WriteString(" accumulate")
	}
	if g.Epilogue != None {
		fmt.Fprintf(&b, " epilogue=%s", g.Epilogue)
	}
	return b.String()
}

// check validates g and the device pointers for Matmul. It does not
// allocate when g is valid.
func check(g *GEMM, c, a, b, bias, aux uint64) error {
	if g == nil {
		return errors.New("cublas: nil GEMM")
	}
	if err := g.Validate(); err != nil {
		return err
	}
	if c == 0 || a == 0 || b == 0 {
		return fmt.Errorf("cublas: %v: a nil matrix pointer (c=%#x a=%#x b=%#x)", g.String(), c, a, b)
	}
	switch {
	case g.Epilogue.hasBias() && bias == 0:
		return fmt.Errorf("cublas: %v: the %s epilogue needs a bias pointer", g.String(), g.Epilogue)
	case !g.Epilogue.hasBias() && bias != 0:
		return fmt.Errorf("cublas: %v: a bias pointer without an epilogue that reads it (Bias, GELUAuxBias)", g.String())
	case g.Epilogue.hasAux() && aux == 0:
		return fmt.Errorf("cublas: %v: the %s epilogue needs an aux pointer", g.String(), g.Epilogue)
	case !g.Epilogue.hasAux() && aux != 0:
		return fmt.Errorf("cublas: %v: an aux pointer without an epilogue that uses it (GELUAuxBias, DGELU)", g.String())
	}
	return nil
}

// Validate reports what is wrong with g's shape, types and epilogue, or
// nil: sizes of at least 1 that fit cuBLAS's int32, known types, a batch's
// strides, the epilogues' rules.
func (g *GEMM) Validate() error {
	if g.M < 1 || g.N < 1 || g.K < 1 {
		return fmt.Errorf("cublas: %v: sizes must be >= 1", g.String())
	}
	if g.M > math.MaxInt32 || g.N > math.MaxInt32 || g.K > math.MaxInt32 {
		return fmt.Errorf("cublas: %v: a size beyond cuBLAS's int32", g.String())
	}
	if g.AType != BF16 && g.AType != F32 || g.CType != BF16 && g.CType != F32 {
		return fmt.Errorf("cublas: %v: unknown element type", g.String())
	}
	if g.Batch < 0 {
		return fmt.Errorf("cublas: %v: negative batch", g.String())
	}
	if g.Batch > 1 {
		if g.Batch > math.MaxInt32 {
			return fmt.Errorf("cublas: %v: a batch beyond cuBLAS's int32", g.String())
		}
		if g.StrideA < 0 || g.StrideB < 0 {
			return fmt.Errorf("cublas: %v: negative stride", g.String())
		}
		if g.StrideC < int64(g.M)*int64(g.N) {
			return fmt.Errorf("cublas: %v: StrideC %d < M*N = %d: the batch's outputs would overlap", g.String(), g.StrideC, int64(g.M)*int64(g.N))
		}
	}
	switch g.Epilogue {
	case None, Bias:
	case GELUAuxBias, DGELU:
		if g.CType != BF16 {
			return fmt.Errorf("cublas: %v: the %s epilogue needs a bf16 C (its aux matrix has C's type)", g.String(), g.Epilogue)
		}
		if g.N%8 != 0 {
			return fmt.Errorf("cublas: %v: the %s epilogue needs N a multiple of 8 (the aux leading dimension)", g.String(), g.Epilogue)
		}
	default:
		return fmt.Errorf("cublas: %v: unknown epilogue", g.String())
	}
	if g.Epilogue != None && g.Batch > 1 {
		return fmt.Errorf("cublas: %v: epilogues are for single GEMMs (Batch <= 1)", g.String())
	}
	return nil
}

// cublasOperation_t values (cublas_api.h).
const (
	opN = 0 // CUBLAS_OP_N
	opT = 1 // CUBLAS_OP_T
)

// layout is a column-major matrix as cublasLtMatrixLayoutCreate takes it:
// rows and cols of the stored matrix (before its op), leading dimension and
// batch stride in elements.
type layout struct {
	rows, cols, ld, stride int64
}

// colMajor is a GEMM as cuBLASLt computes it: D (m×n) = op(A) (m×k) ·
// op(B) (k×n), column-major, batch times.
type colMajor struct {
	m, n, k  int64
	opA, opB int // CUBLAS_OP_N or CUBLAS_OP_T
	a, b, c  layout
	batch    int64 // 1 for one product
}

// colMajorOf maps a row-major GEMM to cuBLAS's column-major one.
//
// Read column-major, a row-major [R, C] matrix with row stride C is the
// column-major [C, R] matrix with leading dimension C: its transpose. So
// the row-major C = op(A)·op(B) is the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ,
// with cuBLAS's A our B and its B our A, m = N, n = M, k = K:
//
//   - our B, [K, N] row-major, read column-major is Bᵀ [N, K], ld N: the
//     op(B)ᵀ wanted, so OP_N. With TransB it is stored [N, K], read as
//     [K, N] with ld K, which is op(B); its transpose is wanted: OP_T.
//   - our A likewise: [M, K] reads as Aᵀ [K, M], ld K, OP_N; with TransA,
//     stored [K, M], it reads as [M, K] with ld M, OP_T.
//   - C [M, N] reads as Cᵀ [N, M], ld N.
func colMajorOf(g *GEMM) colMajor {
	M, N, K := int64(g.M), int64(g.N), int64(g.K)
	cm := colMajor{m: N, n: M, k: K, opA: opN, opB: opN, batch: 1}
	cm.a = layout{rows: N, cols: K, ld: N}
	if g.TransB {
		cm.opA, cm.a = opT, layout{rows: K, cols: N, ld: K}
	}
	cm.b = layout{rows: K, cols: M, ld: K}
	if g.TransA {
		cm.opB, cm.b = opT, layout{rows: M, cols: K, ld: M}
	}
	cm.c = layout{rows: N, cols: M, ld: N}
	if g.Batch > 1 {
		cm.batch = int64(g.Batch)
		cm.a.stride, cm.b.stride, cm.c.stride = g.StrideB, g.StrideA, g.StrideC
	}
	return cm
}

// planKey identifies a plan: the GEMM less what the plan does not depend
// on (alpha, beta, a single GEMM's strides), and the alignment in bytes of
// every pointer, up to 256, since the heuristic picks kernels for it.
type planKey struct {
	g                                           GEMM
	alignA, alignB, alignC, alignBias, alignAux uint16
}

// keyOf returns the plan key of a valid GEMM and its pointers.
func keyOf(g *GEMM, c, a, b, bias, aux uint64) planKey {
	k := planKey{g: *g}
	k.g.Alpha, k.g.Accumulate = 0, false
	var sa, sb, sc int64 // batch strides in bytes
	if g.Batch <= 1 {
		k.g.Batch, k.g.StrideA, k.g.StrideB, k.g.StrideC = 0, 0, 0, 0
	} else {
		sa, sb, sc = g.StrideA*g.AType.Size(), g.StrideB*g.AType.Size(), g.StrideC*g.CType.Size()
	}
	k.alignA = alignment(a, sa)
	k.alignB = alignment(b, sb)
	k.alignC = alignment(c, sc)
	k.alignBias = alignment(bias, 0)
	k.alignAux = alignment(aux, 0)
	return k
}

// maxAlign is the alignment cuBLASLt's heuristic assumes by default
// (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES, cublasLt.h): 256 bytes.
const maxAlign = 256

// alignment is the largest power of two up to maxAlign that divides p and
// stride (a batch stride in bytes; 0 for none). A nil pointer counts as
// aligned.
func alignment(p uint64, stride int64) uint16 {
	v := p | uint64(stride) | maxAlign
	return uint16(v & -v)
}

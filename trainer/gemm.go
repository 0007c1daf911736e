package trainer

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

var impl gonum.Implementation

// gemm computes C = op(A) op(B) + beta C for row-major matrices through gonum's
// Sgemm (F = float32) or Dgemm (F = float64): C is m×n with stride ldc, op(A)
// is m×k (A is k×m when tA), op(B) is k×n (B is n×k when tB). It allocates
// nothing. gonum runs a product serially when it spans fewer than 4 of its
// 64×64 blocks and starts goroutines (allocating) otherwise; callers keep
// each call below that (see tileM, tileN).
func gemm[F float32 | float64](tA, tB bool, m, n, k int, a []F, lda int, b []F, ldb int, beta F, c []F, ldc int) {
	ta, tb := blas.NoTrans, blas.NoTrans
	if tA {
		ta = blas.Trans
	}
	if tB {
		tb = blas.Trans
	}
	switch a := any(a).(type) {
	case []float32:
		impl.Sgemm(ta, tb, m, n, k, 1, a, lda, any(b).([]float32), ldb, float32(beta), any(c).([]float32), ldc)
	case []float64:
		impl.Dgemm(ta, tb, m, n, k, 1, a, lda, any(b).([]float64), ldb, float64(beta), any(c).([]float64), ldc)
	}
}

// Tiles of C that one task computes with one serial gemm call: 3×1 of gonum's
// 64×64 blocks, under its threshold of 4 for going parallel. (On a 2-core
// Sapphire Rapids, 192×64 ran the training step about 4% faster than 64×192
// and 64×64.)
const (
	tileM = 192
	tileN = 64
)

// gemmJob is the product a Model's pool is computing, tile by tile.
type gemmJob[F float32 | float64] struct {
	tA, tB  bool
	m, n, k int
	a       []F
	lda     int
	b       []F
	ldb     int
	beta    F
	c       []F
	ldc     int
	bias    []F // if not nil, each tile's rows of C start as bias (beta is then 1)
	tilesN  int
}

// tile computes tile i of C (row-major over the tiles) with the whole k sum,
// so each element of C is produced by one serial gemm, the same way whatever
// the number of goroutines.
func (g *gemmJob[F]) tile(i, _ int) {
	ti, tj := i/g.tilesN, i%g.tilesN
	i0, j0 := ti*tileM, tj*tileN
	gemmTile(g.tA, g.tB, i0, min(i0+tileM, g.m), j0, min(j0+tileN, g.n), g.k, g.a, g.lda, g.b, g.ldb, g.beta, g.c, g.ldc, g.bias)
}

// gemmTile computes rows [i0, i1) and columns [j0, j1) of C = op(A) op(B) +
// beta C (see gemm); if bias is not nil, those rows of C start as bias and
// beta is taken as 1. The tile must be at most tileM×tileN.
func gemmTile[F float32 | float64](tA, tB bool, i0, i1, j0, j1, k int, a []F, lda int, b []F, ldb int, beta F, c []F, ldc int, bias []F) {
	c = c[i0*ldc+j0:]
	if bias != nil {
		for r := 0; r < i1-i0; r++ {
			copy(c[r*ldc:r*ldc+j1-j0], bias[j0:j1])
		}
		beta = 1
	}
	if tA {
		a = a[i0:]
	} else {
		a = a[i0*lda:]
	}
	if tB {
		b = b[j0*ldb:]
	} else {
		b = b[j0:]
	}
	gemm(tA, tB, i1-i0, j1-j0, k, a, lda, b, ldb, beta, c, ldc)
}

// gemmSerial is gemm for any m and n, tile by tile on the calling goroutine
// (so that gonum starts no goroutines of its own).
func gemmSerial[F float32 | float64](tA, tB bool, m, n, k int, a []F, lda int, b []F, ldb int, beta F, c []F, ldc int) {
	for i0 := 0; i0 < m; i0 += tileM {
		for j0 := 0; j0 < n; j0 += tileN {
			gemmTile(tA, tB, i0, min(i0+tileM, m), j0, min(j0+tileN, n), k, a, lda, b, ldb, beta, c, ldc, nil)
		}
	}
}

// transposeBlock is the side of the square blocks transposeJob copies, so
// that both the rows read and the rows written stay in cache.
const transposeBlock = 32

// transposeJob sets dst [cols, rows] = srcᵀ for src [rows, cols]; task i
// writes dst rows [i*transposeBlock, (i+1)*transposeBlock).
type transposeJob[F float32 | float64] struct {
	dst, src   []F
	rows, cols int
}

func (j *transposeJob[F]) task(i, _ int) {
	c0, c1 := i*transposeBlock, min((i+1)*transposeBlock, j.cols)
	for r0 := 0; r0 < j.rows; r0 += transposeBlock {
		r1 := min(r0+transposeBlock, j.rows)
		for c := c0; c < c1; c++ {
			d := j.dst[c*j.rows+r0 : c*j.rows+r1]
			for r := range d {
				d[r] = j.src[(r0+r)*j.cols+c]
			}
		}
	}
}

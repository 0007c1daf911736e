//go:build !amd64 || noasm

package adam

func simdPaths() []Path { return nil }

func simdKernel(lanes int, p, m, v, vmax, g *float32, n int, k *[9]float32, flags int) {
	panic("adam: no SIMD kernel in this build")
}

func simdKernelTo(lanes int, p, m, v, vmax, g, dp, dm, dv, dvmax, pc *float32, n int, k *[9]float32, flags int) {
	panic("adam: no SIMD kernel in this build")
}

func simdWiden(lanes int, d DType, dst []float32, src []uint16, n int) bool { return false }

func simdRound(lanes int, d DType, dst []uint16, src []float32, n int) bool { return false }

func simdScale(lanes int, x *float32, n int, a, b float32, flags int) {
	panic("adam: no SIMD kernel in this build")
}

func simdStats(lanes int, acc *[statLanes]float64, x *float32, n int, unscale float32) bool {
	panic("adam: no SIMD kernel in this build")
}

func simdCopyNT(lanes int, dst, src *float32, n int) {
	panic("adam: no SIMD kernel in this build")
}

func simdFenceNT() {}

//go:build !amd64 || noasm

package adam

func simdPaths() []Path { return nil }

func simdKernel(lanes int, p, m, v, vmax, g *float32, n int, k *[9]float32, flags int) {
	panic("adam: no SIMD kernel in this build")
}

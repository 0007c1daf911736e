package kernels

import (
	"fmt"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
)

// The GPU benchmarks: bench/gpu.sh runs them beside bench/torch_gpu.py.
// Bytes per parameter as in BENCHMARKS.md: fp32 AdamW reads p, g, m, v and
// writes p, m, v (28 B). A device-to-device copy of S bytes moves 2S.

// fillDevice writes non-zero values (a small ramp) into b.
func fillDevice(b testing.TB, e *env, buf *cuda.Buffer, v float32) {
	b.Helper()
	n := buf.Len() / 4
	const chunk = 1 << 24
	h, err := e.d.HostAlloc(4 * chunk)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Free()
	f := make([]float32, chunk)
	for i := range f {
		f[i] = v * (1 + float32(i%1000)*1e-3)
	}
	copy(h.Bytes(), bytesOf32(f))
	for lo := int64(0); lo < n; lo += chunk {
		m := min(chunk, n-lo)
		if err := e.s.CopyHtoD(buf, 4*lo, h, 0, 4*m); err != nil {
			b.Fatal(err)
		}
		if err := e.s.Sync(); err != nil {
			b.Fatal(err)
		}
	}
}

func gparams(b *testing.B, n int64) {
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gparam/s")
}

// BenchmarkGPUAdamW: one 268M-element fp32 subgroup (2^28), fp32 gradient.
func BenchmarkGPUAdamW(b *testing.B) {
	e := gpu(b)
	const n = 1 << 28
	var bufs [4]*cuda.Buffer
	for i := range bufs {
		var err error
		if bufs[i], err = e.d.Alloc(4 * n); err != nil {
			b.Fatal(err)
		}
		defer bufs[i].Free()
		fillDevice(b, e, bufs[i], []float32{1, 1e-2, 1e-4, 1e-3}[i])
	}
	st := State{Param: Vec{Buf: bufs[0], N: n}, ExpAvg: Vec{Buf: bufs[1], N: n}, ExpAvgSq: Vec{Buf: bufs[2], N: n}}
	g := Grad{DType: adam.F32, Vec: Vec{Buf: bufs[3], N: n}}
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.k.AdamW(e.s, &c, st, g, Copy16{}); err != nil { // warm-up
		b.Fatal(err)
	}
	e.s.Sync()
	b.SetBytes(28 * n)
	for b.Loop() {
		if err := e.k.AdamW(e.s, &c, st, g, Copy16{}); err != nil {
			b.Fatal(err)
		}
		if err := e.s.Sync(); err != nil {
			b.Fatal(err)
		}
	}
	gparams(b, n)
}

// BenchmarkGPUCopyDtoD: the device-to-device copy reference, 1 GiB (2 GiB
// moved per copy; SetBytes counts both).
func BenchmarkGPUCopyDtoD(b *testing.B) {
	e := gpu(b)
	const size = 1 << 30
	src, err := e.d.Alloc(size)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Free()
	dst, err := e.d.Alloc(size)
	if err != nil {
		b.Fatal(err)
	}
	defer dst.Free()
	e.s.CopyDtoD(dst, 0, src, 0, size)
	e.s.Sync()
	b.SetBytes(2 * size)
	for b.Loop() {
		e.s.CopyDtoD(dst, 0, src, 0, size)
		if err := e.s.Sync(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkGPUAdamWMulti: 128 tensors of 2M elements, one launch.
func BenchmarkGPUAdamWMulti(b *testing.B) {
	e := gpu(b)
	const tensors, n = 128, 2 << 20
	var ts []Tensor
	for range tensors {
		var bufs [4]*cuda.Buffer
		for i := range bufs {
			var err error
			if bufs[i], err = e.d.Alloc(4 * n); err != nil {
				b.Fatal(err)
			}
			defer bufs[i].Free()
			e.s.Memset(bufs[i], 0, 4*n, 0x3c) // 0x3c3c3c3c: 0.0115
		}
		ts = append(ts, Tensor{
			State: State{Param: Vec{Buf: bufs[0], N: n}, ExpAvg: Vec{Buf: bufs[1], N: n}, ExpAvgSq: Vec{Buf: bufs[2], N: n}},
			Grad:  Vec{Buf: bufs[3], N: n},
		})
	}
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	if err := e.k.AdamWMulti(e.s, &c, ts, adam.F32, 0); err != nil {
		b.Fatal(err)
	}
	e.s.Sync()
	b.SetBytes(28 * tensors * n)
	for b.Loop() {
		if err := e.k.AdamWMulti(e.s, &c, ts, adam.F32, 0); err != nil {
			b.Fatal(err)
		}
		if err := e.s.Sync(); err != nil {
			b.Fatal(err)
		}
	}
	gparams(b, tensors*n)
}

// BenchmarkGPUPinned: 1 GiB pinned H2D, D2H, and both at once on two
// streams (SetBytes counts both directions there).
func BenchmarkGPUPinned(b *testing.B) {
	e := gpu(b)
	const size = 1 << 30
	for _, kind := range []string{"HostAlloc", "HostRegister"} {
		alloc := e.d.HostAlloc
		if kind == "HostRegister" {
			alloc = e.d.HostRegister
		}
		h1, err := alloc(size)
		if err != nil {
			b.Fatal(err)
		}
		h2, err := alloc(size)
		if err != nil {
			b.Fatal(err)
		}
		d1, _ := e.d.Alloc(size)
		d2, _ := e.d.Alloc(size)
		for i := range h1.Bytes() {
			h1.Bytes()[i] = byte(i)
		}
		s2, _ := e.d.NewStream()
		for _, dir := range []string{"H2D", "D2H", "H2D+D2H"} {
			b.Run(fmt.Sprintf("%s/%s", kind, dir), func(b *testing.B) {
				run := func() {
					if dir != "D2H" {
						e.s.CopyHtoD(d1, 0, h1, 0, size)
					}
					if dir != "H2D" {
						s2.CopyDtoH(h2, 0, d2, 0, size)
					}
					if err := e.s.Sync(); err != nil {
						b.Fatal(err)
					}
					if err := s2.Sync(); err != nil {
						b.Fatal(err)
					}
				}
				run()
				bytes := int64(size)
				if dir == "H2D+D2H" {
					bytes *= 2
				}
				b.SetBytes(bytes)
				for b.Loop() {
					run()
				}
			})
		}
		s2.Free()
		d1.Free()
		d2.Free()
		h1.Free()
		h2.Free()
	}
}

// BenchmarkGPUGradStats: the non-finite check and sum of squares over one
// 2^30-element bf16 gradient (2 GiB read, 2 B/param), in the CPU's order.
func BenchmarkGPUGradStats(b *testing.B) {
	e := gpu(b)
	const n = 1 << 30
	buf, err := e.d.Alloc(2 * n)
	if err != nil {
		b.Fatal(err)
	}
	defer buf.Free()
	fillDevice(b, e, buf, 1e-3)
	g := Grad{DType: adam.BF16, Vec: Vec{Buf: buf, N: n}}
	if _, _, err := e.k.GradStats(e.s, g, 1); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		if _, _, err := e.k.GradStats(e.s, g, 1); err != nil {
			b.Fatal(err)
		}
	}
	gparams(b, n)
	b.ReportMetric(2*float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
}

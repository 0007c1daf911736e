package scheduler

import (
	"fmt"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
)

// cudaDevice is Device on a CUDA device with dos's kernels.
type cudaDevice struct {
	d *cuda.Device
	k *kernels.Kernels
}

// cudaStream and cudaEvent are the Stream and Event of a CUDA device.
type cudaStream struct{ s *cuda.Stream }
type cudaEvent struct{ e *cuda.Event }

func (cudaStream) isStream() {}
func (cudaEvent) isEvent()   {}

// NewCUDA returns the Device for d, launching k's kernels. The caller
// keeps d and k open while the Device is in use, and closes them after.
func NewCUDA(d *cuda.Device, k *kernels.Kernels) Device { return &cudaDevice{d: d, k: k} }

// CUDAOf returns the CUDA device and kernels behind d, when NewCUDA made
// it (ok false for another Device, the simulated one): what
// perfmodel.CalibrateGPU measures.
func CUDAOf(d Device) (dev *cuda.Device, k *kernels.Kernels, ok bool) {
	c, ok := d.(*cudaDevice)
	if !ok {
		return nil, nil, false
	}
	return c.d, c.k, true
}

// CUDAStream returns s as a Stream of the CUDA Devices of its context: a
// trainer's stream, after whose work Engine.Prefetch starts its copies.
func CUDAStream(s *cuda.Stream) Stream { return cudaStream{s} }

func (c *cudaDevice) Name() string { return c.d.Name }

func (c *cudaDevice) Alloc(bytes int64) (Mem, error) { return c.d.Alloc(bytes) }

// AllocHost maps anonymous memory and pins it (cuMemHostRegister): zeroed
// and page-aligned.
func (c *cudaDevice) AllocHost(bytes int64) (Host, error) { return c.d.HostRegister(bytes) }

// mappedHost is MapHost's memory on a CUDA device: cuda.MapHost's, not
// pinned.
type mappedHost struct{ b []byte }

func (m *mappedHost) Bytes() []byte { return m.b }

func (c *cudaDevice) MapHost(bytes int64) (Host, error) {
	b, err := cuda.MapHost(bytes)
	if err != nil {
		return nil, err
	}
	return &mappedHost{b}, nil
}

func (c *cudaDevice) UnmapHost(h Host) error {
	m, ok := h.(*mappedHost)
	if !ok {
		return fmt.Errorf("scheduler: UnmapHost of a %T, not from MapHost", h)
	}
	b := m.b
	m.b = nil
	return cuda.UnmapHost(b)
}

func (c *cudaDevice) NewStream() (Stream, error) {
	s, err := c.d.NewStream()
	if err != nil {
		return nil, err
	}
	return cudaStream{s}, nil
}

func (c *cudaDevice) NewEvent() (Event, error) {
	e, err := c.d.NewEvent(true)
	if err != nil {
		return nil, err
	}
	return cudaEvent{e}, nil
}

func (c *cudaDevice) FreeMem(m Mem) error {
	if b, ok := m.(*cuda.Buffer); ok {
		return b.Free()
	}
	return fmt.Errorf("scheduler: FreeMem of a %T, not from a CUDA device", m)
}

func (c *cudaDevice) FreeHost(h Host) error {
	if b, ok := h.(*cuda.HostBuffer); ok {
		return b.Free()
	}
	return fmt.Errorf("scheduler: FreeHost of a %T, not from a CUDA device", h)
}

func (c *cudaDevice) FreeStream(s Stream) error {
	if x, ok := s.(cudaStream); ok {
		return x.s.Free()
	}
	return fmt.Errorf("scheduler: FreeStream of a %T, not from a CUDA device", s)
}

func (c *cudaDevice) FreeEvent(e Event) error {
	if x, ok := e.(cudaEvent); ok {
		return x.e.Free()
	}
	return fmt.Errorf("scheduler: FreeEvent of a %T, not from a CUDA device", e)
}

func (c *cudaDevice) H2D(s Stream, dst Mem, dstOff int64, src Host, srcOff, n int64) error {
	return s.(cudaStream).s.CopyHtoD(dst.(*cuda.Buffer), dstOff, src.(*cuda.HostBuffer), srcOff, n)
}

func (c *cudaDevice) D2H(s Stream, dst Host, dstOff int64, src Mem, srcOff, n int64) error {
	return s.(cudaStream).s.CopyDtoH(dst.(*cuda.HostBuffer), dstOff, src.(*cuda.Buffer), srcOff, n)
}

func (c *cudaDevice) D2D(s Stream, dst Mem, dstOff int64, src Mem, srcOff, n int64) error {
	return s.(cudaStream).s.CopyDtoD(dst.(*cuda.Buffer), dstOff, src.(*cuda.Buffer), srcOff, n)
}

func (c *cudaDevice) Record(e Event, s Stream) error { return e.(cudaEvent).e.Record(s.(cudaStream).s) }
func (c *cudaDevice) Wait(s Stream, e Event) error   { return s.(cudaStream).s.Wait(e.(cudaEvent).e) }
func (c *cudaDevice) Sync(e Event) error             { return e.(cudaEvent).e.Sync() }

func (c *cudaDevice) Elapsed(a, b Event) (time.Duration, error) {
	return cuda.Elapsed(a.(cudaEvent).e, b.(cudaEvent).e)
}

func kvec(v Vec) kernels.Vec {
	if v.Mem == nil {
		return kernels.Vec{}
	}
	return kernels.Vec{Buf: v.Mem.(*cuda.Buffer), Off: v.Off, N: v.N}
}

func (c *cudaDevice) AdamW(s Stream, co *adam.Coeffs, st State, gd adam.DType, g Vec, od adam.DType, out Vec) error {
	ks := kernels.State{Param: kvec(st.Param), ExpAvg: kvec(st.ExpAvg), ExpAvgSq: kvec(st.ExpAvgSq), MaxExpAvgSq: kvec(st.MaxExpAvgSq)}
	return c.k.AdamW(s.(cudaStream).s, co, ks, kernels.Grad{DType: gd, Vec: kvec(g)}, kernels.Copy16{DType: od, Vec: kvec(out)})
}

func (c *cudaDevice) Widen16(s Stream, d adam.DType, dst, src Vec) error {
	return c.k.Widen16(s.(cudaStream).s, d, kvec(dst), kvec(src))
}

func (c *cudaDevice) Zero(s Stream, m Mem, off, n int64) error {
	return s.(cudaStream).s.Memset(m.(*cuda.Buffer), off, n, 0)
}

func (c *cudaDevice) GradPartials(s Stream, gd adam.DType, g Vec, unscale float32, dst []float64) (bool, error) {
	return c.k.GradPartials(s.(cudaStream).s, kernels.Grad{DType: gd, Vec: kvec(g)}, unscale, dst)
}

func (c *cudaDevice) GradPartialsTo(s Stream, gd adam.DType, g Vec, unscale float32, dst, flag Vec) error {
	return c.k.GradPartialsTo(s.(cudaStream).s, kernels.Grad{DType: gd, Vec: kvec(g)}, unscale, kvec(dst), kvec(flag))
}

func (c *cudaDevice) GradStats(s Stream, gd adam.DType, g Vec, unscale float32) (bool, float64, error) {
	return c.k.GradStats(s.(cudaStream).s, kernels.Grad{DType: gd, Vec: kvec(g)}, unscale)
}

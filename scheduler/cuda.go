package scheduler

import (
	"fmt"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/cuda"
	"github.com/deepstates/dos/kernels"
)

// cudaDevice is Device on a CUDA device with dos's kernels.
type cudaDevice struct {
	d *cuda.Device
	k *kernels.Kernels
}

// NewCUDA returns the Device for d, launching k's kernels. The caller
// keeps d and k open while the Device is in use, and closes them after.
func NewCUDA(d *cuda.Device, k *kernels.Kernels) Device { return &cudaDevice{d: d, k: k} }

func (c *cudaDevice) Name() string { return c.d.Name }

func (c *cudaDevice) Alloc(bytes int64) (Mem, error) { return c.d.Alloc(bytes) }

// AllocHost maps anonymous memory and pins it (cuMemHostRegister): zeroed
// and page-aligned.
func (c *cudaDevice) AllocHost(bytes int64) (Host, error) { return c.d.HostRegister(bytes) }

func (c *cudaDevice) NewStream() (Stream, error) { return c.d.NewStream() }
func (c *cudaDevice) NewEvent() (Event, error)   { return c.d.NewEvent(true) }

func (c *cudaDevice) Free(x any) error {
	switch x := x.(type) {
	case *cuda.Buffer:
		return x.Free()
	case *cuda.HostBuffer:
		return x.Free()
	case *cuda.Stream:
		return x.Free()
	case *cuda.Event:
		return x.Free()
	case nil:
		return nil
	}
	return fmt.Errorf("scheduler: Free of a %T, not from a CUDA device", x)
}

func (c *cudaDevice) H2D(s Stream, dst Mem, dstOff int64, src Host, srcOff, n int64) error {
	return s.(*cuda.Stream).CopyHtoD(dst.(*cuda.Buffer), dstOff, src.(*cuda.HostBuffer), srcOff, n)
}

func (c *cudaDevice) D2H(s Stream, dst Host, dstOff int64, src Mem, srcOff, n int64) error {
	return s.(*cuda.Stream).CopyDtoH(dst.(*cuda.HostBuffer), dstOff, src.(*cuda.Buffer), srcOff, n)
}

func (c *cudaDevice) Record(e Event, s Stream) error { return e.(*cuda.Event).Record(s.(*cuda.Stream)) }
func (c *cudaDevice) Wait(s Stream, e Event) error   { return s.(*cuda.Stream).Wait(e.(*cuda.Event)) }
func (c *cudaDevice) Sync(e Event) error             { return e.(*cuda.Event).Sync() }

func (c *cudaDevice) Elapsed(a, b Event) (time.Duration, error) {
	return cuda.Elapsed(a.(*cuda.Event), b.(*cuda.Event))
}

func kvec(v Vec) kernels.Vec {
	if v.Mem == nil {
		return kernels.Vec{}
	}
	return kernels.Vec{Buf: v.Mem.(*cuda.Buffer), Off: v.Off, N: v.N}
}

func (c *cudaDevice) AdamW(s Stream, co *adam.Coeffs, st State, gd adam.DType, g Vec, od adam.DType, out Vec) error {
	ks := kernels.State{Param: kvec(st.Param), ExpAvg: kvec(st.ExpAvg), ExpAvgSq: kvec(st.ExpAvgSq), MaxExpAvgSq: kvec(st.MaxExpAvgSq)}
	return c.k.AdamW(s.(*cuda.Stream), co, ks, kernels.Grad{DType: gd, Vec: kvec(g)}, kernels.Copy16{DType: od, Vec: kvec(out)})
}

func (c *cudaDevice) Widen16(s Stream, d adam.DType, dst, src Vec) error {
	return c.k.Widen16(s.(*cuda.Stream), d, kvec(dst), kvec(src))
}

func (c *cudaDevice) GradStats(s Stream, gd adam.DType, g Vec, unscale float32) (bool, float64, error) {
	return c.k.GradStats(s.(*cuda.Stream), kernels.Grad{DType: gd, Vec: kvec(g)}, unscale)
}

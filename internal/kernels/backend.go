package kernels

import (
	"fmt"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
)

// CaseBackend replays adam-case/v1 reference cases (package adamcase) on
// the GPU: each call uploads the state and gradient, runs the fused kernel
// and downloads the result. It is a correctness harness, not a fast path.
type CaseBackend struct {
	K *Kernels
	S *cuda.Stream
	D *cuda.Device
}

// Name returns "cuda/<device name>".
func (b CaseBackend) Name() string { return "cuda/" + b.D.Name }

// AllFinite runs GradStats on the device.
func (b CaseBackend) AllFinite(g adam.Grad) (bool, error) {
	dg, free, err := b.upload16or32(g)
	if err != nil {
		return false, err
	}
	defer free()
	ok, _, err := b.K.GradStats(b.S, dg, 1)
	return ok, err
}

// Step uploads, steps with AdamW and downloads.
func (b CaseBackend) Step(c *adam.Coeffs, s adam.State, g adam.Grad, out adam.Copy16) error {
	n := int64(len(s.Param))
	if n == 0 {
		return nil
	}
	var bufs []*cuda.Buffer
	defer func() {
		for _, x := range bufs {
			x.Free()
		}
	}()
	vec := func(f []float32) (Vec, error) {
		if f == nil {
			return Vec{}, nil
		}
		buf, err := b.put(bytesOf32(f))
		if err != nil {
			return Vec{}, err
		}
		bufs = append(bufs, buf)
		return Vec{Buf: buf, N: n}, nil
	}
	var st State
	var err error
	for _, x := range []struct {
		dst *Vec
		src []float32
	}{{&st.Param, s.Param}, {&st.ExpAvg, s.ExpAvg}, {&st.ExpAvgSq, s.ExpAvgSq}, {&st.MaxExpAvgSq, s.MaxExpAvgSq}} {
		if *x.dst, err = vec(x.src); err != nil {
			return err
		}
	}
	dg, freeG, err := b.upload16or32(g)
	if err != nil {
		return err
	}
	defer freeG()
	var dout Copy16
	if out.DType != 0 {
		buf, err := b.put(bytesOf16(out.Data))
		if err != nil {
			return err
		}
		bufs = append(bufs, buf)
		dout = Copy16{DType: out.DType, Vec: Vec{Buf: buf, N: n}}
	}
	if err := b.K.AdamW(b.S, c, st, dg, dout); err != nil {
		return err
	}
	for _, x := range []struct {
		v   Vec
		dst []byte
	}{{st.Param, bytesOf32(s.Param)}, {st.ExpAvg, bytesOf32(s.ExpAvg)}, {st.ExpAvgSq, bytesOf32(s.ExpAvgSq)},
		{st.MaxExpAvgSq, bytesOf32(s.MaxExpAvgSq)}, {dout.Vec, bytesOf16(out.Data)}} {
		if x.v.Buf == nil {
			continue
		}
		if err := b.get(x.dst, x.v.Buf); err != nil {
			return err
		}
	}
	return nil
}

func (b CaseBackend) upload16or32(g adam.Grad) (Grad, func(), error) {
	raw := bytesOf32(g.F32)
	if g.DType != adam.F32 {
		raw = bytesOf16(g.U16)
	}
	if len(raw) == 0 {
		return Grad{DType: g.DType}, func() {}, fmt.Errorf("kernels: empty gradient")
	}
	buf, err := b.put(raw)
	if err != nil {
		return Grad{}, nil, err
	}
	return Grad{DType: g.DType, Vec: Vec{Buf: buf, N: int64(g.Len())}}, func() { buf.Free() }, nil
}

// put copies host bytes to a new device buffer through pinned memory.
func (b CaseBackend) put(src []byte) (*cuda.Buffer, error) {
	h, err := b.D.HostAlloc(int64(len(src)))
	if err != nil {
		return nil, err
	}
	defer h.Free()
	copy(h.Bytes(), src)
	buf, err := b.D.Alloc(int64(len(src)))
	if err != nil {
		return nil, err
	}
	if err := b.S.CopyHtoD(buf, 0, h, 0, int64(len(src))); err != nil {
		buf.Free()
		return nil, err
	}
	if err := b.S.Sync(); err != nil {
		buf.Free()
		return nil, err
	}
	return buf, nil
}

// get copies a device buffer back into dst through pinned memory.
func (b CaseBackend) get(dst []byte, src *cuda.Buffer) error {
	h, err := b.D.HostAlloc(int64(len(dst)))
	if err != nil {
		return err
	}
	defer h.Free()
	if err := b.S.CopyDtoH(h, 0, src, 0, int64(len(dst))); err != nil {
		return err
	}
	if err := b.S.Sync(); err != nil {
		return err
	}
	copy(dst, h.Bytes())
	return nil
}

func bytesOf32(f []float32) []byte {
	if len(f) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&f[0])), 4*len(f))
}

func bytesOf16(u []uint16) []byte {
	if len(u) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&u[0])), 2*len(u))
}

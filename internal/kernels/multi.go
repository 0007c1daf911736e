package kernels

import (
	"fmt"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
)

// Tensor is one tensor of a multi-tensor AdamW launch: its state, gradient
// and optional copy, all with the launch's dtypes.
type Tensor struct {
	State
	Grad   Vec
	Copy16 Vec // ignored when the launch has no copy dtype
}

// MultiChunk is the number of elements one thread block of AdamWMulti
// updates.
const MultiChunk = 1 << 16

// tensorDesc mirrors adamw.cu's struct Tensor.
type tensorDesc struct {
	p, m, v, vmax, g, out uint64
	n                     int64
}

// AdamWMulti enqueues one AdamW step over many tensors in a single launch
// (the multi-tensor form, for many small tensors): every tensor has
// gradient dtype gd and copy dtype od (0 for none). The tensor and chunk
// tables go to the device through pinned memory; a call waits for the
// previous call's table upload before reusing it. Semantics per element
// are AdamW's.
//
// Errors: as AdamW, per tensor (the error names the tensor's index).
func (k *Kernels) AdamWMulti(s *cuda.Stream, c *adam.Coeffs, tensors []Tensor, gd, od adam.DType) error {
	gi, ok := dtypeIndex(gd)
	if !ok || gd == 0 {
		return fmt.Errorf("kernels: AdamWMulti: gradient dtype %v", gd)
	}
	oi, ok := dtypeIndex(od)
	if !ok || od == adam.F32 {
		return fmt.Errorf("kernels: AdamWMulti: copy dtype %v", od)
	}
	chunks := 0
	for i, t := range tensors {
		n := t.Param.N
		if err := checkState(t.State, c.AMSGrad, n); err != nil {
			return fmt.Errorf("tensor %d: %w", i, err)
		}
		if err := t.Grad.check(fmt.Sprintf("tensor %d gradient", i), elemSize(gd), n); err != nil {
			return err
		}
		if od != 0 {
			if err := t.Copy16.check(fmt.Sprintf("tensor %d 16-bit copy", i), 2, n); err != nil {
				return err
			}
		}
		chunks += int((n + MultiChunk - 1) / MultiChunk)
	}
	if chunks == 0 {
		return nil
	}
	tabBytes := int64(len(tensors))*int64(unsafe.Sizeof(tensorDesc{})) + 8*int64(chunks)
	k.mu.Lock()
	defer k.mu.Unlock()
	if err := k.tabDone.Sync(); err != nil { // the previous upload has left the pinned table
		return err
	}
	if k.tables == nil || k.tables.Len() < tabBytes {
		if err := k.grow(&k.tables, &k.hostTab, tabBytes); err != nil {
			return err
		}
	}
	h := k.hostTab.Bytes()
	descs := unsafe.Slice((*tensorDesc)(unsafe.Pointer(&h[0])), len(tensors))
	chunkOff := int64(len(tensors)) * int64(unsafe.Sizeof(tensorDesc{}))
	ch := unsafe.Slice((*[2]int32)(unsafe.Pointer(&h[chunkOff])), chunks)
	j := 0
	for i, t := range tensors {
		d := tensorDesc{
			p: t.Param.Buf.Ptr() + uint64(4*t.Param.Off), m: t.ExpAvg.Buf.Ptr() + uint64(4*t.ExpAvg.Off),
			v: t.ExpAvgSq.Buf.Ptr() + uint64(4*t.ExpAvgSq.Off), g: t.Grad.Buf.Ptr() + uint64(elemSize(gd)*t.Grad.Off),
			n: t.Param.N,
		}
		if c.AMSGrad {
			d.vmax = t.MaxExpAvgSq.Buf.Ptr() + uint64(4*t.MaxExpAvgSq.Off)
		}
		if od != 0 {
			d.out = t.Copy16.Buf.Ptr() + uint64(2*t.Copy16.Off)
		}
		descs[i] = d
		for lo := int64(0); lo < t.Param.N; lo += MultiChunk {
			ch[j] = [2]int32{int32(i), int32(lo / MultiChunk)}
			j++
		}
	}
	if err := s.CopyHtoD(k.tables, 0, k.hostTab, 0, tabBytes); err != nil {
		return err
	}
	if err := k.tabDone.Record(s); err != nil {
		return err
	}
	a := k.args
	a.Reset()
	a.Ptr(k.tables, 0).Ptr(k.tables, chunkOff).U64(MultiChunk)
	coefArgs(a, c)
	return k.multi[gi][oi].Launch(s, cuda.Dim3{X: uint32(chunks), Y: 1, Z: 1}, cuda.Dim3{X: Block, Y: 1, Z: 1}, 0, a)
}

package perfmodel

import (
	"unsafe"

	"github.com/deepstates/dos/internal/cuda"
)

// hostArrays maps the calibration's arrays as the engine maps the memory
// its CPU workers update (cuda.MapHost: outside the Go heap, transparent
// huge pages where the host gives them), so that the rates measured are
// those of that memory. The first mapping that fails is err, and later
// ones return nil; free unmaps them all.
type hostArrays struct {
	maps [][]byte
	err  error
}

func (h *hostArrays) bytes(n int) []byte {
	if h.err != nil {
		return nil
	}
	b, err := cuda.MapHost(int64(max(n, 1)))
	if err != nil {
		h.err = err
		return nil
	}
	h.maps = append(h.maps, b)
	return b
}

// f32 returns n zeroed float32 (nil after a failure).
func (h *hostArrays) f32(n int) []float32 {
	b := h.bytes(4 * n)
	if b == nil {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(b))), n)
}

// u16 returns n zeroed uint16 (nil after a failure).
func (h *hostArrays) u16(n int) []uint16 {
	b := h.bytes(2 * n)
	if b == nil {
		return nil
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(b))), n)
}

// free unmaps every array: none may be used after it.
func (h *hostArrays) free() {
	for _, b := range h.maps {
		cuda.UnmapHost(b)
	}
	h.maps = nil
}

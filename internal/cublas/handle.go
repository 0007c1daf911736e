package cublas

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"unsafe"

	"github.com/deepstates/dos/internal/cuda"
	"golang.org/x/sys/unix"
)

// WorkspaceBytes is the device workspace a Handle owns and offers cuBLASLt:
// 32 MiB, cuBLAS's recommendation for Hopper.
const WorkspaceBytes = 32 << 20

// ErrClosed is returned by Matmul on a closed Handle.
var ErrClosed = errors.New("cublas: use of a closed Handle")

// Error is a failed cuBLASLt call.
type Error struct {
	Call   string // the function and, where useful, the GEMM
	Status int    // the cublasStatus_t
	Name   string // e.g. CUBLAS_STATUS_NOT_SUPPORTED
	Msg    string // cuBLASLt's description of the status, when it has one
}

func (e *Error) Error() string {
	if e.Msg == "" {
		return fmt.Sprintf("cublas: %s: %s", e.Call, e.Name)
	}
	return fmt.Sprintf("cublas: %s: %s: %s", e.Call, e.Name, e.Msg)
}

// statusNames are the cublasStatus_t values (cublas_api.h), for when the
// library cannot name a status itself.
var statusNames = map[int]string{
	0:  "CUBLAS_STATUS_SUCCESS",
	1:  "CUBLAS_STATUS_NOT_INITIALIZED",
	3:  "CUBLAS_STATUS_ALLOC_FAILED",
	7:  "CUBLAS_STATUS_INVALID_VALUE",
	8:  "CUBLAS_STATUS_ARCH_MISMATCH",
	11: "CUBLAS_STATUS_MAPPING_ERROR",
	13: "CUBLAS_STATUS_EXECUTION_FAILED",
	14: "CUBLAS_STATUS_INTERNAL_ERROR",
	15: "CUBLAS_STATUS_NOT_SUPPORTED",
	16: "CUBLAS_STATUS_LICENSE_ERROR",
}

// statusNotSupported is CUBLAS_STATUS_NOT_SUPPORTED, the status of a GEMM
// for which the heuristic finds no algorithm.
const statusNotSupported = 15

// newError names status with cublasLtGetStatusName and
// cublasLtGetStatusString, or with statusNames without the library.
func newError(call string, status int) *Error {
	e := &Error{Call: call, Status: status}
	e.Name = cuda.CStringResult(lib.getStatusName, status)
	// The library names a status it does not know "unrecognized status"
	// (cuBLASLt 13) or "<unknown>": not a name.
	if !strings.HasPrefix(e.Name, "CUBLAS_STATUS_") {
		if n, ok := statusNames[status]; ok {
			e.Name = n
		} else {
			e.Name = fmt.Sprintf("cublasStatus_t(%d)", status)
		}
	}
	if msg := cuda.CStringResult(lib.getStatusString, status); msg != e.Name && msg != "<unknown>" {
		e.Msg = msg
	}
	return e
}

// CUBLAS_COMPUTE_32F (cublasComputeType_t, cublas_api.h): float32 products
// and accumulation.
const computeType32F = 68

// cublasLtMatmulDescAttributes_t values (cublasLt.h).
const (
	descTransA     = 3  // int32, cublasOperation_t
	descTransB     = 4  // int32
	descEpilogue   = 7  // uint32, cublasLtEpilogue_t
	descBiasPtr    = 8  // const void*
	descAuxPtr     = 11 // void*
	descAuxLD      = 12 // int64
	layoutBatch    = 5  // CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, int32 (cublasLtMatrixLayoutAttribute_t)
	layoutStride   = 6  // CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, int64
	prefWorkspace  = 1  // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64 (cublasLtMatmulPreferenceAttributes_t)
	prefMinAlignA  = 5  // CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32; B, C, D follow
	heuristicBytes = 96 // sizeof(cublasLtMatmulHeuristicResult_t): algo, workspaceSize, state, wavesCount, reserved[4]
	heurState      = 72 // offsetof(cublasLtMatmulHeuristicResult_t, state): after the 64-byte algo and the size_t
	algoBytes      = 64 // sizeof(cublasLtMatmulAlgo_t): uint64_t data[8]
)

// Offsets on a Handle's page, the host memory that cuBLASLt reads and
// writes during a call.
const (
	offAlpha = 0   // float32
	offBeta  = 4   // float32
	offOut   = 8   // an out-parameter: a created handle or descriptor
	offValue = 16  // an attribute's value, up to 8 bytes
	offCount = 24  // int32, the heuristic's returned count
	offAlgo  = 64  // the plan's algorithm, for cublasLtMatmul
	offHeur  = 128 // the heuristic's result
)

// Handle is a cuBLASLt handle for one stream, with its workspace and its
// plans. Safe for concurrent use.
type Handle struct {
	d *cuda.Device
	s *cuda.Stream

	mu     sync.Mutex // guards everything below, and the page's contents
	lt     uintptr    // cublasLtHandle_t
	ws     *cuda.Buffer
	page   []byte // mmap'd: off the Go heap
	plans  map[planKey]*plan
	closed bool
}

// plan is a GEMM shape's cuBLASLt state, built by the shape's first Matmul.
type plan struct {
	desc, la, lb, lc, pref uintptr // cuBLAS's A (our B), B (our A), C and D
	algo                   [algoBytes]byte
}

// New creates a handle that enqueues on s, a stream of d, with a
// WorkspaceBytes workspace on d.
//
// Errors: no cuBLASLt (see Available), a stream of another device, a freed
// stream or closed device, no memory for the workspace, cublasLtCreate
// failing.
func New(d *cuda.Device, s *cuda.Stream) (*Handle, error) {
	if d == nil || s == nil {
		return nil, errors.New("cublas: New: nil device or stream")
	}
	if s.Device() != d {
		return nil, fmt.Errorf("cublas: New: the stream belongs to device %d, not %d", s.Device().Ordinal, d.Ordinal)
	}
	if err := load(); err != nil {
		return nil, err
	}
	page, err := unix.Mmap(-1, 0, unix.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("cublas: New: mmap: %w", err)
	}
	h := &Handle{d: d, s: s, page: page, plans: map[planKey]*plan{}}
	if h.ws, err = d.Alloc(WorkspaceBytes); err != nil {
		unix.Munmap(page)
		return nil, err
	}
	if err := s.Lock(); err != nil {
		h.ws.Free()
		unix.Munmap(page)
		return nil, err
	}
	defer cuda.Unlock()
	if h.lt, err = h.create("cublasLtCreate", lib.create); err != nil {
		h.ws.Free()
		unix.Munmap(page)
		return nil, err
	}
	return h, nil
}

// Close waits for the handle's work on its stream, then destroys its plans
// and cublasLt handle and frees its workspace. A second Close does nothing.
func (h *Handle) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	// The workspace may be in use by enqueued work until the stream drains.
	err := h.s.Sync()
	if errors.Is(err, cuda.ErrFreed) {
		err = h.d.Sync()
	}
	if lerr := h.d.Lock(); lerr == nil {
		defer cuda.Unlock()
	} else if err == nil {
		err = lerr
	}
	for k, p := range h.plans {
		if derr := h.destroy(p); err == nil {
			err = derr
		}
		delete(h.plans, k)
	}
	if r := cuda.Call(lib.destroy, h.lt); r != 0 && err == nil {
		err = newError("cublasLtDestroy", r)
	}
	if ferr := h.ws.Free(); err == nil {
		err = ferr
	}
	if merr := unix.Munmap(h.page); merr != nil && err == nil {
		err = fmt.Errorf("cublas: munmap: %w", merr)
	}
	h.page = nil
	return err
}

// Matmul enqueues the GEMM g on the handle's stream: C = alpha·op(A)·op(B)
// (+ C with Accumulate), then g's epilogue, with c, a, b, bias and aux raw
// device pointers (CUdeviceptr; bias and aux 0 unless the epilogue uses
// them). It returns once the work is enqueued; a fault while it runs
// surfaces at the stream's next synchronization. Once g's shape has a plan
// (same GEMM but for Alpha and Accumulate, pointers of the same alignment)
// it does not allocate.
//
// Errors: an invalid GEMM or missing pointer (see GEMM.Validate), a closed
// Handle (ErrClosed), a freed stream (cuda.ErrFreed), cuBLASLt refusing the
// GEMM (an *Error: CUBLAS_STATUS_NOT_SUPPORTED when no algorithm fits).
func (h *Handle) Matmul(g *GEMM, c, a, b, bias, aux uint64) error {
	if err := check(g, c, a, b, bias, aux); err != nil {
		return err
	}
	key := keyOf(g, c, a, b, bias, aux)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return ErrClosed
	}
	if err := h.s.Lock(); err != nil {
		return err
	}
	defer cuda.Unlock()
	p := h.plans[key]
	if p == nil {
		var err error
		if p, err = h.build(g, key, bias, aux); err != nil {
			return err
		}
		h.plans[key] = p
	}
	// The descriptor holds the bias and aux pointers: this call's.
	if bias != 0 {
		if r := h.setAttr(lib.descSetAttribute, p.desc, descBiasPtr, bias, 8); r != 0 {
			return newError("cublasLtMatmulDescSetAttribute(BIAS_POINTER)", r)
		}
	}
	if aux != 0 {
		if r := h.setAttr(lib.descSetAttribute, p.desc, descAuxPtr, aux, 8); r != 0 {
			return newError("cublasLtMatmulDescSetAttribute(EPILOGUE_AUX_POINTER)", r)
		}
	}
	alpha, beta := g.Alpha, float32(0)
	if alpha == 0 {
		alpha = 1
	}
	if g.Accumulate {
		beta = 1
	}
	*(*float32)(unsafe.Pointer(&h.page[offAlpha])) = alpha
	*(*float32)(unsafe.Pointer(&h.page[offBeta])) = beta
	copy(h.page[offAlgo:offAlgo+algoBytes], p.algo[:])
	// cuBLAS's A is our B, its B our A (colMajorOf); C and D are both c.
	r := cuda.Call(lib.matmulCall, h.lt, p.desc, h.addr(offAlpha), uintptr(b), p.la, uintptr(a), p.lb,
		h.addr(offBeta), uintptr(c), p.lc, uintptr(c), p.lc, h.addr(offAlgo), uintptr(h.ws.Ptr()), WorkspaceBytes, h.s.Handle())
	if r != 0 {
		return newError("cublasLtMatmul("+g.String()+")", r)
	}
	return nil
}

// build makes g's plan: descriptor, layouts, preference, and the
// heuristic's best algorithm for them and the alignments in key. Hold h.mu
// and the stream's lock.
func (h *Handle) build(g *GEMM, key planKey, bias, aux uint64) (*plan, error) {
	cm := colMajorOf(g)
	p := &plan{}
	ok := false
	defer func() {
		if !ok {
			h.destroy(p)
		}
	}()
	var err error
	if p.desc, err = h.create("cublasLtMatmulDescCreate", lib.descCreate, computeType32F, cudaR32F); err != nil {
		return nil, err
	}
	type attr struct {
		name       string
		attr       uintptr
		val, bytes uint64
	}
	attrs := []attr{
		{"TRANSA", descTransA, uint64(cm.opA), 4},
		{"TRANSB", descTransB, uint64(cm.opB), 4},
		{"EPILOGUE", descEpilogue, uint64(g.Epilogue.cublas()), 4},
	}
	if g.Epilogue.hasBias() {
		attrs = append(attrs, attr{"BIAS_POINTER", descBiasPtr, bias, 8})
	}
	if g.Epilogue.hasAux() {
		// The aux matrix is laid out as cuBLAS's D: N rows (column-major),
		// leading dimension N; in our terms [M, N] with row stride N.
		attrs = append(attrs, attr{"EPILOGUE_AUX_POINTER", descAuxPtr, aux, 8}, attr{"EPILOGUE_AUX_LD", descAuxLD, uint64(cm.c.ld), 8})
	}
	for _, a := range attrs {
		if r := h.setAttr(lib.descSetAttribute, p.desc, a.attr, a.val, a.bytes); r != 0 {
			return nil, newError("cublasLtMatmulDescSetAttribute("+a.name+")", r)
		}
	}
	if p.la, err = h.layout(g.AType, cm.a, cm.batch); err != nil {
		return nil, err
	}
	if p.lb, err = h.layout(g.AType, cm.b, cm.batch); err != nil {
		return nil, err
	}
	if p.lc, err = h.layout(g.CType, cm.c, cm.batch); err != nil {
		return nil, err
	}
	if p.pref, err = h.create("cublasLtMatmulPreferenceCreate", lib.prefCreate); err != nil {
		return nil, err
	}
	if r := h.setAttr(lib.prefSetAttribute, p.pref, prefWorkspace, WorkspaceBytes, 8); r != 0 {
		return nil, newError("cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)", r)
	}
	// Alignments of cuBLAS's A (our B), B (our A), C and D (both our C).
	for i, al := range []uint16{key.alignB, key.alignA, key.alignC, key.alignC} {
		if r := h.setAttr(lib.prefSetAttribute, p.pref, prefMinAlignA+uintptr(i), uint64(al), 4); r != 0 {
			return nil, newError("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)", r)
		}
	}
	clear(h.page[offHeur : offHeur+heuristicBytes])
	*(*int32)(unsafe.Pointer(&h.page[offCount])) = 0
	r := cuda.Call(lib.algoGetHeuristic, h.lt, p.desc, p.la, p.lb, p.lc, p.lc, p.pref, 1, h.addr(offHeur), h.addr(offCount))
	call := fmt.Sprintf("cublasLtMatmulAlgoGetHeuristic(%v)", g.String())
	if r != 0 {
		return nil, newError(call, r)
	}
	if n := *(*int32)(unsafe.Pointer(&h.page[offCount])); n < 1 {
		e := newError(call, statusNotSupported)
		e.Msg = "no algorithm for this GEMM"
		return nil, e
	}
	if st := *(*int32)(unsafe.Pointer(&h.page[offHeur+heurState])); st != 0 {
		return nil, newError(call+" result", int(st))
	}
	copy(p.algo[:], h.page[offHeur:offHeur+algoBytes])
	ok = true
	return p, nil
}

// layout creates a matrix layout (cublasLtMatrixLayoutCreate) and sets its
// batch count and stride for a batch.
func (h *Handle) layout(t DType, l layout, batch int64) (uintptr, error) {
	m, err := h.create("cublasLtMatrixLayoutCreate", lib.layoutCreate, t.cuda(), uintptr(l.rows), uintptr(l.cols), uintptr(l.ld))
	if err != nil {
		return 0, err
	}
	if batch > 1 {
		if r := h.setAttr(lib.layoutSetAttribute, m, layoutBatch, uint64(batch), 4); r != 0 {
			cuda.Call(lib.layoutDestroy, m)
			return 0, newError("cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)", r)
		}
		if r := h.setAttr(lib.layoutSetAttribute, m, layoutStride, uint64(l.stride), 8); r != 0 {
			cuda.Call(lib.layoutDestroy, m)
			return 0, newError("cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)", r)
		}
	}
	return m, nil
}

// destroy frees a plan's cuBLASLt objects (those it has), returning the
// first failure.
func (h *Handle) destroy(p *plan) error {
	var err error
	for _, o := range []struct {
		name    string
		fn, obj uintptr
	}{
		{"cublasLtMatmulPreferenceDestroy", lib.prefDestroy, p.pref},
		{"cublasLtMatrixLayoutDestroy", lib.layoutDestroy, p.lc},
		{"cublasLtMatrixLayoutDestroy", lib.layoutDestroy, p.lb},
		{"cublasLtMatrixLayoutDestroy", lib.layoutDestroy, p.la},
		{"cublasLtMatmulDescDestroy", lib.descDestroy, p.desc},
	} {
		if o.obj == 0 {
			continue
		}
		if r := cuda.Call(o.fn, o.obj); r != 0 && err == nil {
			err = newError(o.name, r)
		}
	}
	*p = plan{}
	return err
}

// create calls fn(&out, args...), a cuBLASLt constructor, and returns out.
func (h *Handle) create(name string, fn uintptr, args ...uintptr) (uintptr, error) {
	*(*uintptr)(unsafe.Pointer(&h.page[offOut])) = 0
	r := cuda.Call(fn, append([]uintptr{h.addr(offOut)}, args...)...)
	if r != 0 {
		return 0, newError(name, r)
	}
	return *(*uintptr)(unsafe.Pointer(&h.page[offOut])), nil
}

// setAttr calls a cuBLASLt attribute setter fn(obj, attr, &val, bytes)
// with val (little-endian, bytes of 4 or 8) on the page. It does not
// allocate.
func (h *Handle) setAttr(fn, obj, attr uintptr, val, bytes uint64) int {
	*(*uint64)(unsafe.Pointer(&h.page[offValue])) = val
	return cuda.Call(fn, obj, attr, h.addr(offValue), uintptr(bytes))
}

// addr is the address of byte off of the page.
func (h *Handle) addr(off int) uintptr { return uintptr(unsafe.Pointer(&h.page[off])) }

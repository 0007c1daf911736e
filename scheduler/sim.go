package scheduler

import (
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// ErrInjected is the error of an operation the simulated device was told
// to fail (SimOptions.FailAt).
var ErrInjected = errors.New("scheduler: injected device fault")

// ErrSimOutOfMemory is Sim.Alloc's error past SimOptions.Capacity.
var ErrSimOutOfMemory = errors.New("scheduler: simulated device out of memory")

// SimOptions configures a simulated device.
type SimOptions struct {
	// Capacity is the device memory in bytes; 0 means 1 GiB.
	Capacity int64
	// FailAt, when > 0, makes the FailAt-th copy or launch (H2D, D2H,
	// D2D, AdamW, Widen16, Zero, counted from 1 over the device's life) fail
	// with ErrInjected, doing nothing.
	FailAt int
	// Profile, when set, gives each operation a duration from its fits
	// (H2D, D2H, Update, Convert) on a virtual clock that Elapsed reads;
	// without it every operation takes 1 µs.
	Profile *perfmodel.GPUProfile
}

// Sim is the simulated device: a test and planning device, never a
// stand-in for the product's GPU path (DESIGN.md). Its memory is host
// memory; it executes each operation at once, when enqueued, with the
// CPU's kernels (adam.DefaultPath), which is a valid order of the work
// whenever the caller enqueues in an order that respects its own
// dependencies, and it checks that the caller does (simorder.go): an
// operation that reads data before the operation writing them is known
// complete, by its stream, the waits and the host's syncs, fails with
// ErrOrder. Streams, events and lanes keep a virtual clock: an operation
// starts when its stream and its lane (H2D, D2H or compute) are free, and
// events carry the time, so Elapsed gives the schedule's virtual
// timeline.
type Sim struct {
	opts SimOptions

	mu       sync.Mutex
	syncs    int // Sync calls so far
	failSync int // the Sync call that fails (FailSync), 0 for none
	used     int64
	ops      int              // copies and launches so far
	lanes    [3]time.Duration // H2D, D2H, compute: when each is free

	// The ordering check (simorder.go).
	host     map[uint64]*vclock    // per goroutine: what it knows complete (its Syncs; hostClock)
	global   vclock                // the host clock without simGoroutineClocks
	pub      map[handoff]*vclock   // HostPublish's
	stack    [64]byte              // hostClock's scratch
	pos      [maxSimStreams]uint32 // operations enqueued per stream id
	live     [maxSimStreams]bool   // stream ids in use
	maxID    int                   // stream ids used so far: [0, maxID)
	orderErr error                 // the first ErrOrder
	logging  bool                  // tests: log every call
	log      []simCall
}

type simMem struct {
	b  []byte
	sh shadow
}
type simHost struct {
	b      []byte
	sh     shadow
	mapped bool // MapHost's: no copy may touch it
}
type simStream struct {
	id uint8
	t  time.Duration
	vc vclock // what is known complete before its next operation
}
type simEvent struct {
	t      time.Duration
	stream *simStream
	vc     vclock // what is complete when it is
}

func (m *simMem) Len() int64     { return int64(len(m.b)) }
func (h *simHost) Bytes() []byte { return h.b }

// NewSim returns a simulated device.
func NewSim(opts SimOptions) *Sim {
	if opts.Capacity == 0 {
		opts.Capacity = 1 << 30
	}
	return &Sim{opts: opts}
}

// FailAfter makes the k-th copy or launch from now (k >= 1) fail with
// ErrInjected (SimOptions.FailAt); 0 clears it.
func (s *Sim) FailAfter(k int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.opts.FailAt = 0
	if k > 0 {
		s.opts.FailAt = s.ops + k
	}
}

// Ops returns the number of copies and launches enqueued so far, failed
// ones included.
func (s *Sim) Ops() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ops
}

// Used returns the device memory allocated and not freed, in bytes.
func (s *Sim) Used() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used
}

// Name returns "sim".
func (s *Sim) Name() string { return "sim" }

// Alloc returns zeroed memory. Errors: bytes <= 0, ErrSimOutOfMemory.
func (s *Sim) Alloc(bytes int64) (Mem, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if bytes <= 0 {
		return nil, fmt.Errorf("scheduler: sim Alloc(%d): want > 0 bytes", bytes)
	}
	if s.used+bytes > s.opts.Capacity {
		return nil, fmt.Errorf("%w: %d bytes wanted, %d of %d free", ErrSimOutOfMemory, bytes, s.opts.Capacity-s.used, s.opts.Capacity)
	}
	s.used += bytes
	return &simMem{b: alignedBytes(bytes)}, nil
}

// AllocHost returns zeroed host memory. Errors: bytes <= 0.
func (s *Sim) AllocHost(bytes int64) (Host, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("scheduler: sim AllocHost(%d): want > 0 bytes", bytes)
	}
	return &simHost{b: alignedBytes(bytes)}, nil
}

// MapHost returns bytes of zeroed host memory that no copy may touch:
// H2D and D2H refuse it. Errors: bytes <= 0.
func (s *Sim) MapHost(bytes int64) (Host, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("scheduler: sim MapHost(%d): want > 0 bytes", bytes)
	}
	return &simHost{b: alignedBytes(bytes), mapped: true}, nil
}

// UnmapHost releases MapHost's memory. Errors: memory AllocHost returned,
// or another device's.
func (s *Sim) UnmapHost(h Host) error {
	x, ok := h.(*simHost)
	if !ok || !x.mapped {
		return fmt.Errorf("scheduler: sim UnmapHost of a %T not from MapHost", h)
	}
	x.b = nil
	return nil
}

// alignedBytes returns n zeroed bytes, 64-byte aligned (float32 and
// uint16 views need 4).
func alignedBytes(n int64) []byte {
	b := make([]byte, n+64)
	off := (64 - int(uintptr(unsafe.Pointer(&b[0]))%64)) % 64
	return b[off : off+int(n) : off+int(n)]
}

// NewStream returns a stream. Errors: more than 32 streams alive.
func (s *Sim) NewStream() (Stream, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range s.live {
		if !s.live[id] {
			s.live[id] = true
			s.maxID = max(s.maxID, id+1)
			ss := &simStream{id: uint8(id)}
			ss.vc[id] = s.pos[id] // a reused id goes on counting
			return ss, nil
		}
	}
	return nil, fmt.Errorf("scheduler: sim: more than %d streams", maxSimStreams)
}

func (s *Sim) NewEvent() (Event, error) { return &simEvent{}, nil }

func (*simStream) isStream() {}
func (*simEvent) isEvent()   {}

// FreeMem releases device memory. Errors: memory from another device.
func (s *Sim) FreeMem(m Mem) error {
	x, ok := m.(*simMem)
	if !ok {
		return fmt.Errorf("scheduler: FreeMem of a %T, not from the simulated device", m)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if x.b != nil {
		s.used -= int64(len(x.b))
		x.b = nil
	}
	return nil
}

// FreeHost releases pinned host memory. Errors: memory from another
// device.
func (s *Sim) FreeHost(h Host) error {
	x, ok := h.(*simHost)
	if !ok || x.mapped {
		return fmt.Errorf("scheduler: FreeHost of a %T, not from the simulated device's AllocHost", h)
	}
	x.b = nil
	return nil
}

// FreeStream releases a stream's id for a new one. Errors: a stream from
// another device.
func (s *Sim) FreeStream(st Stream) error {
	x, ok := st.(*simStream)
	if !ok {
		return fmt.Errorf("scheduler: FreeStream of a %T, not from the simulated device", st)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.live[x.id] = false
	return nil
}

// FreeEvent does nothing. Errors: an event from another device.
func (s *Sim) FreeEvent(e Event) error {
	if _, ok := e.(*simEvent); !ok {
		return fmt.Errorf("scheduler: FreeEvent of a %T, not from the simulated device", e)
	}
	return nil
}

const (
	laneH2D = iota
	laneD2H
	laneGPU
)

// op counts an operation of kind with uses us, fails it when told to or
// when out of order, and advances the virtual clocks of its stream and
// lane by d. s.mu is held.
func (s *Sim) op(st Stream, lane int, d time.Duration, kind uint8, us *uses) error {
	s.ops++
	if s.ops == s.opts.FailAt {
		return fmt.Errorf("%w (operation %d)", ErrInjected, s.ops)
	}
	ss := st.(*simStream)
	ss.vc.join(s.hostClock())
	if err := s.order(ss, kind, us); err != nil {
		return err
	}
	start := max(ss.t, s.lanes[lane])
	ss.t = start + d
	s.lanes[lane] = ss.t
	return nil
}

func (s *Sim) dur(f perfmodel.Fit, size int64) time.Duration {
	if s.opts.Profile == nil {
		return time.Microsecond
	}
	return time.Duration(f.Time(float64(size)) * 1e9)
}

func (s *Sim) gpu() *perfmodel.GPUProfile {
	if s.opts.Profile == nil {
		return &perfmodel.GPUProfile{}
	}
	return s.opts.Profile
}

func span(what string, b []byte, off, n int64) error {
	if b == nil {
		return fmt.Errorf("scheduler: sim %s: freed memory", what)
	}
	if off < 0 || n < 0 || off > int64(len(b)) || n > int64(len(b))-off {
		return fmt.Errorf("scheduler: sim %s: range [%d, %d) outside %d bytes", what, off, off+n, len(b))
	}
	return nil
}

func (s *Sim) H2D(st Stream, dst Mem, dstOff int64, src Host, srcOff, n int64) error {
	d, h := dst.(*simMem), src.(*simHost)
	if err := firstErr(span("H2D", d.b, dstOff, n), span("H2D", h.b, srcOff, n), pinnedHost("H2D", h)); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var us uses
	us.add(memUse(d, dstOff, n, false, true))
	us.add(hostUse(h, srcOff, n, true, false))
	if err := s.op(st, laneH2D, s.dur(s.gpu().H2D, n), simH2D, &us); err != nil {
		return err
	}
	s.logCall(simCall{kind: simH2D, stream: st.(*simStream).id, dst: d, src: h, dstOff: dstOff, srcOff: srcOff, n: n})
	copy(d.b[dstOff:dstOff+n], h.b[srcOff:srcOff+n])
	return nil
}

// pinnedHost refuses a copy of op on MapHost's memory, which a CUDA
// device could not copy at PCIe speed (it is not pinned).
func pinnedHost(op string, h *simHost) error {
	if h.mapped {
		return fmt.Errorf("scheduler: sim %s on host memory from MapHost, which is not pinned", op)
	}
	return nil
}

func (s *Sim) D2D(st Stream, dst Mem, dstOff int64, src Mem, srcOff, n int64) error {
	d, r := dst.(*simMem), src.(*simMem)
	if err := firstErr(span("D2D", d.b, dstOff, n), span("D2D", r.b, srcOff, n)); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var us uses
	us.add(memUse(d, dstOff, n, false, true))
	us.add(memUse(r, srcOff, n, true, false))
	if err := s.op(st, laneGPU, s.dur(s.gpu().Convert, n/4), simD2D, &us); err != nil {
		return err
	}
	s.logCall(simCall{kind: simD2D, stream: st.(*simStream).id, dst: d, dstOff: dstOff, srcOff: srcOff, n: n})
	copy(d.b[dstOff:dstOff+n], r.b[srcOff:srcOff+n])
	return nil
}

func (s *Sim) D2H(st Stream, dst Host, dstOff int64, src Mem, srcOff, n int64) error {
	h, d := dst.(*simHost), src.(*simMem)
	if err := firstErr(span("D2H", h.b, dstOff, n), span("D2H", d.b, srcOff, n), pinnedHost("D2H", h)); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var us uses
	us.add(hostUse(h, dstOff, n, false, true))
	us.add(memUse(d, srcOff, n, true, false))
	if err := s.op(st, laneD2H, s.dur(s.gpu().D2H, n), simD2H, &us); err != nil {
		return err
	}
	s.logCall(simCall{kind: simD2H, stream: st.(*simStream).id, dst: h, src: d, dstOff: dstOff, srcOff: srcOff, n: n})
	copy(h.b[dstOff:dstOff+n], d.b[srcOff:srcOff+n])
	return nil
}

func (s *Sim) Record(e Event, st Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, ss := e.(*simEvent), st.(*simStream)
	ss.vc.join(s.hostClock())
	ev.t, ev.stream, ev.vc = ss.t, ss, ss.vc
	s.logCall(simCall{kind: simRecord, stream: ss.id, ev: ev})
	return nil
}

func (s *Sim) Wait(st Stream, e Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ss, ev := st.(*simStream), e.(*simEvent)
	ss.t = max(ss.t, ev.t)
	ss.vc.join(&ev.vc)
	s.logCall(simCall{kind: simWait, stream: ss.id, ev: ev})
	return nil
}

// Sync returns at once: the work is done when enqueued; the host now
// knows it complete. The call FailSync named fails with ErrInjected, as a
// fault inside a real device surfaces when waiting.
func (s *Sim) Sync(e Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.syncs++
	if s.syncs == s.failSync {
		return fmt.Errorf("%w (a fault on the device, seen at wait %d)", ErrInjected, s.syncs)
	}
	ev := e.(*simEvent)
	s.hostClock().join(&ev.vc)
	s.logCall(simCall{kind: simSync, ev: ev})
	return nil
}

// FailSync makes the k-th Sync from now (k >= 1) fail with ErrInjected,
// as a fault inside the device would; 0 clears it.
func (s *Sim) FailSync(k int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failSync = 0
	if k > 0 {
		s.failSync = s.syncs + k
	}
}

// Elapsed returns the virtual time from a to b.
func (s *Sim) Elapsed(a, b Event) (time.Duration, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return b.(*simEvent).t - a.(*simEvent).t, nil
}

func f32s(v Vec) ([]float32, error) {
	if v.Mem == nil {
		return nil, errors.New("scheduler: sim: no memory")
	}
	b := v.Mem.(*simMem).b
	if err := span("vector", b, 4*v.Off, 4*v.N); err != nil {
		return nil, err
	}
	if v.N == 0 {
		return nil, nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[4*v.Off])), v.N), nil
}

func u16s(v Vec) ([]uint16, error) {
	if v.Mem == nil {
		return nil, errors.New("scheduler: sim: no memory")
	}
	b := v.Mem.(*simMem).b
	if err := span("vector", b, 2*v.Off, 2*v.N); err != nil {
		return nil, err
	}
	if v.N == 0 {
		return nil, nil
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(&b[2*v.Off])), v.N), nil
}

func simGrad(gd adam.DType, g Vec) (adam.Grad, error) {
	if gd == adam.F32 {
		f, err := f32s(g)
		return adam.GradF32(f), err
	}
	u, err := u16s(g)
	return adam.Grad16(gd, u), err
}

func (s *Sim) AdamW(st Stream, c *adam.Coeffs, x State, gd adam.DType, g Vec, od adam.DType, out Vec) error {
	var as adam.State
	var errs [4]error
	as.Param, errs[0] = f32s(x.Param)
	as.ExpAvg, errs[1] = f32s(x.ExpAvg)
	as.ExpAvgSq, errs[2] = f32s(x.ExpAvgSq)
	if c.AMSGrad {
		as.MaxExpAvgSq, errs[3] = f32s(x.MaxExpAvgSq)
	}
	if err := firstErr(errs[:]...); err != nil {
		return err
	}
	ag, err := simGrad(gd, g)
	if err != nil {
		return err
	}
	var o adam.Copy16
	if od != 0 {
		u, err := u16s(out)
		if err != nil {
			return err
		}
		o = adam.Copy16{DType: od, Data: u}
	}
	if ag.Len() != len(as.Param) || len(as.ExpAvg) != len(as.Param) || len(as.ExpAvgSq) != len(as.Param) || (od != 0 && len(o.Data) != len(as.Param)) {
		return errors.New("scheduler: sim AdamW: lengths differ")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var us uses
	us.add(vecUse(g, elemBytes(gd), true, false))
	arrays := [...]Vec{x.Param, x.ExpAvg, x.ExpAvgSq, x.MaxExpAvgSq}
	for _, v := range arrays[:3+boolInt(c.AMSGrad)] {
		us.add(vecUse(v, 4, true, true))
	}
	if od != 0 {
		us.add(vecUse(out, 2, false, true))
	}
	if err := s.op(st, laneGPU, s.dur(s.gpu().Update, int64(len(as.Param))), simAdamW, &us); err != nil {
		return err
	}
	s.logCall(simCall{kind: simAdamW, stream: st.(*simStream).id, dst: x.Param.Mem, src: g.Mem, dstOff: x.Param.Off, srcOff: g.Off, n: x.Param.N})
	adam.DefaultPath.Step(c, as, ag, o)
	return nil
}

func (s *Sim) Widen16(st Stream, d adam.DType, dst, src Vec) error {
	f, err := f32s(dst)
	if err != nil {
		return err
	}
	u, err := u16s(src)
	if err != nil {
		return err
	}
	if len(f) != len(u) {
		return errors.New("scheduler: sim Widen16: lengths differ")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var us uses
	us.add(vecUse(src, 2, true, false))
	us.add(vecUse(dst, 4, false, true))
	if err := s.op(st, laneGPU, s.dur(s.gpu().Convert, int64(len(f))), simWiden, &us); err != nil {
		return err
	}
	s.logCall(simCall{kind: simWiden, stream: st.(*simStream).id, dst: dst.Mem, src: src.Mem, dstOff: dst.Off, srcOff: src.Off, n: dst.N})
	adam.DefaultPath.Widen16(d, f, u)
	return nil
}

// Zero sets n bytes of m from off to zero: a write on the compute lane,
// timed as a cast of n/4 elements.
func (s *Sim) Zero(st Stream, m Mem, off, n int64) error {
	d := m.(*simMem)
	if err := span("Zero", d.b, off, n); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var us uses
	us.add(memUse(d, off, n, false, true))
	if err := s.op(st, laneGPU, s.dur(s.gpu().Convert, n/4), simZero, &us); err != nil {
		return err
	}
	s.logCall(simCall{kind: simZero, stream: st.(*simStream).id, dst: d, dstOff: off, n: n})
	clear(d.b[off : off+n])
	return nil
}

// HostView returns the bytes of v, elements of size bytes each (4 for
// fp32, 2 for bf16 and fp16), in the simulated device's memory, which is
// host memory: a test, standing in for a GPU trainer's kernels, writes the
// gradients and reads the working copy there (offload's device views).
// The ordering check does not see these accesses: make them only while
// no work of the device's users is in flight on that memory (between the
// engine's calls, as a GPU trainer synchronizes its stream first).
//
// Errors: memory not from a simulated device, freed memory (its engine
// was closed), a range outside it.
func (s *Sim) HostView(v Vec, size int64) ([]byte, error) {
	m, ok := v.Mem.(*simMem)
	if !ok {
		return nil, fmt.Errorf("scheduler: sim HostView of a %T, not the simulated device's memory", v.Mem)
	}
	if size < 1 {
		return nil, fmt.Errorf("scheduler: sim HostView with %d-byte elements", size)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := span("HostView", m.b, size*v.Off, size*v.N); err != nil {
		return nil, err
	}
	return m.b[size*v.Off : size*(v.Off+v.N) : size*(v.Off+v.N)], nil
}

// GradStats runs adam.DefaultPath.GradStats (the CPU's summation order)
// on st and waits for it. It is not counted among the copies and launches
// (SimOptions.FailAt).
func (s *Sim) GradStats(st Stream, gd adam.DType, g Vec, unscale float32) (bool, float64, error) {
	ag, err := s.statsOrder(st, gd, g)
	if err != nil {
		return false, 0, err
	}
	finite, sum := adam.DefaultPath.GradStats(ag, unscale)
	return finite, sum, nil
}

// GradPartials runs adam.DefaultPath.GradPartials on st and waits for it,
// as GradStats.
func (s *Sim) GradPartials(st Stream, gd adam.DType, g Vec, unscale float32, dst []float64) (bool, error) {
	if blocks := (g.N + adam.MinChunk - 1) / adam.MinChunk; int64(len(dst)) < blocks {
		return false, fmt.Errorf("scheduler: sim GradPartials: %d partials for %d blocks", len(dst), blocks)
	}
	ag, err := s.statsOrder(st, gd, g)
	if err != nil {
		return false, err
	}
	return adam.DefaultPath.GradPartials(ag, unscale, dst), nil
}

// GradPartialsTo runs adam.DefaultPath.GradPartials into dst's float64
// elements and sets flag's int32 element for a non-finite gradient, as a
// launch on st's compute lane (counted among SimOptions.FailAt's), timed
// as an update of g's elements.
func (s *Sim) GradPartialsTo(st Stream, gd adam.DType, g Vec, unscale float32, dst, flag Vec) error {
	blocks := (g.N + adam.MinChunk - 1) / adam.MinChunk
	if dst.N < blocks {
		return fmt.Errorf("scheduler: sim GradPartialsTo: %d partials for %d blocks", dst.N, blocks)
	}
	if flag.N != 1 {
		return fmt.Errorf("scheduler: sim GradPartialsTo: a flag of %d elements, want 1", flag.N)
	}
	ag, err := simGrad(gd, g)
	if err != nil {
		return err
	}
	d, f := dst.Mem.(*simMem), flag.Mem.(*simMem)
	if err := firstErr(span("GradPartialsTo", d.b, 8*dst.Off, 8*blocks), span("GradPartialsTo", f.b, 4*flag.Off, 4)); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var us uses
	us.add(vecUse(g, elemBytes(gd), true, false))
	us.add(memUse(d, 8*dst.Off, 8*blocks, false, true))
	us.add(memUse(f, 4*flag.Off, 4, true, true))
	if err := s.op(st, laneGPU, s.dur(s.gpu().Update, g.N), simStats, &us); err != nil {
		return err
	}
	if blocks == 0 {
		return nil
	}
	out := unsafe.Slice((*float64)(unsafe.Pointer(&d.b[8*dst.Off])), blocks)
	if !adam.DefaultPath.GradPartials(ag, unscale, out) {
		*(*int32)(unsafe.Pointer(&f.b[4*flag.Off])) = 1
	}
	return nil
}

// statsOrder orders a read of g on st, waited for by the host, and returns
// g's elements.
func (s *Sim) statsOrder(st Stream, gd adam.DType, g Vec) (adam.Grad, error) {
	ag, err := simGrad(gd, g)
	if err != nil {
		return adam.Grad{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ss := st.(*simStream)
	ss.vc.join(s.hostClock())
	var us uses
	us.add(vecUse(g, elemBytes(gd), true, false))
	if err := s.order(ss, simStats, &us); err != nil {
		return adam.Grad{}, err
	}
	s.hostClock().join(&ss.vc) // the host waits for it
	return ag, nil
}

// vecUse is the use of v's bytes, of elements of size bytes each.
func vecUse(v Vec, size int64, read, write bool) use {
	return memUse(v.Mem.(*simMem), size*v.Off, size*v.N, read, write)
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

package scheduler

import (
	"errors"
	"fmt"
	"runtime"
)

// The simulated device's ordering check. The simulated device runs each
// operation when it is enqueued, so data are always there and a missing
// stream wait would go unseen. Instead it checks, on every buffer, that
// an operation reads a byte range only once the operation that last wrote
// it is known to be complete, and writes one only once the last writer
// and every reader since are (read after write, write after read, write
// after write), the way a CUDA device would order them:
//
//   - an operation is ordered after those before it on its stream;
//   - Wait(s, e) orders what s runs next after the work e's Record saw;
//   - Sync(e) tells the host that work is complete, and everything the
//     host enqueues afterwards, on any stream, comes after it.
//
// These are vector clocks (a count of operations per stream), the
// happens-before relation of the race detector: a wait missing in the
// engine fails the operation with ErrOrder (no effect, as any failed
// call) whenever, in that run, nothing else ordered the two operations.
// Host code's own reads and writes of pinned memory are seen where the
// engine says them (HostAccess: a CPU update's reads and writes of the
// lanes' host staging slots).

// ErrOrder is the error of an operation the simulated device refused
// because it would read data before the operation writing them is known
// complete, or overwrite data another operation may still read or write.
var ErrOrder = errors.New("scheduler: sim: operation out of order")

// maxSimStreams bounds the streams of a simulated device alive at once.
const maxSimStreams = 32

// vclock counts, per stream id, that stream's operations known complete.
type vclock [maxSimStreams]uint32

func (v *vclock) join(w *vclock) {
	for i := range v {
		v[i] = max(v[i], w[i])
	}
}

// Operation kinds, for the messages and the test log.
const (
	simH2D = iota + 1
	simD2H
	simAdamW
	simWiden
	simStats
	simRecord
	simWait
	simSync
	simNote
	simZero
	simD2D
)

var simKinds = [...]string{"", "H2D", "D2H", "AdamW", "Widen16", "GradStats", "Record", "Wait", "Sync", "note", "Zero", "D2D"}

// access is an operation's use of a byte range: its position on its
// stream (from 1; 0 for none) and its kind.
type access struct {
	pos  uint32
	kind uint8
}

// seg is a byte range of a buffer with its last writer and the readers
// since (the last on each stream).
type seg struct {
	lo, hi int64
	wid    uint8 // the writer's stream id
	w      access
	r      [maxSimStreams]access
}

// shadow tracks a buffer's ranges: sorted, disjoint segments that cover
// every byte accessed so far. Segments split and never merge, so repeated
// accesses to the same ranges allocate nothing.
type shadow struct{ segs []seg }

// cover makes sh's segments cover [lo, hi) exactly, splitting and adding
// segments as needed, and returns their index range.
func (sh *shadow) cover(lo, hi int64) (int, int) {
	a, b := 0, len(sh.segs) // the first segment ending after lo
	for a < b {
		m := int(uint(a+b) >> 1)
		if sh.segs[m].hi > lo {
			b = m
		} else {
			a = m + 1
		}
	}
	if a < len(sh.segs) && sh.segs[a].lo < lo {
		sh.split(a, lo)
		a++
	}
	j, cur := a, lo
	for cur < hi {
		switch {
		case j == len(sh.segs) || sh.segs[j].lo >= hi:
			sh.insert(j, seg{lo: cur, hi: hi})
			cur = hi
		case sh.segs[j].lo > cur:
			sh.insert(j, seg{lo: cur, hi: sh.segs[j].lo})
			cur = sh.segs[j].hi
		default:
			if sh.segs[j].hi > hi {
				sh.split(j, hi)
			}
			cur = sh.segs[j].hi
		}
		j++
	}
	return a, j
}

// split cuts segment j at x (inside it) into two with the same accesses.
func (sh *shadow) split(j int, x int64) {
	g := sh.segs[j]
	g.lo = x
	sh.segs[j].hi = x
	sh.insert(j+1, g)
}

func (sh *shadow) insert(j int, g seg) {
	sh.segs = append(sh.segs, seg{})
	copy(sh.segs[j+1:], sh.segs[j:])
	sh.segs[j] = g
}

// use is a byte range an operation reads, writes or both.
type use struct {
	sh          *shadow
	buf         string // "device" or "pinned host", for messages
	size        int64  // the buffer's bytes
	lo, hi      int64
	read, write bool
}

// maxUses bounds an operation's uses (AdamW: the gradient, four state
// arrays, the copy).
const maxUses = 6

// uses collects an operation's uses without allocating.
type uses struct {
	u [maxUses]use
	n int
}

func (us *uses) add(u use) {
	if u.hi > u.lo {
		us.u[us.n] = u
		us.n++
	}
}

func memUse(m *simMem, lo, n int64, read, write bool) use {
	return use{sh: &m.sh, buf: "device", size: int64(len(m.b)), lo: lo, hi: lo + n, read: read, write: write}
}

func hostUse(h *simHost, lo, n int64, read, write bool) use {
	return use{sh: &h.sh, buf: "pinned host", size: int64(len(h.b)), lo: lo, hi: lo + n, read: read, write: write}
}

// order checks the uses of an operation of kind on stream ss (its vector
// clock already joined with the host's) and, when they are in order,
// records them at the stream's next position. s.mu is held.
func (s *Sim) order(ss *simStream, kind uint8, us *uses) error {
	id := ss.id
	pos := s.pos[id] + 1
	known := func(wid int, a access) bool { return a.pos == 0 || wid == int(id) || ss.vc[wid] >= a.pos }
	for _, u := range us.u[:us.n] {
		if err := s.check(u, kind, int(id), known); err != nil {
			return err
		}
	}
	s.pos[id] = pos
	ss.vc[id] = pos
	now := access{pos: pos, kind: kind}
	for _, u := range us.u[:us.n] {
		a, b := u.sh.cover(u.lo, u.hi)
		for j := a; j < b; j++ {
			g := &u.sh.segs[j]
			if u.write {
				g.wid, g.w, g.r = id, now, [maxSimStreams]access{}
			} else {
				g.r[id] = now
			}
		}
	}
	return nil
}

// HostAccess checks the host's own access to pinned bytes [off,
// off+n) of h, about to happen: a read only once the device operation
// that last wrote them is known complete to the host (a Sync saw it), a
// write also once every device operation that read them since is. Out of
// order, it records and returns ErrOrder (OrderErr), as a device
// operation's check does; the access itself is the caller's. The engine
// calls it through hostChecker before a CPU update reads its gradient
// from a host staging slot and writes its new working copy into the copy
// staging slot that the last copy H2D from that slot may still read.
func (s *Sim) HostAccess(h Host, off, n int64, write bool) error {
	hb := h.(*simHost)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := span("HostAccess", hb.b, off, n); err != nil {
		return s.disorder(err) // a range the engine got wrong: as loud as a disorder
	}
	hc := s.hostClock()
	known := func(wid int, a access) bool { return a.pos == 0 || hc[wid] >= a.pos }
	return s.check(hostUse(hb, off, n, !write, write), 0, -1, known)
}

// check checks use u of an operation of kind on stream id (-1: the
// host's own access) against what it knows complete (known: whether the
// access a of stream wid is): the last writer of every byte it reads or
// writes, and for a write every reader since. Out of order, it records
// and returns ErrOrder. s.mu is held; it allocates nothing when in order.
func (s *Sim) check(u use, kind uint8, id int, known func(wid int, a access) bool) error {
	who := func() string {
		if id < 0 {
			return "the host"
		}
		return fmt.Sprintf("%s on stream %d", simKinds[kind], id)
	}
	a, b := u.sh.cover(u.lo, u.hi)
	for j := a; j < b; j++ {
		g := &u.sh.segs[j]
		if !known(int(g.wid), g.w) {
			verb := "reads"
			if !u.read {
				verb = "overwrites"
			}
			return s.disorder(fmt.Errorf("%w: %s %s bytes [%d,%d) of a %d-byte %s buffer before the %s on stream %d that writes them is known complete (a missing wait?)",
				ErrOrder, who(), verb, g.lo, g.hi, u.size, u.buf, simKinds[g.w.kind], g.wid))
		}
		if !u.write {
			continue
		}
		for rid := range s.maxID {
			if r := g.r[rid]; !known(rid, r) {
				return s.disorder(fmt.Errorf("%w: %s overwrites bytes [%d,%d) of a %d-byte %s buffer before the %s on stream %d that reads them is known complete (a missing wait?)",
					ErrOrder, who(), g.lo, g.hi, u.size, u.buf, simKinds[r.kind], rid))
			}
		}
	}
	return nil
}

// disorder records err as the device's first ordering error and returns
// it.
func (s *Sim) disorder(err error) error {
	if s.orderErr == nil {
		s.orderErr = err
	}
	return err
}

// OrderErr returns the first operation the device refused with ErrOrder,
// or nil.
func (s *Sim) OrderErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.orderErr
}

// simCall is one call in the simulated device's log (tests only).
type simCall struct {
	kind     uint8
	stream   uint8 // the stream's id
	ev       *simEvent
	dst, src any // buffers (H2D, D2H: dst, src; AdamW: the master weights, the gradient; Widen16: dst, src)
	dstOff   int64
	srcOff   int64
	n        int64 // bytes (copies) or elements
	note     int   // simNote's
}

// logCall appends c to the log when logging. s.mu is held.
func (s *Sim) logCall(c simCall) {
	if s.logging {
		s.log = append(s.log, c)
	}
}

// simGoroutineClocks gives each goroutine its own host clock (hostClock).
// This package's tests set it (the engine tells the simulated device of
// its goroutines' handoffs: HostPublish); other users of the simulated
// device (offload's and the trainer's tests, dos train --device sim) hand
// work between goroutines the engine does not describe, and keep one host
// clock for all.
var simGoroutineClocks = false

// hostClock returns what the calling goroutine knows complete: the work
// its own Syncs (and GradStats) waited for, and what HostAcquire added. A
// goroutine knows nothing of another's waits, so a missing wait on one
// goroutine is not hidden by a wait that another happened to make first
// (a Go channel or lock between them orders their code, not the device's
// work). Without simGoroutineClocks, one clock for all. s.mu is held.
func (s *Sim) hostClock() *vclock {
	if !simGoroutineClocks {
		return &s.global
	}
	id := goid(&s.stack)
	v := s.host[id]
	if v == nil {
		if s.host == nil {
			s.host = map[uint64]*vclock{}
		}
		v = new(vclock)
		s.host[id] = v
	}
	return v
}

// goid returns the calling goroutine's id, from its stack's header
// ("goroutine 17 [running]:") written into b: the simulated device's
// per-goroutine host clocks (hostClock), a test device's need only.
func goid(b *[64]byte) uint64 {
	n := runtime.Stack(b[:], false)
	var id uint64
	for _, c := range b[len("goroutine "):n] {
		if c < '0' || c > '9' {
			break
		}
		id = 10*id + uint64(c-'0')
	}
	return id
}

// HostPublish records what the calling goroutine knows complete under key,
// joined with what was published there before; HostAcquire adds what was
// published under key to the calling goroutine's knowledge. An engine
// calls them where a Go synchronization orders two goroutines (a lane
// waiting for another's step to be issued, a channel to its workers), so
// that a wait one made counts for the other, as it does on a GPU.
func (s *Sim) HostPublish(key handoff) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pub == nil {
		s.pub = map[handoff]*vclock{}
	}
	v := s.pub[key]
	if v == nil {
		v = new(vclock)
		s.pub[key] = v
	}
	v.join(s.hostClock())
}

func (s *Sim) HostAcquire(key handoff) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v := s.pub[key]; v != nil {
		s.hostClock().join(v)
	}
}

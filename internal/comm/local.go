package comm

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync"
)

// Local is one rank's end of an in-process communicator over host memory
// (NewLocal). Each collective is a rendezvous: the call waits until every
// rank has called, checks that the calls agree, computes this rank's
// result from the other ranks' buffers, and returns once every rank has
// read what it needs, so that no rank changes a buffer another still reads.
//
// Reductions add the ranks' elements in rank order in float64 (Avg then
// divides by Size) and round the result to the dtype (bf16 through
// float32): every rank gets the same bits, and a run gives the same bits
// every time. NCCL's ring adds
// in another order; a trajectory under NCCL matches Local's within float
// tolerance, not bitwise.
type Local struct {
	g       *group
	rank    int
	scratch []float64 // AllReduce's result before it is copied into recv
}

type kind uint8

const (
	kAllGather kind = iota
	kReduceScatter
	kAllReduce
	kBroadcast
)

var kindNames = [...]string{"AllGather", "ReduceScatter", "AllReduce", "Broadcast"}

// call is one rank's side of a collective.
type call struct {
	kind       kind
	dt         DType
	op         Op
	root       int
	send, recv []byte
}

func (c *call) String() string {
	switch c.kind {
	case kAllGather:
		return fmt.Sprintf("AllGather of %d %s elements", int64(len(c.send))/c.dt.Size(), c.dt)
	case kReduceScatter:
		return fmt.Sprintf("ReduceScatter (%s) of %d %s elements", c.op, int64(len(c.send))/c.dt.Size(), c.dt)
	case kAllReduce:
		return fmt.Sprintf("AllReduce (%s) of %d %s elements", c.op, int64(len(c.send))/c.dt.Size(), c.dt)
	}
	return fmt.Sprintf("Broadcast of %d bytes from rank %d", len(c.send), c.root)
}

// group is what the ranks of one Local communicator share.
type group struct {
	mu      sync.Mutex
	cond    *sync.Cond
	size    int
	calls   []call // this collective's call of each rank
	arrived int    // ranks in the collective's first barrier
	left    int    // ranks past its second
	gen     int    // collectives completed (the call number of the current one)
	phase   int    // 0: arriving, 1: computing, 2: leaving
	err     error  // the current collective's mismatch, if any
	fatal   error  // Abort's or Close's: every call from now fails
}

// NewLocal returns the n ends of a new in-process communicator, rank i at
// index i. Panics if n < 1.
func NewLocal(n int) []*Local {
	if n < 1 {
		panic(fmt.Sprintf("comm: NewLocal(%d): want at least one rank", n))
	}
	g := &group{size: n, calls: make([]call, n)}
	g.cond = sync.NewCond(&g.mu)
	ends := make([]*Local, n)
	for i := range ends {
		ends[i] = &Local{g: g, rank: i}
	}
	return ends
}

// Rank returns this end's rank.
func (l *Local) Rank() int { return l.rank }

// Size returns the number of ranks.
func (l *Local) Size() int { return l.g.size }

// AllGather is Comm.AllGather. Errors: len(recv) != Size*len(send), a
// length not a multiple of the element size, a mismatch, an aborted or
// closed communicator.
func (l *Local) AllGather(send, recv []byte, dt DType) error {
	if err := checkLen("AllGather", dt, send, recv); err != nil {
		return err
	}
	if int64(len(recv)) != int64(l.g.size)*int64(len(send)) {
		return fmt.Errorf("comm: AllGather: recv of %d bytes for %d ranks of %d", len(recv), l.g.size, len(send))
	}
	return l.run(call{kind: kAllGather, dt: dt, send: send, recv: recv})
}

// ReduceScatter is Comm.ReduceScatter. Errors: len(send) !=
// Size*len(recv), a length not a multiple of the element size, an unknown
// op, a mismatch, an aborted or closed communicator.
func (l *Local) ReduceScatter(send, recv []byte, dt DType, op Op) error {
	if err := checkLen("ReduceScatter", dt, send, recv); err != nil {
		return err
	}
	if int64(len(send)) != int64(l.g.size)*int64(len(recv)) {
		return fmt.Errorf("comm: ReduceScatter: send of %d bytes for %d ranks of %d", len(send), l.g.size, len(recv))
	}
	if op > Avg {
		return fmt.Errorf("comm: ReduceScatter: unknown %v", op)
	}
	return l.run(call{kind: kReduceScatter, dt: dt, op: op, send: send, recv: recv})
}

// AllReduce is Comm.AllReduce. Errors: len(recv) != len(send), a length
// not a multiple of the element size, an unknown op, a mismatch, an
// aborted or closed communicator. It allocates when the buffer is longer
// than any this end has reduced before.
func (l *Local) AllReduce(send, recv []byte, dt DType, op Op) error {
	if err := checkLen("AllReduce", dt, send, recv); err != nil {
		return err
	}
	if len(recv) != len(send) {
		return fmt.Errorf("comm: AllReduce: recv of %d bytes for send of %d", len(recv), len(send))
	}
	if op > Avg {
		return fmt.Errorf("comm: AllReduce: unknown %v", op)
	}
	if n := len(send) / int(dt.Size()); cap(l.scratch) < n {
		l.scratch = make([]float64, n)
	}
	return l.run(call{kind: kAllReduce, dt: dt, op: op, send: send, recv: recv})
}

// Broadcast is Comm.Broadcast. Errors: root outside [0, Size), a
// mismatch (another root or length), an aborted or closed communicator.
func (l *Local) Broadcast(buf []byte, root int) error {
	if root < 0 || root >= l.g.size {
		return fmt.Errorf("comm: Broadcast: root %d of %d ranks", root, l.g.size)
	}
	return l.run(call{kind: kBroadcast, root: root, send: buf, recv: buf})
}

// Abort fails the current and every later collective on every rank with
// an error wrapping ErrAborted and err.
func (l *Local) Abort(err error) {
	g := l.g
	g.mu.Lock()
	if g.fatal == nil {
		g.fatal = fmt.Errorf("%w by rank %d: %v", ErrAborted, l.rank, err)
	}
	g.cond.Broadcast()
	g.mu.Unlock()
}

// Close releases this end: the collectives of the other ranks fail with
// ErrClosed from now on. It returns nil; a second Close does nothing.
func (l *Local) Close() error {
	g := l.g
	g.mu.Lock()
	if g.fatal == nil {
		g.fatal = fmt.Errorf("%w (rank %d)", ErrClosed, l.rank)
	}
	g.cond.Broadcast()
	g.mu.Unlock()
	return nil
}

func checkLen(what string, dt DType, bufs ...[]byte) error {
	if dt > F64 {
		return fmt.Errorf("comm: %s: unknown %v", what, dt)
	}
	for _, b := range bufs {
		if int64(len(b))%dt.Size() != 0 {
			return fmt.Errorf("comm: %s: %d bytes is not a whole number of %s elements", what, len(b), dt)
		}
	}
	return nil
}

// run is the rendezvous around one collective: the first barrier (every
// rank's call recorded and compared), this rank's part, the second
// barrier (every rank done reading), then what this rank writes only
// after it (AllReduce's copy out of its scratch, which its own send may
// alias). Once every rank has arrived, each goes through both barriers
// even when the communicator is aborted meanwhile: no rank returns, and
// lets its caller change a buffer, while another still reads it.
func (l *Local) run(c call) error {
	g := l.g
	g.mu.Lock()
	defer g.mu.Unlock()
	// Wait until the previous collective's ranks have all left it.
	for g.phase == 2 && g.fatal == nil {
		g.cond.Wait()
	}
	if g.fatal != nil {
		return g.fatal
	}
	g.calls[l.rank] = c
	g.arrived++
	if g.arrived == g.size {
		g.err = g.compare()
		g.phase = 1
		g.cond.Broadcast()
	}
	for g.phase == 0 && g.fatal == nil {
		g.cond.Wait()
	}
	if g.phase == 0 {
		return g.fatal // a rank never came: nobody reads anything
	}
	err := g.err
	if err == nil {
		g.mu.Unlock()
		l.compute(&c)
		g.mu.Lock()
	}
	g.left++
	if g.left == g.size {
		g.phase = 2
		g.cond.Broadcast()
	}
	for g.phase == 1 {
		g.cond.Wait()
	}
	// The last rank out of the second barrier opens the next collective.
	g.left--
	if g.left == 0 {
		g.arrived, g.phase, g.err = 0, 0, nil
		g.gen++
		clear(g.calls)
		g.cond.Broadcast()
	}
	if g.fatal != nil {
		return g.fatal
	}
	if err == nil && c.kind == kAllReduce {
		l.store(c.recv, c.dt, l.scratch[:len(c.recv)/int(c.dt.Size())])
	}
	return err
}

// compare returns a MismatchError when a rank's call differs from rank
// 0's. The caller holds g.mu.
func (g *group) compare() error {
	a := &g.calls[0]
	for r := 1; r < g.size; r++ {
		b := &g.calls[r]
		if a.kind != b.kind || a.dt != b.dt || len(a.send) != len(b.send) || len(a.recv) != len(b.recv) ||
			(a.kind == kReduceScatter || a.kind == kAllReduce) && a.op != b.op || a.kind == kBroadcast && a.root != b.root {
			return &MismatchError{Call: g.gen, Rank: r, Want: a.String(), Got: b.String()}
		}
	}
	return nil
}

// compute writes this rank's result of c (AllReduce's into l.scratch),
// reading the other ranks' calls: between the two barriers, when no rank
// writes a buffer another reads.
func (l *Local) compute(c *call) {
	g := l.g
	switch c.kind {
	case kAllGather:
		for r := range g.size {
			if r != l.rank {
				copy(c.recv[r*len(c.send):], g.calls[r].send)
			}
		}
		if own := c.recv[l.rank*len(c.send):]; len(c.send) > 0 && &own[0] != &c.send[0] {
			copy(own, c.send) // not when send is that segment: others read it now
		}
	case kBroadcast:
		if l.rank != c.root {
			copy(c.recv, g.calls[c.root].send)
		}
	case kReduceScatter:
		n := len(c.recv) / int(c.dt.Size())
		lo := l.rank * n
		for i := range n {
			put(c.recv, c.dt, i, l.reduce(c, lo+i))
		}
	case kAllReduce:
		n := len(c.recv) / int(c.dt.Size())
		s := l.scratch[:n]
		for i := range n {
			s[i] = l.reduce(c, i)
		}
	}
}

// reduce returns element i of every rank's send reduced in rank order.
func (l *Local) reduce(c *call, i int) float64 {
	g := l.g
	var x float64
	for r := range g.size {
		x += get(g.calls[r].send, c.dt, i)
	}
	if c.op == Avg {
		x /= float64(g.size)
	}
	return x
}

// store writes xs into b as dt.
func (l *Local) store(b []byte, dt DType, xs []float64) {
	for i, x := range xs {
		put(b, dt, i, x)
	}
}

// put writes x rounded to dt as element i of b.
func put(b []byte, dt DType, i int, x float64) {
	switch dt {
	case F32:
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(x)))
	case F64:
		binary.LittleEndian.PutUint64(b[8*i:], math.Float64bits(x))
	default:
		binary.LittleEndian.PutUint16(b[2*i:], f32ToBF16(float32(x)))
	}
}

// get returns element i of b, of dtype dt.
func get(b []byte, dt DType, i int) float64 {
	switch dt {
	case F32:
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
	case F64:
		return math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
	}
	return float64(math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[2*i:])) << 16))
}

// f32ToBF16 rounds x to bfloat16, to nearest even (NaN stays NaN), as
// adam.F32ToBF16 and PyTorch's cast do.
func f32ToBF16(x float32) uint16 {
	u := math.Float32bits(x)
	if u&0x7fffffff > 0x7f800000 {
		return uint16(u>>16) | 0x40
	}
	return uint16((u + 0x7fff + (u>>16)&1) >> 16)
}

var _ Comm = (*Local)(nil)

package pinned

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// ErrFull is returned by a non-blocking Ring's Reserve when the ring has no
// contiguous room for the request now.
var ErrFull = errors.New("pinned: ring full")

// Ring is a bounded FIFO of contiguous reservations in one buffer, for
// staging data on its way to or from the GPU or the disk: producers
// Reserve, fill and hand spans on; consumers Release them when done. The
// ring never grows: a full ring makes Reserve wait (Block), in arrival
// order, or fail with ErrFull. Spans may be released in any order; space
// comes back when the oldest outstanding span is released. Safe for
// concurrent use.
type Ring struct {
	buf   Buf
	block bool

	mu      sync.Mutex
	head    int64   // bytes ever reserved, wrap padding included
	tail    int64   // bytes ever given back
	q       []entry // outstanding reservations, a circular queue, oldest at q[qhead]
	qhead   int
	qlen    int
	first   uint64 // id of the oldest outstanding reservation
	next    uint64 // id of the next reservation
	closed  bool
	waiters []chan struct{} // blocked Reserves, in arrival order; the first is woken when space comes back
}

type entry struct {
	end      int64 // head after this reservation
	released bool
}

// Span is one reservation: a Buf of Len bytes inside the ring's buffer;
// like every Buf its Off counts from the start of the arena.
type Span struct {
	Buf
	r  *Ring
	id uint64
}

// NewRing returns a ring over buf. block chooses what Reserve does when
// the ring is full: wait (true) or return ErrFull (false).
func NewRing(buf Buf, block bool) *Ring {
	return &Ring{buf: buf, block: block}
}

// Cap returns the ring's size in bytes.
func (r *Ring) Cap() int64 { return r.buf.Len }

// InUse returns the bytes reserved and not yet given back, wrap padding
// included; it never exceeds Cap.
func (r *Ring) InUse() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.head - r.tail
}

// Reserve returns a contiguous span of n bytes (0 < n <= Cap). On a full
// ring it waits until enough space is released, ctx is done, or the ring is
// closed; a non-blocking ring returns ErrFull instead.
//
// Errors: a bad n, ErrFull, ErrClosed, ctx.Err().
func (r *Ring) Reserve(ctx context.Context, n int64) (Span, error) {
	if n <= 0 || n > r.buf.Len {
		return Span{}, fmt.Errorf("pinned: Reserve(%d) on a ring of %d bytes: want 0 < n <= %d", n, r.buf.Len, r.buf.Len)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return Span{}, ErrClosed
	}
	if len(r.waiters) == 0 {
		if s, ok := r.take(n); ok {
			return s, nil
		}
	}
	if !r.block {
		return Span{}, ErrFull
	}
	// Wait in line: requests are served in arrival order, so a large one
	// is not starved by small ones that keep fitting.
	w := make(chan struct{}, 1)
	r.waiters = append(r.waiters, w)
	for {
		if r.closed {
			r.leave(w)
			return Span{}, ErrClosed
		}
		if r.waiters[0] == w {
			if s, ok := r.take(n); ok {
				r.leave(w)
				return s, nil
			}
		}
		r.mu.Unlock()
		select {
		case <-w:
			r.mu.Lock()
		case <-ctx.Done():
			r.mu.Lock()
			r.leave(w)
			return Span{}, ctx.Err()
		}
	}
}

// take reserves n contiguous bytes if they are free now. Hold r.mu.
func (r *Ring) take(n int64) (Span, bool) {
	size := r.buf.Len
	pos := r.head % size
	pad := int64(0)
	if pos+n > size {
		pad = size - pos // skip to the start: spans are contiguous
	}
	if r.head+pad+n-r.tail > size {
		return Span{}, false
	}
	if pad > 0 {
		// The padding belongs to the previous span (or is free now when
		// the ring is empty).
		if r.qlen == 0 {
			r.tail += pad
		} else {
			r.at(r.qlen - 1).end += pad
		}
		pos = 0
	}
	r.head += pad + n
	r.push(entry{end: r.head})
	s := Span{Buf: r.buf.Slice(pos, pos+n), r: r, id: r.next}
	r.next++
	return s, true
}

// leave removes waiter w from the line and wakes the new head, who may
// now be able to go. Hold r.mu.
func (r *Ring) leave(w chan struct{}) {
	for i, x := range r.waiters {
		if x == w {
			r.waiters = append(r.waiters[:i], r.waiters[i+1:]...)
			break
		}
	}
	r.wakeHead()
}

// wakeHead signals the first waiter. Hold r.mu.
func (r *Ring) wakeHead() {
	if len(r.waiters) > 0 {
		select {
		case r.waiters[0] <- struct{}{}:
		default:
		}
	}
}

// Release gives a span back. Releasing a span twice, or one from another
// ring, is an error.
func (r *Ring) Release(s Span) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if s.r != r || s.id < r.first || s.id >= r.next {
		return fmt.Errorf("pinned: Release of a span this ring does not hold (id %d)", s.id)
	}
	e := r.at(int(s.id - r.first))
	if e.released {
		return fmt.Errorf("pinned: span %d released twice", s.id)
	}
	e.released = true
	freed := false
	for r.qlen > 0 && r.at(0).released {
		r.tail = r.at(0).end
		r.qhead = (r.qhead + 1) % len(r.q)
		r.qlen--
		r.first++
		freed = true
	}
	if r.qlen == 0 && r.head == r.tail { // empty: start over at the buffer's start
		r.head, r.tail = 0, 0
	}
	if freed {
		r.wakeHead()
	}
	return nil
}

// Close makes every waiting and later Reserve return ErrClosed.
// Outstanding spans stay valid until released.
func (r *Ring) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		r.closed = true
		for _, w := range r.waiters {
			select {
			case w <- struct{}{}:
			default:
			}
		}
	}
}

// at returns the i-th outstanding reservation, oldest first.
func (r *Ring) at(i int) *entry { return &r.q[(r.qhead+i)%len(r.q)] }

// push appends a reservation, doubling the queue when it is full (the
// queue only grows to the most reservations ever outstanding at once).
func (r *Ring) push(e entry) {
	if r.qlen == len(r.q) {
		q := make([]entry, max(16, 2*len(r.q)))
		for i := range r.qlen {
			q[i] = *r.at(i)
		}
		r.q, r.qhead = q, 0
	}
	r.q[(r.qhead+r.qlen)%len(r.q)] = e
	r.qlen++
}

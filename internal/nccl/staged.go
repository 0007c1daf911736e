package nccl

import (
	"errors"
	"fmt"

	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/internal/cuda"
)

// Collectives is one rank's end of a communicator over device memory, what
// a multi-GPU trainer calls: *Comm (NCCL between GPUs) or *Staged (through
// host memory: several ranks on one GPU, or no NCCL). Every rank calls the
// same collectives in the same order; see Comm's methods for each one's
// sizes.
type Collectives interface {
	Rank() int
	Size() int
	AllGather(s *cuda.Stream, send, recv Span, dt comm.DType) error
	ReduceScatter(s *cuda.Stream, send, recv Span, dt comm.DType, op comm.Op) error
	AllReduce(s *cuda.Stream, send, recv Span, dt comm.DType, op comm.Op) error
	Broadcast(s *cuda.Stream, buf Span, root int) error
	// AsyncError returns an error found while the rank's collectives ran
	// on the device (Comm's; nil for Staged, whose calls wait).
	AsyncError() error
	Abort(err error) error
	Close() error
}

var (
	_ Collectives = (*Comm)(nil)
	_ Collectives = (*Staged)(nil)
)

// Staged is one rank's end of a communicator whose collectives go through
// pinned host memory and an in-process host communicator (internal/comm's
// Local): the rank's send moves D2H on its stream, the host collective
// runs once every rank has called (the ranks' goroutines meet there),
// and the result moves H2D; the call returns when it is in recv. So, unlike
// NCCL, each call waits on the host, and several ranks may share one GPU:
// the multi-rank GPU trainer's tests run on one GPU with it. Reductions
// are Local's: in rank order in float64, the same bits every run. Its
// methods take the same arguments, sizes and errors as Comm's.
type Staged struct {
	c          comm.Comm
	dev        *cuda.Device
	send, recv *cuda.HostBuffer // pinned staging, grown on demand
}

// NewStaged returns the ends of a communicator of len(devs) ranks, rank r
// on devs[r] (the same device may appear several times).
//
// Errors: no devices, or a nil one.
func NewStaged(devs []*cuda.Device) ([]*Staged, error) {
	if len(devs) == 0 || len(devs) > maxRanks {
		return nil, fmt.Errorf("nccl: NewStaged of %d devices: want 1 to %d", len(devs), maxRanks)
	}
	for i, d := range devs {
		if d == nil {
			return nil, fmt.Errorf("nccl: NewStaged: device %d is nil", i)
		}
	}
	ends := comm.NewLocal(len(devs))
	out := make([]*Staged, len(devs))
	for r, d := range devs {
		out[r] = &Staged{c: ends[r], dev: d}
	}
	return out, nil
}

// Rank returns this end's rank.
func (st *Staged) Rank() int { return st.c.Rank() }

// Size returns the number of ranks.
func (st *Staged) Size() int { return st.c.Size() }

// grow makes *h hold at least n bytes.
func (st *Staged) grow(h **cuda.HostBuffer, n int64) error {
	if *h != nil && (*h).Len() >= n {
		return nil
	}
	if *h != nil {
		if err := (*h).Free(); err != nil {
			return err
		}
		*h = nil
	}
	b, err := st.dev.HostAlloc(max(n, 4096))
	if err != nil {
		return fmt.Errorf("nccl: staging of %d bytes: %w", n, err)
	}
	*h = b
	return nil
}

// stage checks send and recv (each a whole number of es-byte elements
// inside its buffer), moves send D2H on s and waits for it, runs host with
// the host copies, then moves the result into recv and waits for that.
func (st *Staged) stage(what string, s *cuda.Stream, send, recv Span, es int64, host func(send, recv []byte) error) error {
	if s == nil {
		return fmt.Errorf("nccl: %s: nil stream", what)
	}
	if _, err := send.ptr(what+" send", es); err != nil {
		return err
	}
	if _, err := recv.ptr(what+" recv", es); err != nil {
		return err
	}
	if err := st.grow(&st.send, send.Len); err != nil {
		return err
	}
	if err := st.grow(&st.recv, recv.Len); err != nil {
		return err
	}
	if send.Len > 0 {
		if err := s.CopyDtoH(st.send, 0, send.Buf, send.Off, send.Len); err != nil {
			return err
		}
	}
	if err := s.Sync(); err != nil {
		return err
	}
	if err := host(st.send.Bytes()[:send.Len], st.recv.Bytes()[:recv.Len]); err != nil {
		return err
	}
	if recv.Len > 0 {
		if err := s.CopyHtoD(recv.Buf, recv.Off, st.recv, 0, recv.Len); err != nil {
			return err
		}
	}
	return s.Sync()
}

// AllGather is Comm.AllGather through host memory.
func (st *Staged) AllGather(s *cuda.Stream, send, recv Span, dt comm.DType) error {
	if err := sizes("AllGather", send.Len, recv.Len, st.Size(), dt.Size(), "send", "recv"); err != nil {
		return err
	}
	return st.stage("AllGather", s, send, recv, dt.Size(), func(a, b []byte) error { return st.c.AllGather(a, b, dt) })
}

// ReduceScatter is Comm.ReduceScatter through host memory.
func (st *Staged) ReduceScatter(s *cuda.Stream, send, recv Span, dt comm.DType, op comm.Op) error {
	if err := sizes("ReduceScatter", recv.Len, send.Len, st.Size(), dt.Size(), "recv", "send"); err != nil {
		return err
	}
	return st.stage("ReduceScatter", s, send, recv, dt.Size(), func(a, b []byte) error { return st.c.ReduceScatter(a, b, dt, op) })
}

// AllReduce is Comm.AllReduce through host memory.
func (st *Staged) AllReduce(s *cuda.Stream, send, recv Span, dt comm.DType, op comm.Op) error {
	if err := sizes("AllReduce", send.Len, recv.Len, 1, dt.Size(), "send", "recv"); err != nil {
		return err
	}
	return st.stage("AllReduce", s, send, recv, dt.Size(), func(a, b []byte) error { return st.c.AllReduce(a, b, dt, op) })
}

// Broadcast is Comm.Broadcast through host memory.
func (st *Staged) Broadcast(s *cuda.Stream, buf Span, root int) error {
	if root < 0 || root >= st.Size() {
		return fmt.Errorf("nccl: Broadcast from root %d of %d ranks", root, st.Size())
	}
	return st.stage("Broadcast", s, buf, buf, 1, func(a, b []byte) error {
		if err := st.c.Broadcast(a, root); err != nil {
			return err
		}
		copy(b, a)
		return nil
	})
}

// AsyncError returns nil: Staged's collectives report their errors when
// called.
func (st *Staged) AsyncError() error { return nil }

// Abort fails this call and every later one on every rank with err
// (comm.Comm.Abort: the in-process ranks are released).
func (st *Staged) Abort(err error) error {
	if err == nil {
		err = errors.New("aborted")
	}
	st.c.Abort(err)
	return nil
}

// Close releases this end and its staging; a collective the other ranks
// call afterwards fails with comm.ErrClosed.
func (st *Staged) Close() error {
	errs := []error{st.c.Close()}
	for _, h := range []**cuda.HostBuffer{&st.send, &st.recv} {
		if *h != nil {
			errs = append(errs, (*h).Free())
			*h = nil
		}
	}
	return errors.Join(errs...)
}

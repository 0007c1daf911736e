package scheduler

import (
	"errors"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestSimOrder: the simulated device refuses an operation that reads data
// another stream writes, or overwrites data another stream reads, unless a
// stream wait or a host sync orders them; the same stream is ordered; a
// refused operation has no effect.
func TestSimOrder(t *testing.T) {
	d := NewSim(SimOptions{})
	m, _ := d.Alloc(64)
	h, _ := d.AllocHost(64)
	s1, _ := d.NewStream()
	s2, _ := d.NewStream()
	ev, _ := d.NewEvent()
	copy(h.Bytes(), "0123456789abcdef")
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	refused := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, ErrOrder) {
			t.Fatalf("%s: %v, want ErrOrder", what, err)
		}
	}
	// Read after write: s1 writes m, s2 reads it.
	must("H2D", d.H2D(s1, m, 0, h, 0, 16))
	refused("D2H on another stream, no wait", d.D2H(s2, h, 32, m, 0, 16))
	if string(h.Bytes()[32:48]) != string(make([]byte, 16)) {
		t.Fatal("the refused copy moved data")
	}
	must("D2H on the same stream", d.D2H(s1, h, 32, m, 0, 16))
	must("Record", d.Record(ev, s1))
	must("Wait", d.Wait(s2, ev))
	must("D2H after a stream wait", d.D2H(s2, h, 48, m, 0, 16))
	// Write after read: s2 read m; s1 overwrites it.
	refused("H2D over data another stream reads", d.H2D(s1, m, 8, h, 0, 4))
	must("H2D elsewhere", d.H2D(s1, m, 16, h, 0, 16))
	must("Record", d.Record(ev, s2))
	must("Sync", d.Sync(ev))
	must("H2D after a host sync", d.H2D(s1, m, 8, h, 0, 4))
	// A kernel reads and writes: its gradient and state must be ordered.
	st := State{Param: Vec{Mem: m, Off: 0, N: 4}, ExpAvg: Vec{Mem: m, Off: 4, N: 4}, ExpAvgSq: Vec{Mem: m, Off: 8, N: 4}}
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	refused("AdamW after another stream's write", d.AdamW(s2, &c, st, adam.F32, Vec{Mem: m, Off: 12, N: 4}, 0, Vec{}))
	must("Record", d.Record(ev, s1))
	must("Wait", d.Wait(s2, ev))
	must("AdamW after a wait", d.AdamW(s2, &c, st, adam.F32, Vec{Mem: m, Off: 12, N: 4}, 0, Vec{}))
	if err := d.OrderErr(); !errors.Is(err, ErrOrder) {
		t.Fatalf("OrderErr %v", err)
	}
	// Streams: ids are reused; at most maxSimStreams alive.
	for range 3 * maxSimStreams {
		s, err := d.NewStream()
		must("NewStream", err)
		must("Free", d.FreeStream(s))
	}
	for range maxSimStreams - 2 {
		_, err := d.NewStream()
		must("NewStream", err)
	}
	if _, err := d.NewStream(); err == nil {
		t.Fatalf("stream %d accepted", maxSimStreams+1)
	}
}

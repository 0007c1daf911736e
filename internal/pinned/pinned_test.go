package pinned

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deepstates/dos/internal/cuda"
)

// device returns the GPU when there is one (nil otherwise); with
// DOS_REQUIRE_GPU=1 a missing GPU fails the test.
func device(t *testing.T) *cuda.Device {
	t.Helper()
	if err := cuda.Available(); err != nil {
		if os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("DOS_REQUIRE_GPU=1 but no GPU: %v", err)
		}
		t.Logf("no GPU (%v): testing unpinned memory", err)
		return nil
	}
	d, err := cuda.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func TestArena(t *testing.T) {
	d := device(t)
	a, err := New(d, 1<<20+5)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free()
	if a.Pinned() != (d != nil) || a.Len() != 1<<20+5 {
		t.Fatalf("Pinned %v, Len %d", a.Pinned(), a.Len())
	}
	var bufs []Buf
	for i, sz := range []int64{1, 100, 4096, 7, 1 << 19} {
		align := []int64{0, 8, 4096, 16, 256}[i]
		b, err := a.Alloc(sz, align)
		if err != nil {
			t.Fatal(err)
		}
		want := align
		if want == 0 {
			want = 64
		}
		if b.Off%want != 0 || b.Len != sz || int64(len(b.Bytes())) != sz || int64(cap(b.Bytes())) != sz {
			t.Fatalf("Alloc(%d, %d) = off %d len %d", sz, align, b.Off, b.Len)
		}
		for j := range b.Bytes() {
			b.Bytes()[j] = byte(i + 1)
		}
		bufs = append(bufs, b)
	}
	for i, b := range bufs { // no overlap
		if !bytes.Equal(b.Bytes(), bytes.Repeat([]byte{byte(i + 1)}, int(b.Len))) {
			t.Fatalf("buffer %d overwritten", i)
		}
	}
	if _, err := a.Alloc(1<<20, 0); !errors.Is(err, ErrExhausted) {
		t.Fatalf("over-allocation: %v", err)
	}
	for _, bad := range [][2]int64{{0, 0}, {-1, 0}, {8, 3}, {8, -4}} {
		if _, err := a.Alloc(bad[0], bad[1]); err == nil {
			t.Errorf("Alloc(%d, %d) accepted", bad[0], bad[1])
		}
	}
	if h, off := bufs[2].Host(); (h != nil) != a.Pinned() || off != bufs[2].Off {
		t.Fatalf("Host() = %v, %d", h, off)
	}
	a.Reset()
	if a.Used() != 0 {
		t.Fatal("Reset kept usage")
	}
	if _, err := New(d, 0); err == nil {
		t.Error("an empty arena was accepted")
	}
	a.Free()
	if _, err := a.Alloc(8, 0); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Free: %v", err)
	}
}

// rss returns the resident set size in bytes (Linux /proc/self/statm).
func rss(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		t.Skipf("no /proc/self/statm: %v", err)
	}
	f := strings.Fields(string(b))
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize())
}

// TestRSS: an arena of S bytes grows the resident set by at least S (the
// memory is really there, populated or pinned) and at most 1.05 S.
func TestRSS(t *testing.T) {
	d := device(t)
	const size = 256 << 20
	before := rss(t)
	a, err := New(d, size)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free()
	grew := rss(t) - before
	t.Logf("arena of %d MiB (pinned %v): RSS grew %.1f MiB (%.3f x)", size>>20, a.Pinned(), float64(grew)/(1<<20), float64(grew)/size)
	if grew < size*95/100 || grew > size*105/100 {
		t.Fatalf("RSS grew by %d bytes for a %d-byte arena: want within [0.95, 1.05] x", grew, size)
	}
}

func newRing(t *testing.T, size int64, block bool) *Ring {
	a, err := New(nil, size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Free() })
	b, _ := a.Alloc(size, 0)
	return NewRing(b, block)
}

func TestRingBasics(t *testing.T) {
	r := newRing(t, 100, false)
	ctx := context.Background()
	s1, err := r.Reserve(ctx, 40)
	if err != nil || s1.Off != 0 {
		t.Fatalf("first span %+v, %v", s1, err)
	}
	s2, _ := r.Reserve(ctx, 40)
	if s2.Off != 40 {
		t.Fatalf("second span at %d", s2.Off)
	}
	if _, err := r.Reserve(ctx, 30); !errors.Is(err, ErrFull) { // 20 left at the end, 0 at the start
		t.Fatalf("full ring: %v", err)
	}
	if err := r.Release(s2); err != nil { // out of order: no space yet
		t.Fatal(err)
	}
	if _, err := r.Reserve(ctx, 30); !errors.Is(err, ErrFull) {
		t.Fatalf("space before the oldest span was released: %v", err)
	}
	if err := r.Release(s1); err != nil {
		t.Fatal(err)
	}
	if r.InUse() != 0 {
		t.Fatalf("InUse %d after releasing everything", r.InUse())
	}
	a, _ := r.Reserve(ctx, 70)
	b, err := r.Reserve(ctx, 30)
	if err != nil || a.Off != 0 || b.Off != 70 {
		t.Fatalf("spans at %d and %d (%v)", a.Off, b.Off, err)
	}
	r.Release(a)
	c, err := r.Reserve(ctx, 50) // wraps: 0..50
	if err != nil || c.Off != 0 {
		t.Fatalf("wrapped span at %d (%v)", c.Off, err)
	}
	if err := r.Release(c); err != nil {
		t.Fatal(err)
	}
	if err := r.Release(c); err == nil {
		t.Error("double release accepted")
	}
	for _, n := range []int64{0, -1, 101} {
		if _, err := r.Reserve(ctx, n); err == nil || errors.Is(err, ErrFull) {
			t.Errorf("Reserve(%d): %v", n, err)
		}
	}
	r.Close()
	if _, err := r.Reserve(ctx, 1); !errors.Is(err, ErrClosed) {
		t.Errorf("Reserve after Close: %v", err)
	}
}

// TestRingBlocks: a blocking Reserve waits for a release, for its context,
// and for Close.
func TestRingBlocks(t *testing.T) {
	r := newRing(t, 64, true)
	ctx := context.Background()
	s, _ := r.Reserve(ctx, 64)
	got := make(chan error, 1)
	go func() {
		_, err := r.Reserve(ctx, 10)
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("Reserve on a full ring returned %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	r.Release(s)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	r.Reserve(ctx, 54) // full again
	cctx, cancel := context.WithCancel(ctx)
	go func() {
		_, err := r.Reserve(cctx, 20)
		got <- err
	}()
	cancel()
	if err := <-got; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Reserve: %v", err)
	}
	go func() {
		_, err := r.Reserve(ctx, 20)
		got <- err
	}()
	time.Sleep(10 * time.Millisecond)
	r.Close()
	if err := <-got; !errors.Is(err, ErrClosed) {
		t.Fatalf("Reserve across Close: %v", err)
	}
}

// TestRingConcurrent: producers and consumers hammer a small ring (run it
// under -race); every span's contents arrive intact and the ring never
// holds more than its size.
func TestRingConcurrent(t *testing.T) {
	const size = 4096
	r := newRing(t, size, true)
	ctx := context.Background()
	type msg struct {
		s   Span
		tag byte
	}
	ch := make(chan msg, 64)
	var wg sync.WaitGroup
	var prod sync.WaitGroup
	for p := range 4 {
		prod.Add(1)
		go func() {
			defer prod.Done()
			rng := rand.New(rand.NewPCG(uint64(p), 1))
			for i := range 2000 {
				s, err := r.Reserve(ctx, 1+rng.Int64N(700))
				if err != nil {
					t.Error(err)
					return
				}
				if u := r.InUse(); u > size {
					t.Errorf("InUse %d > %d", u, size)
				}
				tag := byte(p*31 + i)
				for j := range s.Bytes() {
					s.Bytes()[j] = tag
				}
				ch <- msg{s, tag}
			}
		}()
	}
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range ch {
				for _, x := range m.s.Bytes() {
					if x != m.tag {
						t.Errorf("span at %d: byte %d, want %d", m.s.Off, x, m.tag)
						break
					}
				}
				if err := r.Release(m.s); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	prod.Wait()
	close(ch)
	wg.Wait()
	if r.InUse() != 0 {
		t.Fatalf("InUse %d at the end", r.InUse())
	}
}

// TestRingGPU: a span of a pinned ring goes to the device and back.
func TestRingGPU(t *testing.T) {
	d := device(t)
	if d == nil {
		t.Skip("no GPU")
	}
	a, err := New(d, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free()
	b, _ := a.Alloc(1<<20, 4096)
	r := NewRing(b, true)
	s1, _ := r.Reserve(context.Background(), 1000)
	s2, _ := r.Reserve(context.Background(), 1000)
	for i := range s1.Bytes() {
		s1.Bytes()[i] = byte(i * 3)
	}
	dev, err := d.Alloc(1000)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free()
	st, _ := d.NewStream()
	defer st.Free()
	h, off := s1.Host()
	if err := st.CopyHtoD(dev, 0, h, off, 1000); err != nil {
		t.Fatal(err)
	}
	h, off = s2.Host()
	if err := st.CopyDtoH(h, off, dev, 0, 1000); err != nil {
		t.Fatal(err)
	}
	if err := st.Sync(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(s1.Bytes(), s2.Bytes()) {
		t.Fatal("round trip through the device differs")
	}
}

// TestRingForeignSpan: a span from another ring over the same arena is
// refused, and the ring's own spans stay outstanding.
func TestRingForeignSpan(t *testing.T) {
	a, err := New(nil, 200)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free()
	b1, _ := a.Alloc(100, 0)
	b2, _ := a.Alloc(64, 0)
	r1, r2 := NewRing(b1, false), NewRing(b2, false)
	s1, _ := r1.Reserve(context.Background(), 60)
	s2, _ := r2.Reserve(context.Background(), 60)
	if err := r1.Release(s2); err == nil {
		t.Fatal("a span of another ring was released")
	}
	if r1.InUse() != 60 {
		t.Fatalf("InUse %d after a refused release", r1.InUse())
	}
	if err := r1.Release(s1); err != nil {
		t.Fatal(err)
	}
}

// TestRingFIFO: a blocked large request is served before smaller ones that
// arrived after it, so it is not starved while the ring never drains.
func TestRingFIFO(t *testing.T) {
	r := newRing(t, 1024, true)
	ctx := context.Background()
	a, _ := r.Reserve(ctx, 100)
	got := make(chan Span, 1)
	go func() {
		s, err := r.Reserve(ctx, 1024) // needs the whole ring
		if err != nil {
			t.Error(err)
		}
		got <- s
	}()
	waiting := func() int {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.waiters)
	}
	for waiting() == 0 { // wait until it queues
		time.Sleep(time.Millisecond)
	}
	small := make(chan error, 1)
	go func() { // arrives later: must queue behind the big one
		s, err := r.Reserve(ctx, 10)
		if err == nil {
			err = r.Release(s)
		}
		small <- err
	}()
	time.Sleep(20 * time.Millisecond)
	select {
	case <-small:
		t.Fatal("a later small request overtook the waiting large one")
	default:
	}
	r.Release(a)
	big := <-got
	if big.Len != 1024 {
		t.Fatalf("big span %+v", big.Buf)
	}
	r.Release(big)
	if err := <-small; err != nil {
		t.Fatal(err)
	}
}

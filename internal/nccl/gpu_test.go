package nccl

import (
	"encoding/binary"
	"errors"
	"math"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/internal/cuda"
)

// devices opens the first n GPUs, or skips (fails with DOS_REQUIRE_GPU=1
// when NCCL or a first GPU is missing; fewer than n GPUs skips, naming
// the count).
func devices(t *testing.T, n int) []*cuda.Device {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("DOS_REQUIRE_GPU=1 but no GPU or no NCCL: %v", err)
		}
		t.Skipf("no GPU or no NCCL: %v", err)
	}
	have, err := cuda.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	if have < n {
		t.Skipf("%d GPUs here; the test needs %d", have, n)
	}
	ds := make([]*cuda.Device, n)
	for i := range ds {
		if ds[i], err = cuda.Open(i); err != nil {
			t.Fatal(err)
		}
		d := ds[i]
		t.Cleanup(func() { _ = d.Close() })
	}
	return ds
}

// rankMem is one rank's device buffer, a stream, and a pinned host buffer
// for its contents.
type rankMem struct {
	s    *cuda.Stream
	buf  *cuda.Buffer
	host *cuda.HostBuffer
}

func newRankMem(t *testing.T, d *cuda.Device, bytes int64) *rankMem {
	t.Helper()
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	b, err := d.Alloc(bytes)
	if err != nil {
		t.Fatal(err)
	}
	h, err := d.HostAlloc(bytes)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Free(); _ = b.Free(); _ = h.Free() })
	return &rankMem{s: s, buf: b, host: h}
}

// put copies vals (fp32 or fp64, by dt; bf16 as the top half of fp32)
// into the device buffer from byte off.
func (m *rankMem) put(t *testing.T, off int64, dt comm.DType, vals []float64) {
	t.Helper()
	b := m.host.Bytes()[off:]
	for i, v := range vals {
		switch dt {
		case comm.F32:
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(v)))
		case comm.F64:
			binary.LittleEndian.PutUint64(b[8*i:], math.Float64bits(v))
		case comm.BF16:
			binary.LittleEndian.PutUint16(b[2*i:], uint16(math.Float32bits(float32(v))>>16))
		}
	}
	n := int64(len(vals)) * dt.Size()
	if err := m.s.CopyHtoD(m.buf, off, m.host, off, n); err != nil {
		t.Fatal(err)
	}
	if err := m.s.Sync(); err != nil {
		t.Fatal(err)
	}
}

// get reads n elements of dt from byte off, after the stream's work.
func (m *rankMem) get(t *testing.T, off int64, dt comm.DType, n int) []float64 {
	t.Helper()
	if err := m.s.CopyDtoH(m.host, off, m.buf, off, int64(n)*dt.Size()); err != nil {
		t.Fatal(err)
	}
	if err := m.s.Sync(); err != nil {
		t.Fatal(err)
	}
	b := m.host.Bytes()[off:]
	out := make([]float64, n)
	for i := range out {
		switch dt {
		case comm.F32:
			out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
		case comm.F64:
			out[i] = math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
		case comm.BF16:
			out[i] = float64(math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[2*i:])) << 16))
		}
	}
	return out
}

// value is rank r's element i in the tests: exact in bf16.
func value(r, i int) float64 { return float64((r+1)*8 + i%8) }

// TestGPUCollectives runs every collective over n ranks, one goroutine per
// rank (NCCL's one device per thread), against the values it must give:
// all-gather in rank order, reduce-scatter and all-reduce with sum and
// avg, broadcast from the last rank, in fp32, bf16 and fp64, in and out of
// place. NCCL: one rank per GPU, every GPU of the machine up to 8 (one
// rank here, where NCCL copies). Staged: three ranks on GPU 0.
func TestGPUCollectives(t *testing.T) {
	t.Run("nccl", func(t *testing.T) {
		n := 1
		if c, err := cuda.DeviceCount(); err == nil && c > 1 {
			n = min(c, 8)
		}
		ds := devices(t, n)
		comms, err := InitAll(ds)
		if err != nil {
			t.Fatal(err)
		}
		v, path, _ := Version()
		t.Logf("NCCL %d from %s, %d ranks", v, path, n)
		cs := make([]Collectives, n)
		for r, c := range comms {
			cs[r] = c
		}
		collectives(t, ds, cs)
	})
	t.Run("staged", func(t *testing.T) {
		d := devices(t, 1)[0]
		ds := []*cuda.Device{d, d, d}
		st, err := NewStaged(ds)
		if err != nil {
			t.Fatal(err)
		}
		cs := make([]Collectives, len(st))
		for r, c := range st {
			cs[r] = c
		}
		collectives(t, ds, cs)
	})
}

// collectives is TestGPUCollectives over the ranks comms, rank r on ds[r].
func collectives(t *testing.T, ds []*cuda.Device, comms []Collectives) {
	n := len(comms)
	const per = 1000 // elements of each rank's shard
	mems := make([]*rankMem, n)
	for r := range n {
		mems[r] = newRankMem(t, ds[r], int64(n)*per*8*2)
	}
	each := func(f func(r int) error) {
		t.Helper()
		errs := make([]error, n)
		var wg sync.WaitGroup
		for r := range n {
			wg.Go(func() { errs[r] = f(r) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
	}
	check := func(what string, r int, got []float64, want func(i int) float64) {
		t.Helper()
		for i, g := range got {
			if w := want(i); g != w {
				t.Fatalf("%s, rank %d, element %d: %v, want %v", what, r, i, g, w)
			}
		}
	}
	for _, dt := range []comm.DType{comm.F32, comm.BF16, comm.F64} {
		es := dt.Size()
		shard, whole := int64(per)*es, int64(n*per)*es
		// AllGather out of place: shard at 0, the whole after it.
		for r := range n {
			vals := make([]float64, per)
			for i := range vals {
				vals[i] = value(r, i)
			}
			mems[r].put(t, 0, dt, vals)
		}
		each(func(r int) error {
			return comms[r].AllGather(mems[r].s, Span{mems[r].buf, 0, shard}, Span{mems[r].buf, whole, whole}, dt)
		})
		for r := range n {
			check("AllGather "+dt.String(), r, mems[r].get(t, whole, dt, n*per), func(i int) float64 { return value(i/per, i%per) })
		}
		// ReduceScatter in place (recv is the rank's own segment of send),
		// with avg: rank r's segment of the mean over ranks.
		for r := range n {
			vals := make([]float64, n*per)
			for i := range vals {
				vals[i] = value(r, i)
			}
			mems[r].put(t, 0, dt, vals)
		}
		each(func(r int) error {
			return comms[r].ReduceScatter(mems[r].s, Span{mems[r].buf, 0, whole}, Span{mems[r].buf, int64(r) * shard, shard}, dt, comm.Avg)
		})
		mean := func(i int) float64 {
			s := 0.0
			for q := range n {
				s += value(q, i)
			}
			return s / float64(n)
		}
		for r := range n {
			check("ReduceScatter avg "+dt.String(), r, mems[r].get(t, int64(r)*shard, dt, per), func(i int) float64 { return mean(r*per + i) })
		}
		// AllReduce sum, in place.
		for r := range n {
			vals := make([]float64, per)
			for i := range vals {
				vals[i] = value(r, i)
			}
			mems[r].put(t, 0, dt, vals)
		}
		each(func(r int) error {
			return comms[r].AllReduce(mems[r].s, Span{mems[r].buf, 0, shard}, Span{mems[r].buf, 0, shard}, dt, comm.Sum)
		})
		for r := range n {
			check("AllReduce sum "+dt.String(), r, mems[r].get(t, 0, dt, per), func(i int) float64 { return mean(i) * float64(n) })
		}
		// Broadcast from the last rank.
		for r := range n {
			vals := make([]float64, per)
			for i := range vals {
				vals[i] = value(r, i)
			}
			mems[r].put(t, 0, dt, vals)
		}
		each(func(r int) error { return comms[r].Broadcast(mems[r].s, Span{mems[r].buf, 0, shard}, n-1) })
		for r := range n {
			check("Broadcast "+dt.String(), r, mems[r].get(t, 0, dt, per), func(i int) float64 { return value(n-1, i) })
		}
	}
	// Refusals before NCCL: a recv of the wrong size, a root out of range.
	if err := comms[0].AllGather(mems[0].s, Span{mems[0].buf, 0, 8}, Span{mems[0].buf, 64, 8*int64(n) + 4}, comm.F32); err == nil {
		t.Error("AllGather into a recv of the wrong size was enqueued")
	}
	if err := comms[0].Broadcast(mems[0].s, Span{mems[0].buf, 0, 8}, n); err == nil {
		t.Error("Broadcast from a root outside the ranks was enqueued")
	}
	for _, c := range comms {
		if err := c.AsyncError(); err != nil {
			t.Errorf("rank %d: %v", c.Rank(), err)
		}
		if err := c.Close(); err != nil {
			t.Errorf("rank %d: Close: %v", c.Rank(), err)
		}
	}
	if err := comms[0].AllReduce(mems[0].s, Span{mems[0].buf, 0, 8}, Span{mems[0].buf, 0, 8}, comm.F32, comm.Sum); !errors.Is(err, ErrClosed) && !errors.Is(err, comm.ErrClosed) {
		t.Errorf("a collective after Close: %v, want ErrClosed", err)
	}
}

// TestGPUAbort: after Abort every call fails with comm.ErrAborted wrapping
// the reason, and Close does nothing.
func TestGPUAbort(t *testing.T) {
	ds := devices(t, 1)
	comms, err := InitAll(ds)
	if err != nil {
		t.Fatal(err)
	}
	m := newRankMem(t, ds[0], 64)
	why := errors.New("rank 0 lost its data")
	if err := comms[0].Abort(why); err != nil {
		t.Fatal(err)
	}
	err = comms[0].AllReduce(m.s, Span{m.buf, 0, 8}, Span{m.buf, 0, 8}, comm.F32, comm.Sum)
	if !errors.Is(err, comm.ErrAborted) || !errors.Is(err, why) {
		t.Errorf("a collective after Abort: %v", err)
	}
	if err := comms[0].Close(); err != nil {
		t.Errorf("Close after Abort: %v", err)
	}
}

// TestGPUSameDeviceTwice: NCCL refuses two ranks on one GPU; InitAll
// returns its error (an *Error naming the call) instead of hanging.
func TestGPUSameDeviceTwice(t *testing.T) {
	ds := devices(t, 1)
	done := make(chan error, 1)
	go func() {
		cs, err := InitAll([]*cuda.Device{ds[0], ds[0]})
		for _, c := range cs {
			_ = c.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		var e *Error
		if !errors.As(err, &e) {
			t.Fatalf("InitAll of one GPU twice: %v, want an *Error", err)
		}
		t.Logf("%v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("InitAll of one GPU twice did not return in 60 s")
	}
}

// TestGPUInitRank: the rendezvous of several processes, on one rank here:
// rank 0's NewID, carried as hex (as through a file), joined with InitRank
// (ncclCommInitRank takes the 128-byte id by value: this checks the call's
// ABI), then an all-reduce through the communicator.
func TestGPUInitRank(t *testing.T) {
	ds := devices(t, 1)
	id, err := NewID()
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseID(id.String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := InitRank(ds[0], 1, got, 1); err == nil { // refused before NCCL is called
		t.Error("InitRank of rank 1 of 1 succeeded")
	}
	c, err := InitRank(ds[0], 1, got, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Rank() != 0 || c.Size() != 1 {
		t.Errorf("rank %d of %d", c.Rank(), c.Size())
	}
	m := newRankMem(t, ds[0], 4096)
	vals := []float64{1, 2, 3, 4, 5}
	m.put(t, 0, comm.F32, vals)
	if err := c.AllGather(m.s, Span{m.buf, 0, 20}, Span{m.buf, 1024, 20}, comm.F32); err != nil {
		t.Fatal(err)
	}
	got2 := m.get(t, 1024, comm.F32, 5)
	for i, v := range vals {
		if got2[i] != v {
			t.Fatalf("AllGather through InitRank's communicator: %v, want %v", got2, vals)
		}
	}
	if nv, _ := cGetenv(EnvNVLS); nv != "0" {
		t.Errorf("%s=%q in the C environment after NCCL loaded, want 0", EnvNVLS, nv)
	}
}

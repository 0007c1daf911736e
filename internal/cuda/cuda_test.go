package cuda

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
)

// gpu opens device 0, or skips the test with the reason when there is none;
// with DOS_REQUIRE_GPU=1 a missing GPU fails the test instead.
func gpu(t testing.TB) *Device {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("DOS_REQUIRE_GPU=1 but no GPU: %v", err)
		}
		t.Skipf("no GPU: %v", err)
	}
	d, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// TestAvailable runs everywhere: without a driver it must return an error
// that says why, not exit or panic.
func TestAvailable(t *testing.T) {
	err := Available()
	t.Logf("Available: %v", err)
	if err != nil {
		if !strings.Contains(err.Error(), "cuda:") {
			t.Errorf("error %q does not name the package", err)
		}
		if _, err := Open(0); err == nil {
			t.Error("Open succeeded where Available failed")
		}
		return
	}
	v, err := DriverVersion()
	if err != nil || v < MinDriverVersion {
		t.Fatalf("DriverVersion = %d, %v", v, err)
	}
	t.Logf("driver API %d.%d", v/1000, v%1000/10)
}

func TestDevice(t *testing.T) {
	d := gpu(t)
	t.Logf("%v", d)
	if d.TotalMem <= 0 || d.Major < 7 || d.SMs <= 0 || d.Name == "" {
		t.Fatalf("implausible device: %+v", d)
	}
	free, total, err := d.MemInfo()
	if err != nil || free <= 0 || total != d.TotalMem {
		t.Fatalf("MemInfo = %d, %d, %v (TotalMem %d)", free, total, err, d.TotalMem)
	}
	if _, err := Open(1 << 20); err == nil {
		t.Error("Open(1<<20) succeeded")
	}
}

// TestCopies: pinned (both kinds) to device, device to device, memset,
// device to pinned; the bytes come back as they went.
func TestCopies(t *testing.T) {
	d := gpu(t)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	const n = 3<<20 + 5
	alloc := map[string]func(int64) (*HostBuffer, error){"HostAlloc": d.HostAlloc, "HostRegister": d.HostRegister}
	for name, f := range alloc {
		src, err := f(n)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		dst, err := f(n)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for i := range src.Bytes() {
			src.Bytes()[i] = byte(i * 7)
		}
		a, _ := d.Alloc(n)
		b, _ := d.Alloc(n)
		must(t, s.CopyHtoD(a, 0, src, 0, n))
		must(t, s.CopyDtoD(b, 0, a, 0, n))
		must(t, s.Memset(b, 100, 10, 0xab))
		must(t, s.CopyDtoH(dst, 0, b, 0, n))
		must(t, s.Sync())
		want := bytes.Clone(src.Bytes())
		for i := 100; i < 110; i++ {
			want[i] = 0xab
		}
		if !bytes.Equal(dst.Bytes(), want) {
			t.Fatalf("%s: round trip differs", name)
		}
		// Out of range and freed: errors, no driver call.
		if err := s.CopyHtoD(a, 1, src, 0, n); err == nil || !strings.Contains(err.Error(), "outside") {
			t.Errorf("copy past the end: %v", err)
		}
		must(t, a.Free())
		if err := s.CopyHtoD(a, 0, src, 0, 8); !errors.Is(err, ErrFreed) {
			t.Errorf("copy to a freed buffer: %v", err)
		}
		must(t, b.Free())
		must(t, src.Free())
		must(t, dst.Free())
		if err := s.CopyDtoH(dst, 0, b, 0, 8); !errors.Is(err, ErrFreed) {
			t.Errorf("copy from a freed buffer: %v", err)
		}
	}
}

// addOnePTX adds 1 to each of n uint32 at p.
const addOnePTX = `
.version 7.8
.target sm_80
.address_size 64
.visible .entry add_one(.param .u64 p, .param .u32 n)
{
	.reg .pred %p<2>;
	.reg .b32 %r<7>;
	.reg .b64 %rd<5>;
	ld.param.u64 %rd1, [p];
	ld.param.u32 %r1, [n];
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mov.u32 %r4, %tid.x;
	mad.lo.s32 %r5, %r2, %r3, %r4;
	setp.ge.u32 %p1, %r5, %r1;
	@%p1 bra DONE;
	cvta.to.global.u64 %rd2, %rd1;
	mul.wide.u32 %rd3, %r5, 4;
	add.s64 %rd4, %rd2, %rd3;
	ld.global.u32 %r6, [%rd4];
	add.s32 %r6, %r6, 1;
	st.global.u32 [%rd4], %r6;
DONE:
	ret;
}
`

type kit struct {
	d    *Device
	s    *Stream
	f    *Function
	args *Args
	host *HostBuffer
	buf  *Buffer
}

func newKit(t testing.TB, d *Device, n int) *kit {
	t.Helper()
	m, err := d.LoadModule([]byte(addOnePTX))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Free() })
	k := &kit{d: d}
	if k.f, err = m.Function("add_one"); err != nil {
		t.Fatal(err)
	}
	if k.s, err = d.NewStream(); err != nil {
		t.Fatal(err)
	}
	if k.args, err = NewArgs(); err != nil {
		t.Fatal(err)
	}
	if k.host, err = d.HostAlloc(int64(4 * n)); err != nil {
		t.Fatal(err)
	}
	if k.buf, err = d.Alloc(int64(4 * n)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.s.Free(); k.args.Free(); k.host.Free(); k.buf.Free() })
	return k
}

// run uploads host, launches add_one times, downloads.
func (k *kit) run(n, times int) error {
	if err := k.s.CopyHtoD(k.buf, 0, k.host, 0, int64(4*n)); err != nil {
		return err
	}
	for range times {
		k.args.Reset()
		k.args.Ptr(k.buf, 0).I32(int32(n))
		if err := k.f.Launch(k.s, Dim3{uint32((n + 255) / 256), 1, 1}, Dim3{256, 1, 1}, 0, k.args); err != nil {
			return err
		}
	}
	if err := k.s.CopyDtoH(k.host, 0, k.buf, 0, int64(4*n)); err != nil {
		return err
	}
	return k.s.Sync()
}

func TestLaunch(t *testing.T) {
	d := gpu(t)
	const n = 100003
	k := newKit(t, d, n)
	for i := range n {
		binary.LittleEndian.PutUint32(k.host.Bytes()[4*i:], uint32(i))
	}
	must(t, k.run(n, 3))
	for i := range n {
		if got := binary.LittleEndian.Uint32(k.host.Bytes()[4*i:]); got != uint32(i+3) {
			t.Fatalf("element %d = %d, want %d", i, got, i+3)
		}
	}
	if _, err := k.f.m.Function("no_such_kernel"); err == nil || !strings.Contains(err.Error(), "no_such_kernel") {
		t.Errorf("missing kernel: %v", err)
	}
}

// TestErrors: failures come back as Go errors naming the call and the
// driver's error, and the context stays usable afterwards.
func TestErrors(t *testing.T) {
	d := gpu(t)
	_, err := d.Alloc(1 << 50)
	if !IsOutOfMemory(err) || !strings.Contains(err.Error(), "CUDA_ERROR_OUT_OF_MEMORY") || !strings.Contains(err.Error(), "cuMemAlloc_v2") {
		t.Errorf("1 PiB Alloc: %v", err)
	}
	t.Logf("out of memory: %v", err)
	_, err = d.LoadModule([]byte(".version 7.8\n.target sm_80\n.address_size 64\n.visible .entry broken( { garbage }"))
	var e *Error
	if !errors.As(err, &e) || !strings.Contains(err.Error(), "cuModuleLoadDataEx") {
		t.Errorf("bad PTX: %v", err)
	}
	t.Logf("bad PTX: %v", err)
	k := newKit(t, d, 1024)
	must(t, k.buf.Free())
	k.args.Reset()
	k.args.Ptr(k.buf, 0).I32(1024)
	err = k.f.Launch(k.s, Dim3{4, 1, 1}, Dim3{256, 1, 1}, 0, k.args)
	if !errors.Is(err, ErrFreed) {
		t.Errorf("launch on a freed buffer: %v", err)
	}
	t.Logf("launch on a freed buffer: %v", err)
	k.args.Reset()
	for range MaxArgs + 1 {
		k.args.I32(1)
	}
	if err := k.f.Launch(k.s, Dim3{1, 1, 1}, Dim3{1, 1, 1}, 0, k.args); err == nil {
		t.Error("too many arguments accepted")
	}
	buf, err := d.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	k.args.Reset()
	k.args.Ptr(buf, 0).I32(1024)
	err = k.f.Launch(k.s, Dim3{1, 1, 1}, Dim3{4096, 1, 1}, 0, k.args) // more threads than a block may have
	if err == nil || !strings.Contains(err.Error(), "cuLaunchKernel") {
		t.Errorf("block of 4096 threads: %v", err)
	}
	t.Logf("block of 4096 threads: %v", err)
	// Still usable.
	k2 := newKit(t, d, 16)
	must(t, k2.run(16, 1))
}

// TestConcurrent: many goroutines, each with its own stream, drive the
// device at once (run it under -race); the context rule holds wherever the
// goroutines land.
func TestConcurrent(t *testing.T) {
	d := gpu(t)
	const n, workers = 4096, 16
	kits := make([]*kit, workers)
	for w := range kits {
		kits[w] = newKit(t, d, n)
	}
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := kits[w]
			for i := range n {
				binary.LittleEndian.PutUint32(k.host.Bytes()[4*i:], uint32(w))
			}
			for range 20 {
				if err := k.run(n, 2); err != nil {
					errs[w] = err
					return
				}
			}
			for i := range n {
				if got := binary.LittleEndian.Uint32(k.host.Bytes()[4*i:]); got != uint32(w+40) {
					errs[w] = errors.New("wrong result")
					return
				}
			}
		}()
	}
	wg.Wait()
	for w, err := range errs {
		if err != nil {
			t.Errorf("worker %d: %v", w, err)
		}
	}
}

// TestEvents: ordering across streams with Wait, and timing.
func TestEvents(t *testing.T) {
	d := gpu(t)
	const n = 1 << 20
	k := newKit(t, d, n)
	s2, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Free()
	start, _ := d.NewEvent(true)
	end, _ := d.NewEvent(true)
	defer start.Free()
	defer end.Free()
	clear(k.host.Bytes())
	must(t, start.Record(k.s))
	must(t, k.s.CopyHtoD(k.buf, 0, k.host, 0, 4*n))
	k.args.Reset()
	k.args.Ptr(k.buf, 0).I32(n)
	must(t, k.f.Launch(k.s, Dim3{n / 256, 1, 1}, Dim3{256, 1, 1}, 0, k.args))
	must(t, end.Record(k.s))
	must(t, s2.Wait(end)) // s2's copy sees the kernel's result
	must(t, s2.CopyDtoH(k.host, 0, k.buf, 0, 4*n))
	must(t, s2.Sync())
	if got := binary.LittleEndian.Uint32(k.host.Bytes()[4*(n-1):]); got != 1 {
		t.Fatalf("s2 did not wait: %d", got)
	}
	done, err := end.Done()
	if err != nil || !done {
		t.Fatalf("Done = %v, %v", done, err)
	}
	el, err := Elapsed(start, end)
	if err != nil || el <= 0 || el.Seconds() > 1 {
		t.Fatalf("Elapsed = %v, %v", el, err)
	}
	t.Logf("4 MiB H2D + kernel: %v", el)
}

// TestHotPathNoAllocs: copies, launches, event records and waits, and the
// host's waits (Event.Sync, Stream.Sync) under each HostWait, allocate
// nothing.
func TestHotPathNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race runtime allocates")
	}
	d := gpu(t)
	const n = 1024
	k := newKit(t, d, n)
	ev, _ := d.NewEvent(false)
	defer ev.Free()
	f := func() {
		k.s.CopyHtoD(k.buf, 0, k.host, 0, 4*n)
		k.args.Reset()
		k.args.Ptr(k.buf, 0).I32(n)
		k.f.Launch(k.s, Dim3{4, 1, 1}, Dim3{256, 1, 1}, 0, k.args)
		ev.Record(k.s)
		k.s.Wait(ev)
		k.s.CopyDtoH(k.host, 0, k.buf, 0, 4*n)
	}
	f()
	if a := testing.AllocsPerRun(100, f); a != 0 {
		t.Errorf("hot path allocates %v times", a)
	}
	must(t, k.s.Sync())
	was := CurrentHostWait()
	defer SetHostWait(was)
	for _, w := range []HostWait{WaitSpin, WaitSleep} {
		must(t, SetHostWait(w))
		sync := func() {
			f()
			ev.Sync()
			f()
			k.s.Sync()
		}
		if a := testing.AllocsPerRun(20, sync); a != 0 {
			t.Errorf("%v: the host's waits allocate %v times", w, a)
		}
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestZeroDevice runs everywhere: a Device not made by Open returns errors.
func TestZeroDevice(t *testing.T) {
	var d Device
	if _, err := d.Alloc(8); err == nil {
		t.Error("Alloc on a zero Device succeeded")
	}
	if err := d.Sync(); err == nil {
		t.Error("Sync on a zero Device succeeded")
	}
	if _, err := d.HostRegister(4096); err == nil {
		t.Error("HostRegister on a zero Device succeeded")
	}
	if err := d.Close(); err == nil {
		t.Error("Close on a zero Device succeeded")
	}
}

// TestBorrow: a Buffer over part of another is used as one (copies in and
// out land in the owner's bytes), counts nothing, and its Free leaves the
// owner's memory allocated and usable.
func TestBorrow(t *testing.T) {
	if _, err := (&Device{}).Borrow(0, 8); err == nil {
		t.Error("Borrow of a zero address succeeded")
	}
	if _, err := (&Device{}).Borrow(4096, 0); err == nil {
		t.Error("Borrow of 0 bytes succeeded")
	}
	d := gpu(t)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	owner, err := d.Alloc(1 << 12)
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Free()
	used := MemoryUsed(d.Ordinal)
	b, err := d.Borrow(owner.Ptr()+1024, 512)
	if err != nil {
		t.Fatal(err)
	}
	if MemoryUsed(d.Ordinal) != used || b.Len() != 512 {
		t.Fatalf("Borrow counted %d bytes, Len %d", MemoryUsed(d.Ordinal)-used, b.Len())
	}
	h, err := d.HostAlloc(1 << 12)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Free()
	for i := range 512 {
		h.Bytes()[i] = byte(i*3 + 1)
	}
	must(t, s.Memset(owner, 0, 1<<12, 0))
	must(t, s.CopyHtoD(b, 0, h, 0, 512))
	if err := s.CopyHtoD(b, 1, h, 0, 512); err == nil {
		t.Error("a copy past the borrowed range succeeded")
	}
	must(t, b.Free())
	if !b.Freed() {
		t.Error("a borrowed buffer is not freed after Free")
	}
	if err := s.CopyHtoD(b, 0, h, 0, 8); !errors.Is(err, ErrFreed) {
		t.Errorf("copy to a freed borrowed buffer: %v", err)
	}
	must(t, s.CopyDtoH(h, 1<<11, owner, 1024, 512)) // the owner still holds the bytes
	must(t, s.Sync())
	if !bytes.Equal(h.Bytes()[1<<11:1<<11+512], h.Bytes()[:512]) {
		t.Fatal("the bytes copied through the borrowed buffer are not in the owner's range")
	}
}

package cuda

import (
	"runtime"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
)

// TestCallABI checks call (the allocation-free path into C) against libc on
// any machine: arguments and results cross intact, up to 11 arguments,
// without allocating. It guards the mirror of purego's internals.
func TestCallABI(t *testing.T) {
	lib, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW)
	if err != nil {
		t.Skipf("no libc.so.6: %v", err)
	}
	labs, err := purego.Dlsym(lib, "labs")
	if err != nil {
		t.Fatal(err)
	}
	m := int64(-123456789012)
	if got, want := call(labs, uintptr(m)), int(int32(-m)); got != want {
		t.Fatalf("labs(-123456789012) = %d (low 32 bits), want %d", got, want)
	}
	// snprintf(buf, 64, fmt, 8 ints): 11 arguments, the last ones on the stack.
	snprintf, err := purego.Dlsym(lib, "snprintf")
	if err != nil {
		t.Fatal(err)
	}
	mem := make([]byte, 128) // written by C only during the call
	fmt := []byte("%d %d %d %d %d %d %d %d\x00")
	n := call(snprintf, addr(mem), 64, addr(fmt), 1, 2, 3, 4, 5, 6, 7, 8)
	runtime.KeepAlive(fmt)
	if got := string(mem[:n]); got != "1 2 3 4 5 6 7 8" {
		t.Fatalf("snprintf through call wrote %q", got)
	}
}

// TestCallNoAllocs: a call into C allocates nothing (make test runs the
// NoAllocs tests without -race, whose runtime allocates).
func TestCallNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("the race runtime allocates")
	}
	lib, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW)
	if err != nil {
		t.Skipf("no libc.so.6: %v", err)
	}
	labs, err := purego.Dlsym(lib, "labs")
	if err != nil {
		t.Fatal(err)
	}
	if a := testing.AllocsPerRun(100, func() { call(labs, 5) }); a != 0 {
		t.Errorf("call allocates %v times", a)
	}
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

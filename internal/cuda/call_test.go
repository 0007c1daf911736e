package cuda

import (
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
)

// TestCallABI checks call (the allocation-free path into C) against libc on
// any machine: arguments and results cross intact, up to MaxCallArgs
// arguments. It guards the mirror of purego's internals.
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
	// snprintf(buf, 512, fmt, 29 distinct ints) through the exported Call:
	// 32 arguments, 26 of them on the stack; each value must land in its
	// own slot, in order.
	const extra = MaxCallArgs - 3
	args := []uintptr{addr(mem), 512, 0}
	var want []string
	for i := range extra {
		v := 1000*(i+1) + i // distinct, so a shifted or repeated slot shows
		args = append(args, uintptr(v))
		want = append(want, strconv.Itoa(v))
	}
	mem = make([]byte, 512)
	args[0] = addr(mem)
	fmt = []byte(strings.Repeat("%d ", extra-1) + "%d\x00")
	args[2] = addr(fmt)
	n = Call(snprintf, args...)
	runtime.KeepAlive(fmt)
	runtime.KeepAlive(mem)
	if got, w := string(mem[:n]), strings.Join(want, " "); got != w {
		t.Fatalf("snprintf with %d arguments wrote\n%q, want\n%q", len(args), got, w)
	}
	// A negative C int comes back sign-extended.
	abs, err := purego.Dlsym(lib, "abs")
	if err != nil {
		t.Fatal(err)
	}
	minus7 := int64(-7)
	if got := Call(abs, uintptr(minus7)); got != 7 {
		t.Fatalf("abs(-7) = %d", got)
	}
	atoi, err := purego.Dlsym(lib, "atoi")
	if err != nil {
		t.Fatal(err)
	}
	neg := []byte("-42\x00")
	if got := Call(atoi, addr(neg)); got != -42 {
		t.Fatalf("atoi(\"-42\") = %d", got)
	}
	runtime.KeepAlive(neg)
}

// TestCallArgsLayout: the integer arguments a1..a32 of purego's block are
// consecutive words, so ints may view them as an array.
func TestCallArgsLayout(t *testing.T) {
	var s syscallArgs
	w := unsafe.Sizeof(uintptr(0))
	if d := unsafe.Offsetof(s.a32) - unsafe.Offsetof(s.a1); d != (MaxCallArgs-1)*w {
		t.Fatalf("a1..a32 span %d bytes, want %d", d, (MaxCallArgs-1)*w)
	}
	a := s.ints()
	for i := range a {
		a[i] = uintptr(i + 1)
	}
	if s.a1 != 1 || s.a7 != 7 || s.a16 != 16 || s.a32 != 32 || s.fn != 0 || s.f1 != 0 {
		t.Fatalf("ints writes the wrong fields: %+v", s)
	}
}

// TestCallTooManyArgs: more than MaxCallArgs arguments panic before any C
// call.
func TestCallTooManyArgs(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "33 arguments") {
			t.Fatalf("recovered %v", r)
		}
	}()
	Call(1, make([]uintptr, MaxCallArgs+1)...)
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
	// The exported Call with 16 arguments, as cublasLtMatmul takes.
	if a := testing.AllocsPerRun(100, func() { Call(labs, 5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) }); a != 0 {
		t.Errorf("Call with 16 arguments allocates %v times", a)
	}
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

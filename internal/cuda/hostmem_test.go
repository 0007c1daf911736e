package cuda

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"testing"
	"unsafe"
)

// TestMapHost runs everywhere: sizes, alignment, zeroed memory, and the
// release of the whole mapping.
func TestMapHost(t *testing.T) {
	for _, n := range []int64{1, 4097, hugeMin - 1, hugeMin, hugeMin + 5} {
		mem, err := MapHost(n)
		if err != nil {
			t.Fatal(err)
		}
		addr := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
		if int64(len(mem)) != n || int64(cap(mem)) < n || cap(mem)%os.Getpagesize() != 0 || addr%uintptr(os.Getpagesize()) != 0 {
			t.Errorf("MapHost(%d): len %d cap %d at %#x", n, len(mem), cap(mem), addr)
		}
		if n >= hugeMin && (addr%hugePage != 0 || cap(mem)%hugePage != 0) {
			t.Errorf("MapHost(%d): %d bytes at %#x, want both multiples of 2 MiB", n, cap(mem), addr)
		}
		full := mem[:cap(mem)]
		for i := 0; i < len(full); i += 4093 {
			if full[i] != 0 {
				t.Fatalf("MapHost(%d): byte %d is %d, want zeroed memory", n, i, full[i])
			}
			full[i] = 1
		}
		if err := UnmapHost(mem); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := MapHost(0); err == nil {
		t.Error("MapHost(0) succeeded")
	}
}

// TestMapHostHuge (Linux, where the kernel has transparent huge pages):
// a mapping of 16 MiB or more is eligible for them (smaps'
// THPeligible), and under DOS_HUGE_PAGES=off it is not, in any mode.
func TestMapHostHuge(t *testing.T) {
	mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil || strings.Contains(string(mode), "[never]") {
		t.Skipf("no transparent huge pages here (%q, %v)", mode, err)
	}
	for _, off := range []bool{false, true} {
		if off {
			t.Setenv(HugePagesEnv, "off")
		}
		mem, err := MapHost(64 << 20)
		if err != nil {
			t.Fatal(err)
		}
		eligible, ok := thpEligible(t, uintptr(unsafe.Pointer(unsafe.SliceData(mem))))
		UnmapHost(mem)
		if !ok {
			t.Skip("smaps has no THPeligible field (an older kernel)")
		}
		want := !off
		t.Logf("THP mode %q, %s=off %v: eligible %v (%s, %s)", strings.TrimSpace(string(mode)), HugePagesEnv, off, eligible, HugePages(), HostPages())
		if eligible != want {
			t.Errorf("%s=off %v: THPeligible %v, want %v", HugePagesEnv, off, eligible, want)
		}
	}
}

// thpEligible returns smaps' THPeligible of the mapping that starts at
// addr.
func thpEligible(t *testing.T, addr uintptr) (eligible, ok bool) {
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skip(err)
	}
	defer f.Close()
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		// A mapping's header: "lo-hi perms offset dev inode [path]"; its
		// fields follow, each "Name: value".
		if f := strings.Fields(line); len(f) >= 5 && !strings.HasSuffix(f[0], ":") {
			var lo, hi uintptr
			n, _ := fmt.Sscanf(f[0], "%x-%x", &lo, &hi)
			in = n == 2 && lo == addr
			continue
		}
		if in && strings.HasPrefix(line, "THPeligible:") {
			return strings.TrimSpace(strings.TrimPrefix(line, "THPeligible:")) == "1", true
		}
	}
	return false, false
}

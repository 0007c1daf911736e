package cuda

import (
	"fmt"
	"os"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// HugePagesEnv is the environment variable that keeps MapHost from asking
// for transparent huge pages: "off". Read at each MapHost.
const HugePagesEnv = "DOS_HUGE_PAGES"

// hugePage is the x86-64 huge page, and hugeMin the smallest mapping
// MapHost aligns and rounds to it (a smaller one wastes too much of its
// last huge page).
const (
	hugePage = 2 << 20
	hugeMin  = 16 << 20
)

// MapHost maps bytes (> 0) of zeroed, private, anonymous read-write host
// memory, outside the Go heap (HostRegister pins such memory; the CPU's
// own arrays use it unpinned). From 16 MiB up the mapping is aligned to
// 2 MiB, rounded up to whole 2 MiB, and advised for transparent huge pages
// (madvise MADV_HUGEPAGE), which hosts whose THP mode is "madvise" (the
// usual default) give only to memory that asks: the CPU workers' updates
// stream through their arrays, and on 4 KiB pages each page boundary
// stops the hardware prefetcher and costs a TLB walk (on a 2-core AMD VM
// of the development machines the update in place ran 2.0-2.4 times as
// fast on huge pages, the out-of-place one 1.2-1.4 times: BENCHMARKS.md).
// The advice is only advice: a kernel without THP, or out of huge pages,
// maps small pages. DOS_HUGE_PAGES=off maps as before (page-rounded) and
// advises MADV_NOHUGEPAGE, so that small pages are what it gets in THP
// mode "always" too. mem has len bytes; its capacity is the whole
// mapping, which UnmapHost releases.
//
// Errors: bytes <= 0; mmap failing (the error says how many bytes).
func MapHost(bytes int64) (mem []byte, err error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("cuda: MapHost(%d): size must be > 0", bytes)
	}
	page := int64(unix.Getpagesize())
	off := os.Getenv(HugePagesEnv) == "off"
	huge := bytes >= hugeMin && !off
	size, slack := (bytes+page-1)/page*page, int64(0)
	if huge {
		size, slack = (bytes+hugePage-1)/hugePage*hugePage, hugePage
	}
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(size+slack), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("cuda: mapping %d bytes of host memory: %w", bytes, err)
	}
	if huge {
		// Keep the 2 MiB-aligned size bytes; unmap the slack around them.
		head := (hugePage - uintptr(p)%hugePage) % hugePage
		if head > 0 {
			unix.MunmapPtr(p, head)
		}
		if tail := uintptr(slack) - head; tail > 0 {
			unix.MunmapPtr(unsafe.Add(p, head+uintptr(size)), tail)
		}
		p = unsafe.Add(p, head)
		advise(unsafe.Slice((*byte)(p), size), true)
	} else if off && bytes >= hugeMin {
		advise(unsafe.Slice((*byte)(p), size), false)
	}
	return unsafe.Slice((*byte)(p), size)[:bytes], nil
}

// UnmapHost releases a mapping of MapHost (all of it, mem's capacity).
// mem must be MapHost's slice or a reslice of it that starts at its first
// byte. Errors: munmap's.
func UnmapHost(mem []byte) error {
	if cap(mem) == 0 {
		return nil
	}
	if err := unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(mem)), uintptr(cap(mem))); err != nil {
		return fmt.Errorf("cuda: unmapping %d bytes of host memory: %w", cap(mem), err)
	}
	return nil
}

// HugePages describes what MapHost gets from the kernel, for a run's
// header: "2 MiB pages asked (transparent huge pages: always [madvise]
// never)", "small pages (DOS_HUGE_PAGES=off)", or where the kernel has
// none, "small pages (no transparent huge pages)".
func HugePages() string {
	mode, on := thpMode()
	switch {
	case os.Getenv(HugePagesEnv) == "off":
		return "small pages (" + HugePagesEnv + "=off)"
	case !on:
		return "small pages (no transparent huge pages)"
	}
	return "2 MiB pages asked (transparent huge pages: " + mode + ")"
}

// HostPages is "huge" where MapHost asks for huge pages and the kernel has
// them, else "small": a profile records it (perfmodel.Machine), since the
// CPU workers' rates depend on it.
func HostPages() string {
	if _, on := thpMode(); on && os.Getenv(HugePagesEnv) != "off" {
		return "huge"
	}
	return "small"
}

// thpMode returns the kernel's transparent huge page mode line and whether
// it gives huge pages to memory that asks (any mode but never).
func thpMode() (string, bool) {
	mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		return "", false
	}
	m := strings.TrimSpace(string(mode))
	return m, !strings.Contains(m, "[never]")
}

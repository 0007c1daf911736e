package cuda

import (
	"strings"
	"testing"
)

// TestMemoryCap: the cap's accounting without a GPU: reserve counts until
// the cap, refuses past it as out of memory (IsOutOfMemory) with the cap
// in the message and counts nothing then; unreserve takes bytes back; no
// cap (0) refuses nothing; bad arguments are refused.
func TestMemoryCap(t *testing.T) {
	const ord = 63 // an ordinal no test device has
	t.Cleanup(func() {
		_ = SetMemoryLimit(ord, 0)
		caps[ord].used.Store(0)
	})
	if err := SetMemoryLimit(ord, 1000); err != nil {
		t.Fatal(err)
	}
	if err := reserve(ord, 600, "a"); err != nil {
		t.Fatal(err)
	}
	err := reserve(ord, 500, "b")
	if !IsOutOfMemory(err) || MemoryUsed(ord) != 600 {
		t.Fatalf("past the cap: %v, used %d; want out of memory, 600", err, MemoryUsed(ord))
	}
	if want := "over the device memory cap of 1000 bytes (600 in use)"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("message %q, want it to say %q", err, want)
	}
	unreserve(ord, 600)
	if err := reserve(ord, 1000, "c"); err != nil || MemoryUsed(ord) != 1000 || MemoryLimit(ord) != 1000 {
		t.Fatalf("up to the cap: %v, used %d", err, MemoryUsed(ord))
	}
	if err := SetMemoryLimit(ord, 0); err != nil {
		t.Fatal(err)
	}
	if err := reserve(ord, 1<<40, "d"); err != nil {
		t.Fatalf("no cap: %v", err)
	}
	for _, bad := range [][2]int64{{-1, 0}, {64, 0}, {0, -1}} {
		if SetMemoryLimit(int(bad[0]), bad[1]) == nil {
			t.Errorf("SetMemoryLimit(%d, %d): no error", bad[0], bad[1])
		}
	}
}

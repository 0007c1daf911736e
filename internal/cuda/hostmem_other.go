//go:build !linux

package cuda

// adviseHuge does nothing where madvise has no MADV_HUGEPAGE.
func adviseHuge(b []byte) {}

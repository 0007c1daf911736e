//go:build !linux

package cuda

// advise does nothing where madvise has no transparent huge pages.
func advise(b []byte, huge bool) {}

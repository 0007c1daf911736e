//go:build !linux

package checkpoint

// oDirect is 0 where open(2) has no O_DIRECT: the engine writes through the
// page cache (DirectAuto) or refuses (DirectOn).
const oDirect = 0

func preallocate(fd uintptr, size int64) {}

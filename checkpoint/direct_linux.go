package checkpoint

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// oDirect is the open(2) flag for direct I/O.
const oDirect = syscall.O_DIRECT

// preallocate reserves size bytes of blocks for the file without changing
// its size (fallocate with FALLOC_FL_KEEP_SIZE), best effort: a file system
// without fallocate grows the file as it is written.
func preallocate(fd uintptr, size int64) {
	_ = unix.Fallocate(int(fd), unix.FALLOC_FL_KEEP_SIZE, 0, size)
}

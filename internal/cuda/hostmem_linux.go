package cuda

import "golang.org/x/sys/unix"

// adviseHuge asks for transparent huge pages for b (madvise MADV_HUGEPAGE):
// advice, whose failure (a kernel without THP) leaves small pages.
func adviseHuge(b []byte) { unix.Madvise(b, unix.MADV_HUGEPAGE) }

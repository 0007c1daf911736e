package cuda

import "golang.org/x/sys/unix"

// advise asks for transparent huge pages for b (madvise MADV_HUGEPAGE), or
// with huge false for none (MADV_NOHUGEPAGE): advice, whose failure (a
// kernel without THP) leaves small pages.
func advise(b []byte, huge bool) {
	if huge {
		unix.Madvise(b, unix.MADV_HUGEPAGE)
	} else {
		unix.Madvise(b, unix.MADV_NOHUGEPAGE)
	}
}

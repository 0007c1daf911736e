//go:build !linux

package pinned

// mapPopulate is 0 where mmap has no MAP_POPULATE: touch faults the pages
// in instead.
const mapPopulate = 0

func touch(mem []byte) {
	for i := 0; i < len(mem); i += 4096 {
		mem[i] = 0
	}
}

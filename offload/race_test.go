//go:build race

package offload

// raceEnabled: the race runtime allocates when told about the memory the
// assembly kernels touch, so allocation counts are checked without -race
// (make test runs the allocation tests a second time, without it).
const raceEnabled = true

package scheduler

// This package's tests run the simulated device with a host clock per
// goroutine (simGoroutineClocks): a wait one goroutine misses is not
// hidden by another's.
func init() { simGoroutineClocks = true }

package cuda

import (
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// threadCPU returns the calling OS thread's CPU time, user and system.
func threadCPU(t *testing.T) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestHostWait: under WaitSleep a Stream.Sync and an Event.Sync on about
// 200 ms of copies leave the waiting thread's core idle (its CPU time under
// a fifth of the wait), and the primary context, inactive when Open came,
// sleeps (Device.Sleeps). Under WaitSpin the CPU time is logged: the
// driver's default is what the CPU workers lose to a trainer that waits
// for its backward.
func TestHostWait(t *testing.T) {
	d0 := gpu(t) // skips without a GPU
	d0.Close()
	was := CurrentHostWait()
	t.Cleanup(func() { SetHostWait(was) })
	for _, w := range []HostWait{WaitSpin, WaitSleep} {
		t.Run(w.String(), func(t *testing.T) {
			must(t, SetHostWait(w))
			d := gpu(t)
			if w == WaitSleep && !d.Sleeps {
				t.Errorf("Open under WaitSleep: the context does not sleep (another holder of the primary context?)")
			}
			const n = 256 << 20
			h, err := d.HostAlloc(n)
			must(t, err)
			defer h.Free()
			b, err := d.Alloc(n)
			must(t, err)
			defer b.Free()
			s, err := d.NewStream()
			must(t, err)
			defer s.Free()
			ev, err := d.NewEvent(false)
			must(t, err)
			defer ev.Free()
			t0 := time.Now()
			must(t, s.CopyHtoD(b, 0, h, 0, n))
			must(t, s.Sync())
			reps := max(4, int(200*time.Millisecond/time.Since(t0)))
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			for _, how := range []string{"Stream.Sync", "Event.Sync"} {
				for range reps {
					must(t, s.CopyHtoD(b, 0, h, 0, n))
				}
				must(t, ev.Record(s))
				c0, w0 := threadCPU(t), time.Now()
				if how == "Stream.Sync" {
					must(t, s.Sync())
				} else {
					must(t, ev.Sync())
				}
				wall, cpu := time.Since(w0), threadCPU(t)-c0
				t.Logf("%s %s of %d copies of 256 MiB: %v waited, %v of CPU (%.0f %%)", w, how, reps, wall.Round(time.Millisecond), cpu.Round(time.Millisecond), 100*cpu.Seconds()/wall.Seconds())
				if w == WaitSleep && cpu > wall/5 {
					t.Errorf("%s under WaitSleep took %v of CPU in a %v wait", how, cpu, wall)
				}
			}
		})
	}
}

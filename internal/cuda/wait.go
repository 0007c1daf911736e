package cuda

import (
	"fmt"
	"os"
	"sync/atomic"
	"time"
)

// HostWait is how a host thread waits for the device in Stream.Sync,
// Event.Sync and Device.Sync.
type HostWait int32

const (
	// WaitSpin leaves the waiting to the primary context's scheduling
	// flags as they are: the driver's default, CU_CTX_SCHED_AUTO, spins
	// while the process has no more contexts than the host has cores, so
	// the waiting thread polls the device on a core of its own until the
	// work is done. The lowest latency; but a wait of a whole backward
	// (the trainer's Loss) holds a core the CPU workers' speculative
	// updates run on at the same time.
	WaitSpin HostWait = iota
	// WaitSleep polls for SpinBeforeSleep, then sleeps in the driver until
	// the device's interrupt wakes the thread: the primary context is
	// made with CU_CTX_SCHED_BLOCKING_SYNC (when Open finds it inactive)
	// and events with CU_EVENT_BLOCKING_SYNC, as CUDA's
	// cudaDeviceScheduleBlockingSync and cudaEventBlockingSync do. A wait
	// longer than the poll costs the wake-up's latency (tens of
	// microseconds) and leaves its core to other threads.
	WaitSleep
)

// SpinBeforeSleep is how long a WaitSleep wait polls before it sleeps: a
// wait for work that is nearly done returns without the wake-up's latency.
const SpinBeforeSleep = 20 * time.Microsecond

// WaitEnv is the environment variable that sets the host wait when the
// driver is first loaded: "spin" (WaitSpin, the default) or "sleep"
// (WaitSleep). Any other value makes Open fail, naming it.
const WaitEnv = "DOS_CUDA_WAIT"

// CUDA's scheduling flags (CUctx_flags) and the event's blocking flag.
const (
	ctxSchedMask         = 0x07
	ctxSchedBlockingSync = 0x04
	eventBlockingSync    = 0x01
)

// hostWait is the current HostWait; envErr is WaitEnv's bad value, which
// Open returns (the driver is usable: Available says so).
var (
	hostWait atomic.Int32
	envErr   error
)

func (w HostWait) String() string {
	switch w {
	case WaitSpin:
		return "spin"
	case WaitSleep:
		return "sleep"
	}
	return fmt.Sprintf("HostWait(%d)", int32(w))
}

// hostWaitFromEnv parses WaitEnv: unset or empty is WaitSpin.
func hostWaitFromEnv() (HostWait, error) {
	switch v := os.Getenv(WaitEnv); v {
	case "", "spin":
		return WaitSpin, nil
	case "sleep":
		return WaitSleep, nil
	default:
		return 0, fmt.Errorf("cuda: %s=%q: want spin or sleep", WaitEnv, v)
	}
}

// SetHostWait sets how the host waits for the device from now on: every
// Sync, the events made after it, and the primary context of the next Open
// that finds it inactive (no other Device, and no other library of the
// process, holds it); an active context keeps its scheduling flags.
// WaitEnv sets it when the driver loads. Errors: load's (no driver); a
// HostWait other than WaitSpin and WaitSleep.
func SetHostWait(w HostWait) error {
	if w != WaitSpin && w != WaitSleep {
		return fmt.Errorf("cuda: SetHostWait(%v): want WaitSpin or WaitSleep", w)
	}
	if err := load(); err != nil {
		return err
	}
	hostWait.Store(int32(w))
	return nil
}

// CurrentHostWait returns the host wait in force (SetHostWait, WaitEnv;
// WaitSpin where the driver cannot load, or WaitEnv's value is bad).
func CurrentHostWait() HostWait {
	load()
	return HostWait(hostWait.Load())
}

// schedFlags sets CU_CTX_SCHED_BLOCKING_SYNC on the primary context of
// CUdevice dev under WaitSleep, when the context is inactive (Open calls
// it before cuDevicePrimaryCtxRetain); an active one (another Device, or
// PyTorch in the process) keeps its own flags, and WaitSpin changes none.
// The check and the change are one step for this package (driver.mu), not
// for another library of the process that may make the context active
// between them. It reports whether the context sleeps in
// cuStreamSynchronize and cuCtxSynchronize. Under WaitSleep, a process
// whose dos opens the device first has PyTorch's synchronizations sleep
// too (dos.torch, before torch touches the GPU).
func schedFlags(dev uintptr) (sleeps bool, err error) {
	driver.mu.Lock()
	defer driver.mu.Unlock()
	a := scratchAddr()
	clear(driver.scratch[:16])
	if r := call(driver.cuDevicePrimaryCtxGetState, dev, a, a+8); r != 0 {
		return false, newErrorLocked("cuDevicePrimaryCtxGetState", r)
	}
	flags, active := uint32(scratchU64()), int32(uint32(scratchU64At(8)))
	if active != 0 || HostWait(hostWait.Load()) != WaitSleep {
		return flags&ctxSchedMask == ctxSchedBlockingSync, nil
	}
	want := flags&^ctxSchedMask | ctxSchedBlockingSync
	if want != flags {
		if r := call(driver.cuDevicePrimaryCtxSetFlags, dev, uintptr(want)); r != 0 {
			return false, newErrorLocked("cuDevicePrimaryCtxSetFlags", r)
		}
	}
	return want&ctxSchedMask == ctxSchedBlockingSync, nil
}

// pollThen waits for a query (cuEventQuery, cuStreamQuery on h) to say
// done, polling it for SpinBeforeSleep under WaitSleep, then calls the
// blocking wait (cuEventSynchronize, cuStreamSynchronize). The caller has
// entered the context.
func pollThen(queryName string, query uintptr, syncName string, sync, h uintptr) error {
	if HostWait(hostWait.Load()) == WaitSleep {
		for t0 := time.Now(); ; {
			switch r := call(query, h); r {
			case 0:
				return nil
			case errNotReady:
			default:
				return newError(queryName, r)
			}
			if time.Since(t0) >= SpinBeforeSleep {
				break
			}
		}
	}
	return check(syncName, sync, h)
}

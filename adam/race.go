//go:build race

package adam

import (
	"runtime"
	"unsafe"
)

// raceRead32 and raceWrite32 tell the race detector about the fp32 memory
// an assembly kernel reads or writes, which it cannot see otherwise.
func raceRead32(s []float32) {
	if len(s) > 0 {
		runtime.RaceReadRange(unsafe.Pointer(&s[0]), 4*len(s))
	}
}

func raceWrite32(s []float32) {
	if len(s) > 0 {
		runtime.RaceWriteRange(unsafe.Pointer(&s[0]), 4*len(s))
	}
}

func raceRead16(s []uint16) {
	if len(s) > 0 {
		runtime.RaceReadRange(unsafe.Pointer(&s[0]), 2*len(s))
	}
}

func raceWrite16(s []uint16) {
	if len(s) > 0 {
		runtime.RaceWriteRange(unsafe.Pointer(&s[0]), 2*len(s))
	}
}

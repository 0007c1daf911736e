package main

import (
	"fmt"
	"math"
	"slices"

	"github.com/deepstates/dos/perfmodel"
)

// strategy is one schedule dos bench measures and dos plan predicts.
type strategy struct {
	name string
	s    perfmodel.Schedule
}

// strategies returns the schedules to compare for w (n subgroups): all on
// the CPU (ZeRO-Offload); a static split, as many subgroups resident as
// the budget holds (ZeRO-Offload++/TwinFlow); all resident when they fit;
// the model's choice; and a sweep of sweep GPU counts from 0 to all
// non-resident subgroups with the choice's residents (fewer where the two
// staging slots need the room), the 0 point keeping the choice's.
func strategies(w perfmodel.Workload, choice perfmodel.Prediction, sweep int) []strategy {
	n := w.Subgroups()
	fit := int(float64(w.GPUBudget) / (12 * float64(min(w.SubgroupSize, w.Params)))) // p, m, v of a subgroup
	out := []strategy{{"cpu-only", perfmodel.Schedule{CPU: n}}}
	if static := perfmodel.StaticSplit(w); static.Resident > 0 {
		out = append(out, strategy{"static", static})
	}
	if fit >= n {
		out = append(out, strategy{"all-gpu", perfmodel.Schedule{Resident: n}})
	}
	out = append(out, strategy{"model", choice.Schedule})
	if sweep < 1 {
		return out
	}
	r := choice.Resident
	if fit-2 < r {
		r = max(0, fit-2) // room for the two staging slots
	}
	N := n - r
	var gs []int
	for j := range sweep {
		gs = append(gs, int(math.Round(float64(j)*float64(N)/float64(max(1, sweep-1)))))
	}
	for _, g := range slices.Compact(gs) {
		s := perfmodel.Schedule{CPU: N - g, GPU: g, Resident: r, UpcastOnGPU: choice.UpcastOnGPU}
		if g == 0 {
			s.Resident = choice.Resident
			s.CPU = n - s.Resident
		}
		out = append(out, strategy{fmt.Sprintf("sweep k=%s", kString(s.K())), s})
	}
	return out
}

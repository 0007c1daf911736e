package scheduler

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/deepstates/dos/perfmodel"
)

// Role is where a subgroup is updated.
type Role uint8

// Roles (perfmodel's package doc: the three kinds of subgroup).
const (
	// OnCPU: the gradient moves D2H, the SIMD workers update p, m, v in
	// pinned host memory, the new 16-bit copy moves H2D.
	OnCPU Role = iota
	// OnGPU: p, m, v move H2D into a staging slot, the fused kernel
	// updates them and writes the 16-bit copy, they move D2H.
	OnGPU
	// Resident: p, m, v stay in device memory; only the kernel runs.
	Resident
)

func (r Role) String() string {
	switch r {
	case OnCPU:
		return "cpu"
	case OnGPU:
		return "gpu"
	case Resident:
		return "resident"
	}
	return fmt.Sprintf("Role(%d)", r)
}

// Plan is where each subgroup updates and in what order.
type Plan struct {
	Schedule perfmodel.Schedule
	// Roles has one entry per subgroup.
	Roles []Role
	// GPUOrder is the order of the GPU lane (OnGPU and Resident
	// subgroups); CPUOrder that of the CPU lane (OnCPU).
	GPUOrder, CPUOrder []int
}

// NewPlan places s on n subgroups. Resident subgroups are the last
// s.Resident; the s.GPU streamed subgroups are spread evenly among the
// others (the stride of DESIGN.md: of every k+1 non-resident subgroups, k
// go to the CPU and one to the GPU, k = s.K(), which may be fractional:
// subgroup j of the N non-resident ones goes to the GPU when
// floor((j+1)·G/N) > floor(j·G/N)). The GPU lane starts with one resident
// subgroup (its kernel runs while the first state moves H2D), then the
// streamed ones, then the other residents (while the last state moves
// D2H).
//
// Errors: counts that are negative or do not add up to n.
func NewPlan(n int, s perfmodel.Schedule) (*Plan, error) { return NewPlanIn(n, s, ResidentLast) }

// Layout is where a plan puts its resident subgroups in the flat space.
type Layout uint8

const (
	// ResidentLast: the last subgroups (NewPlan's). Their kernels fill
	// the GPU lane around the streamed state's copies.
	ResidentLast Layout = iota
	// ResidentFirst: the first subgroups, the GPU lane starting with
	// their kernels, the stride over the others as NewPlan's. A GPT's
	// first blocks are then resident: their gradients are final last in
	// the backward (the speculation, on CPU subgroups, starts with the
	// backward's first blocks instead of after the resident ones) and
	// the next forward reads them first (their kernels run at the
	// phase's start). Issue 31's experiment; the update is the same, bit
	// for bit.
	ResidentFirst
)

// NewPlanIn is NewPlan with the resident subgroups where l puts them.
//
// Errors: NewPlan's; an unknown layout.
func NewPlanIn(n int, s perfmodel.Schedule, l Layout) (*Plan, error) {
	if s.CPU < 0 || s.GPU < 0 || s.Resident < 0 || s.CPU+s.GPU+s.Resident != n {
		return nil, fmt.Errorf("scheduler: schedule %d CPU + %d GPU + %d resident subgroups for %d subgroups", s.CPU, s.GPU, s.Resident, n)
	}
	switch l {
	case ResidentLast:
	case ResidentFirst:
		return residentFirst(n, s), nil
	default:
		return nil, fmt.Errorf("scheduler: layout %d: want ResidentLast or ResidentFirst", l)
	}
	p := &Plan{Schedule: s, Roles: make([]Role, n)}
	nr := n - s.Resident
	for j := range nr {
		if streamed(j, s.GPU, nr) {
			p.Roles[j] = OnGPU
		}
	}
	for j := nr; j < n; j++ {
		p.Roles[j] = Resident
	}
	if s.Resident > 0 {
		p.GPUOrder = append(p.GPUOrder, nr)
	}
	for j := range nr {
		if p.Roles[j] == OnGPU {
			p.GPUOrder = append(p.GPUOrder, j)
		} else {
			p.CPUOrder = append(p.CPUOrder, j)
		}
	}
	for j := nr + 1; j < n; j++ {
		p.GPUOrder = append(p.GPUOrder, j)
	}
	return p, nil
}

// streamed reports whether the j-th of nr non-resident subgroups streams
// through the GPU when gpu of them do: the stride spreads them evenly, k
// CPU subgroups to each streamed one (DESIGN.md).
func streamed(j, gpu, nr int) bool { return (j+1)*gpu/nr > j*gpu/nr }

// residentFirst is NewPlanIn's ResidentFirst plan: subgroups 0..R-1
// resident, the stride of NewPlan over R..n-1, the GPU lane the residents'
// kernels then the streamed subgroups, the CPU lane in order.
func residentFirst(n int, s perfmodel.Schedule) *Plan {
	p := &Plan{Schedule: s, Roles: make([]Role, n)}
	r, nr := s.Resident, n-s.Resident
	for j := range r {
		p.Roles[j] = Resident
		p.GPUOrder = append(p.GPUOrder, j)
	}
	for j := range nr {
		if streamed(j, s.GPU, nr) {
			p.Roles[r+j] = OnGPU
			p.GPUOrder = append(p.GPUOrder, r+j)
		} else {
			p.CPUOrder = append(p.CPUOrder, r+j)
		}
	}
	return p
}

// MixedSchedule splits n subgroups into every role: a third resident
// (rounded down), half of the rest streamed through the GPU, the others on
// the CPU; one subgroup is streamed, two are one streamed and one on the
// CPU. For a device run without a profile or a forced schedule.
func MixedSchedule(n int) perfmodel.Schedule {
	if n == 1 {
		return perfmodel.Schedule{GPU: 1}
	}
	r := n / 3
	g := (n - r) / 2
	return perfmodel.Schedule{CPU: n - r - g, GPU: g, Resident: r}
}

// ParseSchedule reads "C,G,R": the CPU, streamed GPU and resident
// subgroup counts, each >= 0. Errors name the text.
func ParseSchedule(text string) (perfmodel.Schedule, error) {
	const maxCount = math.MaxInt32 // no plan has more subgroups; three such counts add up without overflow
	bad := fmt.Errorf("scheduler: schedule %q: want CPU,GPU,RESIDENT subgroup counts from 0 to 2^31-1, e.g. 2,2,1", text)
	f := strings.Split(text, ",")
	if len(f) != 3 {
		return perfmodel.Schedule{}, bad
	}
	var v [3]int
	for i, x := range f {
		n, err := strconv.Atoi(x)
		if err != nil || n < 0 || n > maxCount || x[0] == '+' {
			return perfmodel.Schedule{}, bad
		}
		v[i] = n
	}
	return perfmodel.Schedule{CPU: v[0], GPU: v[1], Resident: v[2]}, nil
}
